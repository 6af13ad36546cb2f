"""Snapshots to Prometheus: the Collector.

The collector knows nothing about hooks or tensors. Each monitored model registers an
``ExportSource`` (a callable returning an :class:`ExportView`: labels plus the latest
immutable snapshot); at scrape time the collector turns those views into metric
families. Several models in one process share one collector (and one endpoint,
``endpoint``) and are told apart by the ``model`` label.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Iterable, List, Mapping, Optional, Tuple

from prometheus_client.metrics_core import Metric

from .. import metrics as M
from . import process
from ..config import utf8_text
from ..errors import ErrorLog
from ..aggregate.snapshot import Snapshot

log = logging.getLogger("gradmon")


@dataclass(frozen=True)
class ExportView:
    labels: Mapping[str, str]  # model, rank, and the user's constant labels
    snapshot: Snapshot
    errors: Mapping[str, int]
    overhead_seconds: float
    run_state: str
    info: Mapping[str, str]  # version, torch_version, world_size
    reduced_per_layer: bool = True
    """False on ranks other than 0 when every rank holds the same reduced gradient
    (DDP, FSDP): rank 0 carries those per-layer series and the global norm's histogram
    (66 series, the same on every rank), the others only their own."""
    per_layer: bool = True
    """False on those other ranks unless ``all_ranks_per_layer``: no per-layer series at
    all; the rank-level counters, worst-layer gauges and origin series name what matters."""
    failure: Optional[str] = None  # the exception type name of a failed run
    history: Optional[Any] = None  # the live page's gradmon.history.History, where kept


ExportSource = Callable[[], ExportView]


class _Families:
    """Metric families under construction, one per spec, created on first use. Label values
    are made encodable as they come in (:func:`utf8_text`): the exposition is encoded as
    a whole, so one unencodable value would otherwise fail every model's scrape.

    A sample keeps the labels dict it is given, not a copy (a scrape makes one per sample
    of a large model): pass one that nothing changes afterwards. Samples may share one."""

    def __init__(self) -> None:
        self._by_name: Dict[str, Metric] = {}

    def add(self, spec: M.MetricSpec, labels: Dict[str, str], value: float,
            suffix: str = "") -> None:
        metric = self._by_name.get(spec.name)
        if metric is None:
            typ = "gauge" if spec.type == "info-gauge" else spec.type
            metric = self._by_name[spec.name] = Metric(spec.name, spec.help, typ)
        if not suffix and spec.type == "counter":
            suffix = "_total"
        if not all(map(str.isascii, labels.values())):
            labels = {k: utf8_text(v) for k, v in labels.items()}
        metric.add_sample(spec.name + suffix, labels, float(value))

    def merge(self, other: "_Families") -> None:
        """Add every sample of ``other`` (one model's, built apart so that it can be dropped)."""
        for name, metric in other._by_name.items():
            mine = self._by_name.get(name)
            if mine is None:
                self._by_name[name] = metric
            else:
                mine.samples.extend(metric.samples)

    def __iter__(self):
        return iter(self._by_name.values())


def _with(labels: Mapping[str, str], **extra: str) -> Dict[str, str]:
    out = dict(labels)
    out.update(extra)
    return out


def _fmt_bound(b: float) -> str:
    return "+Inf" if math.isinf(b) else repr(float(b))


def add_view(fam: _Families, view: ExportView) -> None:
    """Every family one monitored model contributes."""
    s, base = view.snapshot, dict(view.labels)  # shared by this view's samples without their own labels
    fam.add(M.INFO, _with(base, **view.info), 1)
    fam.add(M.WORLD_SIZE, base, float(view.info["world_size"]))
    for state in M.RUN_STATES:
        fam.add(M.RUN_STATE, _with(base, state=state), 1 if state == view.run_state else 0)
    if view.run_state == M.STATE_FAILED and view.failure:
        fam.add(M.RUN_FAILURE_INFO, _with(base, exception=view.failure), 1)
    # per-model values; None means "not measured yet" (or no scaler): no sample at all
    for spec, value in ((M.STEPS, s.steps_total), (M.STEP, s.global_step),
                        (M.LAST_STEP_TIMESTAMP, s.last_step_time),
                        (M.GROUPED_LAYERS, s.grouped_layers), (M.AMP_SKIPPED_STEPS, s.amp_skipped_steps),
                        (M.AMP_LOSS_SCALE, s.amp_loss_scale),
                        (M.NONFINITE_STEPS, s.nonfinite_steps), (M.GRAD_NORM_OVERFLOW_STEPS, s.norm_overflow_steps),
                        (M.OVERHEAD_SECONDS, view.overhead_seconds)):
        if value is not None:
            fam.add(spec, base, value)
    for spec, value in s.totals.items():
        fam.add(spec, base, value)
    for series in s.layer_gauges + s.layer_counters:
        if not view.per_layer or (series.reduced and not view.reduced_per_layer):
            continue
        labels = _with(base, **series.labels)
        for layer, *kind, value in series.values:
            sample = dict(labels, layer=layer)
            if kind:
                sample["kind"] = kind[0]
            fam.add(series.spec, sample, value)
    for tensor, kind, count, reduced in s.rank_nonfinite:
        if view.reduced_per_layer or not reduced:
            fam.add(M.RANK_NONFINITE, _with(base, tensor=tensor, kind=kind), count)
    for spec, layer, value in s.worst:
        fam.add(spec, _with(base, layer=layer), value)
    for spec, pairs in ((M.SPIKE_SCORE, s.spike_scores), (M.SPIKE_STEPS, s.spike_steps)):
        for signal, value in pairs:
            fam.add(spec, _with(base, signal=signal), value)
    for reason, count in s.guard_skipped_steps:
        fam.add(M.GUARD_SKIPPED_STEPS, _with(base, reason=reason), count)
    if s.guard_last_skip is not None:
        fam.add(M.GUARD_LAST_SKIP_STEP, _with(base, reason=s.guard_last_skip[0]), s.guard_last_skip[1])
    for spec, signal, value in s.signal_gauges:
        fam.add(spec, _with(base, signal=signal), value)
    for tensor, layer, step in s.nonfinite_origin:
        fam.add(M.NONFINITE_ORIGIN, _with(base, tensor=tensor, layer=layer), step)
    if view.reduced_per_layer:
        for bound, cumulative in s.histogram:
            fam.add(M.GRAD_GLOBAL_NORM_DISTRIBUTION, _with(base, le=_fmt_bound(bound)), cumulative, "_bucket")
        fam.add(M.GRAD_GLOBAL_NORM_DISTRIBUTION, base, s.histogram_count, "_count")
        fam.add(M.GRAD_GLOBAL_NORM_DISTRIBUTION, base, s.histogram_sum, "_sum")
    for stage, count in view.errors.items():
        fam.add(M.HOOK_ERRORS, _with(base, stage=stage), count)
    for family, count in s.uncovered:
        fam.add(M.UNCOVERED_LAYERS, _with(base, family=family), count)
    for group, lr in enumerate(s.learning_rates):
        fam.add(M.LEARNING_RATE, _with(base, group=str(group)), lr)
    for group, ratio in s.learning_rate_over_peak:
        fam.add(M.LEARNING_RATE_OVER_PEAK, _with(base, group=str(group)), ratio)


def _with_errors(view: ExportView, more: Mapping[str, int]) -> ExportView:
    if not any(more.values()):
        return view
    errors = dict(view.errors)
    for stage, n in more.items():
        errors[stage] = errors.get(stage, 0) + n
    return dataclasses.replace(view, errors=errors)


def _failed_view(view: ExportView) -> _Families:
    """What a model whose series could not be built still exports: its error counts, the
    one that just failed included, so that the failure is seen where the model is."""
    fam = _Families()
    try:
        for stage, count in _with_errors(view, {"collect": 1}).errors.items():
            fam.add(M.HOOK_ERRORS, _with(view.labels, stage=stage), count)
    except Exception:  # labels that cannot even carry a counter: the model is left out
        return _Families()
    return fam


class GradmonCollector:
    """A prometheus_client collector over the export views of every registered model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: Dict[int, Tuple[ExportSource, Callable[[str, BaseException], None]]] = {}
        self._generations: Dict[int, Callable[[], Hashable]] = {}
        # Final views of models detached while others still use the endpoint: served until
        # the endpoint closes, so that one final-scrape wait covers every model on it.
        self._retired: Dict[int, ExportView] = {}
        self._retired_errors: Dict[int, ErrorLog] = {}  # a retired view's own collect errors

    def generation(self) -> Hashable:
        """Changes whenever any model publishes a snapshot or changes run state."""
        with self._lock:
            gens = list(self._generations.items())
            retired = tuple((key, errors.total()) for key, errors in self._retired_errors.items())
        return tuple((key, gen()) for key, gen in gens), retired

    def add(self, key: int, source: ExportSource, on_error: Callable[[str, BaseException], None],
            generation: Callable[[], Hashable]) -> None:
        with self._lock:
            self._sources[key] = (source, on_error)
            self._generations[key] = generation

    def report_error(self, stage: str, exc: BaseException) -> None:
        """An endpoint-wide fault (e.g. a rotated certificate that does not load): every
        model served here counts it."""
        with self._lock:
            handlers = [on_error for _, on_error in self._sources.values()]
        for on_error in handlers:
            on_error(stage, exc)

    def remove(self, key: int) -> int:
        with self._lock:
            self._sources.pop(key, None)
            self._generations.pop(key, None)
            self._retired.pop(key, None)
            self._retired_errors.pop(key, None)
            return len(self._sources)

    def retire(self, key: int, final: ExportView) -> None:
        """Serve ``final`` in place of the source ``key`` from now on."""
        with self._lock:
            self._sources.pop(key, None)
            self._generations.pop(key, None)
            self._retired[key] = final
            self._retired_errors[key] = ErrorLog(final.labels.get("model", "?"))

    def _views(self) -> List[Tuple[ExportView, Callable[[str, BaseException], None]]]:
        with self._lock:
            sources = list(self._sources.values())
            retired = [(view, self._retired_errors[key]) for key, view in self._retired.items()]
        views: List[Tuple[ExportView, Callable[[str, BaseException], None]]] = []
        for source, on_error in sources:
            try:
                views.append((source(), on_error))
            except Exception as exc:  # one broken model must not blank the whole scrape
                on_error("collect", exc)
        live = {tuple(sorted(v.labels.items())) for v, _ in views}
        # a model attached again under the same name and labels replaces its retired view
        return views + [(_with_errors(v, errors.counts()), errors.record) for v, errors in retired
                        if tuple(sorted(v.labels.items())) not in live]

    def views(self) -> List[ExportView]:
        """Every model served here, live or retired (the live page's models)."""
        return [view for view, _ in self._views()]

    def collect(self) -> Iterable[Metric]:
        fam = _Families()
        views = self._views()
        process_labels: Optional[Mapping[str, str]] = None
        for view, on_error in views:
            own = _Families()
            try:
                add_view(own, view)
            except Exception as exc:  # this model's series are dropped, the others' served
                on_error("collect", exc)
                own = _failed_view(view)
            fam.merge(own)
            if process_labels is None:
                process_labels = {k: v for k, v in view.labels.items() if k != "model"}
        if process_labels is not None:
            for spec, labels, value in process.samples(process_labels):
                fam.add(spec, labels, value)
        return list(fam)
