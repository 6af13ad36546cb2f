"""In-process spike detection: a one-step spike counts even if no scrape sees it.

A Prometheus gauge sampled every 15-30 s misses a loss or gradient-norm spike that lasts
one step; a counter incremented here, on the publisher thread, from every step's host
values, does not (``increase()`` over any window). Nothing here runs on the training
thread or touches a tensor.

The score is one-sided and robust (after OLMo-core's stability monitor), defined once in
``gradmon.robust`` (the step guard scores with it on the device, before the step): against
the last ``window`` accepted values, with a robust linear trend removed, of ``y`` = ln(value)
(a ratio is what matters for a norm or a positive loss). A step is a spike when its score
is above the threshold *and* its value is above twice the window's median (in log units: ln 2
above the median of the logs), so a very quiet series cannot turn a 10 % wobble into a spike.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Collection, Deque, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from .. import metrics as M
from .. import robust
from ..robust import LOG_FLOOR, MAD_TO_SIGMA, lr_jumped
from ..thresholds import Thresholds

__all__ = ["LOG_FLOOR", "MAD_TO_SIGMA", "LayerBaselines", "SpikeDetector", "SpikeTracker", "Verdict", "lr_jumped"]


class Verdict(NamedTuple):
    score: float
    spike: bool


@dataclass
class SpikeDetector:
    """The robust score of one series, one value per step. Pure: no clock, no tensor.

    ``update`` returns None for a value it does not score: a non-finite one (the
    non-finite counters' business: it never enters the window), a non-positive one on a
    log scale, and any value while fewer than ``min_steps`` earlier values are in the
    window. ``raw_below_zero``: a series that may legitimately go to zero or below (the
    loss of some objectives) is scored on raw values from its first non-positive value
    on, with ``floor`` in its own units and "twice the median" read as "above the median
    by its magnitude"; otherwise (a norm) such values are skipped."""

    window: int = 128
    min_steps: int = 32
    threshold: float = 6.0
    floor: float = LOG_FLOOR
    raw_below_zero: bool = False

    def __post_init__(self) -> None:
        if not 4 <= self.min_steps <= self.window:
            raise ValueError(f"min_steps must be in 4..window, got {self.min_steps} (window {self.window})")
        self.log_scale = True
        # one value per accepted step, oldest first: position i is step i of the window
        self._values: Deque[float] = deque(maxlen=self.window)

    def restart(self) -> None:
        """Forget the window: what came before (another run, another learning rate) is no baseline."""
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)

    def update(self, value: float) -> Optional[Verdict]:
        judged = self.judge(value)
        return None if judged is None else Verdict(judged.score, judged.spike)

    def judge(self, value: float) -> Optional["Judged"]:
        """:meth:`update` with the score left to compute until it is read (:class:`Judged`):
        the publisher decides every step whether it is a spike, a scrape reads the score."""
        if not math.isfinite(value):
            return None
        if self.log_scale and value <= 0:
            if not self.raw_below_zero:
                return None
            self.log_scale = False  # for good: this objective is not a positive quantity
            self.restart()
        y = math.log(value) if self.log_scale else value
        judged = Judged(tuple(self._values), y, self) if len(self._values) >= self.min_steps else None
        self._values.append(y)
        return judged


class Judged:
    """One value judged against the window before it: whether it is a spike, decided at
    once, and its score, computed with ``robust.score`` when first read.

    A spike needs its value above the window's median (``robust.score``'s ``above``), which
    the host reads off the sorted window with the same float64 operations in the same
    order, so the same answer; only a value above it is scored at once. A step of a
    healthy run then costs a sort of the window in Python, where the tensor score costs
    some thirty small tensor operations on the publisher thread every step."""

    __slots__ = ("_window", "_y", "_floor", "_log_scale", "_score", "spike")

    def __init__(self, window: Tuple[float, ...], y: float, detector: SpikeDetector) -> None:
        self._window, self._y = window, y
        self._floor, self._log_scale = detector.floor, detector.log_scale
        self._score: Optional[float] = None
        self.spike = False
        if self._above_median():
            score, above = self._scored()
            self.spike = score > detector.threshold and above

    def _above_median(self) -> bool:
        s = sorted(self._window)
        n = len(s)
        mid = (s[(n - 1) // 2] + s[n // 2]) / 2
        return (self._y - mid) > (robust.LN2 if self._log_scale else abs(mid))

    def _scored(self) -> Tuple[float, bool]:
        score, above = robust.score(torch.tensor(self._window, dtype=torch.float64),
                                    torch.tensor(self._y, dtype=torch.float64), self._floor, self._log_scale)
        self._score = score.item()  # a CPU tensor of host values: nothing to wait for
        return self._score, bool(above)

    @property
    def score(self) -> float:
        return self._scored()[0] if self._score is None else self._score


class LayerBaselines:
    """A robust, adaptive baseline of each layer's value on a log scale: an exponentially
    weighted mean of ln(value) and of its absolute deviation, over about ``window`` steps.

    The spread adapts (a layer whose norm swings 3x from batch to batch needs a larger
    jump than one that moves by 5 %), which a fixed ratio to a median cannot do. A value
    scores against the baseline before it enters it; an outlier enters clipped to the
    baseline's edge, so a spike lasting a few steps does not drag the baseline up behind
    it, while a lasting change of level is followed within a window. A layer is a spike
    at a score above ``threshold`` that is also at least ``min_ratio`` times its baseline.

    A step's layers are updated in one loop over flat per-layer lists (:meth:`update_many`),
    with no call or object per layer: this runs on the publisher thread at every step, and
    its Python takes the interpreter lock from the training thread as models grow."""

    def __init__(self, window: int = 128, min_steps: int = 32, threshold: float = 6.0,
                 min_ratio: float = 3.0) -> None:
        self.alpha = 2.0 / (window + 1)
        self.min_steps = min_steps
        self.threshold = threshold
        self.log_ratio = math.log(min_ratio)
        # per layer: values seen (0: none yet), mean and mean absolute deviation of ln(value)
        self._seen: List[float] = []
        self._mean: List[float] = []
        self._dev: List[float] = []

    def restart(self) -> None:
        self._seen = [0.0] * len(self._seen)

    def update_many(self, layers: Collection[int], values: Sequence[Optional[float]]) -> Optional[Verdict]:
        """One step's value of each of ``layers`` (distinct): the highest score among them
        and whether any is a spike; None if none was scored. A missing (None), non-finite or
        non-positive value is skipped; a layer's first ``min_steps`` values enter its
        baseline unscored."""
        top = max(layers, default=-1) + 1
        if top > len(self._seen):
            grow = [0.0] * (top - len(self._seen))
            self._seen += grow
            self._mean += grow
            self._dev += grow
        seen, means, devs = self._seen, self._mean, self._dev
        alpha, min_steps, threshold, log_ratio = self.alpha, self.min_steps, self.threshold, self.log_ratio
        log, inf = math.log, math.inf
        best = -1.0  # no score yet (a score is never below 0)
        spike = False
        # max/min/abs as comparisons: a builtin's call per layer and step costs as much as the arithmetic
        for layer, value in zip(layers, values):
            if value is None or not 0.0 < value < inf:  # NaN compares False
                continue
            y = log(value)
            n = seen[layer]
            seen[layer] = n + 1.0
            if n == 0.0:
                means[layer], devs[layer] = y, 0.0
                continue
            mean, dev = means[layer], devs[layer]
            # the first steps average plainly: an exponential weight on one value is no baseline
            rate = 1.0 / (n + 1.0)
            if alpha > rate:
                rate = alpha
            scale = MAD_TO_SIGMA * dev
            if LOG_FLOOR > scale:
                scale = LOG_FLOOR
            clipped = y
            if n >= min_steps:
                up = y - mean
                score = up / scale if up > 0.0 else 0.0
                if score > best:
                    best = score
                if score > threshold and up >= log_ratio:
                    spike = True
                edge = 3.0 * scale
                if mean - edge > clipped:
                    clipped = mean - edge
                if mean + edge < clipped:
                    clipped = mean + edge
            moved = clipped - mean
            means[layer] = mean + rate * moved
            devs[layer] = dev + rate * ((moved if moved >= 0.0 else -moved) - dev)
        return None if best < 0.0 else Verdict(best, spike)


class SpikeTracker:
    """The detectors of one monitor, one per ``signal``, their last scores and spike counts.

    ``new_step`` is called once per step before the step's values: the windows restart
    when the global step goes backwards or jumps by more than a window (a resumed run)
    and when any parameter group's learning rate jumps (see :func:`lr_jumped`).

    A signal's spike step with at least ``burst`` of its spike steps within the last
    ``burst_window`` steps (itself included) is a burst: what the spike warnings read, so
    that a lone spike is counted but warns only once spikes recur."""

    def __init__(self, signals: Sequence[str], threshold: float = 6.0, window: int = 128,
                 min_steps: int = 32, raw_below_zero: Iterable[str] = (),
                 layers: Optional[Mapping[str, float]] = None, burst: int = Thresholds().spike_burst,
                 burst_window: int = Thresholds().spike_hold_steps) -> None:
        """``layers``: signals scored per layer (:class:`LayerBaselines`), each with its
        minimum ratio to the layer's baseline."""
        raw = frozenset(raw_below_zero)
        self.layers: Dict[str, LayerBaselines] = {
            s: LayerBaselines(window, min_steps, threshold, ratio) for s, ratio in (layers or {}).items() if s in signals}
        self.detectors: Dict[str, SpikeDetector] = {
            s: SpikeDetector(window, min_steps, threshold, raw_below_zero=s in raw) for s in signals
            if s not in self.layers and s not in M.EVENT_SIGNALS}
        self._scores: Dict[str, Union[float, Judged]] = {}  # a signal's last score, or the value to score
        self.spikes: Dict[str, int] = {s: 0 for s in signals}
        self.last: Dict[str, int] = {}  # signal -> the step count (``steps``) of its last spike
        self.last_burst: Dict[str, int] = {}  # signal -> the step count of its last burst
        self._burst, self._burst_window = burst, burst_window
        self._recent: Dict[str, Deque[int]] = {}  # signal -> the step counts of its spikes in the burst window
        self.this_step: Set[str] = set()  # the signals that spiked in the current step
        self.steps = 0  # calls of new_step: steps, counted the same way for every signal
        self.restarts = 0
        self.resumed = False  # whether the current step restarted the windows as a resumed run
        self._window = window
        self._step: Optional[int] = None
        self._lrs: Tuple[Optional[float], ...] = ()

    @property
    def scores(self) -> Dict[str, float]:
        """Each signal's last score, computed now for a signal judged since the last read."""
        for signal, score in self._scores.items():
            if isinstance(score, Judged):
                self._scores[signal] = score.score
        return dict(self._scores)  # type: ignore[arg-type]

    def restart(self) -> None:
        self.restarts += 1
        for d in self.detectors.values():
            d.restart()
        for layers in self.layers.values():
            layers.restart()

    def new_step(self, global_step: int, learning_rates: Sequence[Optional[float]] = ()) -> None:
        """``learning_rates``: per parameter group, None where unknown; () when the step
        says nothing about them (a skipped or a manual step): the last known ones stay."""
        prev, self._step = self._step, global_step
        self.steps += 1
        self.this_step = set()
        self.resumed = prev is not None and not 0 <= global_step - prev <= self._window
        resumed = self.resumed
        jumped = False
        if learning_rates:
            lrs, self._lrs = self._lrs, tuple(learning_rates)
            jumped = len(lrs) == len(self._lrs) and any(
                a is not None and b is not None and lr_jumped(a, b) for a, b in zip(lrs, self._lrs))
        if resumed or jumped:
            self.restart()

    def relabel(self, global_step: int) -> None:
        """The last step's number, as the training corrected it (``monitor.step(n)``)."""
        self._step = global_step

    def observe(self, signal: str, value: float) -> None:
        detector = self.detectors.get(signal)
        if detector is None:
            return
        judged = detector.judge(value)
        if judged is not None:
            self._scores[signal] = judged
            self._count(signal, judged.spike)

    def observe_layers(self, signal: str, layers: Collection[int], values: Sequence[Optional[float]]) -> None:
        """One step's value (None: none) of each of ``layers`` for a layer signal (a
        gradient norm per layer): a spike step when any layer is a spike against its own
        baseline."""
        baselines = self.layers.get(signal)
        if baselines is None:
            return
        verdict = baselines.update_many(layers, values)
        if verdict is not None:
            self._scores[signal] = verdict.score
            self._count(signal, verdict.spike)

    def event(self, signal: str) -> None:
        """A step of a signal that no detector scores (an event decided elsewhere, such as an
        attention layer's growth doubling) counted as a spike step of it."""
        if signal in self.spikes:
            self._count(signal, True)

    def _count(self, signal: str, spike: bool) -> None:
        if spike:
            self.spikes[signal] += 1
            self.last[signal] = self.steps
            self.this_step.add(signal)
            recent = self._recent.setdefault(signal, deque())
            if not recent or recent[-1] != self.steps:  # a burst counts steps, not calls
                recent.append(self.steps)
            while recent[0] <= self.steps - self._burst_window:
                recent.popleft()
            if len(recent) >= self._burst:
                self.last_burst[signal] = self.steps

    def steps_since(self) -> Dict[str, int]:
        """Steps since each signal's last spike step (0: this step); signals that never spiked are absent."""
        return {signal: self.steps - at for signal, at in self.last.items()}

    def steps_since_burst(self) -> Dict[str, int]:
        """Steps since each signal's last burst (0: this step); signals that never had one are absent."""
        return {signal: self.steps - at for signal, at in self.last_burst.items()}

    def resume(self, spikes: Mapping[str, int]) -> None:
        """Continue an earlier monitor's counts (same model name and labels)."""
        for signal, n in spikes.items():
            if signal in self.spikes:
                self.spikes[signal] += n
