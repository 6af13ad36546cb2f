"""What one alert is, and the PromQL and wording every family of alerts shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import metrics as M
from ..thresholds import Thresholds, Timing, dur
from .names import sample

RUNBOOK = "https://github.com/gradmon/gradmon/blob/main/docs/runbook.md"
WHERE = "job {{ $labels.job }}, rank {{ $labels.rank }}, model {{ $labels.model }}"  # in every description
NEVER_SINGLE_RANK = "Never fires in a single-rank job."
NEVER_FP32 = "Never fires in an fp32 job (without float16 tensors or a GradScaler)."


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    summary: str
    description: str
    expr: str
    for_seconds: float

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK}#{self.name.lower()}"

    @property
    def for_duration(self) -> str:
        """The ``for`` of the Prometheus rule and of the Grafana-managed one."""
        return dur(self.for_seconds) if self.for_seconds else "0s"


def past_warmup(th: Thresholds) -> str:
    """True for a target past the warm-up steps after attach (labels: TARGET)."""
    return f"({sample(M.STEPS)} > {th.warmup_steps})"


def last_state(states: Sequence[str], by: str, t: Timing) -> str:
    """True (1) where the last run state a target reported, within the history window, is one
    of ``states``. last_over_time, not max_over_time: one scrape just before the process exits
    is enough, and a target that reports ``training`` again (an elastic restart) clears it at
    once, where a max over the window would fire again when the restarted run ends."""
    selector = f"{M.RUN_STATE.name}{{state=~\"{'|'.join(states)}\"}}"
    return f"max by ({by}) (last_over_time({selector}[{dur(t.history_window)}])) == 1"
