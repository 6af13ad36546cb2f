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
  ``floor`` above it (in the loss's own units: 0.002 against 0.001 is no divergence), and
  evidence that came *before* the loss left its best: a spike of any signal in the
  ``evidence`` steps before the trend's climb began (and at least ``creep`` steps before it:
  the trend, a mean, crosses ``onset`` a few steps after a jump in the loss), or a climb that
  took ``creep`` steps or more. The trend of ``window`` losses takes 16/(k-1) steps from 1.2x
  to 2x its best after a k-fold step in the loss: a climb of ``creep`` (4) steps or more is a
  loss that rose at most five-fold at once, or rose over many steps, as a model losing its fit
  does; a bad batch's loss (random labels: chance level) is many times a trained model's best
  and jumps there in one step. Without evidence, a trend that stays diverged for ``sustain`` steps pages
  too. A non-finite loss pages at once. The page holds until the trend falls below
  ``settled`` times its best.

A batch of bad data (a loss and gradient spike in the same step, from a healthy trend) is a
warning that clears when the batch has passed; a divergence whose gradients moved first
pages on the step the loss confirms it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, FrozenSet, Iterable, Optional, Tuple

SIGNAL_NONFINITE_LOSS = "nonfinite_loss"
"""Evidence: the loss itself was NaN or infinite."""
SIGNAL_LOSS_CREEP = "loss_creep"
"""Evidence: the trend took ``creep`` steps or more to climb from ``rising`` to ``diverged``."""
SIGNAL_LOSS_SUSTAINED = "loss_sustained"
"""Evidence: the trend stayed diverged for ``sustain`` steps."""


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
    """The trend's climb begins where it last rose above this many times its best."""
    evidence: int = 300
    """Steps before the climb's beginning in which a spike counts as evidence."""
    creep: int = 4
    """A climb from ``onset`` to ``diverged`` that took this many steps is evidence itself; a
    spike counts only this many steps or more before the climb began."""
    sustain: int = 100
    """Steps a diverged trend without other evidence must last to page."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if not 1 < self.onset <= self.settled < self.rising < self.diverged:
            raise ValueError("need 1 < onset <= settled < rising < diverged")


class LossTrend:
    """The mean of the last ``window`` finite losses and the lowest such mean seen."""

    def __init__(self, window: int) -> None:
        self._losses: Deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self.value: Optional[float] = None
        self.best: Optional[float] = None

    def restart(self) -> None:
        self._losses.clear()
        self._sum = 0.0
        self.value = self.best = None

    def update(self, loss: float) -> None:
        if len(self._losses) == self._losses.maxlen:
            self._sum -= self._losses[0]
        self._losses.append(loss)
        self._sum += loss
        if len(self._losses) < (self._losses.maxlen or 1):
            return  # a partial window's mean is one batch's noise at the start
        self.value = self._sum / len(self._losses)
        if self.best is None or self.value < self.best:
            self.best = self.value

    def ratio(self) -> Optional[float]:
        """The trend over its best; None before the first full window, or for a best at or
        below 0 (an objective that is not a positive quantity has no ratio)."""
        if self.value is None or self.best is None or self.best <= 0:
            return None
        return self.value / self.best

    def above_best(self) -> float:
        return 0.0 if self.value is None or self.best is None else self.value - self.best


class DivergenceWatch:
    """The loss trend, the rising warning and the confirmed-divergence page of one monitor.

    ``step`` is called once per optimizer step that scored, after the step's spikes were
    counted, with the step's loss (None: not observed) and the signals that spiked in it."""

    def __init__(self, settings: DivergenceSettings = DivergenceSettings()) -> None:
        self.settings = settings
        self.trend = LossTrend(settings.window)
        self.steps = 0
        self.rising_steps = 0  # steps the current rising warning has lasted; 0: none
        self.diverging_steps = 0  # steps the current divergence has lasted; 0: none
        self.divergences = 0  # counter: divergences entered
        self.evidence: FrozenSet[str] = frozenset()  # of the current divergence
        self._spikes: Deque[Tuple[int, str]] = deque()  # (step, signal), the last ``evidence`` steps
        self._onset: Optional[int] = None  # step the trend's current climb began
        self._diverged_since: Optional[int] = None
        self._climb = 0

    def restart(self) -> None:
        """A resumed run: the old best is no baseline. The counter carries on."""
        self.trend.restart()
        self._spikes.clear()
        self._onset = self._diverged_since = None
        self.rising_steps = self.diverging_steps = 0
        self.evidence = frozenset()

    def step(self, loss: Optional[float], spiked: Iterable[str] = ()) -> None:
        self.steps += 1
        now, s = self.steps, self.settings
        if loss is not None and not math.isfinite(loss):
            self._page(frozenset({SIGNAL_NONFINITE_LOSS}))
            return
        if loss is not None:
            self.trend.update(loss)
        ratio = self.trend.ratio()
        if ratio is None:
            return
        above = self.trend.above_best()
        if ratio < s.onset:
            self._onset = None
        elif self._onset is None:
            self._onset = now
        onset = self._onset if self._onset is not None else now
        # spikes count as evidence only well before the climb began: a bad batch spikes with
        # its loss, and the trend (a mean) crosses ``onset`` up to ``creep`` steps after a jump
        evidence = {signal for at, signal in self._spikes if onset - s.evidence <= at < onset - s.creep}
        for signal in spiked:
            self._spikes.append((now, signal))
        while self._spikes and self._spikes[0][0] < now - s.evidence:
            self._spikes.popleft()
        settled = ratio < s.settled
        diverged = ratio >= s.diverged and above >= s.floor
        if diverged and self._diverged_since is None:
            self._diverged_since = now
            self._climb = now - onset  # steps from the climb's beginning to diverged
        elif not diverged and settled:
            self._diverged_since = None
        if self.diverging_steps:
            if settled:
                self.diverging_steps, self.evidence = 0, frozenset()
            else:
                self.diverging_steps += 1
        elif diverged:
            if self._climb >= s.creep:
                evidence.add(SIGNAL_LOSS_CREEP)
            if self._diverged_since is not None and now - self._diverged_since + 1 >= s.sustain:
                evidence.add(SIGNAL_LOSS_SUSTAINED)
            if evidence:
                self._page(frozenset(evidence))
        if settled:
            self.rising_steps = 0
        elif self.rising_steps or (ratio >= s.rising and above >= s.floor / 2):
            self.rising_steps += 1

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
    the trend, its best and their ratio (None where not known, or not finite)."""
    def number(x: Optional[float]) -> Optional[float]:
        return x if x is not None and math.isfinite(x) else None
    return {"kind": "divergence", "evidence": sorted(watch.evidence), "trend": number(watch.trend.value),
            "best": number(watch.trend.best), "ratio": number(watch.trend.ratio()),
            "diverged": watch.settings.diverged, "floor": watch.settings.floor, "window": watch.settings.window}
