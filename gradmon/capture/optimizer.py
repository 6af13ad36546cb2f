"""What the optimizer did at a step, read from its own state after ``step()``.

The post-step hook sees ``w_t`` (the parameter), ``p.grad`` (still there: ``zero_grad``
comes later, and it is the gradient the optimizer consumed: after any clipping, already
unscaled by a GradScaler) and the optimizer's state. From them, with no copy of the
parameters kept from before the step, it rebuilds the update the optimizer intended.
Every rule gradmon knows is of one form::

    w_t = w_{t-1} * (1 - lr*c) - lr*A

with ``A`` computable from the state and the gradient alone and ``c`` the weight decay
that the step applied to ``w_{t-1}`` outside the state (AdamW's decoupled decay, SGD's
decay when no momentum buffer holds it). So ``(1 - lr*c) * w_{t-1} = w_t + lr*A`` and
``Δw = -lr * (A + c*w_{t-1})``. It is the intended update in at least float32: a bf16
parameter's applied update differs from it by the rounding of ``w_t``.

Everything stays on the device: ``lr``, ``step`` and the betas may be tensors
(capturable, fused or tensor-lr optimizers) and are used as tensors, never read. The
math runs as multi-tensor (``torch._foreach_*``) kernels over batches of parameters;
large parameters are cut into pieces so that a batch's temporaries stay within
:data:`CHUNK_BYTES`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from . import kernels as stats

log = logging.getLogger("gradmon")

CHUNK_BYTES = 64 * 2 ** 20
"""Most bytes of float32 temporaries alive at once while reading one batch."""
_TEMPORARIES = 5  # float32 pieces alive at once in _adam_sums (at most)
_COLUMNS = 4  # a row of sums: Σ(Δw)², Σw², Σ g'²/max(v̂, ε²), Σ v̂/ε² (the last two 0 for SGD)
CHUNK = min(CHUNK_BYTES // (4 * _TEMPORARIES), 2 ** 20)
"""Most elements of one batch. Smaller than the memory cap allows: the passes over a
batch of 4 MB pieces find it still in the CPU's cache (against larger batches:
docs/benchmark.md, "Kernel choices")."""

#: Optimizers whose update gradmon can rebuild, by exact type: a subclass may change
#: the rule, and a wrong ratio is worse than a layer counted as uncovered.
SUPPORTED: Tuple[type, ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

Rows = Tuple[torch.Tensor, Tuple[int, ...]]


@dataclass(frozen=True)
class Reading:
    """One step of one optimizer, for the parameters it read. ``update`` rows are
    (‖Δw‖, ‖w_{t-1}‖); ``adam`` rows are sqrt(Σ g'²/max(v̂, ε²)) and ``eps`` rows
    sqrt(Σ v̂/ε²) (Adam family only). Rows are ``(tensor (n, width) on home, parameter
    positions)`` as the hooks' batched records are; None: no parameter read."""

    update: Optional[Rows]
    adam: Optional[Rows]
    eps: Optional[Rows] = None


def supported(opt: torch.optim.Optimizer) -> bool:
    return type(opt) in SUPPORTED


SMALL = 4096
"""A parameter read whole with at most this many elements (a bias, a norm's weight) is
zero-padded into one block with the others, so that a model's dozens of them cost a few
kernels rather than a few each: zeros add nothing to any sum here."""


@dataclass
class _Batch:
    """Pieces of parameters of one param group (and one step count) read together:
    ``sampled`` pieces (a (runs, RUN) view of each tensor the rule needs, for a parameter
    above the sample size), ``small`` ones (a whole parameter of at most :data:`SMALL`
    elements) and ``whole`` ones (a flat view of a parameter, or of a chunk of it).
    Step counts on a device cannot be compared without a sync: such parameters are read
    together all the same, ``step`` None and each one's count in ``steps``."""

    group: Dict[str, Any]
    step: Any
    names: Tuple[str, ...]
    sampled: List[Tuple[int, float, Dict[str, torch.Tensor]]] = field(default_factory=list)
    """(position in ``params``, numel over elements read, views) of each sampled piece."""
    small: List[Tuple[int, Dict[str, torch.Tensor]]] = field(default_factory=list)
    whole: List[Tuple[int, Dict[str, torch.Tensor]]] = field(default_factory=list)
    numel: int = 0
    steps: Dict[int, torch.Tensor] = field(default_factory=dict)
    """Each parameter's step count on the device, by position in ``params`` (else empty)."""

    @property
    def owners(self) -> List[int]:
        """Position in ``params`` of each piece, in the order of the rows of :meth:`tensors`."""
        return [j for j, _, _ in self.sampled] + [j for j, _ in self.small] + [j for j, _ in self.whole]

    def step_pieces(self) -> List[torch.Tensor]:
        """The device step counts as the pieces of :meth:`tensors` are laid out, in float64:
        an (n, 1) column for a block of n parameters' rows, a 0-d tensor for a whole piece."""
        out = [torch.stack([self.steps[j] for j in rows]).double().reshape(-1, 1)
               for rows in ([j for j, _, _ in self.sampled], [j for j, _ in self.small]) if rows]
        return out + [self.steps[j].double() for j, _ in self.whole]

    @property
    def weights(self) -> Optional[List[float]]:
        """What each piece's sums are multiplied by to stand for its whole parameter
        (None: every piece is read element for element)."""
        if not self.sampled:
            return None
        return [w for _, w, _ in self.sampled] + [1.0] * (len(self.small) + len(self.whole))

    def tensors(self) -> Dict[str, List[torch.Tensor]]:
        """Each tensor name's pieces, at least float32: the sampled ones gathered into one
        (n, sample) block and the small ones padded into one (n, longest) float64 block (one
        copy per name each), then the whole ones flat. Every row of a block is one piece."""
        out: Dict[str, List[torch.Tensor]] = {}
        for name in self.names:
            pieces: List[torch.Tensor] = []
            if self.sampled:
                block = torch.cat([_up(views[name]) for _, _, views in self.sampled])
                pieces.append(block.reshape(len(self.sampled), -1))
            if self.small:
                # in float64: a bias at 0 before the step (the usual init) has its ‖w_{t-1}‖²
                # rebuilt by sums that cancel (see _update_sums), beyond float32 in a batched product
                pieces.append(stats.padded_rows([views[name] for _, views in self.small], torch.float64))
            out[name] = pieces + [_up(views[name]) for _, views in self.whole]
        return out


def read(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], home: torch.device,
         sample: int = 0) -> Reading:
    """Sums of squares of the update and of the weights before it, per parameter of
    ``params`` that ``opt`` steps, has a dense real gradient and a readable state.
    A parameter of more than ``sample`` elements (``sample`` > 0) is read through a
    sample of at most ``sample`` elements (:func:`stats.sample_runs`), its sums scaled
    up to its size."""
    with torch.no_grad():  # views of parameters must not build autograd nodes
        return _read(opt, params, home, sample)


Batched = Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]
"""A statistic's (n, width) rows, with the parameter and the numel of each row (``writer.Batched``)."""


class Reads:
    """What the optimizer did, read after the step for each statistic recorded at the
    optimizer (``statistics.OPTIMIZER``); says once per kind of optimizer that it cannot."""

    def __init__(self, sample: int) -> None:
        self.sample = sample
        self._unread: set = set()  # kinds of optimizer already said to be unreadable

    def rows(self, opt: torch.optim.Optimizer, params: Sequence[Optional[torch.Tensor]], sharded: bool,
             statistics: Sequence[Any]) -> Dict[str, Batched]:
        """Each statistic's rows, by name, for the ``params`` (None: gone) that have a gradient."""
        if sharded or not supported(opt):
            self._say_unread_once(opt, sharded)
            return {}
        present: List[int] = []
        stepped: List[torch.Tensor] = []
        for i, p in enumerate(params):
            if p is not None and p.grad is not None:
                present.append(i)
                stepped.append(p)
        if not stepped:
            return {}
        reading = read(opt, stepped, stepped[0].grad.device, self.sample)
        out: Dict[str, Batched] = {}
        for st in statistics:
            made = st.record(reading)
            if made is not None:
                rows, order = made
                out[st.name] = (rows, tuple(present[j] for j in order), tuple(stepped[j].numel() for j in order))
        return out

    def _say_unread_once(self, opt: torch.optim.Optimizer, sharded: bool) -> None:
        what = type(opt).__name__ + (" under FSDP" if sharded else "")
        if what in self._unread:
            return
        self._unread.add(what)
        log.warning("gradmon: cannot read the update of %s (gradmon reads torch.optim.SGD, Adam and AdamW, not "
                    "under FSDP); its layers are counted in gradmon_uncovered_layers{family=\"optimizer\"} and have "
                    "no gradmon_update_to_weight_ratio or gradmon_adam_rms", what)


def step_count(opt: torch.optim.Optimizer) -> Optional[int]:
    """The optimizer's own step count (Adam & co.), read without a device sync. The first
    parameter with any state decides: an optimizer keeps the same keys for each (SGD keeps
    no step, and with no momentum no state at all), so the search is not a loop over every
    parameter at every step."""
    if not opt.state:
        return None
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            if "step" not in state:
                return None
            value = state["step"]
            if isinstance(value, (int, float)):
                return int(value)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                return int(value.tolist())  # tolist reads CPU memory, no dispatch, no sync
            return None  # capturable/fused state lives on the device: reading it would sync
    return None


def _read(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], home: torch.device, sample: int) -> Reading:
    is_adam = isinstance(opt, torch.optim.Adam)
    batches = _batches(opt, params, is_adam, sample)
    pieces: List[torch.Tensor] = []
    owners: List[int] = []
    for batch in batches:
        rows = (_adam_sums if is_adam else _sgd_sums)(batch, batch.tensors())
        weights = batch.weights
        if weights is not None:
            rows = rows * stats.host_values(weights, rows.device, rows.dtype).unsqueeze(1)
        pieces.append(rows.to(home, non_blocking=True))
        owners += batch.owners
    if not pieces:
        return Reading(None, None, None)
    read_at = sorted(set(owners))
    slot = {j: k for k, j in enumerate(read_at)}
    index = stats.host_values([slot[j] for j in owners], home)
    sums = torch.zeros(len(read_at), _COLUMNS, dtype=torch.float64, device=home)
    sums.index_add_(0, index, torch.cat(pieces).double())
    norms = sums.sqrt()
    at = tuple(read_at)
    if not is_adam:
        return Reading((norms[:, :2], at), None, None)
    return Reading((norms[:, :2], at), (norms[:, 2:3], at), (norms[:, 3:], at))


def _batches(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], is_adam: bool, sample: int
             ) -> List[_Batch]:
    group_of = {id(p): (k, g) for k, g in enumerate(opt.param_groups) for p in g["params"]}
    open_: Dict[Hashable, _Batch] = {}
    done: List[_Batch] = []

    def batch_for(key: Hashable, group: Dict[str, Any], step: Any, names: Tuple[str, ...], size: int,
                  j: int, counted: Optional[torch.Tensor]) -> _Batch:
        batch = open_.get(key)
        if batch is None or batch.numel + size > CHUNK:
            if batch is not None:
                done.append(batch)
            batch = open_[key] = _Batch(group, step, names)
        batch.numel += size
        if counted is not None:
            batch.steps[j] = counted
        return batch

    for j, p in enumerate(params):
        found = group_of.get(id(p))
        g = p.grad
        if found is None or g is None or g.is_sparse or p.is_complex():
            continue
        k, group = found
        state = opt.state.get(p, {})
        tensors = _adam_tensors(group, state, p, g) if is_adam else _sgd_tensors(group, state, p, g)
        if tensors is None:
            continue
        step = _host_step(state["step"]) if is_adam else None
        on_device = isinstance(step, torch.Tensor)  # its value unknown here: one batch for all such
        key = (k, "device" if on_device else step, p.device, torch.promote_types(p.dtype, torch.float32),
               tuple(tensors))
        counted, step = (step, None) if on_device else (None, step)
        numel = p.numel()
        if 0 < sample < numel:
            runs, step_ = stats.sample_runs(tuple(p.shape), numel, sample)
            batch = batch_for(key, group, step, tuple(tensors), runs * stats.RUN, j, counted)
            # a contiguous tensor is strided over as it is (a reshape first is a call per tensor)
            views = {name: (t if t.is_contiguous() else t.reshape(-1)).as_strided((runs, stats.RUN), (step_, 1))
                     for name, t in tensors.items()}
            batch.sampled.append((j, numel / (runs * stats.RUN), views))
            continue
        if numel <= SMALL:  # read flat where they are padded into one block: no view made per tensor
            batch_for(key, group, step, tuple(tensors), SMALL, j, counted).small.append((j, tensors))
            continue
        # a view where the memory is contiguous; a copy otherwise (channels_last weights
        # and their state flatten in the same element order, so the pieces still match).
        # A vector is already flat: a model's dozens of biases and norm weights would
        # otherwise cost a reshape call each (docs/benchmark.md, "Kernel choices")
        flat = {name: t if t.dim() == 1 else t.reshape(-1) for name, t in tensors.items()}
        for start in range(0, numel, CHUNK):
            size = min(CHUNK, numel - start)
            batch = batch_for(key, group, step, tuple(tensors), size, j, counted)
            batch.whole.append((j, {name: t[start:start + size] for name, t in flat.items()}))
    return done + list(open_.values())


def _up(t: torch.Tensor) -> torch.Tensor:
    """A piece in float32 at least (bf16/fp16 weights, state and gradients are widened)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _host_step(step: Any) -> Any:
    """A step count in host memory as a number (reading CPU memory waits for nothing);
    on a device it stays a tensor and the bias corrections are computed there."""
    if isinstance(step, torch.Tensor) and step.device.type == "cpu":
        return float(step.tolist())
    return step


def _nonzero(c: Any) -> bool:
    # a Python number is decided on the host; a tensor decay is always applied (reading it would sync)
    return isinstance(c, torch.Tensor) or c != 0


def _axpy(x: List[torch.Tensor], y: List[torch.Tensor], alpha: Any) -> List[torch.Tensor]:
    """x + alpha·y: one pass over memory when alpha is a number, two for a tensor; a list
    gives each piece its own alpha."""
    if isinstance(alpha, list):
        return [xi + yi * ai for xi, yi, ai in zip(x, y, alpha)]
    if isinstance(alpha, torch.Tensor):
        out = torch._foreach_mul(y, alpha)
        torch._foreach_add_(out, x)
        return out
    return torch._foreach_add(x, y, alpha=alpha)


def _update_sums(a: List[torch.Tensor], w: List[torch.Tensor], lr: Any, c: Any, k: Any = 1.0
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(Σ Δw², Σ w_{t-1}²) per piece, for A = k·a. Each element-wise pass costs about
    what the optimizer's own step costs on a CPU, so nothing of size n is written here:
    with P = (1 - lr·c)·w_{t-1} = w + lr·k·a, ‖P‖² and ‖a + c'·P‖² expand into ‖w‖²,
    ‖a‖² and ⟨w, a⟩. The cross terms are small beside the leading one (lr·k·‖a‖ is far
    below ‖w‖; the decay c'·P far below a unless Adam's step is near zero), so their
    float32 rounding barely reaches the result; a negative from rounding is clamped (both sums)."""
    shrink = 1 - lr * c
    alpha = lr * k
    ww = _dots(w, w)
    aa = _dots(a, a)
    wa = _dots(w, a)
    # ‖P‖²; exactly 0 for a weight that was 0 before the step (a bias at init), where
    # rounding of the expansion may land on either side of 0
    pp = (ww + 2 * alpha * wa + alpha * alpha * aa).clamp_min(0)
    if _nonzero(c):
        cp = c / (k * shrink)  # A + c·w_{t-1} = k·(a + cp·P)
        step = aa + 2 * cp * (wa + alpha * aa) + cp * cp * pp
    else:
        step = aa
    return step.clamp_min(0) * (alpha * alpha), pp / (shrink * shrink)


def _dots(x: List[torch.Tensor], y: List[torch.Tensor]) -> torch.Tensor:
    """Σ x·y of each piece, in float64, one value per row of a 2-D block and per flat
    piece (a dot product: on the CPU as fast as the norm kernel or faster). ``vecdot``
    takes a block's rows at once, faster on the CPU than a batched matrix product
    (docs/benchmark.md, "Kernel choices")."""
    out = [torch.linalg.vecdot(a, b) if a.dim() == 2 else torch.dot(a, b).reshape(1) for a, b in zip(x, y)]
    return (torch.cat(out) if len(out) > 1 else out[0]).double()


def _sgd_tensors(group: Dict[str, Any], state: Dict[str, Any], p: torch.Tensor, g: torch.Tensor
                 ) -> Optional[Dict[str, torch.Tensor]]:
    if group.get("momentum", 0) == 0:
        return {"w": p, "g": g}
    buf = state.get("momentum_buffer")
    return {"w": p, "g": g, "buf": buf} if buf is not None else None


def _sgd_sums(batch: _Batch, t: Dict[str, List[torch.Tensor]]) -> torch.Tensor:
    """torch.optim.SGD: g' = ±g + wd·w_{t-1}; plain: Δw = -lr·g' (A = ±g, c = wd);
    momentum: -lr·buf_t, which holds the decay (A = buf_t, c = 0); Nesterov:
    -lr·(g' + μ·buf_t) (A = ±g + μ·buf_t, c = wd)."""
    group = batch.group
    momentum, wd = group.get("momentum", 0), group.get("weight_decay", 0)
    sign = -1.0 if group.get("maximize", False) else 1.0
    if momentum == 0:
        a, c, k = t["g"], wd, sign
    elif group.get("nesterov", False):
        a, c, k = torch._foreach_add(t["g"], t["buf"], alpha=sign * momentum), wd, sign
    else:
        a, c, k = t["buf"], 0, 1.0
    moved, weight = _update_sums(a, t["w"], group["lr"], c, k)
    return torch.stack((moved, weight) + (torch.zeros_like(moved),) * (_COLUMNS - 2), dim=1)


def _adam_tensors(group: Dict[str, Any], state: Dict[str, Any], p: torch.Tensor, g: torch.Tensor
                  ) -> Optional[Dict[str, torch.Tensor]]:
    if "exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state:
        return None
    out = {"w": p, "g": g, "m": state["exp_avg"], "v2": state["exp_avg_sq"]}
    if group.get("amsgrad", False):
        out["v"] = state["max_exp_avg_sq"]
    return out


def _device_corrections(steps: List[torch.Tensor], beta1: Any, beta2: Any, eps: float, v2: List[torch.Tensor],
                        root: List[torch.Tensor]) -> Tuple[List[torch.Tensor], float, List[torch.Tensor],
                                                           List[torch.Tensor], torch.Tensor, torch.Tensor]:
    """:func:`_adam_sums`' bias-corrected terms where the step counts (or the betas) live on
    the device and are never read: (floor = max(√v̂, ε) per piece, its scale 1, ε√bc2 per
    piece, k = √bc2/bc1 per piece, k and bc2 for each row of :func:`_dots`). Each piece has its own
    corrections (an (n, 1) column for a block's rows), computed in float64 and applied in the
    piece's own dtype, as a number would be; with no tensor clamp bound, one more pass."""
    bc1 = [1 - beta1 ** s for s in steps]
    bc2 = [1 - beta2 ** s for s in steps]
    floor = [v / b.to(v.dtype) for v, b in zip(v2, bc2)]
    torch._foreach_clamp_min_(floor, eps * eps)
    torch._foreach_sqrt_(floor)
    shift = [(eps * b.sqrt()).to(r.dtype) for b, r in zip(bc2, root)]
    k = [b2.sqrt() / b1 for b1, b2 in zip(bc1, bc2)]
    return floor, 1.0, shift, k, _by_row(k, root), _by_row(bc2, root)


def _by_row(values: List[torch.Tensor], root: List[torch.Tensor]) -> torch.Tensor:
    """One value per piece spread over the piece's rows of :func:`_dots` (a 2-D block's
    rows, or a flat piece's one)."""
    return torch.cat([x.reshape(-1).expand(r.shape[0] if r.dim() == 2 else 1) for x, r in zip(values, root)])


def _adam_sums(batch: _Batch, t: Dict[str, List[torch.Tensor]]) -> torch.Tensor:
    """torch.optim.Adam/AdamW: A = m̂/(√v̂+ε) with v the max_exp_avg_sq under amsgrad
    (m already holds maximize's sign); c = wd when the decay is decoupled. The third
    column is Σ g'²/max(v̂, ε²) with v̂ from exp_avg_sq and g' = ±g (+ wd·w_{t-1} for
    Adam's L2 decay): its RMS is bounded by about (1-β2)^(-1/2)."""
    group, step = batch.group, batch.step
    beta1, beta2 = group["betas"]
    eps, wd = group["eps"], group.get("weight_decay", 0)
    decoupled = group.get("decoupled_weight_decay", False)
    lr, maximize = group["lr"], group.get("maximize", False)
    # The bias corrections stay out of the element-wise passes: m̂/(√v̂+ε) = k·m/(√v+ε√bc2)
    # with k = √bc2/bc1, and g'²/max(v̂, ε²) = bc2·(g'/max(√v, ε√bc2))².
    root = torch._foreach_sqrt(t["v2"])
    second = _dots(root, root)  # Σ v, before root changes
    if batch.steps or isinstance(beta2, torch.Tensor):
        steps = batch.step_pieces() if batch.steps else [step] * len(root)
        floor, scale, shift, k, k_rows, bc2_rows = _device_corrections(steps, beta1, beta2, eps, t["v2"], root)
    else:
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
        floor, scale = torch._foreach_clamp_min(root, eps * bc2 ** 0.5), bc2
        shift = eps * bc2 ** 0.5
        k = k_rows = bc2 ** 0.5 / bc1
        bc2_rows = bc2
    # Σ v̂/ε² (v̂ = v/bc2): the layer's gradient scale as Adam sees it, in units of its ε
    over_eps = second / (bc2_rows * eps * eps) if eps > 0 else torch.full_like(second, math.inf)
    if "v" in t:
        root = torch._foreach_sqrt(t["v"])  # amsgrad steps with max_exp_avg_sq
    if isinstance(shift, list):
        root = [r + x for r, x in zip(root, shift)]
    else:
        torch._foreach_add_(root, shift)
    a = torch._foreach_div(t["m"], root)
    del root
    moved, weight = _update_sums(a, t["w"], lr, wd if decoupled else 0, k_rows)
    if not decoupled and _nonzero(wd):
        # Adam's L2 decay: g' = ±g + wd·w_{t-1}, which needs A first
        alpha = [(lr * x).to(w.dtype) for x, w in zip(k, t["w"])] if isinstance(k, list) else lr * k
        prev = _axpy(t["w"], a, alpha)  # c = 0: this is w_{t-1}
        consumed = _axpy(t["g"], prev, -wd if maximize else wd)  # ±g' (sign squared away)
    else:
        consumed = t["g"]  # its sign (maximize) does not change its square
    q = torch._foreach_div(consumed, floor)
    return torch.stack((moved, weight, _dots(q, q) * scale, over_eps), dim=1)
