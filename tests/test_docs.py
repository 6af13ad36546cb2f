"""The reference pages' tables document the public contract, and the README only points at them:
neither may drift from the code, and no link between them may break."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from gradmon import metrics as M
from gradmon.config import Config, env_var, _ENV_PARSERS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 260


def page(name: str) -> str:
    return (DOCS / name).read_text()


def table_after(text: str, marker: str) -> str:
    start = text.index(marker)
    return text[start:text.index("\n\n", text.index("|", start))]


def test_every_config_field_is_in_the_configuration_table_with_its_env_var():
    table = table_after(page("configuration.md"), "<!-- config-table")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (`?[\w—]+`?) \|", table, re.M)}
    assert set(rows) == {f.name for f in fields(Config)}
    for name, env in rows.items():
        if name in _ENV_PARSERS:
            assert env == f"`{env_var(name)}`", name
        else:
            assert env == "—", name


def test_every_metric_is_in_the_metrics_table_with_its_type_and_labels():
    table = table_after(page("metrics.md"), "<!-- metrics-table")
    rows = {m.group(1): (m.group(2), m.group(3)) for m in
            re.finditer(r"^\| `(gradmon_\w+)` \|([^|]+)\|([^|]*)\|", table, re.M)}
    documented = {}
    for spec in M.ALL_SPECS:
        shown = spec.name + ("_total" if spec.type == "counter" else "")
        documented[shown] = spec
    assert set(rows) == set(documented)
    for shown, spec in documented.items():
        typ, labels = rows[shown]
        assert typ.strip().split()[0] == ("gauge" if spec.type == "info-gauge" else spec.type), shown
        for label in spec.labels:
            assert label in labels, (shown, label)


def test_every_alert_is_in_the_alerts_table():
    from gradmon import alerting
    table = table_after(page("alerts.md"), "<!-- alerts-table")
    listed = set(re.findall(r"^\| `(Gradmon\w+)` \|", table, re.M))
    assert listed == {a.name for a in alerting.alerts(alerting.Thresholds(), alerting.PRODUCTION)}


def test_the_readme_is_short_enough_to_read_on_arrival():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: move reference material into docs/"


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Two commands\n.*?^```bash\n(.*?)^```", readme, re.M | re.S).group(1)
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    # .ci/run execs the same script from the repository root, with pytest's flags appended
    assert commands[1] == "bash scripts/test" and re.search(r"^exec bash scripts/test\b", ci, re.M)


FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def prose(path: Path) -> str:
    """The text outside fenced code blocks, where a `[x](y)` is not a link."""
    return FENCE.sub("", path.read_text())


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but `-` and `_` dropped, spaces to `-`,
    a repeated heading numbered from `-1`."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", prose(path), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def test_every_relative_link_in_the_readme_and_docs_points_at_an_existing_file_and_heading():
    broken = []
    for source in markdown_files():
        for target in LINK.findall(prose(source)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (source.parent / path).resolve() if path else source
            if not resolved.exists():
                broken.append(f"{source.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                broken.append(f"{source.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
