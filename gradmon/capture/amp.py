"""Mixed precision with a GradScaler: unscaled norms and deliberately skipped steps.

With dynamic loss scaling the gradients gradmon sees at the end of backward are
multiplied by the loss scale, and an overflow step is skipped on purpose: the scaler's
``step()`` never calls ``optimizer.step()``, so optimizer hooks cannot see it. Given
the scaler (``attach(model, scaler=scaler)``), gradmon

* divides sums of squares by the scale squared on the device (no host read),
* wraps the scaler's ``update()`` (called once per iteration, stepped or skipped): an
  iteration with a backward but no optimizer step was skipped, and its Inf/NaN are the
  overflow the scaler exists to absorb, counted in ``gradmon_amp_skipped_steps_total``
  and not as non-finite incidents,
* exports the loss scale, so a scale that keeps collapsing is visible and alerts.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def is_scaler(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("scale", "step", "update", "unscale_", "is_enabled"))


def scale_tensor(scaler: Any) -> Optional[torch.Tensor]:
    """The current loss scale as a device tensor (a copy), or None when not scaling."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale.detach().reshape(1).clone() if isinstance(scale, torch.Tensor) else None


class UpdateHook:
    """Calls ``before()`` at each ``scaler.update()``; ``remove()`` restores the scaler."""

    def __init__(self, scaler: Any, before: Callable[[], None]) -> None:
        self._scaler = scaler
        original = type(scaler).update

        def update(*args: Any, **kwargs: Any) -> Any:
            before()
            return original(scaler, *args, **kwargs)

        scaler.update = update  # an instance attribute shadows the class method

    def remove(self) -> None:
        if "update" in vars(self._scaler):
            del self._scaler.update
