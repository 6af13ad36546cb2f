"""``gradmon incident PATH``: read a bundle, print its summary, write its HTML report."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Sequence


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gradmon incident",
        description="Summarise an incident bundle that gradmon wrote at a non-finite step (incident_dir) and write "
                    "its HTML report: one self-contained file, no network. A bundle is treated as untrusted input.")
    parser.add_argument("path", help="a bundle (.npz), or a directory: its newest bundle")
    parser.add_argument("--html", metavar="FILE",
                        help="where to write the report (default: the bundle's name with .html, in the current "
                             "directory)")
    parser.add_argument("--no-html", action="store_true", help="print the summary only")
    args = parser.parse_args(list(argv))
    from . import bundle as B
    from . import report
    from ..sanitize import clean
    try:
        path = _pick(args.path)
        b = B.load(path)
        text = report.summary(b)
        page = None if args.no_html else report.page(b)
    except B.Refused as exc:
        print(f"gradmon incident: {clean(str(exc))}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
        # checked fields are well-formed; one the check does not cover is still the file's fault
        print(f"gradmon incident: {clean(path)}: malformed bundle ({clean(type(exc).__name__)}: {clean(str(exc))})",
              file=sys.stderr)
        return 2
    sys.stdout.write(text)
    if page is not None:
        out = args.html or os.path.splitext(os.path.basename(path))[0] + ".html"
        try:
            with open(out, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as exc:
            print(f"gradmon incident: cannot write the report {clean(out)}: {clean(exc.strerror or str(exc))}",
                  file=sys.stderr)
            return 1
        print(f"report: {clean(out)}")
    return 0


def _pick(path: str) -> str:
    """A directory stands for its newest bundle."""
    if not os.path.isdir(path):
        return path
    from .bundle import Refused
    bundles: List[str] = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".npz")]
    if not bundles:
        raise Refused(f"{path}: no incident bundle (*.npz) in this directory")
    return max(bundles, key=os.path.getmtime)
