"""Who this process is in the job: rank, local rank and world size."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(environ.get(name, default))
    except ValueError:
        return default


def detect(environ: Optional[Mapping[str, str]] = None) -> RankInfo:
    """torch.distributed when initialised, else torchrun's RANK/LOCAL_RANK/WORLD_SIZE."""
    environ = os.environ if environ is None else environ
    local = _env_int(environ, "LOCAL_RANK", 0)
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return RankInfo(dist.get_rank(), local, dist.get_world_size())
    except Exception:  # a broken distributed build must not stop attach()
        pass
    return RankInfo(_env_int(environ, "RANK", 0), local, _env_int(environ, "WORLD_SIZE", 1))


def data_parallel_rank(model: object, default: int) -> int:
    """This process's rank in the group that replicates ``model``: the process group of
    DistributedDataParallel or FSDP (``model.process_group``), so that with pipeline
    stages or expert groups each stage's own rank 0 is found. ``default`` (the global
    rank) when the model names no group or the group cannot be asked."""
    group = getattr(model, "process_group", None)
    if group is None:
        return default
    try:
        import torch.distributed as dist
        return int(dist.get_rank(group))
    except Exception:  # not a process group, or not a member of it
        return default
