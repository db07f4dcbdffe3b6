"""The dashboard: jobplane's own web pages, served by the server process (docs/dashboard.md)."""

from jobplane.server.dashboard.app import Backend, Dashboard

__all__ = ["Backend", "Dashboard"]
