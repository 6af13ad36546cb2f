"""The spike alerts: a warning while a burst of spikes of the loss, the gradient norm or one
layer's norm is recent, and a critical tier once the loss confirms a divergence with such a
spike among its evidence. Spikes and bursts are decided and counted in the process
(``gradmon/aggregate/spikes.py``)."""

from __future__ import annotations

from typing import List, Sequence

from .. import metrics as M
from ..thresholds import Thresholds, Timing, dur
from .alert import WHERE, Alert, past_warmup
from .names import TARGET, sample

SPIKE_MEANING = "a value above twice its window's median and far outside its noise"


def recent_spike(th: Thresholds, t: Timing, signals: Sequence[str], by: str,
                 gauge: M.MetricSpec = M.STEPS_SINCE_SPIKE) -> str:
    """A spike (``gauge``: or a burst of them) of ``signals`` within the last
    ``spike_hold_steps`` steps, or since the previous scrape: decided in the process and
    counted in steps, so a hold means the same at any step rate, and a job that runs more
    than ``spike_hold_steps`` steps between two scrapes still warns once for a spike no
    scrape saw (the steps between the last two scrapes, ``idelta``)."""
    since = f"{gauge.name}{{signal=~\"{'|'.join(signals)}\"}}"
    return (f"min by ({by}) (\n  {since} < {th.spike_hold_steps}\n  or\n"
            f"  {since} < on({TARGET}) group_left() idelta({sample(M.STEPS)}[{dur(t.event_window)}])\n)\n"
            f"and on({TARGET}) {past_warmup(th)}")


def spike_pair(th: Thresholds, t: Timing, name: str, what: str, signals: Sequence[str],
               meaning: str = SPIKE_MEANING) -> List[Alert]:
    """A warning while a burst of spikes of ``signals`` is recent (counted in steps, in the
    process: a burst no scrape saw still warns), and a critical alert while a confirmed
    divergence has such a spike among its evidence: a spike before the loss climbed. A lone
    spike is evidence for the critical tier but no warning: healthy runs have them."""
    evidence = f"{{signal=~\"{'|'.join(signals)}\"}}"
    return [
        Alert(f"Gradmon{name}", "warning", f"{what} spike",
              f"Repeated {{{{ $labels.signal }}}} spikes ({WHERE}): {th.spike_burst} spike steps within "
              f"{th.spike_hold_steps} steps, the last of them in the last {th.spike_hold_steps} steps; a spike is "
              f"{meaning}. Gradient or loss evidence alone: a warning until the loss confirms a divergence. A lone "
              f"spike is counted ({M.exposed_names(M.SPIKE_STEPS)[0]}) and drawn, not warned.",
              recent_spike(th, t, signals, f"{TARGET}, signal", M.STEPS_SINCE_SPIKE_BURST), 0),
        Alert(f"Gradmon{name}Severe", "critical", f"The loss diverges after a {what.lower()} spike",
              f"The loss is diverging ({WHERE}), and a {{{{ $labels.signal }}}} spike came before it climbed: "
              "the instability started before the loss showed it (see GradmonLossDiverging).",
              f"max by ({TARGET}, signal) ({M.DIVERGENCE_EVIDENCE.name}{evidence}) == 1", 0),
    ]


def spike_alerts(th: Thresholds, t: Timing) -> List[Alert]:
    return [
        *spike_pair(th, t, "LossSpike", "Loss", (M.SIGNAL_LOSS,)),
        *spike_pair(th, t, "GradNormSpike", "Gradient norm", (M.SIGNAL_GRAD_NORM, M.SIGNAL_LOCAL_GRAD_NORM)),
        # a layer's norm far outside its own adaptive baseline: in unstable runs the
        # embeddings and first blocks jump like this before the loss does
        *spike_pair(th, t, "GradNormJump", "Layer gradient-norm", (M.SIGNAL_LAYER_GRAD_NORM,),
                    "a layer's gradient norm far outside its own recent spread and at least norm_jump_ratio "
                    f"times its baseline; {M.GRAD_NORM_BASELINE_RATIO.name} shows which layer"),
    ]
