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
