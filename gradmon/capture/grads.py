"""The parameters' gradients, measured all at once (the statistics recorded at
``statistics.PARAM_GRAD``), and, for sharded parameters, combined over their shard groups
once per step; likewise the parameters themselves on the steps the optimizer is read
(``statistics.WEIGHT``).
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence

import torch

from ..errors import ErrorLog
from ..statistics import Statistic
from . import sharded
from .writer import Batched


_WEIGHTS_READ, _WEIGHTS_FAILED = "read", "failed"


class ParamGradients:
    def __init__(self, statistics: Sequence[Statistic], params: Sequence[Optional[torch.Tensor]],
                 flat_units: Sequence[sharded.FlatUnit] = (), weights: Sequence[Statistic] = ()) -> None:
        self._statistics = tuple(statistics)
        self._weight_statistics = tuple(weights)
        self._weights: Optional[str] = None  # whether (and how) this step read the weights
        self._groups = sharded.plan(params, flat_units)
        # FSDP1: a parameter lying wholly on other ranks has no local gradient, yet its row
        # must join the step's all-reduce for this rank to learn its norm
        flat_of = {id(p): unit.flat_param for unit in flat_units for p in unit.params}
        self._flat_of: Dict[int, weakref.ref] = {i: weakref.ref(flat_of[id(p)]) for i, p in enumerate(params)
                                                 if p is not None and id(p) in flat_of}

    @property
    def sharded(self) -> bool:
        """Some parameter is sharded: its statistics combine over ranks at every step."""
        return bool(self._groups)

    def measure(self, params: Sequence[Optional[torch.Tensor]]) -> Dict[str, Batched]:
        """Each statistic's rows, by name, of the gradients ``params`` hold now (a shard's
        own elements where a gradient is sharded); none without a gradient."""
        every: List[Optional[torch.Tensor]] = [p.grad if p is not None else None for p in params]
        for i, ref in self._flat_of.items():
            if every[i] is None:
                every[i] = _empty_shard(params[i], ref())
        return _record(every, self._statistics)

    def measure_weights(self, params: Sequence[Optional[torch.Tensor]]) -> Dict[str, Batched]:
        """Each WEIGHT statistic's rows, by name, of the parameters as they are now (after
        the optimizer's step). From here on the step's collective includes them, on this
        rank as on every other (all read at the same steps), even if measuring fails here."""
        self._weights = _WEIGHTS_FAILED
        out = _record([p.detach() if p is not None else None for p in params], self._weight_statistics)
        self._weights = _WEIGHTS_READ
        return out

    def reduce(self, batched: Dict[str, Batched], failed: bool, errors: ErrorLog) -> None:
        """The step's collective, in place in ``batched``: every rank calls it at every step,
        whatever failed before (``failed``: this rank's rows are not to be trusted), for the
        gradients, and for the weights at the steps they were read."""
        weights, self._weights = self._weights, None
        if not self._groups:
            return
        reduced = [(st, failed) for st in self._statistics]
        if weights is not None:
            reduced += [(st, failed or weights == _WEIGHTS_FAILED) for st in self._weight_statistics]
        for st, untrusted in reduced:
            rows, order, numels = batched.pop(st.name, (None, (), ()))
            try:
                rows, _ok = sharded.all_reduce_rows(rows, order, self._groups, untrusted,
                                                    [c.fold for c in st.columns])
                if rows is not None:
                    batched[st.name] = (rows, order, numels)
            except Exception as exc:
                errors.record("step", exc)


def _record(every: List[Optional[torch.Tensor]], statistics: Sequence[Statistic]) -> Dict[str, Batched]:
    """Each statistic's rows, by name, of the tensors ``every`` holds (None: none for that
    parameter), row j naming its parameter and the elements it covered."""
    present = [i for i, t in enumerate(every) if t is not None]
    tensors = every if len(present) == len(every) else [every[i] for i in present]
    if set(map(type, tensors)) - {torch.Tensor}:
        # a shard's own elements, summed at the step (a plain tensor is its own)
        tensors = [t if type(t) is torch.Tensor else sharded.local(t) for t in tensors]
    numels = list(map(torch.Tensor.numel, tensors))
    out: Dict[str, Batched] = {}
    for st in statistics if tensors else ():
        rows, order = st.record(tensors, tensors[0].device)
        out[st.name] = (rows, tuple(map(present.__getitem__, order)), tuple(map(numels.__getitem__, order)))
    return out


def _empty_shard(p: Optional[torch.Tensor], flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's (empty) part of an FSDP1 parameter held wholly by other ranks, when its
    unit received a gradient in this backward."""
    if p is None or flat is None or flat.grad is None:
        return None
    return torch.zeros(0, dtype=flat.grad.dtype, device=flat.grad.device)
