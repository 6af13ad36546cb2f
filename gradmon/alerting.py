"""One definition of every alert, recording rule and dashboard (build time): the names as
they always were, now made in ``gradmon.artefacts`` (rules, Grafana alerting, Alertmanager,
dashboards, the writer), with the numbers in ``gradmon.thresholds``.

``python -m gradmon.alerting write`` regenerates the committed files; ``python -m
gradmon.alerting check`` fails if they differ from what the generators make (the tests run
it). Nothing at runtime imports this module.
"""

from __future__ import annotations

import sys

from . import metrics as M  # noqa: F401  (rule text built from it; some scripts read it here)
from .artefacts.alert import (NEVER_FP32, NEVER_SINGLE_RANK, RUNBOOK, WHERE, Alert, last_state as _last_state,
                              past_warmup as _past_warmup)
from .artefacts.alertmanager import alertmanager_config
from .artefacts.dashboards import dashboards
from .artefacts.files import HEADER, generated_files, main, to_yaml as _yaml
from .artefacts.grafana import grafana_alerting, grafana_template
from .artefacts.health import rank_nonfinite as _rank_nonfinite
from .artefacts.names import (LOCAL_GLOBAL_NORM, REC_GLOBAL_BASELINE, REC_GLOBAL_POST_WARMUP, REC_LAYER_BASELINE,
                              REC_LAYER_POST_WARMUP, REC_LOCAL_MEDIAN, REC_LOCAL_MIN, REC_LOCAL_RANKS,
                              REC_STEPS_RATE, TARGET, sample as _s)
from .artefacts.panels import (LSEL, PSEL, SEL, dashboard as _dashboard, panel as _panel, row as _row,
                               target as _target, variable as _var)
from .artefacts.rules import INHIBITIONS, alerts, recording_rules, rule_groups
from .artefacts.signals import diverging as _diverging, signal_alerts as _signal_alerts
from .artefacts.spikes import SPIKE_MEANING as _SPIKE_MEANING, recent_spike as _recent_spike, spike_pair as _spike_alerts
from .thresholds import PRODUCTION, TEST_SCALE, Thresholds, Timing, dur

__all__ = [
    "Alert", "HEADER", "INHIBITIONS", "LOCAL_GLOBAL_NORM", "LSEL", "NEVER_FP32", "NEVER_SINGLE_RANK", "PRODUCTION",
    "PSEL", "REC_GLOBAL_BASELINE", "REC_GLOBAL_POST_WARMUP", "REC_LAYER_BASELINE", "REC_LAYER_POST_WARMUP",
    "REC_LOCAL_MEDIAN", "REC_LOCAL_MIN", "REC_LOCAL_RANKS", "REC_STEPS_RATE", "RUNBOOK", "SEL", "TARGET",
    "TEST_SCALE", "Thresholds", "Timing", "WHERE", "alertmanager_config", "alerts", "dashboards", "dur",
    "generated_files", "grafana_alerting", "grafana_template", "main", "recording_rules", "rule_groups",
]

if __name__ == "__main__":
    sys.exit(main())
