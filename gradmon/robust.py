"""The robust spike score: its one definition, on tensors, used in two places.

* The publisher's spike detectors (``aggregate.spikes``) score every step's host values with
  it, for the trustworthy pages (``gradmon_spike_steps_total``).
* The step guard (``guard="spike"``, ``capture.stepguard``) scores the loss and the global
  gradient norm with it on the device, before ``optimizer.step()``, without a host read.

The score is one-sided and robust (after OLMo-core's stability monitor): against a window of
earlier values, with a robust linear trend removed so that a loss that falls steadily or a
norm that rises steadily is not a spike,

    score = max(0, (y - trend(n)) / max(1.4826 * MAD(residuals), floor))

where the trend is the line through the medians of the window's two halves, anchored at the
median residual, and the window's values are at positions 0..n-1 (``y`` is position n). A
step is a spike when its score is above the threshold *and* its value is above the window's
median by ln 2 on a log scale (twice the median), by the median's magnitude on a raw scale.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

MAD_TO_SIGMA = 1.4826
"""MAD times this estimates a normal distribution's standard deviation."""

LOG_FLOOR = 0.05
"""Smallest scale, in ln units (5 %): a series quieter than this (a loss on a memorized
batch, a norm of a frozen model) would otherwise score noise as a spike."""

LN2 = math.log(2.0)


def median(t: torch.Tensor) -> torch.Tensor:
    """The median over the last dimension as ``statistics.median`` defines it: the mean of
    the two middle values of an even count (``torch.median`` takes the lower one)."""
    s = torch.sort(t, dim=-1).values
    n = s.shape[-1]
    return (s[..., (n - 1) // 2] + s[..., n // 2]) / 2


def score(ys: torch.Tensor, y: torch.Tensor, floor: float = LOG_FLOOR, log_scale: bool = True
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(score, above) of ``y`` against the window ``ys`` (oldest first along its last
    dimension, at least 4 values; leading dimensions are windows scored at once, ``y`` has
    them too), both already on the scale scored (ln of the values on a log scale), in the
    window's dtype and device: nothing is read on the host."""
    n = ys.shape[-1]
    half = n // 2
    # the halves' middle steps are n - half apart
    slope = (median(ys[..., n - half:]) - median(ys[..., :half])) / (n - half)
    residuals = ys - slope.unsqueeze(-1) * torch.arange(n, dtype=ys.dtype, device=ys.device)
    level = median(residuals)
    scale = torch.clamp(MAD_TO_SIGMA * median((residuals - level.unsqueeze(-1)).abs()), min=floor)
    value = torch.clamp((y - (level + slope * n)) / scale, min=0.0)  # this step is step n of the window
    mid = median(ys)
    above = (y - mid) > (LN2 if log_scale else mid.abs())
    return value, above


def lr_jumped(prev: float, cur: float) -> bool:
    """A learning rate that changed by more than a factor 2 in one step, or left or
    reached 0: a series' baseline moves with it. A linear warm-up from 0 changes by 2x
    only at its first steps, before the window scores anything."""
    if prev == cur:
        return False
    if prev <= 0 or cur <= 0:
        return True
    return max(prev, cur) > 2 * min(prev, cur)
