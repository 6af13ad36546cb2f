"""The reference's generated tables: every option (docs/configuration.md, from ``Config``'s
fields, their docstrings, their validation and the statistics they switch) and every metric (docs/metrics.md, from the
specs in ``metrics``). Each table lies between two markers in its page; the prose around
it is written by hand, the table never is."""

from __future__ import annotations

import ast
import re
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from .. import config as C
from .. import metrics as M
from .. import statistics as S

BEGIN = "<!-- generated: {name} by `python -m gradmon.alerting write` from {source}; edit it there -->"
END = "<!-- end generated: {name} -->"


def _markdown(text: str) -> str:
    """A docstring as one table cell: reST literals as code, ``docs/x.md`` as a link from
    docs/, the lines joined, ``|`` escaped."""
    text = re.sub(r":\w+:`([^`]+)`", r"``\1``", text)
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r"\bdocs/([\w-]+\.md)\b", r"[\1](\1)", text)
    return " ".join(text.split()).replace("|", "\\|")


def field_docs() -> Dict[str, str]:
    """Each ``Config`` field's docstring, read from the source as Python leaves it there."""
    tree = ast.parse(Path(C.__file__).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config").body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value  # type: ignore[union-attr]
    return docs


def _default(f: Any, hint: Any) -> str:
    value = f.default_factory() if f.default is MISSING else f.default
    if value is None:
        return "auto" if hint == Optional[bool] else "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (tuple, dict)) and not value:
        return "empty"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def accepted(name: str, hint: Any) -> Optional[str]:
    """What the validation accepts for a number, in its own words: the message ``Config``
    raises for a value far out of range (None: not a number, or no range)."""
    if hint not in (int, float):
        return None
    try:
        C.Config(**{name: hint(-10 ** 12)})
    except ValueError as exc:
        detail = getattr(exc, "gradmon_detail", "")
        return re.sub(r", got .*$", "", detail.removeprefix("must be "))
    return None


def switched(option: str) -> List[str]:
    """The series of the statistics that ``option`` switches (``Statistic.switch``): their
    gauges' families, and their counter's with the labels that tell their series apart."""
    names = []
    for st in S.STATISTICS:
        if option in st.switches:
            names += [g.spec.name for g in st.gauges]
            if st.counter is not None:
                labels = ", ".join(f'{k}="{v}"' for k, v in st.counter_labels.items())
                names.append(M.exposed_names(st.counter)[0] + (f"{{{labels}}}" if labels else ""))
    return list(dict.fromkeys(names))


def config_rows() -> Iterator[str]:
    hints = typing.get_type_hints(C.Config)
    docs = field_docs()
    for f in fields(C.Config):
        env = f"`{C.env_var(f.name)}`" if f.name in C._ENV_PARSERS else "—"
        meaning = _markdown(docs[f.name])
        values = accepted(f.name, hints[f.name])
        if values:
            meaning += f" Accepted: {_markdown(values)}."
        families = switched(f.name)
        if families:
            meaning += " Switches: " + ", ".join(f"`{name}`" for name in families) + "."
        yield f"| `{f.name}` | {env} | {_default(f, hints[f.name])} | {meaning} |"


def config_table() -> str:
    return "\n".join(["| option | env var | default | meaning |", "|---|---|---|---|", *config_rows()])


def _type(spec: M.MetricSpec) -> str:
    return "gauge (1)" if spec.type == "info-gauge" else spec.type


def _labels(spec: M.MetricSpec) -> str:
    values = dict(spec.values)
    return ", ".join(label + (" (" + ", ".join(f"`{v}`" for v in values[label]) + ")" if label in values else "")
                     for label in spec.labels)


def metrics_table() -> str:
    rows = [f"| `{M.exposed_names(spec)[0] if spec.type == 'counter' else spec.name}` | {_type(spec)} |"
            f"{' ' + _labels(spec) if spec.labels else ''} | {_markdown(spec.doc or spec.help)} |" for spec in M.ALL_SPECS]
    return "\n".join(["| name | type | labels | meaning |", "|---|---|---|---|", *rows])


TABLES = {
    "docs/configuration.md": ("config-table", "gradmon/config.py", config_table),
    "docs/metrics.md": ("metrics-table", "gradmon/metrics.py", metrics_table),
}


def with_table(text: str, name: str, source: str, table: str) -> str:
    """``text`` with its generated table ``name`` replaced by ``table``."""
    begin, end = BEGIN.format(name=name, source=source), END.format(name=name)
    start = text.index(begin) + len(begin)
    stop = text.index(end, start)
    return text[:start] + "\n" + table + "\n" + text[stop:]


def pages(template_root: Path) -> Dict[str, str]:
    """Each page with its generated table current, from the page under ``template_root``
    (its hand-written prose)."""
    out = {}
    for path, (name, source, make) in TABLES.items():
        out[path] = with_table((template_root / path).read_text(), name, source, make())
    return out
