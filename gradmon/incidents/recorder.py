"""The black box: the last steps kept on the publisher thread, a bundle at an incident.

Everything here runs on the publisher thread (``keep``, ``batch``, ``write``), except
:func:`check_batch_ids`, which ``Monitor.observe`` runs on the training thread. The
bundle is written inside the fold that finds the incident, so it is on disk before any
snapshot (hence ``/metrics``) shows the incident's counters.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import math
import operator
import os
import platform
import random
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..capture.kernels import to_host
from ..errors import ErrorLog
from . import bundle as B
from .steps import Step, decode, optimizer_values

log = logging.getLogger("gradmon")

MAX_INCIDENTS = 3
"""Bundles one rank writes per run: the first incidents say what happened; a job that
goes non-finite again and again must not fill a disk."""
MAX_IDS = 65536
"""Sample ids kept per step: a batch is rarely larger, and a bundle is bounded anyway."""
ROW_STEPS = 4
"""Newest kept steps whose per-row block checks are held (device tensors): a bundle is
written in the fold of its incident's step, so the origin step's rows are the newest."""

KIND_NONFINITE = "nonfinite"
"""A bundle's ``kind``: the first step of a run of non-finite steps."""
KIND_DIVERGENCE = "divergence"
"""A bundle's ``kind``: the step on which the loss confirmed a divergence (the page)."""


@dataclass(frozen=True)
class Moment:
    """What a bundle is written for other than a non-finite run (which passes its
    ``NonFiniteIncident``, with the same fields): the step, and no origin block."""

    step: int
    origin_step: Optional[int] = None
    block: Optional[str] = None
    grad_layer: Optional[str] = None
    activation_layer: Optional[str] = None


@dataclass(frozen=True)
class BatchIds:
    """``observe(batch=...)``: put on the publisher's queue before its step's packet."""

    ids: object  # a tuple of ints/strs, or a 1-D integer tensor (a copy, still on its device)


def check_batch_ids(ids: object) -> object:
    """The ids in the form kept, or TypeError saying what ``batch=`` takes. Training
    thread: a tensor is copied on its device (no host sync), a sequence into a tuple."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() > 1:
            raise TypeError(f"gradmon: Monitor.observe(batch=...) takes a 1-D integer tensor of sample ids, got a "
                            f"{ids.dim()}-D {ids.dtype} tensor")
        return ids.detach().reshape(-1)[:MAX_IDS].clone()
    if type(ids).__module__ == "numpy" and getattr(ids, "ndim", None) == 1:
        ids = ids.tolist()  # a sampler's index array: host memory already
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise TypeError(f"gradmon: Monitor.observe(batch=...) takes the batch's sample ids: a list or tuple of "
                        f"ints or strings, a 1-D integer tensor or NumPy array; got {type(ids).__name__}")
    out = []
    for x in ids[:MAX_IDS]:
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, bool) or not hasattr(type(x), "__index__"):
            raise TypeError(f"gradmon: Monitor.observe(batch=...): each sample id is an int or a string, got "
                            f"{type(x).__name__} {x!r}")
        else:
            out.append(operator.index(x))
    return tuple(out)


ID_KEYS = ("ids", "id", "idx", "index", "sample_ids")
"""Fields of a dict batch that a trainer callback takes for the samples' ids."""


def ids_in(batch: object) -> Optional[object]:
    """The sample ids a dict batch carries (:data:`ID_KEYS`), checked, or None: a batch
    without usable ids is not an error for a callback that only looked."""
    if not isinstance(batch, Mapping):
        return None
    for key in ID_KEYS:
        if key in batch:
            try:
                return check_batch_ids(batch[key])
            except TypeError:
                return None
    return None


@dataclass(frozen=True)
class RunFacts:
    """What a bundle says about the run, fixed at attach."""

    model: str
    rank: int
    world_size: int
    layers: Tuple[str, ...]
    blocks: Tuple[str, ...]
    param_layer: Tuple[int, ...]
    device: str
    options: Mapping[str, Any]
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started: str = field(default_factory=lambda: _now())
    run: int = field(default_factory=lambda: next(_RUNS))
    """This process's monitors in attach order: a model attached again, whose steps start
    again from 1, never writes over an earlier run's bundle."""


_RUNS = itertools.count(1)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


class BlackBox:
    """The last ``steps`` steps of one monitor as their packets held them, and the
    incident bundles written from them."""

    def __init__(self, directory: str, max_bytes: int, steps: int, facts: RunFacts, errors: ErrorLog) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.facts = facts
        self._errors = errors
        self._ring: Deque[Step] = collections.deque(maxlen=max(1, steps))
        self._ring_bytes = 0
        self._pending: List[object] = []
        self.spent = 0
        self.attempts = 0
        self._failed = False
        self._last_step: Optional[int] = None  # the step of the last bundle: one bundle a step

    # -- every step -------------------------------------------------------------------

    def batch(self, ids: object) -> None:
        """Sample ids of a micro-batch of the next step to be kept."""
        self._pending.append(ids)

    def keep(self, packet: Any) -> None:
        """One step's packet (its host data, read after its event completed), copied:
        the recorder may reuse its buffers. Never raises (counted, stage ``publish``)."""
        try:
            self._keep(packet)
        except Exception as exc:  # noqa: BLE001 - the aggregator must still fold the step
            self._errors.record("publish", exc)

    def _keep(self, packet: Any) -> None:
        data = packet.data.to(torch.float32, copy=True) if packet.data is not None else None
        if len(self._ring) == self._ring.maxlen:
            self._ring_bytes -= _bytes(self._ring[0].data)
        self._ring.append(Step(packet.global_step, data, tuple(packet.sections), tuple(packet.scalars),
                                tuple(packet.learning_rates), bool(packet.skipped), self._pending,
                                tuple(getattr(packet, "rows", ())), tuple(getattr(packet, "row_hashes", ()))))
        self._pending = []
        if len(self._ring) > ROW_STEPS:
            self._ring[-ROW_STEPS - 1].rows = self._ring[-ROW_STEPS - 1].hashes = ()
        self._ring_bytes += _bytes(data)
        # a bundle never holds more than max_bytes, so neither need the steps kept for it
        while len(self._ring) > 1 and self._ring_bytes > self.max_bytes:
            self._ring_bytes -= _bytes(self._ring.popleft().data)

    # -- at an incident ---------------------------------------------------------------

    def write(self, incident: Any, kind: str = KIND_NONFINITE, reason: Optional[Mapping[str, Any]] = None
              ) -> Optional[str]:
        """Write the bundle of ``incident`` (a ``NonFiniteIncident``, or a :class:`Moment`
        for another ``kind``), with ``reason`` (JSON values: why it was written) in it; the
        path, or None. Never raises. One bundle a step: the first written for it (the
        non-finite one, made first in the fold) stands for any other reason that step. A
        failure to write (a full or read-only disk) is logged once per run and counted
        (stage ``publish``)."""
        if self.attempts >= MAX_INCIDENTS or self.spent >= self.max_bytes or incident.step == self._last_step:
            return None
        self.attempts += 1  # a disk that refuses them must not be asked at every incident
        self._last_step = incident.step
        try:
            here = incident.block is not None
            full = here or self.facts.rank == 0 or self.facts.world_size == 1
            meta, arrays = self._content(incident, kind, here, full)
            meta["reason"] = dict(reason or {})
            fitted = B.fit(meta, arrays, self.max_bytes - self.spent, int(meta["history"]["steps"]))
            if fitted is None:
                log.warning("gradmon[%s]: incident at step %d not written: the %d bytes of incident_max_bytes "
                            "left for this run do not hold even its record", self.facts.model, incident.step,
                            self.max_bytes - self.spent)
                return None
            name = (f"gradmon-incident-{B.safe_name(self.facts.model)}-rank{self.facts.rank}-step{incident.step}-"
                    f"{self.facts.pid}-{self.facts.run}-{self.attempts}.npz")
            path = B.write(self.directory, name, *fitted)
        except OSError as exc:
            self._errors.record("publish", exc, log_first=False)
            if not self._failed:
                self._failed = True
                log.error("gradmon[%s]: could not write the incident bundle into incident_dir %r (%s); training "
                          "continues, further failures are only counted in gradmon_hook_errors_total"
                          "{stage=\"publish\"}", self.facts.model, self.directory, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - nothing may reach the training job
            self._errors.record("publish", exc)
            return None
        self.spent += os.path.getsize(path)
        log.warning("gradmon[%s]: incident bundle written (%s at step %d): %s (read it with `gradmon incident %s`)",
                    self.facts.model, kind, incident.step, path, path)
        return path

    def _kept(self, step: int) -> Optional[Step]:
        return next((s for s in reversed(self._ring) if s.step == step), None)

    def batch_ids(self, step: int) -> Optional[List[Any]]:
        """The sample ids ``observe(batch=...)`` gave for ``step``, if it is still kept and had any."""
        at = self._kept(step)
        return _ids(at.batch) if at is not None else None

    def _content(self, incident: Any, kind: str, here: bool, full: bool
                 ) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
        facts = self.facts
        steps = list(self._ring) if full else []
        at = self._kept(incident.step)
        ids = _ids(at.batch) if at is not None else None
        origin = next((s for s in reversed(self._ring) if s.step == (incident.origin_step or incident.step)), None)
        arrays, history = _history(steps, facts)
        arrays.update(_rng_arrays())
        meta: Dict[str, Any] = {
            "schema": B.SCHEMA, "schema_version": B.VERSION, "kind": kind, "full": full,
            "written_at": _now(),
            "run": {"model": facts.model, "rank": facts.rank, "world_size": facts.world_size, "host": facts.host,
                    "pid": facts.pid, "run": facts.run, "device": facts.device, "started_at": facts.started},
            "incident": {"step": incident.step, "origin_step": incident.origin_step,
                         "origin_here": here, "block": incident.block, "grad_layer": incident.grad_layer,
                         "activation_layer": incident.activation_layer},
            "rows": (_rows(origin, incident.block, facts.blocks) if kind == KIND_NONFINITE else
                     {"known": False, "rows": [], "block": None,
                      "reason": f"a {kind} bundle names no rows: no value of the batch went non-finite"}),
            "batch": _batch(ids, at),
            "blamed": _blamed(steps, facts, incident) if full else {},
            "history": history,
            "options": dict(facts.options),
            "rng": {"python_state_version": random.getstate()[0],
                    "torch_initial_seed": torch.initial_seed(),
                    "arrays": sorted(name for name in arrays if name.startswith("rng."))},
            "versions": {"gradmon": _gradmon_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                         "python": platform.python_version(), "platform": sys.platform},
        }
        return meta, arrays


def _bytes(t: Optional[torch.Tensor]) -> int:
    return t.numel() * 4 if t is not None else 0


def _gradmon_version() -> str:
    from .. import __version__
    return __version__


def _ids(batch: Sequence[object]) -> Optional[List[Any]]:
    """The step's sample ids, micro-batches in order; a tensor is read here (publisher
    thread, at an incident only)."""
    if not batch:
        return None
    out: List[Any] = []
    for ids in batch:
        out.extend(_host(ids).tolist() if isinstance(ids, torch.Tensor) else ids)  # type: ignore[union-attr]
    return out[:MAX_IDS]


HASH = "gradmon.rowhash.1"
"""How ``batch.hashes`` are made: docs/incidents.md (*Row hashes*) gives the reference code."""


def _batch(ids: Optional[List[Any]], at: Optional[Step]) -> Dict[str, Any]:
    """The step's sample ids, or else its rows' input hashes, read here (publisher thread,
    at an incident only): per input, one 16-digit hex string per row, micro-batches in order."""
    hashes: Dict[str, List[str]] = {}
    if ids is None and at is not None:
        for name, values, _ in sorted(at.hashes, key=lambda h: h[2]):
            hashes.setdefault(name, []).extend(format(v & 0xFFFFFFFFFFFFFFFF, "016x")
                                               for v in _host(values).tolist())
    reason = None if ids is not None else "no ids given: Monitor.observe(batch=ids)"
    return {"known": ids is not None, "ids": ids if ids is not None else [], "reason": reason,
            "hashes": {name: values[:MAX_IDS] for name, values in hashes.items()}, "hash": HASH if hashes else None}


def _rows(origin: Optional[Step], block: Optional[str], blocks: Sequence[str]) -> Dict[str, Any]:
    """Which rows of the batch held a NaN or an Inf at the origin block, at the origin
    step: its per-row block checks, micro-batches in order (as the ids), read here
    (publisher thread, at an incident only). Rows with a NaN or a +Inf are named before
    rows with only a -Inf, which a float attention mask carries in every row."""
    def unknown(reason: str) -> Dict[str, Any]:
        return {"known": False, "rows": [], "block": block, "reason": reason}

    if block is None:
        return unknown("no origin block on this rank: its forward stayed finite")
    if origin is None:
        return unknown("the origin step is no longer among the kept steps")
    key = blocks.index(block) if block in blocks else -1
    forwards: Dict[int, List[torch.Tensor]] = {}
    for rows in origin.rows:
        for values in rows.of(key):
            forwards.setdefault(rows.forward, []).append(values)
    if not forwards:
        return unknown("no per-row check of the origin block at that step: its output's first dimension is not "
                       "the root input's batch, the batch is sequence-first or packed, or (a block that is a layer, "
                       "on a detail step) its check was taken from its activation record")
    # a block's value of several tensors (a tuple, the input and its mask) is one batch: their rows' flags are or-ed
    nan_or_inf, minus_inf = (torch.cat([torch.stack([kind(_host(t).double()) for t in tensors])
                                        .any(dim=0) for _, tensors in sorted(forwards.items())])
                             for kind in (_nan_or_inf, _minus_inf))
    bad = (nan_or_inf if nan_or_inf.any() else minus_inf).nonzero().reshape(-1)
    return {"known": True, "rows": bad.tolist()[:MAX_IDS], "block": block, "reason": None}


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, waiting for its own copy only: a blocking copy would wait on the
    whole stream, a sync that CUDA's sync debug mode refuses in any thread."""
    host, event = to_host(t.detach().contiguous())
    if event is not None:
        event.synchronize()
    return host


def _nan_or_inf(rows: torch.Tensor) -> torch.Tensor:
    """Per row of (n, 2) [min, max]: it holds a NaN or a +Inf."""
    return rows.isnan().any(dim=1) | (rows[:, 1] == math.inf)


def _minus_inf(rows: torch.Tensor) -> torch.Tensor:
    return rows[:, 0] == -math.inf


def _rng_arrays() -> Dict[str, torch.Tensor]:
    """RNG states when the bundle is written (the publisher lags the training thread by
    a step or so): torch's CPU generator, each CUDA device's, Python's ``random``."""
    out = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda{i}"] = state
    out["rng.python"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
    return out


def _history(steps: Sequence[Step], facts: RunFacts) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    # a record without history (fleet scale: neither the origin rank nor rank 0) has no arrays of it
    arrays, described = decode(steps, len(facts.layers), facts.param_layer) if steps else ({}, {})
    meta = {"present": len(steps) > 0, "steps": len(steps), "dropped_steps": 0, "layers": list(facts.layers),
            "blocks": list(facts.blocks), "statistics": described}
    return arrays, meta


def _blamed(steps: Sequence[Step], facts: RunFacts, incident: Any) -> Dict[str, Dict[str, Any]]:
    """The optimizer statistics of the layers the incident names, at the last kept step
    that read the optimizer's state."""
    index = {name: i for i, name in enumerate(facts.layers)}
    wanted = [index[n] for n in (incident.grad_layer, incident.activation_layer) if n in index]
    found = optimizer_values(steps, wanted, facts.param_layer)
    return {facts.layers[layer]: {param: {k: B.finite_or_none(v) if isinstance(v, float) else v
                                          for k, v in values.items()} for param, values in params.items()}
            for layer, params in found.items()}


def options_of(cfg: Any) -> Dict[str, Any]:
    """The options as JSON: secrets (fields hidden from the Config's repr) left out,
    objects only code can give (registry, scaler, callbacks) named by their type."""
    import dataclasses
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        if not f.repr:
            continue
        value = getattr(cfg, f.name)
        if isinstance(value, (bool, int, float, str)) or value is None:
            out[f.name] = value if not isinstance(value, float) or value == value else repr(value)
        elif isinstance(value, tuple):
            out[f.name] = [v if isinstance(v, str) else getattr(v, "__name__", type(v).__name__) for v in value]
        elif isinstance(value, Mapping):
            out[f.name] = {str(k): str(v) for k, v in value.items()}
        else:
            out[f.name] = f"<{type(value).__name__}>"
    return out
