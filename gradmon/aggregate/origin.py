"""Where a run of non-finite steps started, and the incident each of its steps is.

The origin is decided on the first step of a run of steps with non-finite gradients and
kept until a finite step ends the run: after it the weights are poisoned and every later
step is non-finite everywhere, so only the first step can say where it began.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .. import metrics as M


@dataclass(frozen=True)
class NonFiniteIncident:
    """Where a run of non-finite steps started, as ``on_nonfinite`` receives it."""

    model: str
    rank: int
    step: int
    grad_layer: Optional[str]
    """First layer in backward order whose gradient (flow or parameter) went non-finite."""
    activation_layer: Optional[str]
    """First layer in forward order whose output went non-finite (detail steps only)."""
    block: Optional[str] = None
    """Where the run started, every step: ``input`` when the batch itself carried new
    non-finite values, else the first of the root module's direct children in forward
    order whose output did (``output``: the root's own code after its children)."""
    origin_step: Optional[int] = None
    """The run's first step, whose origin every later step of the run repeats (the
    weights are poisoned after it: everything is non-finite everywhere)."""


class Origin(NamedTuple):
    """One ``gradmon_nonfinite_origin`` series: where a tensor's run started, and when."""

    tensor: str
    layer: str
    step: int


OnIncident = Callable[[NonFiniteIncident, bool], None]


class OriginTracker:
    """Per step: which layers' gradients and forward values went non-finite; per run of
    non-finite steps: where it started; per non-finite step: the incident, handed to
    ``on_incident`` with whether it starts a run."""

    def __init__(self, model: str, rank: int, layer_names: Sequence[str], block_names: Sequence[str] = (),
                 on_incident: Optional[OnIncident] = None) -> None:
        """``layer_names`` name the (grouped) layers that gradient and forward records are
        keyed by, ``block_names`` the BLOCK records' keys."""
        self.model = model
        self.rank = rank
        self.layer_names = tuple(layer_names)
        self.block_names = tuple(block_names)
        self.on_incident = on_incident
        self.origin: Dict[str, Tuple[str, int]] = {}  # tensor -> (layer or block, global step)
        self._in_incident = False
        self._in_grad_run = False
        # (tensor, key) -> non-finite kinds its forward values held on the last step whose
        # gradients were finite: a -Inf a float mask always carries is no step's origin.
        # Only kinds are kept: a key missing held none.
        self._baseline: Dict[Tuple[str, int], int] = {}
        self._step_origin: Dict[str, int] = {}
        self._flags: Dict[Tuple[str, int], int] = {}  # this step's non-finite kinds, by (tensor, key)
        # this step's records found finite, as (tensor, keys): read only where the baseline
        # holds a kind to forget, so a step of finite records costs nothing per key
        self._finite: List[Tuple[str, Sequence[int]]] = []
        self._grads_bad = False

    def start_step(self) -> None:
        self._step_origin = {}
        self._flags = {}
        self._finite = []
        self._grads_bad = False

    def forward_values(self, tensor: str, key: int, flags: int) -> None:
        """The non-finite kinds (``statistics.nonfinite_flags``) a forward record held."""
        if flags:
            self._flags[(tensor, key)] = self._flags.get((tensor, key), 0) | flags
        else:
            self._finite.append((tensor, (key,)))

    def forward_finite(self, tensor: str, keys: Sequence[int]) -> None:
        """:meth:`forward_values` of finite records of ``keys``, all at once."""
        self._finite.append((tensor, keys))

    def _settle_baseline(self) -> None:
        """A step with finite gradients: its forward values' kinds are the baseline, for
        every key it recorded (one flagged in any of the step's forwards keeps its kinds)."""
        baseline = self._baseline
        if baseline:
            held: Dict[str, set] = {}
            for tensor, key in baseline:
                held.setdefault(tensor, set()).add(key)
            for tensor, keys in self._finite:
                for key in held.get(tensor, set()).intersection(keys):
                    baseline.pop((tensor, key), None)
        baseline.update(self._flags)

    def bad_gradient(self, tensor: str, layer: int) -> None:
        """A gradient record held non-finite values: the first layer in backward order
        (the highest index) is the step's origin for ``tensor``."""
        self._grads_bad = True
        known = self._step_origin.get(tensor)
        if known is None or layer > known:
            self._step_origin[tensor] = layer

    def end_step(self, bad: bool, step: int) -> None:
        """Close the step (``bad``: it held non-finite values anywhere): a finite step's
        forward flags become the baseline, a run's first step decides the origin, and a
        non-finite step is an incident."""
        if not self._grads_bad:
            self._settle_baseline()
        elif not self._in_grad_run:
            self.origin = {tensor: (name, step) for tensor, name in self._step_origins().items()}
        self._in_grad_run = self._grads_bad
        starts = bad and not self._in_incident
        self._in_incident = bad
        if bad and self.on_incident is not None:
            self.on_incident(self._incident(step), starts)

    def origins(self) -> Tuple[Origin, ...]:
        """The origin of every tensor's last run, by tensor."""
        return tuple(Origin(tensor, name, step) for tensor, (name, step) in sorted(self.origin.items()))

    def _incident(self, step: int) -> NonFiniteIncident:
        origin = self.origin if self._grads_bad else {}
        name = lambda t: origin[t][0] if t in origin else None  # noqa: E731
        first = min((s for _, s in origin.values()), default=None)
        return NonFiniteIncident(self.model, self.rank, step, name(M.TENSOR_GRAD), name(M.TENSOR_ACTIVATION),
                                 name(M.TENSOR_BLOCK), first)

    def _step_origins(self) -> Dict[str, str]:
        """This step's origin per ``tensor``: gradients first in backward order; forward
        values first in forward order among those holding a kind of non-finite value they
        did not hold on the last finite step."""
        out = {tensor: self.layer_names[layer] for tensor, layer in self._step_origin.items()}
        new: Dict[str, int] = {}
        for (tensor, key), flags in self._flags.items():
            if flags & ~self._baseline.get((tensor, key), 0) and (tensor not in new or key < new[tensor]):
                new[tensor] = key
        for tensor, key in new.items():
            out[tensor] = self.block_names[key] if tensor == M.TENSOR_BLOCK else self.layer_names[key]
        return out
