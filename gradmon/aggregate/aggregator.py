"""One monitor's cumulative state, folded from its step packets on the publisher thread.

:class:`Aggregator` reads each packet and hands its parts to the units that keep them: each
statistic's fold (``fold``), the counters (``counters``), the global-norm histogram
(``histogram``), coverage (``coverage``), the origin of a non-finite run and its incidents
(``origin``), the step scalars (``scalars``), the spike scores (``spikes``), the divergence
watch (``divergence``), the live page's history (``history``) and the incident bundles'
steps (``gradmon.incidents``); a snapshot is assembled from them (``snapshot``).
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import metrics as M
from .. import statistics as S
from ..capture.packet import StepPacket
from ..incidents.recorder import KIND_DIVERGENCE, BlackBox, Moment
from ..statistics import Section, Statistic
from .counters import Counters
from .coverage import CoverageTracker
from .divergence import DivergenceWatch
from .divergence import reason as divergence_reason
from .fold import Folded, fused_skip
from .histogram import NormHistogram
from .history import History
from .origin import OnIncident, OriginTracker
from .scalars import LastStep
from .skips import GuardSkips
from .snapshot import Snapshot, WorstNames, per_layer, signal_gauges, spike_series, totals
from .spikes import SpikeTracker


class Aggregator:
    """Cumulative state of one monitor. Used only by the publisher thread."""

    def __init__(self, layer_names: Sequence[str], param_layer: Sequence[int],
                 statistics: Sequence[Statistic], model: str,
                 layer_group: Optional[Sequence[int]] = None, rank: int = 0,
                 on_incident: Optional[OnIncident] = None, amp: bool = False,
                 tied: Optional[Mapping[int, str]] = None, block_names: Sequence[str] = (),
                 spikes: Optional[SpikeTracker] = None, windows: Optional[Mapping[str, int]] = None,
                 history: Optional[History] = None, divergence: Optional[DivergenceWatch] = None,
                 baseline_warmup: int = 0, roles: Optional[Mapping[str, FrozenSet[int]]] = None) -> None:
        """``layer_names`` are the exported names (groups, when grouping); ``layer_group``
        maps the recorder's layer index to them; ``param_layer`` maps each parameter to
        the recorder's layer index; ``tied`` maps a recorder layer without parameters of
        its own to the module that owns them; ``block_names`` names the BLOCK records'
        keys (``input``, the root's children, ``output``); ``spikes`` scores the loss and
        the statistics' totals (default: every signal, default settings); ``windows`` the
        length of each baseline gauge's window by its Config field (see ``LayerGauge.baseline``);
        ``baseline_warmup`` the steps whose values enter no baseline (Config.baseline_warmup);
        ``roles`` the exported layers of each role (``LayerGauge.role``)."""
        names = self.layer_names = tuple(layer_names)
        group = tuple(layer_group) if layer_group is not None else tuple(range(len(names)))
        param_group = tuple(group[layer] for layer in param_layer)
        statistics = tuple(statistics)
        self.grouped_layers = len(group) - len(names)
        self.folded = _folds(statistics, len(names), windows or {}, group, param_group, roles or {})
        self.counts = Counters(statistics, len(names), amp)
        self.histogram = NormHistogram()
        # The grad family applies exactly where a measured parameter lives: the same
        # mapping the recorder measures by, so expectation and measurement cannot drift.
        grad_layers = frozenset(param_group)
        self.cover = CoverageTracker(model, names, statistics, grad_layers, {
            names[group[layer]]: owner for layer, owner in (tied or {}).items() if group[layer] not in grad_layers})
        self.origins = OriginTracker(model, rank, names, block_names, on_incident)
        self.last = LastStep()
        self.spikes = spikes if spikes is not None else SpikeTracker(
            S.spike_signals(statistics, reduced_here=True, roles=roles), raw_below_zero=(M.SIGNAL_LOSS,))
        self.divergence = divergence if divergence is not None else DivergenceWatch()
        self.baseline_warmup = baseline_warmup
        self.history = history  # the live page's ring buffers, filled step by step here
        self.black_box: Optional[BlackBox] = None  # the incident bundles' steps, kept here; set by attach
        self.guard: Optional[GuardSkips] = None  # the step guard's skips (guard=); set by attach
        self.generation = 0
        self._worst = WorstNames()

    @property
    def block_names(self) -> Tuple[str, ...]:
        """The BLOCK records' keys by name, as the incident bundles name them too."""
        return self.origins.block_names

    # -- counters that outlive a monitor ------------------------------------------

    def counters(self) -> Dict[str, object]:
        """Every counter, keyed by layer name rather than index, for :meth:`resume`."""
        return {**self.counts.saved(self.layer_names), "histogram": self.histogram.saved(),
                "spike_steps": dict(self.spikes.spikes), "divergence": self.divergence.counters(),
                "guard_skipped": self.guard.saved() if self.guard is not None else ({}, None)}

    def resume(self, saved: Mapping[str, object]) -> None:
        """Continue the counters of an earlier monitor with the same model name and
        labels: a counter that went back to 0 and climbed past its old value between two
        scrapes would hide increments from rate() and increase()."""
        self.counts.resume(saved, self.layer_names)
        self.histogram.resume(saved["histogram"])  # type: ignore[arg-type]
        self.spikes.resume(saved.get("spike_steps", {}))  # type: ignore[arg-type]
        self.divergence.resume(saved.get("divergence", {}))  # type: ignore[arg-type]
        if self.guard is not None:
            self.guard.resume(*saved.get("guard_skipped", ({}, None)))  # type: ignore[misc]

    # -- folding -------------------------------------------------------------------

    def relabel(self, global_step: int, skipped: bool = False) -> None:
        """``monitor.step(n)`` renumbered the last step (not a resume), or numbered a step
        the scaler skipped, which scored nothing to renumber."""
        self.last.global_step = global_step
        if not skipped:
            self.spikes.relabel(global_step)

    def fold(self, packet: StepPacket) -> None:
        data = packet.data
        # the step scalars, the packet's last values, as host floats; the sections are read as tables
        values: List[float] = data[len(data) - len(packet.scalars):].tolist() if data is not None else []
        if self.black_box is not None:
            self.black_box.keep(packet)  # never raises: a bundle's trouble must not cost a step's count
        skipped = packet.skipped or fused_skip(values, packet)
        # Count the step before parsing anything else: a packet that fails to parse must
        # still be a step, or rate(gradmon_steps_total) would lie.
        if skipped:
            self.counts.skipped()
        else:
            self.counts.steps_total += 1
            self.last.counted(packet)
            if packet.measured_at_step:
                self.cover.count_measured_at_step()
        scalars = self._fold_scalars(values, packet)
        if skipped:
            if self.history is not None:
                self._remember(packet.global_step, skipped=True)
            return
        # a step the guard skipped still had its gradients (counted as they were); the
        # optimizer's reading of an update it never applied is dropped
        guarded = self.guard.fold(scalars, packet.global_step) if self.guard is not None else None
        if data is not None:
            self._fold_sections(data, packet, applied=guarded is None)
            if packet.detail and any(sec.statistic is S.GRAD for sec in packet.sections):
                self.cover.detail_backward()
        paged = self.divergence.divergences
        # an event decided elsewhere (a growth's doubling) is not (yet) evidence of a divergence:
        # the evidence was chosen from the loss's and the gradients' scored spikes, on the tune split
        self.divergence.step(self.last.step_loss, self.spikes.this_step.difference(M.EVENT_SIGNALS),
                             max((ratio for _, ratio in self.last.peaks.ratios()), default=None))
        if self.divergence.divergences > paged and self.black_box is not None:
            # written before any snapshot counts the divergence, as a non-finite incident's
            self.black_box.write(Moment(packet.global_step), KIND_DIVERGENCE, divergence_reason(self.divergence))

    def _fold_sections(self, data: torch.Tensor, packet: StepPacket, applied: bool = True) -> None:
        self.origins.start_step()
        any_bad = False
        for stat, section, table in S.read_tables(data, packet.sections):
            if not applied and stat.at == S.OPTIMIZER:
                continue
            any_bad |= self._fold(self.folded[stat.name], section, table, packet.sampled)
        if any_bad:
            self.counts.nonfinite_steps += 1
        self.origins.end_step(any_bad, packet.global_step)
        if self.history is not None:
            self._remember(packet.global_step, any_bad)

    def _remember(self, step: int, nonfinite: bool = False, skipped: bool = False) -> None:
        """One row of the live page's history: the global norm and each layer's gradient
        norm of this step (the statistic that declares the global norm; none for a step
        the scaler skipped), loss, first lr."""
        grad = None if skipped else next((f for f in self.folded.values() if f.stat.histogram is not None), None)
        norms = grad.layer_norms() if grad is not None else {}
        self.history.record(step, grad.total if grad is not None else None, self.last.step_loss,  # type: ignore[union-attr]
                            self.last.first_rate, nonfinite, norms, skipped)

    def _fold_scalars(self, values: Sequence[float], packet: StepPacket) -> Dict[str, float]:
        """The step scalars; first the learning rates, which restart the spike windows
        when they jump, then what is scored. Returns them all."""
        scalars = S.read_scalars(values, packet.scalars)
        lrs = self.last.rates(scalars, packet)
        restarts = self.spikes.restarts
        self.spikes.new_step(packet.global_step, tuple(lr if math.isfinite(lr) else None for lr in lrs))
        if self.spikes.restarts != restarts:
            for folded in self.folded.values():
                folded.restart()
        if self.spikes.resumed:
            self.divergence.restart()
        loss = self.last.observe_loss(scalars)
        if loss is not None:
            self.spikes.observe(M.SIGNAL_LOSS, loss)
        return scalars

    def _fold(self, f: Folded, section: Section, table: torch.Tensor, sampled: bool) -> bool:
        """One statistic's records of one step (``table``: one row per record), folded per
        (grouped) layer by its columns' declared rules; counts its NaN/Inf into the
        counters. True if any was non-finite."""
        stat = f.stat
        if f.folds_at_once(len(section.keys)):
            acc, bad = self._accumulate_table(f, section, table)
        else:
            acc, bad = self._accumulate(f, section, table.tolist())
        f.last = acc
        if stat.coverage:
            self.cover.saw(stat.coverage, acc)
        if stat.total is not None:
            self._fold_total(f, acc, bad)
        if sampled or not stat.sampled:
            values = f.update_gauges(acc, baseline=self.spikes.steps > self.baseline_warmup)
            for gauge in stat.gauges:
                if gauge.jump is not None:
                    self.spikes.observe_layers(gauge.jump, acc.keys(), values[gauge])
            for signal in f.events:
                self.spikes.event(signal)
            f.events.clear()
        return bad

    def _accumulate(self, f: Folded, section: Section, rows: Sequence[Sequence[float]]
                    ) -> Tuple[Dict[int, List[float]], bool]:
        """The step's records combined per (grouped) layer, their non-finite values counted
        and told to the origin tracker; True if any record was non-finite. Python runs per
        record to combine them (where anything reads the accumulators), and otherwise only
        for the records of a step that holds a non-finite value."""
        stat = f.stat
        plan = f.plan(section.keys)
        acc: Dict[int, List[float]] = {}
        if f.keeps:
            combine, get = f.combine, acc.get
            for layer, numel, row in zip(plan.of_record, section.numels, rows):
                acc[layer] = combine(get(layer), row, numel)
        origins = self.origins
        if f.lo >= 0:
            # one sum over every record's extremes: finite unless one is (or, rarely, unless
            # finite values overflow the sum, where the records are read one by one, as then)
            lo, hi = itemgetter(f.lo), itemgetter(f.hi)
            if math.isfinite(sum(map(lo, rows)) + sum(map(hi, rows))):
                origins.forward_finite(stat.origin, plan.layers)  # type: ignore[arg-type]
            else:
                for layer, row in zip(plan.of_record, rows):
                    origins.forward_values(stat.origin, layer, S.nonfinite_flags(lo(row), hi(row)))  # type: ignore[arg-type]
        cells = self.counts.cells.get(stat.name)
        nan, inf = f.nan, f.inf
        if cells is None or not (any(map(itemgetter(nan), rows)) or any(map(itemgetter(inf), rows))):
            return acc, False
        grad_origin = stat.origin if not stat.forward else None
        for layer, row in zip(plan.of_record, rows):
            if row[nan] or row[inf]:
                if grad_origin is not None:
                    origins.bad_gradient(grad_origin, layer)
                cells[layer][0] += int(row[nan])
                cells[layer][1] += int(row[inf])
        return acc, True

    def _accumulate_table(self, f: Folded, section: Section, table: torch.Tensor
                          ) -> Tuple[Dict[int, List[float]], bool]:
        """:meth:`_accumulate` of all records at once (``Folded.accumulate``): Python runs
        per layer to hand the accumulators over, and per record only for a non-finite one."""
        stat = f.stat
        plan = f.plan(section.keys)
        acc = f.accumulate(plan, section.numels, table) if f.keeps else {}
        origins = self.origins
        if f.lo >= 0:
            # column sums, as the record-by-record fold's (finite values whose sum overflows
            # only go the slow way): advanced indexing would copy the columns first
            if math.isfinite(table[:, f.lo].sum().item() + table[:, f.hi].sum().item()):
                origins.forward_finite(stat.origin, plan.layers)  # type: ignore[arg-type]
            else:
                for layer, (lo, hi) in zip(plan.of_record, table[:, [f.lo, f.hi]].tolist()):
                    origins.forward_values(stat.origin, layer, S.nonfinite_flags(lo, hi))  # type: ignore[arg-type]
        cells = self.counts.cells.get(stat.name)
        if cells is None:
            return acc, False
        if table[:, f.nan].sum().item() + table[:, f.inf].sum().item() == 0:  # counts: none, nothing to find
            return acc, False
        counts = table[:, [f.nan, f.inf]]
        flagged = counts.ne(0).any(dim=1).nonzero().flatten().tolist()
        for k, (nan, inf) in zip(flagged, counts[flagged].tolist()):
            layer = plan.of_record[k]
            if not stat.forward and stat.origin is not None:
                origins.bad_gradient(stat.origin, layer)
            cells[layer][0] += int(nan)
            cells[layer][1] += int(inf)
        return acc, bool(flagged)

    def _fold_total(self, f: Folded, acc: Mapping[int, List[float]], bad: bool) -> None:
        """The norm over every layer: a gauge, the histogram's observation, a spike signal."""
        stat = f.stat
        total = f.total = f.norm_total(acc)
        # every element finite and yet an infinite norm: float32's range, not a NaN incident
        overflow = total == math.inf and not bad
        self.counts.norm_overflow_steps += overflow and stat.histogram is not None
        if stat.histogram is not None:
            self.histogram.observe(total, overflow)
        if stat.spike is not None:
            self.spikes.observe(stat.spike, total)

    # -- snapshot ------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        self.generation += 1
        layers = per_layer(self.folded.values(), self.counts.cells, self.layer_names, self._worst)
        counts, last, hist = self.counts, self.last, self.histogram
        scores, spike_steps = spike_series(self.spikes)
        return Snapshot(
            generation=self.generation, steps_total=counts.steps_total,
            global_step=last.global_step, last_step_time=last.time,
            totals=totals(self.folded.values(), last, self.divergence),
            layer_gauges=layers.gauges, layer_counters=layers.counters,
            nonfinite_steps=counts.nonfinite_steps, histogram=hist.buckets(),
            histogram_sum=hist.sum, histogram_count=hist.count,
            uncovered=self.cover.series(counts.steps_total), coverage=self.cover.coverage(),
            nonfinite_origin=self.origins.origins(), norm_overflow_steps=counts.norm_overflow_steps,
            grouped_layers=self.grouped_layers, amp_skipped_steps=counts.amp_skipped(),
            amp_loss_scale=last.amp_loss_scale, spike_scores=scores, spike_steps=spike_steps,
            learning_rates=last.learning_rates, learning_rate_over_peak=last.peaks.ratios(),
            rank_nonfinite=layers.rank_nonfinite, worst=layers.worst,
            signal_gauges=signal_gauges(self.spikes, self.divergence),
            guard_skipped_steps=self.guard.series() if self.guard is not None else (),
            guard_last_skip=self.guard.last if self.guard is not None else None)


def _folds(statistics: Sequence[Statistic], layers: int, windows: Mapping[str, int], group: Sequence[int],
           param_group: Sequence[int], roles: Mapping[str, FrozenSet[int]]) -> Dict[str, Folded]:
    """Each statistic's fold, its records keyed by block, by parameter or by layer."""
    windows = {**{g.baseline: S.MIN_BASELINE for st in statistics for g in st.gauges if g.baseline}, **windows}
    return {st.name: Folded(st, layers, windows, None if st.at == S.BLOCK else
                            param_group if st.by_parameter else group, roles) for st in statistics}
