"""README's tables are the documentation of the public contract: they must not drift."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from gradmon import metrics as M
from gradmon.config import Config, env_var, _ENV_PARSERS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def table_after(marker: str) -> str:
    start = README.index(marker)
    return README[start:README.index("\n\n", README.index("|", start))]


def test_every_config_field_is_in_the_configuration_table_with_its_env_var():
    table = table_after("<!-- config-table")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| (`?[\w—]+`?) \|", table, re.M)}
    assert set(rows) == {f.name for f in fields(Config)}
    for name, env in rows.items():
        if name in _ENV_PARSERS:
            assert env == f"`{env_var(name)}`", name
        else:
            assert env == "—", name


def test_every_metric_is_in_the_metrics_table_with_its_type_and_labels():
    table = table_after("<!-- metrics-table")
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
    table = table_after("<!-- alerts-table")
    listed = set(re.findall(r"^\| `(Gradmon\w+)` \|", table, re.M))
    assert listed == {a.name for a in alerting.alerts(alerting.Thresholds(), alerting.PRODUCTION)}
