"""Is the run diverging? Decided in the process, once per step, from every step.

Runs on the publisher thread, from host values the fold already has: no tensor, no clock.
A Prometheus rule sees only what a scrape happens to catch, and a window in minutes means
12 steps at 10 s/step and 120 at 1 s/step; here every step is seen and every duration is
counted in steps, so the same rule means the same thing at any step rate.

Two tiers, after what separates a divergence from a bad batch in recorded runs:

- **warnings** (gradient-only or loss-only evidence): a spike of a signal (``spikes.py``:
  the loss, the global and local gradient norms, a layer's norm against its own adaptive
  baseline), and a loss *rising*: the trend (the mean of the last ``window`` losses) at
  ``rising`` times its best or more, by at least half the absolute floor, held until it falls
  back below ``settled`` times its best (hysteresis: a trend hovering at the threshold is one
  warning, not a dozen).
- **a page** needs the loss to confirm it: the trend at ``diverged`` times its best *and*
  ``floor`` above it (in the loss's own units: 0.002 against 0.001 is no divergence), or one
  loss back at the run's starting level after the trend had fallen below half of it (the
  model lost what it learned), and evidence that this is the model, not a batch. The climb is
  dated from the loss's recent *level* (an exponentially weighted mean over ``level_steps``),
  not from the trend's best (the luckiest mean of the run, which a noisy trend sits above for
  long stretches): it begins where the mean of the last ``onset_window`` losses rose to
  ``onset`` times the level. Evidence: the climb's loss rose through intermediate values,
  taking ``ramp`` steps or more to come within a fifth of its highest (a model losing its fit;
  a bad batch's loss jumps to its top at once), or a spike of any signal in the ``evidence``
  steps before the climb began (at least ``creep`` steps before it: the short mean crosses
  ``onset`` a step or two after a jump), or a gradient that spiked without the loss on the
  step before the loss spiked (an update that broke the model: the gradients led, the loss
  followed), or a learning rate at ``lr_above_peak`` times its settled peak in the ``evidence``
  steps before the climb or since (a cause in the schedule, not in the data: a converged model
  often collapses within tens of steps of such a rise, over a few steps or in one). A climb
  whose loss jumped to ``jump`` times its level or more without a ramp is a bad batch's
  signature (its loss and gradients spike in the same step): of the spikes before it only
  gradients that led the loss are evidence, and a learning rate above its peak still is.
  Without evidence, a trend that stays diverged for ``sustain`` steps pages too, and so does one
  that has not settled ``unrecovered`` steps after it first diverged (a run that neither
  recovers nor stays at ``diverged`` times its best has diverged all the same). A non-finite
  loss pages at once. The page holds for ``window`` steps at least (the trend's lag), then
  until the trend falls below ``settled`` times its best.

A batch of bad data (a loss and gradient spike in the same step, from a healthy trend) is a
warning that clears when the batch has passed; a divergence whose gradients moved first
pages on the step the loss confirms it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, FrozenSet, Iterable, Optional, Tuple

from ..metrics import SIGNAL_LOSS
from ..thresholds import Thresholds

NEAR_TOP = 0.8
"""A climb's loss is near its top from this share of the way up (from its level to its highest)."""

SIGNAL_NONFINITE_LOSS = "nonfinite_loss"
"""Evidence: the loss itself was NaN or infinite."""
SIGNAL_LOSS_CREEP = "loss_creep"
"""Evidence: the loss climbed through intermediate values (``ramp`` steps or more) before the divergence."""
SIGNAL_LOSS_SUSTAINED = "loss_sustained"
"""Evidence: the trend stayed diverged for ``sustain`` steps."""
SIGNAL_LOSS_UNRECOVERED = "loss_unrecovered"
"""Evidence: the trend has not settled ``unrecovered`` steps after it first diverged."""
SIGNAL_LR_ABOVE_PEAK = "learning_rate_above_peak"
"""Evidence: a learning rate at ``lr_above_peak`` times its settled peak before or during the climb."""


@dataclass(frozen=True)
class DivergenceSettings:
    window: int = 20
    """Losses whose mean is the trend: one batch's loss is noise."""
    floor: float = 0.1
    """The trend must be this far above its best, in the loss's units, to be diverged."""
    rising: float = 1.5
    """The trend at this many times its best is rising (a warning)."""
    settled: float = 1.3
    """...and stays rising (or diverged) until it falls below this many times its best."""
    diverged: float = 2.0
    """The trend at this many times its best (and ``floor`` above it) confirms a divergence."""
    onset: float = 1.2
    """The climb begins where the mean of the last ``onset_window`` losses rose above this many
    times the loss's recent ``level`` and stayed there."""
    onset_window: int = 4
    """Losses whose mean dates the climb: a few steps, so the date is the loss's, not the lagging trend's."""
    level_steps: int = 200
    """Steps over which the loss's recent level (an exponentially weighted mean, each loss clipped
    at ``rising`` times it) follows the loss: the climb is measured from where the loss has been,
    not from the luckiest mean of the run."""
    evidence: int = 300
    """Steps before the climb's beginning in which a spike counts as evidence."""
    creep: int = 4
    """A spike counts as evidence only this many steps or more before the climb began."""
    ramp: int = 3
    """A climb whose loss took this many steps to come within a fifth of its highest rose
    through intermediate values: the model losing its fit (evidence), not a batch."""
    jump: float = 3.0
    """A climb without a ramp whose loss reached this many times its level is a jump, a bad
    batch's signature: of the spikes before it, only gradients that led the loss by a step are
    evidence."""
    sustain: int = 100
    """Steps a diverged trend without other evidence must last to page."""
    unrecovered: int = 200
    """Steps after the trend first reached ``diverged`` without falling back below ``settled``
    after which the run pages whatever the evidence: a spike that recovers comes back within
    this long (the alert corpus's labels call a return within 200 steps a recovering spike)."""
    lr_above_peak: float = Thresholds().lr_over_peak
    """A learning rate this many times its settled peak (``scalars.LearningRatePeaks``), from
    ``evidence`` steps before the climb began to the step it is confirmed, is evidence, for a
    jump as for a climb: the schedule, not a batch, moved the model (the warning
    ``GradmonLearningRateAbovePeak`` fires at the same bar)."""

    def __post_init__(self) -> None:
        if self.window < 1 or self.onset_window < 1 or self.level_steps < 1:
            raise ValueError("window, onset_window and level_steps must be at least 1")
        if not 1 < self.onset <= self.settled < self.rising < self.diverged:
            raise ValueError("need 1 < onset <= settled < rising < diverged")


class LossTrend:
    """The mean of the last ``window`` finite losses, the lowest such mean seen, and the first:
    where the run started (an untrained model's loss, about chance for a classifier)."""

    def __init__(self, window: int) -> None:
        self._losses: Deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self.value: Optional[float] = None
        self.best: Optional[float] = None
        self.start: Optional[float] = None

    def restart(self) -> None:
        self._losses.clear()
        self._sum = 0.0
        self.value = self.best = self.start = None

    def update(self, loss: float) -> None:
        if len(self._losses) == self._losses.maxlen:
            self._sum -= self._losses[0]
        self._losses.append(loss)
        self._sum += loss
        if len(self._losses) < (self._losses.maxlen or 1):
            return  # a partial window's mean is one batch's noise at the start
        self.value = self._sum / len(self._losses)
        if self.start is None:
            self.start = self.value
        if self.best is None or self.value < self.best:
            self.best = self.value

    def ratio(self) -> Optional[float]:
        """The trend over its best; None before the first full window, or for a best at or
        below 0 (an objective that is not a positive quantity has no ratio)."""
        if self.value is None or self.best is None or self.best <= 0:
            return None
        return self.value / self.best

    def back_to_start(self, loss: float) -> bool:
        """Whether ``loss`` is back at the run's starting level after the trend had fallen
        below half of it: the model lost what it learned (a positive loss only)."""
        return (self.start is not None and self.best is not None and 0 < self.best < self.start / 2
                and loss >= self.start)

    def above_best(self) -> float:
        return 0.0 if self.value is None or self.best is None else self.value - self.best


class Climb:
    """The loss's current climb: the streak of steps in which the mean of the last ``window``
    losses has stayed at ``ratio`` times the loss's recent level or more, and each of its
    losses as a multiple of that level.

    The level is an exponentially weighted mean of the loss over about ``level_steps`` steps,
    each loss entering it clipped at ``clip`` times it, so that a bad batch does not lift it;
    a loss that settles higher for good is followed within a few windows."""

    def __init__(self, window: int, ratio: float, level_steps: int, clip: float, longest: int) -> None:
        self._recent: Deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self._ratio, self._clip = ratio, clip
        self._alpha = 2.0 / (level_steps + 1)
        self._seen = 0
        self.level: Optional[float] = None
        self.since: Optional[int] = None  # the step the current climb began; None: no climb
        self.ratios: Deque[float] = deque(maxlen=longest)  # the climb's losses over the level

    def restart(self) -> None:
        self._recent.clear()
        self._sum, self._seen = 0.0, 0
        self.level = self.since = None
        self.ratios.clear()

    def update(self, step: int, loss: float) -> None:
        recent, level = self._recent, self.level
        full = len(recent) == recent.maxlen
        if full:
            self._sum -= recent[0]
        recent.append(loss)
        self._sum += loss
        if level is None:
            self.level, self._seen = loss, 1
            return
        if full or len(recent) == recent.maxlen:
            # hysteresis: a climb begins at ``ratio`` times the level and lasts while the mean
            # stays above halfway to it, so a noisy ramp is one climb, not several short ones
            bar = self._ratio if self.since is None else (1.0 + self._ratio) / 2
            if level > 0 and self._sum >= bar * level * len(recent):
                if self.since is None:
                    self.since = step
                self.ratios.append(loss / level)
            elif self.since is not None:
                self.since = None
                self.ratios.clear()
        self._seen += 1
        # the first losses average plainly: an exponential weight on one value is no level
        rate = self._alpha if self._seen * self._alpha >= 1.0 else 1.0 / self._seen
        clipped = self._clip * level
        self.level = level + rate * ((clipped if 0 < clipped < loss else loss) - level)

    def top(self) -> float:
        """The climb's highest loss as a multiple of the level; 0 without a climb."""
        return max(self.ratios, default=0.0)

    def gradual_steps(self) -> int:
        """Steps the climb took before its loss first came within a fifth of its highest (as
        multiples of the level, from 1): a loss that rose through intermediate values (a model
        losing its fit) took several; a bad batch, whose loss jumps to its top at once, took
        none, and the damaged steps that follow it come after its top and do not count."""
        if not self.ratios:
            return 0
        near_top = 1.0 + NEAR_TOP * (max(self.ratios) - 1.0)
        return next(i for i, r in enumerate(self.ratios) if r >= near_top)


class DivergenceWatch:
    """The loss trend, the rising warning and the confirmed-divergence page of one monitor.

    ``step`` is called once per optimizer step that scored, after the step's spikes were
    counted, with the step's loss (None: not observed) and the signals that spiked in it."""

    def __init__(self, settings: DivergenceSettings = DivergenceSettings()) -> None:
        self.settings = settings
        self.trend = LossTrend(settings.window)
        self.climb = Climb(settings.onset_window, settings.onset, settings.level_steps, settings.rising,
                           settings.evidence)
        self.steps = 0
        self.rising_steps = 0  # steps the current rising warning has lasted; 0: none
        self.diverging_steps = 0  # steps the current divergence has lasted; 0: none
        self.divergences = 0  # counter: divergences entered
        self.evidence: FrozenSet[str] = frozenset()  # of the current divergence
        self._spikes: Deque[Tuple[int, str]] = deque()  # (step, signal), the last ``evidence`` steps
        self._diverged_since: Optional[int] = None
        self._before: FrozenSet[str] = frozenset()  # evidence from before the climb, dated when diverged
        self._lr_above_peak_at: Optional[int] = None  # the last step a learning rate was above its peak

    def restart(self) -> None:
        """A resumed run: the old best is no baseline. The counter carries on."""
        self.trend.restart()
        self.climb.restart()
        self._spikes.clear()
        self._diverged_since = self._lr_above_peak_at = None
        self.rising_steps = self.diverging_steps = 0
        self.evidence = frozenset()

    def step(self, loss: Optional[float], spiked: Iterable[str] = (), lr_over_peak: Optional[float] = None) -> None:
        """``lr_over_peak``: the step's highest learning rate over its group's settled peak
        (None: no group has settled one)."""
        spiked = tuple(spiked)  # read twice: by the dating and into the spikes kept
        self.steps += 1
        now, s = self.steps, self.settings
        if lr_over_peak is not None and lr_over_peak >= s.lr_above_peak:
            self._lr_above_peak_at = now
        if loss is not None and not math.isfinite(loss):
            self._page(frozenset({SIGNAL_NONFINITE_LOSS}))
            return
        if loss is not None:
            self.trend.update(loss)
            self.climb.update(now, loss)
        ratio = self.trend.ratio()
        if ratio is None:
            return
        above = self.trend.above_best()
        settled = ratio < s.settled
        # the trend at ``diverged`` times its best, or this loss back where the run started
        diverged = (ratio >= s.diverged and above >= s.floor) or (
            loss is not None and self.trend.back_to_start(loss) and loss - (self.trend.best or 0.0) >= s.floor)
        if diverged and self._diverged_since is None:
            # the climb and what came before it are dated once, when the trend reaches
            # ``diverged``: a later restart of the climb (the loss dipping after a bad batch)
            # must not turn the batch's own spikes into evidence from before it
            self._diverged_since = now
            self._before = self._evidence_before(now, spiked)
        elif not diverged and settled:
            self._diverged_since = None
        for signal in spiked:
            self._spikes.append((now, signal))
        while self._spikes and self._spikes[0][0] < now - s.evidence:
            self._spikes.popleft()
        if self.diverging_steps:
            # the trend lags the loss by its window: a page confirmed by one loss back at the
            # starting level would read as settled on the next step and page again on the one after
            if settled and self.diverging_steps >= s.window:
                self.diverging_steps, self.evidence = 0, frozenset()
            else:
                self.diverging_steps += 1
        elif self._diverged_since is not None:  # diverged, or has been and not settled since
            since = now - self._diverged_since + 1
            evidence = set(self._before) if diverged else set()
            if diverged and since >= s.sustain:
                evidence.add(SIGNAL_LOSS_SUSTAINED)
            if since >= s.unrecovered:
                evidence.add(SIGNAL_LOSS_UNRECOVERED)
            if evidence:
                self._page(frozenset(evidence))
        if settled:
            self.rising_steps = 0
        elif self.rising_steps or (ratio >= s.rising and above >= s.floor / 2):
            self.rising_steps += 1

    def _evidence_before(self, now: int, spiked: Tuple[str, ...]) -> FrozenSet[str]:
        """What, from before the climb that reached ``diverged`` at ``now``, says it is the model."""
        s = self.settings
        onset = self.climb.since if self.climb.since is not None else now
        # a climb is the model's when its loss rose through intermediate values for ``ramp``
        # steps; without a ramp, a loss at ``jump`` times its level is a bad batch's signature:
        # what spiked before it is no evidence either, and it pages only if it lasts
        # (``sustain``) or something moved the model rather than the batch
        gradual = self.climb.gradual_steps() >= s.ramp
        jumped = not gradual and self.climb.top() >= s.jump
        # what moved the model: gradients that led the loss, a learning rate risen past its peak
        caused = self._gradients_led(onset - s.creep, now, spiked) | self._rate_rose(onset - s.evidence)
        if jumped:
            return caused
        return frozenset({signal for at, signal in self._spikes if onset - s.evidence <= at < onset - s.creep}
                         | ({SIGNAL_LOSS_CREEP} if gradual else set()) | caused)

    def _rate_rose(self, since: int) -> FrozenSet[str]:
        """A learning rate at ``lr_above_peak`` times its settled peak from ``since`` on."""
        at = self._lr_above_peak_at
        return frozenset({SIGNAL_LR_ABOVE_PEAK}) if at is not None and at >= since else frozenset()

    def _gradients_led(self, since: int, now: int, spiked: Tuple[str, ...]) -> FrozenSet[str]:
        """The signals that spiked without the loss on a step before which the loss spiked, from
        ``since`` to ``now`` (whose spikes, ``spiked``, are not yet recorded): the gradients moved
        first and the loss followed on the next step, as when an update breaks the model. A bad
        batch moves both in the same step: its own loss is what pushes its gradients."""
        by_step: Dict[int, set] = {}
        for at, signal in self._spikes:
            if at >= since - 1:
                by_step.setdefault(at, set()).add(signal)
        by_step.setdefault(now, set()).update(spiked)
        return frozenset(signal for at, signals in by_step.items() if SIGNAL_LOSS in signals
                         for signal in by_step.get(at - 1, ()) if SIGNAL_LOSS not in by_step[at - 1])

    def _page(self, evidence: FrozenSet[str]) -> None:
        if not self.diverging_steps:
            self.divergences += 1
            self.evidence = evidence
        self.diverging_steps += 1

    def counters(self) -> Dict[str, int]:
        return {"divergences": self.divergences}

    def resume(self, saved: Dict[str, int]) -> None:
        self.divergences += saved.get("divergences", 0)


def reason(watch: DivergenceWatch) -> Dict[str, object]:
    """Why ``watch`` paged, as JSON values (an incident bundle's ``reason``): the evidence,
    the trend, its best, their ratio and the run's first trend (None where not known, or
    not finite)."""
    def number(x: Optional[float]) -> Optional[float]:
        return x if x is not None and math.isfinite(x) else None
    return {"kind": "divergence", "evidence": sorted(watch.evidence), "trend": number(watch.trend.value),
            "best": number(watch.trend.best), "ratio": number(watch.trend.ratio()), "start": number(watch.trend.start),
            "diverged": watch.settings.diverged, "floor": watch.settings.floor, "window": watch.settings.window}
