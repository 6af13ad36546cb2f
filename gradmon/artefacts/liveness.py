"""The alerts on whether a run is alive: no step while training, a rank gone without having
finished, fewer ranks than the world size, a run that ended with an exception."""

from __future__ import annotations

from typing import List

from .. import metrics as M
from ..thresholds import Thresholds, Timing, dur
from .alert import NEVER_SINGLE_RANK, WHERE, Alert, last_state
from .names import TARGET, sample


def liveness_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    history = dur(t.history_window)
    ended = last_state(M.END_STATES, TARGET, t)  # a target gone after any end is not "down"
    return [
        Alert("GradmonTrainingStalled", "warning", "Training stalled",
              f"No optimizer step for {{{{ $value | humanizeDuration }}}} ({WHERE}) while the run state is "
              f"\"training\" and the exporter is up.",
              f"max by ({TARGET}) (time() - {M.LAST_STEP_TIMESTAMP.name})\n"
              f"  > {th.stall_seconds:g}\n"
              f"and on({TARGET}) max by ({TARGET}) ({M.RUN_STATE.name}{{state=\"training\"}}) == 1",
              t.stall_for),
        Alert("GradmonExporterDown", "critical", "A rank stopped reporting",
              f"Rank {{{{ $labels.rank }}}} of job {{{{ $labels.job }}}} (instance {{{{ $labels.instance }}}}) reported "
              f"in the last {history} and reports no more, without having finished: "
              "the process died, hung hard, or its pod is gone.",
              f"(\n  max by ({TARGET}) (max_over_time({sample(M.STEPS)}[{history}]))\n"
              f"  unless max by ({TARGET}) ({sample(M.STEPS)})\n)\nunless on({TARGET}) ({ended})",
              t.down_for),
        Alert("GradmonRanksMissing", "critical", "Fewer ranks report than the world size",
              "Only {{ $value }} ranks of job {{ $labels.job }} (model {{ $labels.model }}) report, fewer than "
              "its world size: some ranks never came up or their targets are missing. "
              f"{NEVER_SINGLE_RANK}",
              f"(\n  count by (job, model) ({sample(M.STEPS)})\n"
              f"  < max by (job, model) (max_over_time({M.WORLD_SIZE.name}[{history}]))\n)\n"
              f"unless on(job, model) ({last_state(M.END_STATES, 'job, model', t)})",
              t.down_for),
        Alert("GradmonRunFailed", "critical", "A training run failed",
              f"The run ended with an exception ({{{{ $labels.exception }}}}) on {WHERE}. Its last traceback is in "
              "the job's log; other ranks' missing, down or stalled alerts of this job are inhibited.",
              f"({last_state((M.STATE_FAILED,), TARGET, t)})\n"
              f"* on({TARGET}) group_left(exception)\n"
              f"max by ({TARGET}, exception) (last_over_time({M.RUN_FAILURE_INFO.name}[{history}]))",
              0),
    ]
