#!/usr/bin/env python3
"""gradmon's shape at a glance: the longest classes and functions, and which imports point the
wrong way between the threads' packages (gradmon/capture/__init__.py and its siblings say
which way is allowed). Read from the source with ``ast``; nothing is imported or run.

    python scripts/sizes.py [--top N]     # exit status 1 when an import points the wrong way

tests/test_layout.py runs the same import check.
"""

from __future__ import annotations

import argparse
import ast
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "gradmon"

PUBLISHER = ("gradmon.snapshot", "gradmon.spikes", "gradmon.history", "gradmon.incidents", "gradmon.aggregate")
BUILD_TIME = ("gradmon.alerting", "gradmon.artefacts")


@dataclass(frozen=True)
class Rule:
    importer: str
    """Modules under this name (a package and everything in it) may not import ..."""
    forbidden: Tuple[str, ...]
    why: str


RULES = (
    Rule("gradmon.capture", PUBLISHER + ("gradmon.serve", "gradmon.clients", "gradmon.monitor"),
         "the training thread hands over a packet; it never reaches into the publisher or scrape side"),
    Rule("gradmon.serve", ("gradmon.capture",),
         "a scrape reads the published snapshot, never the training thread's live objects"),
    Rule("gradmon", BUILD_TIME, "rules and dashboards are generated at build time; nothing at runtime imports them"),
    Rule("gradmon.artefacts", PUBLISHER + ("gradmon.capture", "gradmon.serve", "gradmon.clients", "gradmon.monitor"),
         "the generators read the shared declarations (metrics, thresholds, statistics), never a running thread's code"),
)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # the module that runs, with any compatibility shim followed
    line: int

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} imports {self.imported}"


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(name: str, root: Path) -> Optional[Path]:
    base = root.parent.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    package = package[:len(package) - node.level + (1 if is_package else 0)]
    return ".".join(package + ([node.module] if node.module else []))


def _named(tree: ast.AST, importer: str, is_package: bool, root: Path) -> Iterator[Tuple[str, int]]:
    """Every gradmon module the tree imports, anywhere in it (a function-level import runs too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, importer, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # ``from pkg import name``: the submodule when there is one, else pkg itself
                yield (sub if module_path(sub, root) else base), node.lineno


def shim_target(path: Path, name: str, root: Path) -> Optional[str]:
    """The module a compatibility shim stands for: one that replaces itself in ``sys.modules``
    with a module it imported (``from .capture import kernels``; ``sys.modules[__name__] = kernels``)."""
    tree = ast.parse(path.read_text(), str(path))
    bound: Dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, path.name == "__init__.py")
            bound.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names})
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in bound
              and any(isinstance(t, ast.Subscript) and ast.unparse(t) == "sys.modules[__name__]" for t in node.targets)):
            return bound[node.value.id]
    return None


def resolve(name: str, root: Path) -> str:
    seen = set()
    while name not in seen:
        seen.add(name)
        path = module_path(name, root)
        target = shim_target(path, name, root) if path else None
        if target is None:
            return name
        name = target
    return name


def imports(root: Path = PACKAGE) -> List[Import]:
    found: Dict[Import, None] = {}  # one per line: ``from .a import b, c`` names a twice
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        if shim_target(path, importer, root):
            continue  # a shim's one import is the module it stands for, checked where it lives
        tree = ast.parse(path.read_text(), str(path))
        for imported, line in _named(tree, importer, path.name == "__init__.py", root):
            if under(imported, root.name):
                found[Import(importer, resolve(imported, root), line)] = None
    return list(found)


def wrong_way(found: Sequence[Import], rules: Sequence[Rule] = RULES) -> List[Tuple[Import, Rule]]:
    return [(imp, rule) for imp in found for rule in rules
            if under(imp.importer, rule.importer) and not any(under(imp.importer, f) for f in rule.forbidden)
            and any(under(imp.imported, f) for f in rule.forbidden)]


def spans(root: Path = PACKAGE) -> Iterator[Tuple[str, str, int]]:
    """(kind, where, lines) of every class and function, nested ones included."""
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                where = f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"
                yield kind, where, node.end_lineno - node.lineno + 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=5, help="how many of the longest of each kind to print")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    everything = list(spans())
    for kind in ("class", "function"):
        print(f"longest {kind}es:" if kind == "class" else f"longest {kind}s:")
        for _, where, lines in sorted((s for s in everything if s[0] == kind), key=lambda s: -s[2])[:args.top]:
            print(f"  {lines:5d}  {where}")
    bad = wrong_way(imports())
    print("imports pointing the wrong way:" if bad else "imports pointing the wrong way: none")
    for imp, rule in bad:
        print(f"  {imp}  ({rule.why})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
