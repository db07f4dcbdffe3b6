"""``python -m jobplane`` is the ``jobplane`` command."""

from __future__ import annotations

from jobplane.console import main

main()
