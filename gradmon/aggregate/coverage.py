"""What gradmon could observe: per layer, the families seen so far against those that apply."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Dict, FrozenSet, Iterable, Iterator, Mapping, NamedTuple, Sequence, Set, Tuple

from .. import metrics as M
from ..statistics import Statistic

log = logging.getLogger("gradmon")


@dataclass(frozen=True, eq=False)  # eq=False keeps Mapping's ==, so it still equals a plain dict
class Coverage(Mapping[str, FrozenSet[str]]):
    """What gradmon could observe, as ``Monitor.coverage()`` returns it.

    It reads as ``{layer: families observed so far}`` (``grad``, ``grad_flow``,
    ``activation``, ``optimizer``); the fields say which families apply to a layer and at which moment
    the gradients were measured."""

    observed: Mapping[str, FrozenSet[str]] = field(default_factory=dict)
    """Families observed so far, per layer (what indexing the mapping returns)."""
    expected: Mapping[str, FrozenSet[str]] = field(default_factory=dict)
    """Families that apply to each layer: the enabled ones, less ``grad`` for a layer
    that owns no parameter of its own (see ``tied``)."""
    tied: Mapping[str, str] = field(default_factory=dict)
    """Layers whose every parameter is shared with an earlier module (GPT-2's
    ``lm_head``, whose weight is ``wte.weight``) -> that module. Their weights' gradient
    is reported once, under the owner: not a gap."""
    measured_at_step: int = 0
    """Steps whose gradients reached the optimizer without autograd accumulating them
    into the monitored parameters (``.grad`` assigned by hand after
    ``torch.autograd.grad``): their norms were measured at the optimizer step, after any
    ``clip_grad_norm_``, so they are not pre-clip. 0: every step was measured at the end
    of its backward pass."""
    limits: Tuple[str, ...] = ()
    """Whole-model limits on what is measured, one sentence each (FSDP1 flat parameters
    without ``use_orig_params``, DeepSpeed ZeRO), as logged at attach."""

    def __getitem__(self, layer: str) -> FrozenSet[str]:
        return self.observed[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self.observed)

    def __len__(self) -> int:
        return len(self.observed)

    def gaps(self) -> Dict[str, FrozenSet[str]]:
        """Per layer, the families that apply but were not observed. Judge it after a
        detail step (``detail_every``): before one, activations and grad flow are unseen."""
        out = {}
        for layer, families in self.expected.items():
            missing = families - self.observed.get(layer, frozenset())
            if missing:
                out[layer] = missing
        return out


class Uncovered(NamedTuple):
    """One ``gradmon_uncovered_layers`` series: a family and the layers it cannot observe."""

    family: str
    layers: int


class CoverageTracker:
    """The layers each family was seen on, and the steps that tell whether the rest is a gap."""

    def __init__(self, model: str, layer_names: Sequence[str], statistics: Sequence[Statistic],
                 grad_layers: Iterable[int], tied: Mapping[str, str]) -> None:
        """``grad_layers`` are the (grouped) layers where a measured parameter lives: the
        mapping the recorder measures by, so expectation and measurement cannot drift;
        ``tied`` maps a layer without parameters of its own to the module that owns them."""
        self.model = model
        self.layer_names = tuple(layer_names)
        self.statistics = tuple(statistics)
        self.families = tuple(st.coverage for st in self.statistics if st.coverage)  # enabled families
        self.grad_layers = frozenset(grad_layers)
        self.all_layers = frozenset(range(len(self.layer_names)))
        self.tied = dict(tied)
        self.seen: Dict[str, Set[int]] = {f: set() for f in M.FAMILIES}
        self.limits: Tuple[str, ...] = ()  # see Coverage.limits
        self.detail_backward_steps = 0
        self.measured_at_step = 0
        self._gaps_logged = False

    def saw(self, family: str, layers: Iterable[int]) -> None:
        self.seen[family].update(layers)

    def add_limit(self, text: str) -> None:
        """A whole-model limit found after attach (see ``Coverage.limits``)."""
        self.limits += (text,)

    def detail_backward(self) -> None:
        """A detail step measured gradients: every family had its chance to be seen."""
        self.detail_backward_steps += 1
        self._log_gaps_once()

    def count_measured_at_step(self) -> None:
        self.measured_at_step += 1
        if self.measured_at_step == 1:
            log.warning("gradmon[%s]: gradients reached the optimizer without autograd accumulating them into "
                        "the monitored parameters (e.g. .grad assigned by hand after torch.autograd.grad); they "
                        "are measured at the optimizer step, after any clipping (Monitor.coverage()"
                        ".measured_at_step counts such steps)", self.model)

    def uncovered(self, steps_total: int) -> Dict[str, int]:
        """Layers each enabled family applies to but has not observed, once there is
        evidence to judge: the grad family after one step with gradients (of
        ``steps_total``), the others after one detail step."""
        out = {}
        for st in self.statistics:
            if not st.coverage:
                continue
            if not (self.detail_backward_steps if st.detail else steps_total):
                if st.detail:
                    out[st.coverage] = 0  # no evidence yet, and nothing to report
                continue
            out[st.coverage] = len(self._expected_layers(st) - self.seen[st.coverage])
        return out

    def series(self, steps_total: int) -> Tuple[Uncovered, ...]:
        return tuple(Uncovered(*pair) for pair in sorted(self.uncovered(steps_total).items()))

    def coverage(self) -> Coverage:
        # read-only views: the snapshot's coverage is shared with every reader
        return Coverage(
            observed=MappingProxyType({name: frozenset(f for f in M.FAMILIES if i in self.seen[f])
                                       for i, name in enumerate(self.layer_names)}),
            expected=MappingProxyType({name: frozenset(st.coverage for st in self.statistics
                                                       if st.coverage and i in self._expected_layers(st))
                                       for i, name in enumerate(self.layer_names)}),
            tied=MappingProxyType(dict(self.tied)), measured_at_step=self.measured_at_step, limits=self.limits)

    def _expected_layers(self, st: Statistic) -> FrozenSet[int]:
        """Layers ``st`` can observe: a statistic of parameters only those where a measured
        parameter lives (not a tied head whose weight another layer owns)."""
        return self.grad_layers if st.by_parameter else self.all_layers

    def _log_gaps_once(self) -> None:
        if self._gaps_logged:
            return
        self._gaps_logged = True
        gaps = [f"{name} ({', '.join(f for f in self.families if f in missing)})"
                for name, missing in self.coverage().gaps().items()]
        if gaps:
            hint = ""
            if not self.seen[M.FAMILY_GRAD_FLOW]:
                hint = (" No gradient-flow record came: under torch.compile gradient flow is not measured (its "
                        "tensor hooks on the layers' outputs would break the graph); see docs/limits.md.")
            log.warning("gradmon[%s]: %d layer(s) not fully observable, reported in "
                        "gradmon_uncovered_layers and Monitor.coverage(): %s.%s", self.model,
                        len(gaps), "; ".join(gaps[:20]) + (" ..." if len(gaps) > 20 else ""), hint)
