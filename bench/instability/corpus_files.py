"""Where the corpus lives and how a recording is read: the one reader of the files
``record_corpus.py`` writes (``corpus/<run>.npz``, ``corpus/manifest.json``, ``corpus/labels.json``).

The directory is ``corpus/`` unless :func:`use` (each script's ``--dir``) or the environment
variable ``GRADMON_CORPUS_DIR`` names another: the independent set (``independent.py``) lives
outside the repository, and everything else about its files is the same.

A recording holds, as numpy arrays (``np.load(..., allow_pickle=False)``):

- ``loss`` (float32, one per step): the loss as the training loop computed it, unscaled;
- ``packet_step`` (int32): the loop step (1-based) during which gradmon published each packet;
- ``packet_index``, ``packet_global_step`` (int32): the packet's own numbering;
- ``packet_layout`` (int16): which of ``layouts`` (a JSON string) the packet has: its sections
  (statistic name, record keys, numels), its step scalars and its flags;
- ``packet_lr`` (float64, packets x param groups): the host learning rates it carried (NaN: a
  tensor lr, packed as a step scalar);
- ``packet_offset`` (int64, packets + 1) into ``packet_values``: each packet's host values as
  gradmon's fold read them, stored by :func:`encode` (float32 rounded to 16 mantissa bits, a
  relative error below 8e-6, byte planes apart so that deflate finds the repeated exponents:
  a third smaller than plain float32, which would not fit the 0.5 MB a run may take);
- ``meta`` (a JSON string): the run, the attach options, the layer names, the torch and gradmon
  versions.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]  # the repository
COMMITTED = HERE / "corpus"
ENV = "GRADMON_CORPUS_DIR"
DIR = MANIFEST = LABELS = TEST_LOG = COMMITTED  # set by use() below


def use(directory: Optional[Union[str, Path]]) -> None:
    """Read and write recordings, manifest, labels and test log in ``directory`` (None: the
    committed corpus). Kept in the environment too, so that the processes a script starts (one
    per recorded run, score.py's pool) read the same directory."""
    global DIR, MANIFEST, LABELS, TEST_LOG
    DIR = Path(directory).resolve() if directory else COMMITTED
    MANIFEST, LABELS, TEST_LOG = DIR / "manifest.json", DIR / "labels.json", DIR / "test-split-log.jsonl"
    if DIR == COMMITTED:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = str(DIR)


use(os.environ.get(ENV))


MANTISSA_BITS = 16  # of float32's 23


def encode(exact: np.ndarray) -> np.ndarray:
    """float64 values -> (4, n) uint8 byte planes of float32 rounded to MANTISSA_BITS. Counts
    below 2**17 stay exact; NaN and +-Inf stay what they are. A finite value that would round
    past float32's range is refused (it would read back as an overflow)."""
    with np.errstate(over="ignore"):  # an overflow is refused below, by value
        f = exact.astype(np.float32)
    drop = 23 - MANTISSA_BITS
    bits = f.view(np.uint32)
    finite = np.isfinite(f)
    rounded = np.where(finite, ((bits + np.uint32(1 << (drop - 1))) >> drop) << drop, bits).astype(np.uint32)
    if np.any(np.isfinite(exact) & ~np.isfinite(rounded.view(np.float32))):
        raise ValueError("a packet value exceeds float32's range; this recording needs another encoding")
    return rounded.view(np.uint8).reshape(-1, 4).T.copy()


def decode(planes: np.ndarray) -> np.ndarray:
    """The inverse of :func:`encode`: float32 values."""
    return np.ascontiguousarray(planes.T).view(np.float32).reshape(-1)


def path(name: str) -> Path:
    return DIR / f"{name}.npz"


def load(name: str) -> Dict[str, np.ndarray]:
    with np.load(path(name), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def meta(rec: Dict[str, np.ndarray]) -> dict:
    return json.loads(str(rec["meta"]))


def layouts(rec: Dict[str, np.ndarray]) -> List[dict]:
    return json.loads(str(rec["layouts"]))


def losses(name: str) -> List[float]:
    with np.load(path(name), allow_pickle=False) as z:
        return [float(x) for x in z["loss"]]


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def manifest() -> dict:
    return json.loads(MANIFEST.read_text())
