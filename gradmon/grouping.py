"""A per-process series budget: past it, layers are grouped by module-name prefix.

A 1,000-layer model on 1,024 ranks would otherwise put millions of series into one
Prometheus. The grouping is decided once, at attach, from the layer names alone, so it
is identical on every rank and never changes during the run (a series that changes its
meaning mid-run is worse than a coarse one). A group is just a coarser "layer" to the
aggregator: norms combine as the root of summed squares, maxima as max, counts as sums,
because the aggregator only ever adds squares, takes maxima and adds counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class Grouping:
    names: Tuple[str, ...]
    """The ``layer`` label values: layer names, or prefixes when grouped."""
    of_layer: Tuple[int, ...]
    """Group index of each layer."""

    @property
    def grouped_layers(self) -> int:
        """How many layers were merged into a coarser series (0: no grouping)."""
        return len(self.of_layer) - len(self.names)


def _prefix(name: str, depth: int) -> str:
    return ".".join(name.split(".")[:depth])


def _by_prefix(names: Sequence[str], depth: int) -> Tuple[List[str], List[int]]:
    prefixes: Dict[str, int] = {}
    of_layer = [prefixes.setdefault(_prefix(n, depth) if depth else "(all)", len(prefixes)) for n in names]
    return list(prefixes), of_layer


def _chunked(groups: List[str], of_layer: List[int], most: int) -> Grouping:
    """Merge consecutive groups (named_modules order, i.e. depth order) into ``most`` ranges."""
    size = -(-len(groups) // most)
    names = [groups[i] if i + size >= len(groups) and size == 1 else f"{groups[i]}..{groups[min(i + size, len(groups)) - 1]}"
             for i in range(0, len(groups), size)]
    return Grouping(tuple(names), tuple(g // size for g in of_layer))


def group_layers(names: Sequence[str], per_layer: int, budget: int) -> Grouping:
    """Identity when ``len(names) * per_layer`` fits the budget. Otherwise the deepest
    module-name prefix that fits ("blocks.17.attn.qkv" -> "blocks.17"); when that is
    much coarser than the budget allows (flat names, or "blocks" alone), consecutive
    groups one level deeper are merged into ranges ("blocks.0..blocks.6") instead."""
    most = max(1, budget // per_layer)
    if len(names) <= most:
        return Grouping(tuple(names), tuple(range(len(names))))
    deeper: Tuple[List[str], List[int]] = (list(names), list(range(len(names))))
    for depth in range(max(n.count(".") + 1 for n in names) - 1, -1, -1):
        groups, of_layer = _by_prefix(names, depth)
        if len(groups) <= most:
            if 2 * len(groups) < most:
                return _chunked(deeper[0], deeper[1], most)
            return Grouping(tuple(groups), tuple(of_layer))
        deeper = (groups, of_layer)
    return _chunked(deeper[0], deeper[1], most)  # pragma: no cover - depth 0 always fits
