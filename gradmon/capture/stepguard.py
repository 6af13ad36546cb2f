"""The step guard (``guard=``): skip an optimizer step whose gradients are non-finite, the
same way on every rank, and say so.

The verdict is made on the device from what the hooks measured anyway (the gradients' NaN
and Inf counts, one small reduction), so the guard adds no pass over the gradients. At the
optimizer's step (its pre-hook, every owned optimizer):

* every rank's verdict is combined by one scalar all-reduce (MAX) over the groups that
  replicate or shard the model, so that every replica skips the same steps and stays
  identical; the code MAX keeps is the most serious reason (:data:`CODES`);
* a run of more than ``max_skips`` consecutive bad steps is no longer skipped (the run is
  then failed, or the step raises: ``guard_on_persist``), counted on the device too;
* an optimizer that unscales itself (torch's fused Adam, AdamW and SGD: those with
  ``_step_supports_amp_scaling``) gets the verdict as its ``found_inf``, the flag a
  GradScaler hands it: the fused kernel applies nothing and takes its step count back,
  and nothing is read on the host. A GradScaler's own flag is kept (the larger of the
  two) and put back after the step, so the scaler's bookkeeping never sees the guard's;
* any other optimizer cannot be stopped from a pre-hook, so the verdict is read on the
  host (one read per step, the price a GradScaler pays for the same decision) and, on a
  skip, the optimizer finds no gradient: every ``.grad`` it steps is set to None for the
  step and put back after it. Every torch.optim optimizer leaves a parameter without a
  gradient, and its state, untouched; this holds from the very first step, with or
  without a trainer, without wrapping anything.

A step with a closure (``opt.step(closure)``, as Lightning's automatic optimization steps)
runs its backward inside ``step()``, after the pre-hook: the decision waits for that
backward's measurement, and is applied then, before the optimizer updates anything.

A GradScaler's overflow skip comes first: the scaler never calls ``step()`` (or hands a
fused optimizer its own flag, which the packet keeps apart), so it is not counted twice,
and a guard skip never reaches the scaler's ``update()``: the loss scale does not shrink.
The learning-rate scheduler still advances: it is the training loop's, not the optimizer's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import metrics as M
from .. import robust
from .. import statistics as S
from . import sharded

NONFINITE, SPIKE = M.GUARD_NONFINITE, M.GUARD_SPIKE
MODES: Tuple[str, ...] = M.GUARD_REASONS
CODES = S.GUARD_CODES
ON_PERSIST: Tuple[str, ...] = ("fail", "raise")


def modes(text: str) -> FrozenSet[str]:
    """``guard``'s text as a set of modes ("" or "off": none); ValueError on an unknown one."""
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    if parts == ["off"]:
        return frozenset()
    unknown = sorted(set(parts) - set(MODES))
    if unknown:
        raise ValueError(f"takes a comma-separated list of {', '.join(MODES)} (or \"off\"), got {unknown}")
    return frozenset(parts)


def takes_found_inf(opt: torch.optim.Optimizer) -> bool:
    """The optimizer skips its own update on a ``found_inf`` flag (torch's fused kernels)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


class GuardPersisted(RuntimeError):
    """``guard_on_persist="raise"``: more consecutive steps were bad than ``guard_max_skips``."""


class StepGuard:
    """One monitor's guard on the training thread: this step's verdict, the run of bad
    steps (both device tensors), and what it changed on an optimizer for its step."""

    def __init__(self, wanted: FrozenSet[str], max_skips: int, on_persist: str = "fail",
                 groups: Sequence[Any] = (), spike_z: float = 6.0, spike_window: int = 128) -> None:
        self.wanted = wanted
        self.windows = {signal: SpikeWindow(spike_window, spike_z) for signal in (M.SIGNAL_LOSS, M.SIGNAL_GRAD_NORM)
                        } if SPIKE in wanted else {}
        self._lrs: Tuple[Optional[float], ...] = ()
        self.max_skips = max_skips
        self.on_persist = on_persist
        self.groups = tuple(groups)
        """Process groups the verdict is agreed over (empty: a single process)."""
        self.syncs = 0
        """Host reads of a verdict so far (unfused optimizers only)."""
        self._local: Optional[torch.Tensor] = None  # this rank's code for the step being measured
        self._code: Optional[torch.Tensor] = None  # the agreed code of the step, once decided
        self._skip: Optional[torch.Tensor] = None  # 1.0: the step is skipped
        self._run: Optional[torch.Tensor] = None  # consecutive bad steps, including this one
        self._hidden: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its gradient) hidden for the step
        self._installed: Optional[Tuple[Any, Optional[torch.Tensor], torch.Tensor]] = None
        self.skipped_on_host = False  # the host read said: this step was skipped
        self._deferred: Optional[torch.optim.Optimizer] = None  # stepping with a closure, its backward to come
        self._deferred_measured = False  # ... and that backward has measured
        self.persisted = False  # the publisher saw a run past max_skips (a fused optimizer's, read nowhere else)

    # -- at each measurement -----------------------------------------------------------

    def measured(self, signals: "StepSignals") -> None:
        """The gradients were measured (again): this rank's verdict, from their NaN and Inf
        counts (nothing measured: nothing to fault)."""
        self._code = self._skip = None
        self.skipped_on_host = False
        bad = signals.nonfinite() if NONFINITE in self.wanted else None
        self._local = bad.float() * CODES[NONFINITE] if bad is not None else None  # a spike is scored at the step
        self._deferred_measured = self._deferred is not None

    def defer(self, opt: torch.optim.Optimizer) -> None:
        """``opt.step(closure)``: the gradients to judge come from the closure's backward,
        inside the step; the decision waits for it (the recorder calls :meth:`before_step`
        when it has measured, before the optimizer updates anything)."""
        self._deferred, self._deferred_measured = opt, False

    def deferred_measured(self) -> bool:
        return self._deferred is not None and self._deferred_measured

    def take_deferred(self) -> Optional[torch.optim.Optimizer]:
        opt, self._deferred, self._deferred_measured = self._deferred, None, False
        return opt

    # -- at the optimizer's step ---------------------------------------------------------

    def before_step(self, opt: torch.optim.Optimizer, signals: "StepSignals") -> None:
        """Decide the step once (every rank, every step: the collective must not be skipped
        on one rank) and apply the decision to ``opt``."""
        fused = takes_found_inf(opt)
        theirs = self._scalers_flag(opt) if fused else None
        if self._skip is None:
            if self.windows:
                self._score_spikes(opt, signals.spiking())
            self._decide(signals.home, theirs)
        if fused:
            self._install_found_inf(opt, theirs)
        else:
            self._hide_if_skipped(opt)

    def _scalers_flag(self, opt: torch.optim.Optimizer) -> Optional[torch.Tensor]:
        """The ``found_inf`` a GradScaler handed ``opt`` for this step, if any."""
        theirs = getattr(opt, "found_inf", None)
        if self._installed is not None and theirs is self._installed[2]:
            theirs = self._installed[1]  # ours, left by a step that raised: not a scaler's
        return theirs if isinstance(theirs, torch.Tensor) else None

    def _score_spikes(self, opt: torch.optim.Optimizer, signals: Mapping[str, Optional[torch.Tensor]]) -> None:
        """``spike``: this step's scores on the device; a spike adds its code to the local
        verdict. The windows restart where the publisher's do on a learning-rate jump."""
        lrs = S.host_learning_rates([group.get("lr") for group in opt.param_groups])
        if len(lrs) == len(self._lrs) and any(a is not None and b is not None and robust.lr_jumped(a, b)
                                              for a, b in zip(self._lrs, lrs)):
            for window in self.windows.values():
                window.restart()
        self._lrs = lrs
        spiked: Optional[torch.Tensor] = None
        for signal, window in self.windows.items():
            value = signals.get(signal)
            if value is not None:
                spike = window.push(value)
                spiked = spike if spiked is None else spiked | spike.to(spiked.device)
        if spiked is None:
            return
        code = spiked.float() * CODES[SPIKE]
        self._local = code if self._local is None else torch.maximum(self._local, code.to(self._local.device))

    def _decide(self, home: Callable[[], torch.device], scalers: Optional[torch.Tensor]) -> None:
        local = self._local
        code = local.reshape(1).clone() if local is not None else torch.zeros(1, device=home())
        if self.groups:
            import torch.distributed as dist
            for group in self.groups:
                # on NCCL, wait() orders the current stream after the collective; the host waits for nothing
                dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        code = code.reshape(())
        bad = (code > 0).float()
        if scalers is not None:  # the scaler skips this step itself: its overflow is not the guard's
            bad = bad * (scalers.to(bad.device).reshape(()) == 0).float()
        run = self._run.to(code.device) if self._run is not None else torch.zeros((), device=code.device)
        self._run = (run + 1) * bad
        self._skip = bad * (self._run <= self.max_skips).float()
        self._code = code * self._skip

    def _install_found_inf(self, opt: torch.optim.Optimizer, theirs: Optional[torch.Tensor]) -> None:
        flag = self._skip.to(torch.float32)
        if theirs is not None:
            flag = torch.maximum(theirs.to(flag.device, torch.float32).reshape(()), flag).reshape(theirs.shape)
        opt.found_inf = flag
        self._installed = (opt, theirs, flag)

    def _hide_if_skipped(self, opt: torch.optim.Optimizer) -> None:
        self.syncs += 1
        skip, run = torch.stack((self._skip, self._run)).tolist()  # the one host read of the step
        self.skipped_on_host = bool(skip)
        if run > self.max_skips and self.on_persist == "raise":
            self.persisted = True
        if not skip:
            return
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._hidden.append((p, p.grad))
                    p.grad = None

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        """Undo what the step needed: the gradients come back (the training loop zeroes
        them as always), a GradScaler's own flag comes back (or none)."""
        hidden, self._hidden = self._hidden, []
        for p, grad in hidden:
            p.grad = grad
        installed, self._installed = self._installed, None
        if installed is not None and installed[0] is opt and getattr(opt, "found_inf", None) is installed[2]:
            if installed[1] is None:
                del opt.found_inf
            else:
                opt.found_inf = installed[1]

    def raise_if_persisted(self) -> None:
        """``guard_on_persist="raise"``: the step after a run past ``max_skips`` was seen raises."""
        if self.persisted and self.on_persist == "raise":
            self.persisted = False
            raise GuardPersisted(f"gradmon: more than guard_max_skips={self.max_skips} consecutive optimizer steps "
                                 "were bad; the guard stopped skipping them (guard_on_persist=\"raise\")")

    def scalars(self) -> List[Tuple[str, Optional[torch.Tensor]]]:
        """The packet's view of the step: the agreed code of a skipped step (0: applied)
        and the run of bad steps, for the publisher to count; once per decision, so that a
        step closed without one carries none."""
        code, self._code = self._code, None
        return [(S.SCALAR_GUARD_SKIP, code), (S.SCALAR_GUARD_RUN, self._run if code is not None else None)]


class SpikeWindow:
    """One signal's last ``size`` accepted values on the device (ln of each, oldest first), as
    the publisher's detector keeps them: a non-finite or non-positive value is not accepted.
    Each step's value is scored against the window before it enters (``robust.score``, the
    pages' definition); nothing is read on the host. It scores once the window is full."""

    def __init__(self, size: int, threshold: float) -> None:
        self.size, self.threshold = size, threshold
        self._ys: Optional[torch.Tensor] = None
        self._count: Optional[torch.Tensor] = None

    def restart(self) -> None:
        self._ys = self._count = None

    def push(self, value: torch.Tensor) -> torch.Tensor:
        """Whether ``value`` (0-d, on its device) is a spike, as a 0-d bool tensor."""
        v = value.detach().reshape(()).to(torch.float64)
        if self._ys is None or self._ys.device != v.device:
            self._ys = torch.zeros(self.size, dtype=torch.float64, device=v.device)
            self._count = torch.zeros((), dtype=torch.float64, device=v.device)
        accepted = torch.isfinite(v) & (v > 0)
        y = torch.where(accepted, v, 1.0).log()
        score, above = robust.score(self._ys, y)
        spike = accepted & (self._count >= self.size) & (score > self.threshold) & above
        self._ys = torch.where(accepted, torch.cat((self._ys[1:], y.reshape(1))), self._ys)
        self._count = self._count + accepted.double()
        return spike


class StepSignals:
    """What the guard judges a step by, read from the recorder's step values when asked:
    the NaN/Inf counts of the gradient rows (the first statistic measured at
    ``PARAM_GRAD`` that counts them, whose column 0 is each parameter's norm), the loss."""

    def __init__(self, statistics: Sequence[Any], values: Any, sharded: bool,
                 params: Callable[[], Sequence[Optional[torch.Tensor]]]) -> None:
        judged = [(st.name, count_columns(st.columns)) for st in statistics if count_columns(st.columns)]
        self._name, counts = judged[0] if judged else (None, ())
        # columns as slices: indexing with a list would copy it to the device, a host sync on CUDA
        self._counts = [slice(c, c + 1) for c in counts]
        if counts and tuple(counts) == tuple(range(counts[0], counts[0] + len(counts))):
            self._counts = [slice(counts[0], counts[0] + len(counts))]
        self._values, self._sharded, self._params = values, sharded, params

    def _rows(self) -> Optional[torch.Tensor]:
        rows = self._values.batched.get(self._name) if self._name is not None else None
        return rows[0] if rows is not None else None

    def nonfinite(self) -> Optional[torch.Tensor]:
        """Whether any gradient element is NaN or Inf, a 0-d bool on the device (None: not measured)."""
        rows = self._rows()
        if rows is None or not self._counts:
            return None
        return sum(rows[:, cut].sum() for cut in self._counts) > 0

    def spiking(self) -> Dict[str, Optional[torch.Tensor]]:
        """This step's loss and unscaled global gradient norm on the device (None: unknown;
        no norm where gradients are sharded: a rank holds only its shard's before the step)."""
        rows = None if self._sharded else self._rows()
        norm = global_norm(rows, self._values.scale) if rows is not None else None
        return {M.SIGNAL_LOSS: self._values.loss.mean(), M.SIGNAL_GRAD_NORM: norm}

    def home(self) -> torch.device:
        """Where a verdict lives when nothing was measured: the first parameter's device."""
        for p in self._params():
            if p is not None:
                return sharded.local(p).device
        return torch.device("cpu")


def stepped_with_closure(opt: torch.optim.Optimizer, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """An optimizer step's pre-hook arguments (``args`` begin with the optimizer itself)
    hold a closure: ``step(closure)`` or ``step(closure=...)``."""
    positional = args[1:] if args and args[0] is opt else args
    return callable(kwargs.get("closure", positional[0] if positional else None))


def global_norm(rows: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The global norm of a step's gradient rows (column 0: each parameter's norm), with a
    GradScaler's ``scale`` divided out, as the publisher folds it."""
    total = rows[:, 0].double().square().sum().sqrt()
    return total / scale.double().reshape(()).to(total.device) if scale is not None else total


def count_columns(columns: Sequence[Any]) -> Tuple[int, ...]:
    """The NaN and Inf count columns of a statistic's columns, by name."""
    return tuple(j for j, c in enumerate(columns) if c.name in ("nan", "inf"))


def agreement_groups(model: Any, params: Sequence[torch.Tensor]) -> Tuple[Any, ...]:
    """The process groups over which ranks must agree on a skip: DDP's or FSDP1's group
    (FSDP1's hybrid strategies: with the group across nodes), every dimension of a DTensor
    parameter's mesh (FSDP2's shard and HSDP's replicate dimensions alike), else the whole
    world; none in a single process."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return ()
    except Exception:  # a broken distributed build: nothing to agree with
        return ()
    groups: List[Any] = []
    for pg in (getattr(model, "process_group", None), getattr(model, "_inter_node_pg", None)):
        if pg is not None:
            groups.append(pg)
    seen = set()
    for p in params:
        if sharded.is_sharded(p) and id(p.device_mesh) not in seen:
            seen.add(id(p.device_mesh))
            groups.extend(p.device_mesh.get_group(d) for d in range(p.device_mesh.ndim))
    unique = {id(g): g for g in groups}
    return tuple(unique.values()) or (dist.group.WORLD,)


