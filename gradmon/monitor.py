"""``attach()`` and the :class:`Monitor` handle that owns everything it started.

attach validates its input (every mistake is a TypeError/ValueError here, never an
error at training time), finds the layers, installs the hooks, starts the publisher
thread and joins or starts the exporter endpoint. ``detach()`` undoes all of it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, FrozenSet, Optional, Tuple

import torch
from torch import nn

from . import config as _config
from . import exporter
from . import metrics as M
from .config import Config
from .errors import ErrorLog
from .hooks import HookSet, Recorder
from .identity import RankInfo, detect
from .layers import discover, has_trainable_parameters, is_ddp, unwrap
from .grouping import group_layers, per_layer_series
from .snapshot import Aggregator, NonFiniteIncident, Publisher, Snapshot

log = logging.getLogger("gradmon")

_LOCK = threading.RLock()
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, Monitor]" = weakref.WeakKeyDictionary()
_NAMES_IN_USE: Dict[str, int] = {}


def _version() -> str:
    from . import __version__
    return __version__


def _unique_name(wanted: str) -> str:
    name, n = wanted, 1
    while name in _NAMES_IN_USE:
        n += 1
        name = f"{wanted}-{n}"
    return name


class Monitor:
    """The handle ``attach()`` returns. A context manager; ``detach()`` is idempotent."""

    def __init__(self, cfg: Config, name: str = "", rank: RankInfo = RankInfo()) -> None:
        self.config = cfg
        self.name = name
        self.rank = rank
        self.error: Optional[str] = None
        self._state = "disabled" if cfg.disable else "starting"
        self._run_state = "training"
        self._model_ref: Optional[weakref.ref] = None
        self._layer_names: Tuple[str, ...] = ()
        self._hooks = HookSet()
        self._recorder: Optional[Recorder] = None
        self._publisher: Optional[Publisher] = None
        self._endpoint: Optional[exporter.Endpoint] = None
        self._errors = ErrorLog(name or "disabled")
        self._snapshot = Snapshot()
        self._labels: Dict[str, str] = {}
        self._reduced_per_layer = True

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
        optimizer step, set the training's own global step number (e.g. after resuming)."""
        if self._recorder is not None:
            self._recorder.manual_step(global_step)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every step so far is in the exported snapshot. True if it is."""
        return self._publisher.flush(timeout) if self._publisher is not None else True

    def pause(self) -> None:
        """Mark the run as paused on purpose: stall alerts stay silent."""
        if self._state not in ("detached", "disabled"):
            self._set_run_state("paused")

    def resume(self) -> None:
        if self._state not in ("detached", "disabled"):
            self._set_run_state("training")

    def _set_run_state(self, state: str) -> None:
        self._run_state = state
        if self._endpoint is not None:
            self._endpoint.changed()

    def snapshot(self) -> Snapshot:
        """The latest published snapshot (what the endpoint serves)."""
        return self._snapshot

    def coverage(self) -> Dict[str, FrozenSet[str]]:
        """Families observed so far for each layer; a missing family is a stated gap
        (e.g. ``nn.MultiheadAttention.out_proj``, whose forward never runs)."""
        return dict(self._snapshot.coverage)

    def detach(self) -> None:
        """Remove every hook, stop the publisher and (last user) the HTTP server."""
        with _LOCK:
            if self._state in ("detached", "disabled"):
                return
            self._state = "detached"
            self._hooks.remove()
            if self._recorder is not None:
                self._recorder.release()
            if self._publisher is not None:
                self._publisher.close()
            self._finish_run_state()
            if self._endpoint is not None:
                exporter.release(self._endpoint, id(self))
                self._endpoint = None
            _NAMES_IN_USE.pop(self.name, None)
            model = self._model_ref() if self._model_ref is not None else None
            if model is not None and _ATTACHED.get(model) is self:
                del _ATTACHED[model]

    def _finish_run_state(self) -> None:
        """Set "finished" and let a scraping Prometheus see it once before the endpoint goes."""
        scrapes = self._endpoint.scrapes if self._endpoint is not None else 0
        self._set_run_state("finished")
        timeout = self.config.final_scrape_timeout
        if self._endpoint is None or self._endpoint.port is None or not scrapes or timeout <= 0:
            return
        if not self._endpoint.wait_for_scrape(scrapes, timeout):
            log.info("gradmon[%s]: no scrape within final_scrape_timeout=%ss after the run "
                     "finished; Prometheus may not have seen the final state", self.name, timeout)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (f"<gradmon.Monitor model={self.name!r} rank={self.rank.rank} state={self._state} "
                f"layers={len(self._layer_names)} url={self.url}>")

    # -- wiring ------------------------------------------------------------------------

    def _start(self, model: nn.Module, inner: nn.Module) -> None:
        cfg = self.config
        layers = discover(inner, cfg)
        if not layers:
            raise ValueError(
                "gradmon: no layer matches the options include/exclude/layer_types "
                f"(include={cfg.include}, exclude={cfg.exclude}, layer_types={cfg.layer_types})")
        self._layer_names = tuple(layer.name for layer in layers)
        self._model_ref = weakref.ref(model)
        self._labels = {"model": self.name, "rank": str(self.rank.rank), **cfg.labels}
        families = [M.FAMILY_GRAD] + ([M.FAMILY_GRAD_FLOW] if cfg.grad_flow else []) + (
            [M.FAMILY_ACTIVATION] if cfg.activations else [])
        local_view = cfg.local_view if cfg.local_view is not None else is_ddp(model)
        recorder = Recorder(layers, cfg, self._errors, self._publish, local_view)
        grouping = group_layers(self._layer_names, per_layer_series(families, local_view), cfg.series_budget)
        if grouping.grouped_layers:
            log.warning("gradmon[%s]: %d layers exceed series_budget=%d; exporting %d module-name-prefix "
                        "groups instead (gradmon_grouped_layers)", self.name, len(layers), cfg.series_budget,
                        len(grouping.names))
        # Every rank holds the same reduced gradient under DDP/FSDP: rank 0 carries its per-layer series.
        self._reduced_per_layer = self.rank.rank == 0 or self.rank.world_size == 1 or not (
            local_view or recorder.sharded)
        aggregator = Aggregator(grouping.names, recorder.param_layer, families, self.name, local_view,
                                grouping.of_layer, self.rank.rank, self._on_incident, amp=cfg.scaler is not None)
        self._recorder = recorder
        self._publisher = Publisher(aggregator, self._errors, self._set_snapshot, self.name)
        try:
            self._hooks.install(recorder, model, layers, cfg)
        except BaseException:
            self._publisher.close()
            raise
        self._state = "running"
        self._join_endpoint()

    def _join_endpoint(self) -> None:
        cfg = self.config
        port = cfg.port
        if port and cfg.port_offset_by_local_rank:
            port += self.rank.local_rank
        try:
            self._endpoint = exporter.acquire(cfg, port)
        except OSError as exc:
            # A taken port must not kill a training job: keep measuring, say so loudly.
            self._state = "server_failed"
            self.error = f"could not serve metrics on {cfg.addr}:{port}: {exc}"
            self._errors.record("server", exc)
            log.error("gradmon[%s]: %s; training continues without an endpoint "
                      "(set GRADMON_PORT or port=0)", self.name, self.error)
            return
        self._endpoint.collector.add(id(self), self._export_view, self._errors.record,
                                     lambda: (self._snapshot.generation, self._run_state, self._errors.total()))

    def _on_incident(self, incident: NonFiniteIncident, starts: bool) -> None:
        """Publisher thread: one log line per run of non-finite steps, and the user's callback."""
        if starts or self.config.log_every_incident:
            log.warning("gradmon[%s]: non-finite values on rank %d at step %d: gradient first in layer %s, "
                        "activation first in layer %s", incident.model, incident.rank, incident.step,
                        incident.grad_layer or "-", incident.activation_layer or "-")
        if starts and self.config.on_nonfinite is not None:
            try:
                self.config.on_nonfinite(incident)
            except Exception as exc:
                self._errors.record("publish", exc)

    def _publish(self, item: object) -> None:
        if self._publisher is not None:
            self._publisher.put(item)

    def _set_snapshot(self, snap: Snapshot) -> None:
        self._snapshot = snap

    def _export_view(self) -> exporter.ExportView:
        rec = self._recorder
        return exporter.ExportView(
            labels=self._labels, snapshot=self._snapshot, errors=self._errors.counts(),
            overhead_seconds=rec.overhead if rec is not None else 0.0,
            run_state=self._run_state,
            info={"version": _version(), "torch_version": torch.__version__,
                  "world_size": str(self.rank.world_size)},
            reduced_per_layer=self._reduced_per_layer)


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
    inner = unwrap(model)
    if not has_trainable_parameters(inner):
        raise ValueError(f"gradmon.attach(): {type(inner).__name__} has no trainable parameters "
                         "(all requires_grad=False); there are no gradients to monitor")
    with _LOCK:
        existing = _ATTACHED.get(inner)
        if existing is not None and existing.state != "detached":
            if existing.config == cfg:
                log.info("gradmon: %s is already monitored; returning the existing handle", existing.name)
                return existing
            raise ValueError(
                f"gradmon.attach(): this model is already monitored as {existing.name!r} with "
                "different options; call detach() on that handle before attaching again")
        name = _unique_name(cfg.name or type(inner).__name__.lower())
        mon = Monitor(cfg, name, detect())
        _NAMES_IN_USE[name] = 1
        try:
            mon._start(model, inner)
        except BaseException:
            _NAMES_IN_USE.pop(name, None)
            raise
        _ATTACHED[inner] = mon
    log.info("gradmon: monitoring %d layers of %s (rank %d)%s", len(mon.layers), name,
             mon.rank.rank, f", metrics at {mon.url}" if mon.url else "")
    return mon
