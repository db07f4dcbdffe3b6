"""Observability: metrics, health and tracing."""
