"""Moved to :mod:`gradmon.aggregate` (issue 24), which exports what this module did: ``Snapshot``,
``Coverage``, ``NonFiniteIncident``, ``Aggregator``, ``Publisher``, ``CarriedCounters``; this name
stays for the imports not yet retargeted."""
import sys

from . import aggregate

# the same module object, not a copy of its names: module state and monkeypatches stay one
sys.modules[__name__] = aggregate
