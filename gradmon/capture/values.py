"""What one optimizer step collected on the device for its packet besides the hooks'
records: the statistics measured many rows at once (PARAM_GRAD, OPTIMIZER), the learning
rates, a fused optimizer's overflow flag, the GradScaler's loss scale and the observed loss.
None of it is read on the host here: the packet carries it (``writer.write``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import statistics as S
from ..statistics import Statistic
from . import amp
from .loss import LossMean
from .writer import Batched


class StepValues:
    def __init__(self, scaler: Any = None) -> None:
        self._scaler = scaler
        self.batched: Dict[str, Batched] = {}  # by statistic: (rows, parameter and numel of each row)
        self.learning_rates: Tuple[Any, ...] = ()  # per param group: floats or tensors
        self.found_inf: Optional[torch.Tensor] = None  # a fused optimizer's overflow flag
        self.scale: Optional[torch.Tensor] = None  # the loss scale during this step's backward
        self.loss = LossMean()  # observe(loss=...) since the last step, on the device

    def read_scale(self) -> None:
        """The GradScaler's scale now, as the gradients just measured carry it."""
        self.scale = amp.scale_tensor(self._scaler)

    def drop(self, statistics: Sequence[Statistic]) -> None:
        """Forget the rows of ``statistics`` (measured again)."""
        for st in statistics:
            self.batched.pop(st.name, None)

    def add(self, batched: Mapping[str, Batched]) -> None:
        self.batched.update(batched)

    def read_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """The learning rates ``opt`` stepped with and its overflow flag, every step whatever
        optimizer_every says: floats are free, tensors are packed."""
        self.learning_rates = tuple(group.get("lr") for group in opt.param_groups)
        # A fused optimizer is stepped even on overflow, with the scaler's flag, and applies
        # nothing: the flag rides in the packet (reading it here would sync the device).
        found = getattr(opt, "found_inf", None)
        self.found_inf = found.detach().reshape(()).float() if isinstance(found, torch.Tensor) else None

    def host_learning_rates(self) -> Tuple[Optional[float], ...]:
        return S.host_learning_rates(self.learning_rates)

    def scalars(self, scale: Optional[torch.Tensor]) -> List[Tuple[str, Optional[torch.Tensor]]]:
        """The step scalars with the loss scale ``scale``, names and 0-d device tensors
        (None: absent), in packet order."""
        return [(S.SCALAR_AMP_SCALE, scale), (S.SCALAR_AMP_FOUND_INF, self.found_inf),
                (S.SCALAR_LOSS, self.loss.mean()),
                *((S.learning_rate_scalar(group), lr.detach().reshape(()))
                  for group, lr in enumerate(self.learning_rates) if isinstance(lr, torch.Tensor))]

    def reset(self) -> None:
        """The step is closed: nothing collected."""
        self.batched = {}
        self.found_inf = None
        self.learning_rates = ()
        self.scale = None
        self.loss.reset()
