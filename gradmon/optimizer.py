"""What the optimizer did at a step, read from its own state after ``step()``.

The post-step hook sees ``w_t`` (the parameter), ``p.grad`` (still there: ``zero_grad``
comes later, and it is the gradient the optimizer consumed: after any clipping, already
unscaled by a GradScaler) and the optimizer's state. From them, with no copy of the
parameters kept from before the step, it rebuilds the update the optimizer intended.
Every rule gradmon knows is of one form::

    w_t = w_{t-1} * (1 - lr*c) - lr*A

with ``A`` computable from the state and the gradient alone and ``c`` the weight decay
that the step applied to ``w_{t-1}`` outside the state (AdamW's decoupled decay, SGD's
decay when no momentum buffer holds it). So ``w_{t-1} = (w_t + lr*A) / (1 - lr*c)`` and
``Δw = -lr * (A + c*w_{t-1})``. It is the intended update in at least float32: a bf16
parameter's applied update differs from it by the rounding of ``w_t``.

Everything stays on the device: ``lr``, ``step`` and the betas may be tensors
(capturable, fused or tensor-lr optimizers) and are used as tensors, never read. Large
parameters are walked in chunks so that the temporaries of one chunk stay within
:data:`CHUNK_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch

CHUNK_BYTES = 64 * 2 ** 20
"""Most bytes of float32 temporaries alive at once while reading one parameter."""
_TEMPORARIES = 4  # float32 chunks alive at once in _sums (A, w_{t-1}, update, ratio)
CHUNK = CHUNK_BYTES // (4 * _TEMPORARIES)

#: Optimizers whose update gradmon can rebuild, by exact type: a subclass may change
#: the rule, and a wrong ratio is worse than a layer counted as uncovered.
SUPPORTED: Tuple[type, ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

Rows = Tuple[torch.Tensor, Tuple[int, ...]]


@dataclass(frozen=True)
class Reading:
    """One step of one optimizer, for the parameters it read. ``update`` rows are
    (‖Δw‖, ‖w_{t-1}‖); ``adam`` rows are sqrt(Σ g'²/max(v̂, ε²)) (Adam family only).
    Rows are ``(tensor (n, width) on home, parameter positions)`` as the hooks' batched
    records are; None: no parameter read."""

    update: Optional[Rows]
    adam: Optional[Rows]


def supported(opt: torch.optim.Optimizer) -> bool:
    return type(opt) in SUPPORTED


def read(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], home: torch.device) -> Reading:
    """Sums of squares of the update and of the weights before it, per parameter of
    ``params`` that ``opt`` steps, has a dense real gradient and a readable state."""
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    update: List[torch.Tensor] = []
    update_at: List[int] = []
    adam: List[torch.Tensor] = []
    adam_at: List[int] = []
    is_adam = isinstance(opt, torch.optim.Adam)
    for j, p in enumerate(params):
        group = group_of.get(id(p))
        g = p.grad
        if group is None or g is None or g.is_sparse or p.is_complex():
            continue
        state = opt.state.get(p, {})
        rule = _adam(group, state, g) if is_adam else _sgd(group, state, g)
        if rule is None:
            continue
        sums = _sums(p.detach(), group["lr"], *rule)
        update.append(sums[:2].sqrt().to(home, non_blocking=True))
        update_at.append(j)
        if rule[2] is not None:
            adam.append(sums[2:].sqrt().to(home, non_blocking=True))
            adam_at.append(j)
    return Reading(_rows(update, update_at), _rows(adam, adam_at))


def _rows(rows: List[torch.Tensor], at: List[int]) -> Optional[Rows]:
    return (torch.stack(rows), tuple(at)) if rows else None


Direction = Callable[[slice], torch.Tensor]
"""A over an element range of the flattened parameter, in float32 at least."""
Ratio = Callable[[slice, torch.Tensor], torch.Tensor]
"""Adam's g'²/max(v̂, ε²) over an element range, given w_{t-1} over it."""


def _sums(w: torch.Tensor, lr: Any, c: Any, direction: Direction, ratio: Optional[Ratio]) -> torch.Tensor:
    """[Σ Δw², Σ w_{t-1}², Σ ratio] as a float64 tensor on w's device. Δw/lr is what the
    chunks sum: lr² multiplies it once at the end (a tensor lr stays a tensor)."""
    flat = w.reshape(-1)
    acc = torch.zeros(3, dtype=torch.float64, device=w.device)
    for start in range(0, flat.numel(), CHUNK):
        sl = slice(start, start + CHUNK)
        a = direction(sl)
        prev = (_up(flat[sl]) + lr * a) / (1 - lr * c) if _nonzero(c) else _up(flat[sl]) + lr * a
        step = a + c * prev if _nonzero(c) else a
        acc[0] += step.square().sum(dtype=torch.float64)
        acc[1] += prev.square().sum(dtype=torch.float64)
        if ratio is not None:
            acc[2] += ratio(sl, prev).sum(dtype=torch.float64)
    return torch.stack((acc[0] * (lr * lr), acc[1], acc[2]))


def _nonzero(c: Any) -> bool:
    # a Python number is decided on the host; a tensor decay is always applied (reading it would sync)
    return isinstance(c, torch.Tensor) or c != 0


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _up(t: torch.Tensor) -> torch.Tensor:
    """A chunk in float32 at least (bf16/fp16 state and gradients are widened)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _sgd(group: Mapping[str, Any], state: Mapping[str, Any], g: torch.Tensor
         ) -> Optional[Tuple[Any, Direction, None]]:
    """(c, A, no ratio) of torch.optim.SGD: g' = ±g + wd·w_{t-1}; plain: Δw = -lr·g';
    momentum: -lr·buf_t (buf_t holds the decay); Nesterov: -lr·(g' + μ·buf_t)."""
    sign = -1.0 if group.get("maximize", False) else 1.0
    momentum, wd = group.get("momentum", 0), group.get("weight_decay", 0)
    grad = _flat(g)
    if momentum == 0:
        return wd, lambda sl: sign * _up(grad[sl]), None
    buf = state.get("momentum_buffer")
    if buf is None:
        return None
    buf = _flat(buf)
    if group.get("nesterov", False):
        return wd, lambda sl: sign * _up(grad[sl]) + momentum * _up(buf[sl]), None
    return 0, lambda sl: _up(buf[sl]), None


def _adam(group: Mapping[str, Any], state: Mapping[str, Any], g: torch.Tensor
          ) -> Optional[Tuple[Any, Direction, Ratio]]:
    """(c, A, ratio) of torch.optim.Adam/AdamW: A = m̂/(√v̂+ε) with v the max_exp_avg_sq
    under amsgrad (m already holds maximize's sign); c = wd when the decay is decoupled.
    The ratio is g'²/max(v̂, ε²) with v̂ from exp_avg_sq, g' = ±g (+ wd·w_{t-1} for
    Adam's L2 decay): the RMS of it is bounded by about (1-β2)^(-1/2)."""
    if "exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state:
        return None
    beta1, beta2 = group["betas"]
    eps, wd = group["eps"], group.get("weight_decay", 0)
    decoupled = group.get("decoupled_weight_decay", False)
    step = _host_step(state["step"])
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    m, v2 = _flat(state["exp_avg"]), _flat(state["exp_avg_sq"])
    v = _flat(state["max_exp_avg_sq"]) if group.get("amsgrad", False) else v2
    sign = -1.0 if group.get("maximize", False) else 1.0
    grad = _flat(g)

    def direction(sl: slice) -> torch.Tensor:
        return (_up(m[sl]) / bc1) / ((_up(v[sl]) / bc2).sqrt() + eps)

    def ratio(sl: slice, prev: torch.Tensor) -> torch.Tensor:
        consumed = sign * _up(grad[sl])
        if not decoupled and _nonzero(wd):
            consumed = consumed + wd * prev
        return consumed.square() / (_up(v2[sl]) / bc2).clamp_min(eps * eps)

    return (wd if decoupled else 0), direction, ratio


def _host_step(step: Any) -> Any:
    """A step count in host memory as a number (reading CPU memory waits for nothing);
    on a device it stays a tensor and the bias corrections are computed there."""
    if isinstance(step, torch.Tensor) and step.device.type == "cpu":
        return float(step.tolist())
    return step
