"""``attach()`` and the :class:`Monitor` handle that owns everything it started.

attach validates its input (every mistake is a TypeError/ValueError here, never an
error at training time), has what it runs built (``wiring``: layers, recorder,
aggregator), continues the counters of an earlier monitor of the same name (``carry``),
joins or starts the exporter endpoint (``serving``), installs the hooks and starts the
publisher thread. ``detach()`` undoes all of it.
"""

from __future__ import annotations

import logging
import operator
import os
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import config as _config
from . import metrics as M
from .aggregate import CarriedCounters, Coverage, NonFiniteIncident, Publisher, Snapshot
from .aggregate.history import History
from .capture import sharded
from .capture.hooks import HookSet, Recorder
from .capture.layers import has_trainable_parameters, wrappers
from .carry import CarryOver
from .config import Config
from .errors import ErrorLog
from .identity import RankInfo, detect
from .serve import run_end
from .serve.collector import ExportView
from .serve.endpoint import Endpoint
from .incidents import recorder as incidents
from .serving import Serving
from .wiring import wire

log = logging.getLogger("gradmon")

_LOCK = threading.RLock()
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, Monitor]" = weakref.WeakKeyDictionary()
_NAMES_IN_USE: Dict[str, "Monitor"] = {}
_LIVE: "weakref.WeakSet[Monitor]" = weakref.WeakSet()
_HELD: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], "Monitor"] = {}  # keep_serving: ended, still served
# Counters of detached monitors, by (model name, labels): a monitor attached again under
# the same name continues them, so they never go backwards within a process.
_CARRIED = CarriedCounters(most=64)


_UNSET = object()  # observe() without loss=
GUARD_FAILURE = "GuardPersisted"
"""gradmon_run_failure_info's exception when the step guard gave up (``guard_max_skips``)."""


def _version() -> str:
    from . import __version__
    return __version__


def _unique_name(wanted: str, ended: Callable[[str], bool] = lambda name: False) -> str:
    """``wanted``, or ``wanted-N``: not in use, nor a name whose carried counters were
    dropped (``ended``; its series must not start again from 0)."""
    name, n = wanted, 1
    while name in _NAMES_IN_USE or ended(name):
        n += 1
        name = f"{wanted}-{n}"
    return name


def _started_in(incident: NonFiniteIncident) -> str:
    """Where a run of non-finite steps started, for the log: the block whose forward output
    (or the batch, ``input``) first held them, or that none of this rank's did: the
    backward made them, or another rank's gradients did through the reduction."""
    if incident.block is not None:
        return f"in {incident.block}"
    return "with this rank's forward finite (no block made them: the backward did, or another rank)"


class Monitor:
    """The handle ``attach()`` returns. A context manager; ``detach()`` is idempotent."""

    def __init__(self, cfg: Config, name: str = "", rank: RankInfo = RankInfo()) -> None:
        self.config = cfg
        self.name = name
        self.rank = rank
        self.error: Optional[str] = None
        self._state = "disabled" if cfg.disable else "starting"
        self._run_state = M.STATE_TRAINING
        self._failure: Optional[str] = None  # the exception type name of a failed run
        self._model_ref: Optional[weakref.ref] = None
        self._layer_names: Tuple[str, ...] = ()
        self._hooks = HookSet()
        self._recorder: Optional[Recorder] = None
        self._publisher: Optional[Publisher] = None
        self._serving = Serving(cfg, id(self), self._export_view)
        self._errors = ErrorLog(name or "disabled")
        self._final_snapshot = Snapshot()  # what the publisher held last, once it is stopped
        self._labels: Dict[str, str] = {}
        self._reduced_per_layer = True
        self._per_layer = True
        self._history: Optional[History] = None
        self._black_box: Optional[incidents.BlackBox] = None
        self._pid = os.getpid()
        self._carry = CarryOver(_CARRIED)

    @property
    def _endpoint(self) -> Optional[Endpoint]:
        return self._serving.endpoint

    # -- public surface --------------------------------------------------------------

    @property
    def state(self) -> str:
        """"running", "server_failed" (metrics kept, no endpoint), "disabled" or "detached"."""
        if self._state == "running" and self._endpoint is not None and not self._endpoint.serving():
            self._state = "server_failed"
            self.error = "the metrics server thread stopped; training continues without an endpoint"
            log.error("gradmon[%s]: %s", self.name, self.error)
        return self._state

    @property
    def port(self) -> Optional[int]:
        return self._endpoint.port if self._endpoint is not None else None

    @property
    def url(self) -> Optional[str]:
        return self._endpoint.url if self._endpoint is not None else None

    @property
    def layers(self) -> Tuple[str, ...]:
        """Names (``layer`` label values) of the monitored layers."""
        return self._layer_names

    def step(self, global_step: Optional[int] = None) -> None:
        """Close a training step by hand (loops without torch.optim), or, right after an
        optimizer step, set the training's own global step number (e.g. after resuming).
        ``global_step`` is an integer (numpy's too); anything else is a TypeError here."""
        _check_step_number(global_step)
        if self._recorder is not None:
            self._recorder.manual_step(None if global_step is None else operator.index(global_step))

    def observe(self, *, loss: Union[torch.Tensor, float, object] = _UNSET,
                batch: Union[torch.Tensor, Sequence[Union[int, str]], None] = None) -> None:
        """Give gradmon this micro-batch's loss and/or its sample ids (call it before
        ``optimizer.step()``; once per micro-batch under gradient accumulation).

        ``gradmon_loss`` is the mean of the losses observed since the last optimizer step,
        on this rank; one observed with no step yet goes into the next step. It is
        detached and added on its device, never read by the training thread: it reaches
        the host in the step's one packet. Bad input (a non-scalar tensor, a string) is
        counted in ``gradmon_hook_errors_total{stage="observe"}``, never raised.

        ``batch`` is the micro-batch's sample ids, row by row (a list, tuple or range of
        ints or strings, a 1-D NumPy array, or a 1-D integer tensor, copied on its device
        and read only at an incident): an incident bundle names the ids of the rows that went non-finite.
        Anything else is a TypeError here, like a wrong ``step()`` number."""
        if batch is not None:
            ids = incidents.check_batch_ids(batch)
            if self._recorder is not None and self._black_box is not None:
                self._recorder.hash_rows(False)  # the ids name the rows: no need to hash them
                self._publish(incidents.BatchIds(ids))
        recorder = self._recorder
        if recorder is not None and loss is not _UNSET:
            recorder.observe_loss(loss)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every step so far is in the exported snapshot. True if it is."""
        return self._publisher.flush(timeout) if self._publisher is not None else True

    def pause(self) -> None:
        """Mark the run as paused on purpose: stall alerts stay silent."""
        if self._state not in ("detached", "disabled"):
            self._set_run_state(M.STATE_PAUSED)

    def resume(self) -> None:
        if self._state not in ("detached", "disabled"):
            self._set_run_state(M.STATE_TRAINING)

    def _set_run_state(self, state: str, failure: Optional[str] = None) -> None:
        self._run_state, self._failure = state, failure
        self._serving.changed()

    def snapshot(self) -> Snapshot:
        """The latest published snapshot (what the endpoint serves)."""
        publisher = self._publisher
        return publisher.latest if publisher is not None else self._final_snapshot

    def coverage(self) -> Coverage:
        """Families observed so far for each layer (a mapping, layer -> families); a
        missing family is a stated gap (e.g. ``nn.MultiheadAttention.out_proj``, whose
        forward never runs), listed by ``gaps()``. ``measured_at_step`` counts steps whose
        gradients could only be measured at the optimizer step, after any clipping."""
        return self.snapshot().coverage

    def _add_limit(self, text: str) -> None:
        """Log a limit of coverage and add it to ``coverage().limits``: the model's own
        (FSDP1 flat parameters, at attach) or one an integration knows of (DeepSpeed
        behind a Trainer)."""
        log.warning("gradmon[%s]: %s", self.name, text)
        if self._publisher is not None:
            self._publisher.add_limit(text)

    def detach(self, error: Optional[BaseException] = None) -> None:
        """End the run: remove every hook, stop the publisher and (last user) the HTTP
        server, after the scrapers have seen the final state (final_scrape_timeout). The
        state is "finished", unless an exception is being handled (``detach()`` in a
        ``finally`` or ``except`` block) or given as ``error`` (a framework's exception
        hook): then "failed" with its type, or "interrupted" for a Ctrl-C.

        Safe from any thread, including gradmon's own publisher thread (a "stop on NaN"
        ``on_nonfinite`` callback), and idempotent: each part of the teardown is undone
        once, and a part that failed is tried again by the next call. A Ctrl-C during the
        final-scrape wait ends the wait, not the teardown; it is re-raised afterwards."""
        self._end(*(run_end.outcome(error) if error is not None else run_end.outcome_now()))

    def _end(self, state: str, failure: Optional[str]) -> None:
        with _LOCK:
            if self._state == "disabled" or (self._state == "detached" and not self._teardown_left()):
                return
            first = self._state != "detached"
            self._state = "detached"
        if first and self._pid == os.getpid():
            if self._failure == GUARD_FAILURE and state == M.STATE_FINISHED:
                state, failure = M.STATE_FAILED, GUARD_FAILURE  # a run the guard gave up on did not finish well
            self._set_run_state(state, failure)
        self._teardown(final_scrape=first)

    def _teardown_left(self) -> bool:
        return bool(len(self._hooks)) or self._recorder is not None or self._publisher is not None \
            or (self._endpoint is not None and not self._serving.holding) or _NAMES_IN_USE.get(self.name) is self

    def _teardown(self, final_scrape: bool) -> None:
        interrupted: Optional[BaseException] = None
        forked = self._pid != os.getpid()  # an inherited monitor: the parent owns the endpoint
        for part in (self._stop_measuring, self._stop_publisher,
                     lambda: self._drop_endpoint(forked, final_scrape and not forked), self._forget):
            try:
                part()
            except KeyboardInterrupt as exc:
                interrupted = exc
            except Exception as exc:  # noqa: BLE001 - the rest of the teardown must still run
                log.error("gradmon[%s]: error while detaching (%s); detach() again retries the rest",
                          self.name, exc, exc_info=True)
        if interrupted is not None:
            raise interrupted

    def _stop_measuring(self) -> None:
        self._hooks.remove()
        if self._recorder is not None:
            self._recorder.release()
            self._carry.stopped(self._recorder.overhead)
            self._recorder = None

    def _stop_publisher(self) -> None:
        if self._publisher is not None:
            publisher = self._publisher
            publisher.close()
            self._final_snapshot = publisher.latest
            self._carry.leave(self._carry_key(), publisher.counters(), self._errors)
            self._publisher = None

    def _drop_endpoint(self, forked: bool, final_scrape: bool) -> None:
        if self._serving.leave(forked, final_scrape):
            _HELD[self._carry_key()] = self
            _announce(self, f"gradmon: the run of {self.name} ended ({self._run_state}); still serving it until "
                            f"the process exits (keep_serving): {_where(self)}")

    def _stop_holding(self, final_scrape: bool) -> None:
        if _HELD.get(self._carry_key()) is self:
            del _HELD[self._carry_key()]
        self._serving.stop_holding(final_scrape)

    def _forget(self) -> None:
        with _LOCK:
            if _NAMES_IN_USE.get(self.name) is self:
                del _NAMES_IN_USE[self.name]
            model = self._model_ref() if self._model_ref is not None else None
            if model is not None and _ATTACHED.get(model) is self:
                del _ATTACHED[model]

    def _carry_key(self) -> Tuple[str, Tuple[Tuple[str, str], ...]]:
        return self.name, tuple(sorted(self._labels.items()))

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        """The way the block is left decides the end state: an exception is "failed" (and
        pages), Ctrl-C "interrupted", anything else "finished"."""
        try:
            self._end(*run_end.outcome(exc))
        except KeyboardInterrupt:
            if exc is None:
                raise  # a Ctrl-C during the final-scrape wait, with nothing else in flight
            # otherwise the exception that left the block propagates as it was

    def __repr__(self) -> str:
        return (f"<gradmon.Monitor model={self.name!r} rank={self.rank.rank} state={self._state} "
                f"layers={len(self._layer_names)} url={self.url}>")

    # -- wiring ------------------------------------------------------------------------

    def _start(self, model: nn.Module, inner: nn.Module, port: int) -> None:
        """Everything that can be refused is checked before anything is started; on any
        failure the caller tears down what was started (see ``attach``)."""
        cfg = self.config
        self._model_ref = weakref.ref(model)
        self._labels = _series_labels(self.name, self.rank, cfg)
        wired = wire(model, inner, cfg, self.name, self.rank, self._errors, self._publish, self._on_incident,
                     self._on_guard_persist)
        self._layer_names = tuple(layer.name for layer in wired.layers)
        self._reduced_per_layer, self._per_layer = wired.reduced_per_layer, wired.per_layer
        self._history, self._black_box = wired.history, wired.black_box
        self._carry.resume(self._carry_key(), wired.aggregator, self._errors)
        # ValueError (TLS files, settings) before any hook exists
        failed = self._serving.join(port, self._errors, self.name)
        if failed is not None:
            self._state, self.error = "server_failed", failed
        self._recorder = wired.recorder
        self._publisher = Publisher(wired.aggregator, self._errors, self.name)
        # served from here on, before the hooks: a scrape in between sees the run at its first
        # step, never an endpoint that is up with no series of it (a live view shadows the held one)
        self._serving.register(self._errors.record,
                               lambda: (self.snapshot().generation, self._run_state, self._errors.total()))
        held = _HELD.get(self._carry_key())
        if held is not None:  # the same model again (a notebook cell run twice): it serves its own state now
            held._stop_holding(final_scrape=False)
        for text in sharded.limits(wired.units):
            self._add_limit(text)
        self._hooks.install(wired.recorder, model, wired.layers, cfg, [block for _, block in wired.blocks])
        self._state = self._state if self._state == "server_failed" else "running"
        self._carry.taken(self._carry_key())  # now in this monitor's counters

    def _on_incident(self, incident: NonFiniteIncident, starts: bool) -> None:
        """Publisher thread: the incident bundle (written inside the fold, so before any
        snapshot shows the incident), one log line per run of non-finite steps, and the
        user's callback."""
        if starts and self._black_box is not None:
            self._black_box.write(incident)
        if starts or self.config.log_every_incident:
            log.warning("gradmon[%s]: non-finite values on rank %d at step %d: started at step %s %s, "
                        "gradient first in layer %s, activation first in layer %s",
                        incident.model, incident.rank, incident.step,
                        incident.origin_step if incident.origin_step is not None else "-", _started_in(incident),
                        incident.grad_layer or "-", incident.activation_layer or "-")
        if starts and self.config.on_nonfinite is not None:
            try:
                self.config.on_nonfinite(incident)
            except Exception as exc:
                self._errors.record("publish", exc)

    def _on_guard_persist(self, reason: str, run: int, step: int) -> None:
        """Publisher thread: the guard gave up on a run of bad steps (``guard_max_skips``):
        the run is failed, and stays failed when it ends; with ``guard_on_persist="raise"``
        the training thread raises at its next step (if it did not already)."""
        log.error("gradmon[%s]: %d consecutive bad optimizer steps up to step %d (last skipped for %s): more than "
                  "guard_max_skips=%d; the guard stopped skipping and the run is failed", self.name, run, step,
                  reason, self.config.guard_max_skips)
        recorder = self._recorder
        if recorder is not None and recorder.step_guard is not None:
            recorder.step_guard.persisted = True
        if self._run_state == M.STATE_TRAINING or self._run_state == M.STATE_PAUSED:
            self._set_run_state(M.STATE_FAILED, GUARD_FAILURE)

    def _publish(self, item: object) -> None:
        if self._publisher is not None:
            self._publisher.put(item)

    def _export_view(self) -> ExportView:
        rec = self._recorder
        return ExportView(
            labels=self._labels, snapshot=self.snapshot(), errors=self._errors.counts(),
            overhead_seconds=self._carry.overhead(rec.overhead if rec is not None else None),
            run_state=self._run_state, failure=self._failure,
            info={"version": _version(), "torch_version": torch.__version__,
                  "world_size": str(self.rank.world_size)},
            reduced_per_layer=self._reduced_per_layer, per_layer=self._per_layer, history=self._history)


def _series_labels(name: str, rank: RankInfo, cfg: Config) -> Dict[str, str]:
    return {"model": name, "rank": str(rank.rank), **cfg.labels}


def _check_step_number(global_step: object) -> None:
    """``step(global_step)`` takes an integer (numpy's too): a mistake there is the caller's
    and is said at the call, never found later as a broken step count."""
    if global_step is None:
        return
    if isinstance(global_step, (bool, torch.Tensor)) or not hasattr(type(global_step), "__index__"):
        tensor = isinstance(global_step, torch.Tensor)
        hint = "; pass int(t) (gradmon never reads a tensor on the host for you)" if tensor else ""
        raise TypeError(f"gradmon: Monitor.step(global_step=...) takes an integer step number or None, "
                        f"got {type(global_step).__name__} {global_step!r}{hint}")


def _serving_port(cfg: Config, rank: RankInfo) -> int:
    """The port to serve on: ``port`` plus the local rank under torchrun (0 stays 0)."""
    if cfg.registry is not None or not cfg.port or not cfg.port_offset_by_local_rank:
        return cfg.port
    port = cfg.port + rank.local_rank
    if port > 65535:
        raise ValueError(f"gradmon: option 'port' {cfg.port} plus LOCAL_RANK {rank.local_rank} is {port}, "
                         "past 65535; choose a lower port, or port=0")
    return port


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, a Hogwild trainer) inherits the monitors but not
    their threads: make every inherited monitor inert, so a child that trains never grows
    a queue nobody reads, and start the child with no monitor registered (it may attach
    its own, on its own port). The endpoint's sockets are closed by the server module."""
    global _LOCK
    _LOCK = threading.RLock()  # another thread may have held it at fork time
    for mon in list(_LIVE):
        if mon._recorder is not None:
            mon._recorder.active = False
    _ATTACHED.clear()
    _NAMES_IN_USE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _live_monitors() -> "list[Monitor]":
    return [mon for mon in list(_LIVE) if mon._state in ("running", "server_failed")]


def _mark_all(state: str, failure: Optional[str]) -> None:
    """Publish an end of the run now (an exception on its way to the top, a SIGTERM)."""
    for mon in _live_monitors():
        mon._set_run_state(state, failure)


def _end_all(state: str, failure: Optional[str]) -> None:
    """Interpreter exit: end every monitor still attached, then stop serving the ended runs
    that keep_serving held; each endpoint waits once."""
    for mon in _live_monitors():
        mon._end(state, failure)
    for mon in list(_HELD.values()):
        mon._stop_holding(final_scrape=True)


def _where(mon: Monitor) -> str:
    """Where a user looks: the metrics URL and, with ``ui``, the live page."""
    if mon.url is None:
        return f"no endpoint: {mon.error}" if mon.error else "metrics in the given registry"
    page = f", live page at {mon.url[:-len('metrics')]}" if mon.config.ui else ""
    return f"metrics at {mon.url}{page}"


def _announce(mon: Monitor, text: str) -> None:
    """One stderr line on the job's main process (``announce``), DEBUG elsewhere: a print,
    since a framework's default log level (the Trainer's WARNING) hides an INFO record."""
    main = mon.config.announce if mon.config.announce is not None else mon.rank.rank == 0
    if not main:
        log.debug("%s", text)
        return
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed or broken stderr must not fail attach()
        pass


def attach(model: nn.Module, **options: Any) -> Monitor:
    """Monitor ``model``'s gradient health; see :class:`gradmon.Config` for options.

    Attaching the same model again returns the existing handle when the options are
    the same, and raises ValueError when they differ: hooks are never doubled.
    """
    if _config.is_disabled():
        log.info("gradmon: GRADMON_DISABLE is set; attach() is a no-op")
        return Monitor(Config(disable=True))
    if not isinstance(model, nn.Module):
        raise TypeError(f"gradmon.attach() expects a torch.nn.Module, got {type(model).__name__}")
    cfg = _config.resolve(options)
    if cfg.disable:
        return Monitor(cfg)
    chain = wrappers(model)
    inner = chain[-1]
    replicated = [m for m in chain
                  if type(m).__name__ == "DataParallel" and len(getattr(m, "device_ids", None) or ()) > 1]
    if replicated:  # torch.compile's wrapper around it too
        raise ValueError(
            f"gradmon.attach(): nn.DataParallel over {len(replicated[0].device_ids)} devices copies the model into a "
            "replica per device on every forward, and gradmon's checks stay with the original model's blocks; "
            "use DistributedDataParallel (one process per GPU, see docs/multi-gpu.md) or one device")
    if not has_trainable_parameters(inner):
        raise ValueError(f"gradmon.attach(): {type(inner).__name__} has no trainable parameters "
                         "(all requires_grad=False); there are no gradients to monitor")
    rank = detect()
    port = _serving_port(cfg, rank)
    with _LOCK:
        existing = _ATTACHED.get(inner)
        if existing is not None and existing.state != "detached":
            if existing.config == cfg:
                log.info("gradmon: %s is already monitored; returning the existing handle", existing.name)
                return existing
            raise ValueError(
                f"gradmon.attach(): this model is already monitored as {existing.name!r} with "
                "different options; call detach() on that handle before attaching again")
        name = _unique_name(cfg.name or type(inner).__name__.lower(),
                            lambda n: _CARRIED.ended((n, tuple(sorted(_series_labels(n, rank, cfg).items())))))
        mon = Monitor(cfg, name, rank)
        _NAMES_IN_USE[name] = mon
        try:
            mon._start(model, inner, port)
        except BaseException:
            # nothing of a failed attach may remain: hooks, threads, sockets, the name
            mon._state = "detached"
            mon._teardown(final_scrape=False)
            raise
        _ATTACHED[inner] = mon
        _LIVE.add(mon)
        run_end.install(_mark_all, _end_all, cfg.handle_sigterm,
                        lambda: min(run_end.SIGTERM_GRACE_S, cfg.final_scrape_timeout))
    rank = f" on rank {mon.rank.rank}" if mon.rank.world_size > 1 else ""
    _announce(mon, f"gradmon: monitoring {len(mon.layers)} layers of {name}{rank}, {_where(mon)}")
    return mon
