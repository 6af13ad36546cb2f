"""The ``gradmon`` command."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import Optional, Sequence


_COMMANDS = ("demo", "top", "incident")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="gradmon", description="Gradient-health monitor for PyTorch training jobs.",
        epilog="Start with `gradmon demo` (options: `gradmon demo --help`) and watch it with `gradmon top`. In your "
               "own training script: `import gradmon; gradmon.attach(model)`.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("command", nargs="?", choices=list(_COMMANDS),
                        help="demo: train a small model with gradmon attached; top: watch an endpoint in the terminal; "
                             "incident: summarise an incident bundle and write its HTML report")
    known, rest = parser.parse_known_args(argv[:1] if argv and argv[0] in _COMMANDS else argv)
    if known.version:
        from .. import __version__
        print(__version__)
        return 0
    if known.command == "demo":
        # torch warns at import when NumPy is missing; nothing gradmon or the demo does needs it
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        from . import demo
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
        return demo.run(argv[1:])
    if known.command == "top":
        from . import top
        return top.main(argv[1:])
    if known.command == "incident":
        from ..incidents import command
        return command.main(argv[1:])
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
