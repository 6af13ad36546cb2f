"""What ``attach()`` builds for one monitor before anything runs: the layers, the recorder
the hooks will call (training thread), the aggregator it feeds (publisher thread) with its
spike, divergence, history and incident parts, and which series this rank exports.

Building starts nothing (no hook, thread or socket), so a refusal here leaves nothing
behind; ``Monitor._start`` starts what was built.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from . import metrics as M
from . import statistics as S
from .aggregate import Aggregator, NonFiniteIncident
from .aggregate.divergence import DivergenceSettings, DivergenceWatch
from .aggregate.history import History
from .aggregate.skips import KIND_GUARD, ExcludeList, GuardSkips, OnPersist
from .aggregate.spikes import SpikeTracker
from .capture import sharded
from .capture.hooks import Recorder
from .capture.layers import Layer, discover, is_ddp, roles, top_blocks
from .capture.stepguard import StepGuard, agreement_groups, modes
from .config import Config
from .errors import ErrorLog
from .grouping import Grouping, group_layers
from .identity import RankInfo, data_parallel_rank
from .incidents import recorder as incidents

log = logging.getLogger("gradmon")


@dataclass(frozen=True)
class Wiring:
    layers: Tuple[Layer, ...]
    blocks: Tuple[Tuple[str, nn.Module], ...]
    """The root's direct children, by name."""
    units: Tuple[sharded.FlatUnit, ...]
    """FSDP1's flat-parameter units (their limits are said at attach)."""
    recorder: Recorder
    aggregator: Aggregator
    history: Optional[History]
    """The live page's steps: only where per-layer series are exported and a page is served."""
    black_box: Optional[incidents.BlackBox]
    reduced_per_layer: bool
    """This rank exports the per-layer series of the statistics identical on every rank."""
    per_layer: bool


def wire(model: nn.Module, inner: nn.Module, cfg: Config, name: str, rank: RankInfo, errors: ErrorLog,
         publish: Callable[[object], None], on_incident: Callable[[NonFiniteIncident, bool], None],
         on_guard_persist: Optional[OnPersist] = None) -> Wiring:
    """Everything one monitor of ``inner`` (``model`` unwrapped) needs, built and not started;
    a ValueError when no layer matches the options."""
    layers = tuple(discover(inner, cfg))
    if not layers:
        raise ValueError(
            "gradmon: no layer matches the options include/exclude/layer_types "
            f"(include={cfg.include}, exclude={cfg.exclude}, layer_types={cfg.layer_types})")
    local_view = cfg.local_view if cfg.local_view is not None else is_ddp(model)
    statistics = S.enabled(cfg, local_view=local_view, fp16_headroom=_fp16_headroom(cfg, layers))
    blocks = tuple(top_blocks(inner))
    units = tuple(sharded.fsdp1_units(model))
    guarded = modes(cfg.guard)
    step_guard = StepGuard(guarded, cfg.guard_max_skips, cfg.guard_on_persist, agreement_groups(
        model, [p for layer in layers for p in layer.params]), cfg.guard_spike_z, cfg.spike_window) if guarded else None
    recorder = Recorder(layers, cfg, errors, publish, statistics, units, step_guard)
    grouping = group_layers(tuple(layer.name for layer in layers), S.series_per_layer(statistics), cfg.series_budget)
    if grouping.grouped_layers:
        log.warning("gradmon[%s]: %d layers exceed series_budget=%d; exporting %d module-name-prefix "
                    "groups instead (gradmon_grouped_layers)", name, len(layers), cfg.series_budget,
                    len(grouping.names))
    # Every rank holds the same reduced gradient under DDP/FSDP: data-parallel rank 0
    # carries its per-layer series, and the other replicas none unless asked
    # (all_ranks_per_layer): what tells them apart fits in a few rank-level series.
    dp_rank = data_parallel_rank(model, rank.rank)
    reduced_per_layer = dp_rank == 0 or rank.world_size == 1 or not (local_view or recorder.sharded)
    per_layer = reduced_per_layer or cfg.all_ranks_per_layer
    history = History(grouping.names, cfg.ui_history) if (
        cfg.ui and per_layer and cfg.registry is None) else None
    aggregator = _aggregator(cfg, name, rank, layers, blocks, grouping, statistics, recorder, reduced_per_layer,
                             history, on_incident)
    aggregator.black_box = black_box = _black_box(cfg, name, rank, errors, layers, aggregator.block_names,
                                                  recorder, inner)
    if guarded:
        exclude = ExcludeList(black_box.directory, name, rank.rank, errors) if black_box is not None else None
        aggregator.guard = GuardSkips(
            sorted(guarded), cfg.guard_max_skips, on_guard_persist, exclude,
            black_box.batch_ids if black_box is not None else None,
            (lambda step, why: black_box.write(incidents.Moment(step), KIND_GUARD, {"guard": why}))
            if black_box is not None else None)
    return Wiring(layers, blocks, units, recorder, aggregator, history, black_box, reduced_per_layer, per_layer)


def _aggregator(cfg: Config, name: str, rank: RankInfo, layers: Sequence[Layer],
                blocks: Sequence[Tuple[str, nn.Module]], grouping: Grouping, statistics: Sequence[S.Statistic],
                recorder: Recorder, reduced_per_layer: bool, history: Optional[History],
                on_incident: Callable[[NonFiniteIncident, bool], None]) -> Aggregator:
    # each role's layers by their exported (grouped) index
    exported = {role: frozenset(grouping.of_layer[i] for i in found) for role, found in roles(layers, cfg).items()}
    return Aggregator(grouping.names, recorder.param_layer, statistics, name, grouping.of_layer,
                      rank.rank, on_incident, amp=cfg.scaler is not None,
                      tied={layer.index: layer.tied_to for layer in layers if layer.tied_to},
                      block_names=(M.BLOCK_INPUT, *(block for block, _ in blocks), M.BLOCK_OUTPUT),
                      spikes=SpikeTracker(S.spike_signals(statistics, reduced_per_layer, exported),
                                          cfg.spike_threshold, cfg.spike_window, cfg.spike_min_steps,
                                          raw_below_zero=(M.SIGNAL_LOSS,),
                                          layers={M.SIGNAL_LAYER_GRAD_NORM: cfg.norm_jump_ratio}),
                      divergence=DivergenceWatch(DivergenceSettings(floor=cfg.loss_floor)),
                      windows={g.baseline: getattr(cfg, g.baseline)
                               for st in statistics for g in st.gauges if g.baseline},
                      baseline_warmup=cfg.baseline_warmup, history=history, roles=exported)


def _black_box(cfg: Config, name: str, rank: RankInfo, errors: ErrorLog, layers: Sequence[Layer],
               blocks: Sequence[str], recorder: Recorder, inner: nn.Module) -> Optional[incidents.BlackBox]:
    """The incident recorder, unless ``incident_dir`` is ``""``."""
    if not cfg.incident_dir:
        return None
    device = next((p.device for p in inner.parameters()), torch.device("cpu"))
    facts = incidents.RunFacts(
        model=name, rank=rank.rank, world_size=rank.world_size,
        layers=tuple(layer.name for layer in layers),
        blocks=tuple(blocks), param_layer=tuple(recorder.param_layer), device=incidents.device_name(device),
        options=incidents.options_of(cfg))
    recorder.hash_rows(True)
    # resolved now: a job that changes its working directory later still writes where it said
    return incidents.BlackBox(os.path.abspath(cfg.incident_dir), cfg.incident_max_bytes, cfg.ui_history, facts,
                              errors)


def _fp16_headroom(cfg: Config, layers: Sequence[Layer]) -> bool:
    """Whether the fp16 families can have series, decided at attach so that the series
    budget counts them only then: float16 parameters (a ``.half()`` model), or a
    GradScaler (fp16 autocast: the outputs of matmuls and convolutions are float16)."""
    if cfg.fp16_headroom is not None:
        return cfg.fp16_headroom
    return cfg.scaler is not None or any(p.dtype == torch.float16 for layer in layers for p in layer.params)
