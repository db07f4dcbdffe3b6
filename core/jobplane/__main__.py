"""``python -m jobplane`` is the ``jobplane`` command."""

from __future__ import annotations

try:
    from jobplane.console import main
except KeyboardInterrupt:  # Ctrl-C while importing: the command had not begun
    raise SystemExit(130) from None

main()
