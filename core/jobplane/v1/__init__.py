"""Generated from proto/jobplane/v1 by `make proto`. Do not edit."""
