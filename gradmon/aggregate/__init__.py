"""The publisher thread: per-step packets in, immutable snapshots out.

The training thread hands one step packet per optimizer step to the :class:`Publisher`'s
queue and goes on. The publisher thread waits for the packet's device-to-host copy and folds
it (``aggregator``) into units that each own their state: each statistic's fold
(``fold``), counters that never reset and what a later monitor continues (``counters``),
the global-norm histogram (``histogram``), coverage (``coverage``), where a run of
non-finite steps started and its incidents (``origin``), the step scalars (``scalars``),
spike scores (``spikes``), the divergence watch (``divergence``), the live page's history
(``history``) and the incident bundles' steps (``gradmon.incidents``). When a snapshot is
read it assembles an immutable :class:`Snapshot` (``snapshot``); the scrape thread reads
only snapshots.

May import: its own modules, the shared declarations at the top of the package
(``metrics``, ``statistics``, ``errors``, ``config`` values), the step packet type
(``gradmon.capture.packet``) and ``gradmon.incidents``. Never the rest of the training
thread's code (``capture``), the scrape side (``serve``), the clients, ``monitor`` or the
build-time generators (``alerting``, ``artefacts``).
"""

from .aggregator import Aggregator
from .counters import CarriedCounters
from .coverage import Coverage
from .origin import NonFiniteIncident
from .publisher import Publisher
from .snapshot import LayerSeries, Snapshot

__all__ = ["Aggregator", "CarriedCounters", "Coverage", "LayerSeries", "NonFiniteIncident", "Publisher", "Snapshot"]
