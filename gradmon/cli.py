"""Moved to :mod:`gradmon.clients.cli` (issue 24); kept for console scripts installed before the move."""
import sys

from .clients.cli import main

__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
