"""Optional parts built on jobplane's handler API (each with its own extra)."""
