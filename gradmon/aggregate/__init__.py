"""The publisher thread: per-step packets in, immutable snapshots out.

The training thread hands one step packet per optimizer step to the :class:`Publisher`'s
queue and goes on. The publisher thread waits for the packet's device-to-host copy and folds
it (``aggregator``) into what it keeps: per-layer values, counters that never reset, the
global-norm histogram, coverage, where a run of non-finite steps started, spike scores
(``spikes``), the divergence watch (``divergence``), the live page's history (``history``)
and the incident bundles' steps (``gradmon.incidents``). When a snapshot is read it builds
an immutable :class:`Snapshot` (``snapshot``); the scrape thread reads only snapshots.

May import: its own modules, the shared declarations at the top of the package
(``metrics``, ``statistics``, ``errors``, ``config`` values), the step packet type
(``gradmon.capture.packet``) and ``gradmon.incidents``. Never the scrape side (``serve``) or
the build-time generators (``alerting``): tests/test_layout.py checks it.
"""

from .snapshot import (Aggregator, CarriedCounters, Coverage, LayerSeries, NonFiniteIncident, Publisher,
                       Snapshot)

__all__ = ["Aggregator", "CarriedCounters", "Coverage", "LayerSeries", "NonFiniteIncident", "Publisher", "Snapshot"]
