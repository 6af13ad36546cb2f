"""Process and device memory metrics, read at scrape time on the exporter thread.

Named ``gradmon_process_*`` so they never collide with prometheus_client's own
``process_*`` collector in a user's registry.
"""

from __future__ import annotations

from typing import Dict, Iterator, Mapping, Tuple

import psutil
import torch

from .. import metrics as M

_PROC = psutil.Process()


def samples(labels: Mapping[str, str]) -> Iterator[Tuple[M.MetricSpec, Dict[str, str], float]]:
    with _PROC.oneshot():
        cpu = _PROC.cpu_times()
        yield M.PROCESS_RESIDENT_MEMORY, dict(labels), float(_PROC.memory_info().rss)
        yield M.PROCESS_CPU_SECONDS, dict(labels), float(cpu.user + cpu.system)
        yield M.PROCESS_THREADS, dict(labels), float(_PROC.num_threads())
    # is_initialized(), not is_available(): the exporter must never be the one that
    # creates a CUDA context in a process that did not use CUDA.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            dev = {**labels, "device": str(i)}
            yield M.CUDA_MEMORY_ALLOCATED, dev, float(torch.cuda.memory_allocated(i))
            yield M.CUDA_MEMORY_RESERVED, dev, float(torch.cuda.memory_reserved(i))
