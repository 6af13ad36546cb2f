"""The numbers behind the alerts, shared by the rule generator (``alerting``, build time) and
the runtime clients that judge an endpoint locally (``gradmon top``, the demo): plain values,
no rule text, so a runtime module never imports the generator.

Time scales: :data:`PRODUCTION` is what ships. The end-to-end tests use
``PRODUCTION.scaled(1/60)``: every window and ``for`` of the same rules, a minute becoming a
second, never a hand-copied second rule file.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Thresholds:
    """The numbers behind the alerts; dashboards draw the same values as threshold lines."""

    warmup_steps: int = 100
    """Steps after attach that neither page nor enter a baseline: warm-up spikes are normal."""
    explode_abs: float = 1000.0
    """Pre-clip global norm that pages whatever the model's baseline."""
    explode_jump: float = 100.0
    """A global norm this many times its own recent median pages, even below explode_abs..."""
    explode_floor: float = 0.01
    """...as long as it is above this floor (a jump from 1e-6 to 1e-4 is not an explosion)."""
    vanish_abs: float = 1e-8
    """A layer gradient norm below this is vanishing whatever its history."""
    vanish_rel: float = 1e-4
    """A layer gradient norm below this fraction of its own recent median is vanishing."""
    activation_abs_max: float = 3.0e4
    """max|x| of an activation near fp16's 65504 overflows at the next multiply."""
    attention_growth: float = 8.0
    """A query or key projection's max|x| this many times its first measurement: the
    attention logits, their product, have grown some 64x (the attention-logit growth that
    precedes many transformer divergences). On the alert corpus's tune split, healthy
    transformers' projections grew at most about 3x over a run."""
    lr_over_peak: float = 1.5
    """A learning rate this many times its settled peak (``gradmon_learning_rate_over_peak``):
    half again above the highest rate the schedule had held. A restart back to the same peak
    reads 1; a converged model often collapses within tens of steps of a rise like this
    (the late collapses of the alert corpus are such restarts)."""
    lr_settle_steps: int = 100
    """Steps a parameter group's learning rate must go without a new high for that high to be
    its settled peak (counted in the process): a warm-up rises at every step and settles
    nothing, a schedule that decays or holds settles its peak within this many steps, and a
    rise past it reads above 1 until the new rate has held this long."""
    divergence_factor: float = 10.0
    """A rank's local (pre-all-reduce) norm this many times the ranks' median (or, with two
    ranks, the other rank's) is diverging."""
    stall_seconds: float = 600.0
    """No optimizer step for this long, while the run state is "training", is a stall."""
    amp_skip_fraction: float = 0.5
    """fp16 loss scaling skips an overflow step now and then; skipping more than this
    fraction of steps means the scale is collapsing and the run is not learning."""
    amp_min_loss_scale: float = 1.0
    """A loss scale below this has given up on fp16's range."""
    spike_hold_steps: int = 20
    """Steps a burst of spikes keeps its warning firing, counted in the process (the same at
    any step rate): the loss trend's window, long enough for the trend to show whether the
    spikes moved it (``GradmonLossRising`` takes over if they did). Also the window in which
    ``spike_burst`` spike steps make a burst."""
    spike_burst: int = 3
    """Spike steps of one signal within ``spike_hold_steps`` steps that warn (a burst,
    ``gradmon_steps_since_spike_burst``): a lone spike step, or two, is counted and drawn but
    does not warn. Healthy recurrent nets meet a steep wall of their loss now and then (a
    gradient-norm spike of 3-30x every few hundred steps in the alert corpus's ``rnn`` runs),
    where an instability building up spikes again and again. Chosen on the alert corpus's
    tune split (docs/alert-evaluation.md): 2 left its healthy runs over one warning edge per
    1,000 steps at 10 and 60 s a step, 4 lost one more early warning."""
    norm_baseline_ratio: float = 4.0
    """A layer's gradient norm this many times the median of its own last norm_baseline
    sampled steps, sustained (``norm_ratio_steps``), is the warning tier. Not 3: the small
    LayerNorm layers of gradmon's own healthy demo reach 3.1x for a few dozen steps early
    in training."""
    norm_ratio_steps: int = 6
    """Sampled steps in a row a layer's gradient norm must stay above ``norm_baseline_ratio``
    times its baseline (``gradmon_grad_norm_above_baseline_steps``, counted in the process)
    for ``GradmonGradNormAboveBaseline`` (and a rank's own norm of a layer, before the
    all-reduce, for ``GradmonLocalGradNormAboveBaseline``): steps, not minutes, so the
    same at 1 and at 60 s a step. Chosen on the alert corpus's tune split
    (docs/alert-evaluation.md): 2 steps let a healthy run's learning-phase jolts through, 12
    left almost no early warning."""
    update_baseline_ratio: float = 10.0
    """A layer's update-to-weight ratio this many times its own baseline (its median of
    the last update_baseline readings): the layer moves an order of magnitude faster
    than it did at the same learning rate."""
    adam_rms_spike: float = 3.5
    """Adam's RMS_t of g/sqrt(v̂) is about 1 for a gradient as large as its history; this
    many times that means a gradient spike the second moment has not caught up with (the
    instability StableAdamW clips; the bound is (1-β2)^(-1/2), 31.6 at β2=0.999, 4.5 at 0.95).
    Above the 3.1-3.6 that healthy runs of the alert corpus's tune split reach now and
    then; not higher, so that a β2 of 0.95 keeps a band below its bound to fire in."""
    guard_skip_run: int = 3
    """Steps the step guard (``guard=``) skipped within ``guard_window`` that page: one
    skipped batch is a warning, several close together a job that keeps making bad steps
    (the guard gives up after ``guard_max_skips`` consecutive ones: the run then fails)."""
    fp16_min_headroom: float = 2.0
    """A float16 tensor whose max |x| is within this factor of 65504 is one doubling from
    overflow. The gradient's headroom is the GradScaler's job where one is given (it
    raises the scale until overflow on purpose): only a scaler-less gradient pages."""


@dataclass(frozen=True)
class Timing:
    """Windows and ``for`` durations, in seconds."""

    nonfinite_window: float = 300
    explode_for: float = 60
    baseline_window: float = 1800
    baseline_offset: float = 300
    vanish_for: float = 600
    activation_for: float = 120
    stall_for: float = 60
    down_for: float = 60
    history_window: float = 3600
    """How far back a vanished rank or a finished run is remembered."""
    divergence_for: float = 300
    amp_window: float = 600
    amp_for: float = 600
    event_window: float = 120
    """Range that holds the last two scrapes (``idelta``: what moved since the previous
    scrape): at least twice the scrape interval, Prometheus' default 1m included."""
    fp16_for: float = 120
    lr_zero_for: float = 600
    guard_window: float = 600
    """Range over which the step guard's skips are counted (the warning holds this long after a skip)."""

    def scaled(self, factor: float) -> "Timing":
        return replace(self, **{f.name: getattr(self, f.name) * factor for f in fields(self)})


PRODUCTION = Timing()
TEST_SCALE = 1 / 60


def dur(seconds: float) -> str:
    """A Prometheus duration: whole minutes as "5m", anything else in seconds."""
    s = int(round(seconds))
    return f"{s // 60}m" if s >= 60 and s % 60 == 0 else f"{max(s, 1)}s"
