"""Which modules are "layers", and which parameters each one owns.

A layer is a module that owns trainable parameters directly (Linear, Conv, Norm,
Embedding, ...). Containers (Sequential, ModuleList, a user's Block) own none and are
not layers: their children are. The label of a layer is its qualified name from
``named_modules()``. A parameter shared by two layers (tied embeddings) belongs to the
first one in ``named_modules()`` order, so every parameter is counted exactly once in
the global norm. A layer left with no parameter of its own (GPT-2's ``lm_head``, whose
weight is ``wte.weight``) is still a layer, for its activations and gradient flow, but
has no gradient of its own to observe: ``tied_to`` names the layer whose gradient norm
includes its weights, so coverage does not report it as a gap.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import metrics as M
from ..config import Config, utf8_text

ROOT_LABEL = "(root)"


@dataclass(frozen=True)
class Layer:
    index: int
    name: str
    module: nn.Module
    params: Tuple[nn.Parameter, ...]
    """Trainable parameters this layer owns and no earlier layer already claimed."""
    tied_to: Optional[str] = None
    """When ``params`` is empty (every parameter is shared with an earlier module): the
    name of the module that owns them, whose gradient norm includes them."""


def wrappers(model: nn.Module) -> List[nn.Module]:
    """``model`` and each module it wraps, down to the one whose names users know (the
    last): DDP/FSDP1/DataParallel wrappers and torch.compile's OptimizedModule prefix every
    name with ``module.``/``_orig_mod.``."""
    chain = [model]
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None) if type(model).__name__ in (
                "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel") else None
        if not isinstance(inner, nn.Module) or any(inner is m for m in chain):
            return chain
        chain.append(inner)
        model = inner


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose names users know (:func:`wrappers`)."""
    return wrappers(model)[-1]


def is_ddp(model: nn.Module) -> bool:
    return type(model).__name__ == "DistributedDataParallel" and isinstance(getattr(model, "module", None), nn.Module)


def _type_matches(module: nn.Module, wanted: Sequence[object]) -> bool:
    if not wanted:
        return True
    for t in wanted:
        if isinstance(t, type) and isinstance(module, t):
            return True
        if isinstance(t, str) and any(c.__name__ == t for c in type(module).__mro__):
            return True
    return False


def _check_type_names(model: nn.Module, wanted: Iterable[object]) -> None:
    known = {c.__name__ for m in model.modules() for c in type(m).__mro__}
    known |= {name for name, obj in vars(nn).items() if isinstance(obj, type)}
    for t in wanted:
        if isinstance(t, str) and t not in known:
            present = sorted({type(m).__name__ for m in model.modules()
                              if any(p.requires_grad for p in m.parameters(recurse=False))})
            raise ValueError(
                f"gradmon: option 'layer_types' names unknown layer type {t!r}; "
                f"layer types with trainable parameters in this model: {present}")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a layer name matches any of the options' glob patterns (case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _name_selected(name: str, cfg: Config) -> bool:
    if cfg.include and not _matches(name, cfg.include):
        return False
    return not _matches(name, cfg.exclude)


def roles(layers: Sequence[Layer], cfg: Config) -> Dict[str, FrozenSet[int]]:
    """The layers (indices) of each role a gauge may watch: the attention's query and key
    projections (``attention_layers``) and the output layer, the last ``nn.Linear``, whose
    outputs are the logits in the models this is for (a tied head included)."""
    attention = frozenset(layer.index for layer in layers if _matches(layer.name, cfg.attention_layers))
    linear = [layer.index for layer in layers if isinstance(layer.module, nn.Linear)]
    return {M.ROLE_ATTENTION: attention, M.ROLE_OUTPUT: frozenset(linear[-1:])}


# Wrappers that FSDP1 and activation checkpointing insert between a module and its
# parent: their names are not the ones users know (FSDP's own named_parameters drops them).
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def clean_name(qname: str) -> str:
    """The layer label of a module: wrappers dropped, and any lone surrogate escaped (a name
    is any str to ``add_module``; gradmon's labels must encode as UTF-8)."""
    return utf8_text(".".join(part for part in qname.split(".") if part not in _WRAPPER_SEGMENTS))


def discover(model: nn.Module, cfg: Config) -> List[Layer]:
    """The monitored layers of ``model``, in ``named_modules()`` (roughly forward) order."""
    _check_type_names(model, cfg.layer_types)
    owner: Dict[int, str] = {}  # id(parameter) -> name of the first module holding it
    layers: List[Layer] = []
    taken = set()
    for qname, module in model.named_modules():
        own = [p for p in module._parameters.values() if p is not None and p.requires_grad]
        if not own:
            continue  # a container, or a frozen layer
        name = clean_name(qname) or ROOT_LABEL
        if name in taken:  # a wrapper and what it wraps both own parameters: keep them apart
            name = utf8_text(qname)
        taken.add(name)
        unclaimed = tuple(p for p in own if id(p) not in owner)
        tied_to = None if unclaimed else owner[id(own[0])]
        for p in own:
            owner.setdefault(id(p), name)
        if not (_name_selected(name, cfg) and _type_matches(module, cfg.layer_types)):
            continue
        layers.append(Layer(len(layers), name, module, unclaimed, tied_to))
    return layers


def has_trainable_parameters(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def is_floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided


def top_blocks(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The top-level blocks whose outputs are checked for non-finite values every step, in
    forward order as registered: the root's children, with a ModuleList or ModuleDict
    (never called itself, so a hook on it never fires) replaced by its entries, so that
    a GPT's ``blocks.3`` is a block of its own rather than part of an invisible list."""
    out: List[Tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(full + ".", child)
            else:
                out.append((utf8_text(full), child))
    visit("", root)
    return out
