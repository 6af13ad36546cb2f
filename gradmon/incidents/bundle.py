"""The bundle's schema: one ``.npz`` file, a ``bundle.json`` member and plain arrays.

Written only by :func:`write` (bounded, atomic) and read only by :func:`load` (which
trusts nothing in the file). docs/incidents.md is the reference for every field.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from . import npz

SCHEMA = "gradmon.incident"
VERSION = 1
JSON_MEMBER = "bundle.json"
_MEMBER_OVERHEAD = 256  # zip local and central headers plus a padded .npy header, per array
_FIXED_OVERHEAD = 1024
READ_LIMIT = 1 << 30  # the reader's bound on a bundle's uncompressed members


@dataclass
class Bundle:
    """A bundle as :func:`load` returns it: the parsed JSON and the arrays by name."""

    path: str
    meta: Dict[str, Any]
    arrays: Dict[str, torch.Tensor]


def size_of(meta: Mapping[str, Any], arrays: Mapping[str, torch.Tensor]) -> int:
    """An upper bound of the file :func:`write` makes of these."""
    return (_FIXED_OVERHEAD + len(_json(meta)) + sum(
        _MEMBER_OVERHEAD + 2 * len(name) + t.numel() * t.element_size() for name, t in arrays.items()))


def fit(meta: Dict[str, Any], arrays: Dict[str, torch.Tensor], budget: int, steps: int
        ) -> Optional[Tuple[Dict[str, Any], Dict[str, torch.Tensor]]]:
    """The bundle cut to ``budget`` bytes: the oldest steps of the history arrays (those
    named ``history.*`` and ``stat.*`` whose first dimension is ``steps``) are dropped
    first, then the history altogether; None when not even that fits."""
    def cut(keep: int) -> Dict[str, torch.Tensor]:
        return {name: (t[steps - keep:] if _per_step(name, t, steps) else t) for name, t in arrays.items()
                if keep or not _per_step(name, t, steps)}
    whole = size_of(meta, arrays)
    if whole <= budget:
        return meta, arrays
    fixed = size_of(meta, cut(0)) + 64
    per_step = (whole - fixed) / max(steps, 1)
    keep = min(steps, max(0, int((budget - fixed) // per_step))) if per_step > 0 else 0
    while keep > 0 and size_of(meta, cut(keep)) > budget:
        keep -= 1
    meta = {**meta, "history": {**meta["history"], "steps": keep, "dropped_steps": steps - keep}}
    if keep == 0:
        meta["history"]["present"] = False
    out = cut(keep)
    return (meta, out) if size_of(meta, out) <= budget else None


def _per_step(name: str, t: torch.Tensor, steps: int) -> bool:
    return name.startswith(("history.", "stat.")) and not name.endswith(".keys") and not name.endswith(
        ".layer") and t.dim() >= 1 and t.shape[0] == steps


def _json(meta: Mapping[str, Any]) -> bytes:
    return json.dumps(meta, allow_nan=False, ensure_ascii=True, default=str).encode("ascii")


def safe_name(text: str) -> str:
    """A file-name part: letters, digits, ``.``, ``_`` and ``-``, at most 64 characters."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64] or "model"


def write(directory: str, name: str, meta: Mapping[str, Any], arrays: Mapping[str, torch.Tensor]) -> str:
    """Write the bundle atomically: a temporary file in ``directory``, flushed and fsynced,
    then renamed over ``name`` (and the directory fsynced), so a reader or a crash sees
    either nothing or the whole file. OSError (a full or read-only disk) is the caller's."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, name)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out:
            npz.write(out, arrays, {JSON_MEMBER: _json(meta)})
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:  # some file systems refuse a directory fsync; the rename is done
        pass
    return final


def finite_or_none(x: Optional[float]) -> Optional[float]:
    """JSON has no NaN: a non-finite number is written as a string naming it."""
    if x is None:
        return None
    return x if math.isfinite(x) else repr(float(x))  # type: ignore[return-value]


# -- reading ---------------------------------------------------------------------------

class Refused(ValueError):
    """``gradmon incident`` refuses the file; the message says why."""


def load(path: str) -> Bundle:
    """Read and check a bundle from an untrusted run: Refused for anything malformed."""
    try:
        arrays, texts = npz.read(path, READ_LIMIT)
    except npz.BadFile as exc:
        raise Refused(f"{path}: not a gradmon incident bundle: {exc}") from None
    except OSError as exc:
        raise Refused(f"{path}: cannot read it: {exc.strerror or exc}") from None
    raw = texts.get(JSON_MEMBER)
    if raw is None:
        raise Refused(f"{path}: not a gradmon incident bundle: it has no {JSON_MEMBER}")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused(f"{path}: not a gradmon incident bundle: {JSON_MEMBER} is not JSON") from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise Refused(f"{path}: not a gradmon incident bundle (no schema {SCHEMA!r})")
    if meta.get("schema_version") != VERSION:
        raise Refused(f"{path}: schema version {meta.get('schema_version')!r}; this gradmon reads version {VERSION}")
    _check(path, meta, arrays)
    return Bundle(path, meta, arrays)


_REQUIRED = {"run": dict, "incident": dict, "history": dict, "rows": dict, "batch": dict, "versions": dict}


def _check(path: str, meta: Dict[str, Any], arrays: Mapping[str, torch.Tensor]) -> None:
    for key, kind in _REQUIRED.items():
        if not isinstance(meta.get(key), kind):
            raise Refused(f"{path}: malformed bundle: {key!r} missing or not an object")
    step = meta["incident"].get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise Refused(f"{path}: malformed bundle: incident.step is not an integer")
    history = meta["history"]
    if history.get("present"):
        steps = arrays.get("history.step")
        if steps is None or steps.dim() != 1 or steps.dtype != torch.int64:
            raise Refused(f"{path}: malformed bundle: history.step missing or not 1-D int64")
        n = steps.shape[0]
        layers = history.get("layers")
        if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
            raise Refused(f"{path}: malformed bundle: history.layers is not a list of names")
        for name in ("history.global_norm", "history.loss"):
            t = arrays.get(name)
            if t is None or t.shape != (n,):
                raise Refused(f"{path}: malformed bundle: {name} missing or not {n} values")
        heat = arrays.get("history.layer_grad_norm")
        if heat is None or heat.shape != (n, len(layers)):
            raise Refused(f"{path}: malformed bundle: history.layer_grad_norm is not steps x layers")


def dumps(meta: Mapping[str, Any]) -> bytes:
    """``bundle.json``'s bytes for ``meta``, as :func:`write` makes them."""
    return _json(meta)
