"""Moved to :mod:`gradmon.serve.run_end` (issue 24); this name stays for the imports not yet retargeted."""
import sys

from .serve import run_end

# the same module object, not a copy of its names: module state and monkeypatches stay one
sys.modules[__name__] = run_end
