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

A recording of every statistic on every step (``record_corpus.py``: four times the
values of the default cadence) would not fit 0.5 MB so. It holds ``packet_codes_xz`` and
``packet_columns`` in place of ``packet_values`` (:func:`encode_columns`): the packets of each
layout as a matrix, one column per value; a column of whole numbers kept exactly, the step
scalars (the loss) as float32, any other column as float32 rounded to COLUMN_MANTISSA_BITS
(bfloat16's precision, a relative error below 2**-8, float32's range); each column as
differences from the step before (zigzag), column after column, in byte planes, so that the
compressor sees the small numbers a slowly moving statistic makes; the planes compressed with
LZMA (a uint8 array: the .npz still loads without pickle), which a diverging run's codes needed
to fit (deflate left them a sixth larger). An older recording's ``packet_codes`` (the planes
as they are) reads too. :func:`values` reads every encoding.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

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


COLUMN_MANTISSA_BITS = 7  # bfloat16's: a healthy lm run of every statistic every step fits 0.5 MB, a diverging one not yet
_WHOLE, _FLOAT, _FLOAT32 = 0, 1, 2  # a column's kind in packet_columns


def _round_bits(exact: np.ndarray, keep: int) -> np.ndarray:
    """float64 -> the float32 bit patterns rounded to ``keep`` mantissa bits (NaN and +-Inf as
    they are); a finite value that rounds past float32's range is refused."""
    with np.errstate(over="ignore"):  # an overflow is refused below, by value
        f = exact.astype(np.float32)
    drop = 23 - keep
    bits = f.view(np.uint32)
    if not drop:
        return bits
    rounded = np.where(np.isfinite(f), ((bits + np.uint32(1 << (drop - 1))) >> drop) << drop, bits).astype(np.uint32)
    if np.any(np.isfinite(exact) & ~np.isfinite(rounded.view(np.float32))):
        raise ValueError("a packet value exceeds float32's range; this recording needs another encoding")
    return rounded


def encode(exact: np.ndarray) -> np.ndarray:
    """float64 values -> (4, n) uint8 byte planes of float32 rounded to MANTISSA_BITS. Counts
    below 2**17 stay exact; NaN and +-Inf stay what they are. A finite value that would round
    past float32's range is refused (it would read back as an overflow)."""
    return _round_bits(exact, MANTISSA_BITS).view(np.uint8).reshape(-1, 4).T.copy()


def decode(planes: np.ndarray) -> np.ndarray:
    """The inverse of :func:`encode`: float32 values."""
    return np.ascontiguousarray(planes.T).view(np.float32).reshape(-1)


def _matrices(offset: np.ndarray, layout: np.ndarray):
    """(packet indices, width) of each layout, in layout order: a layout's packets hold equally many values."""
    for lay in np.unique(layout):
        idx = np.nonzero(layout == lay)[0]
        widths = set((offset[idx + 1] - offset[idx]).tolist())
        if len(widths) != 1:
            raise ValueError(f"layout {lay}: packets of {sorted(widths)} values")
        yield idx, widths.pop()


def encode_columns(exact: np.ndarray, offset: np.ndarray, layout: np.ndarray,
                   scalars: Sequence[int]) -> Dict[str, np.ndarray]:
    """The packets' values (``exact``, float64, sliced by ``offset``; ``layout`` per packet, whose
    last ``scalars[layout]`` values are its step scalars) -> ``packet_columns`` (each column's
    kind, layout after layout) and ``packet_codes`` (uint8)."""
    kinds, codes = [], []
    for idx, width in _matrices(offset, layout):
        m = exact[offset[idx][:, None] + np.arange(width)] if width else np.zeros((len(idx), 0))
        m = np.where(np.isnan(m), np.nan, m)  # one NaN: a payload below the kept bits would read back as Inf
        whole = np.all(np.isfinite(m) & (m == np.round(m)) & (np.abs(m) < 2 ** 31), axis=0)
        kind = np.where(whole, _WHOLE, _FLOAT).astype(np.uint8)
        kind[width - scalars[layout[idx[0]]]:] = np.where(whole[width - scalars[layout[idx[0]]]:], _WHOLE, _FLOAT32)
        drop = np.where(kind == _FLOAT32, 0, 23 - COLUMN_MANTISSA_BITS)
        rounded = np.where(kind == _FLOAT32, _round_bits(m, 23), _round_bits(m, COLUMN_MANTISSA_BITS))
        c = np.where(kind == _WHOLE, np.where(whole, m, 0).astype(np.int64), (rounded >> drop).astype(np.int64))
        d = np.diff(c, axis=0, prepend=0)
        codes.append(((d << 1) ^ (d >> 63)).T.reshape(-1))  # zigzag, column after column
        kinds.append(kind)
    z = np.concatenate(codes or [np.empty(0, np.int64)])
    planes = z.view(np.uint8).reshape(-1, 8).T.tobytes()
    return {"packet_columns": np.concatenate(kinds or [np.empty(0, np.uint8)]),
            "packet_codes_xz": np.frombuffer(lzma.compress(planes, filters=_XZ), np.uint8)}


# LZMA2 at its strongest, told that the data is not text (no literal context: the planes' bytes are
# numbers, not characters)
_XZ = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lc": 0, "lp": 0, "pb": 0}]


def _codes(rec: Dict[str, np.ndarray]) -> np.ndarray:
    """The zigzag codes (int64) of :func:`encode_columns`, from either of its layouts."""
    if "packet_codes_xz" in rec:
        planes = np.frombuffer(lzma.decompress(rec["packet_codes_xz"].tobytes()), np.uint8).reshape(8, -1)
    else:
        planes = rec["packet_codes"]
    return np.ascontiguousarray(planes.T).view(np.int64).reshape(-1)


def decode_columns(rec: Dict[str, np.ndarray]) -> np.ndarray:
    """The inverse of :func:`encode_columns`: float64 values in packet order."""
    offset, layout = rec["packet_offset"], rec["packet_layout"]
    z = _codes(rec)
    out = np.empty(int(offset[-1]))
    at = col = 0
    for idx, width in _matrices(offset, layout):
        n = len(idx) * width
        d = ((z[at:at + n] >> 1) & np.int64(2 ** 63 - 1) ^ -(z[at:at + n] & 1)).reshape(width, len(idx)).T
        c = np.cumsum(d, axis=0)
        kind = rec["packet_columns"][col:col + width]
        shift = np.where(kind == _FLOAT32, 0, 23 - COLUMN_MANTISSA_BITS)
        codes = np.where(kind == _WHOLE, 0, c) << shift  # a whole column's numbers are no codes
        floats = codes.astype(np.uint32).view(np.float32).astype(np.float64)
        out[offset[idx][:, None] + np.arange(width)] = np.where(kind == _WHOLE, c.astype(np.float64), floats)
        at, col = at + n, col + width
    return out


def values(rec: Dict[str, np.ndarray]) -> np.ndarray:
    """A recording's packet values (float64), in either encoding."""
    return decode(rec["packet_values"]).astype(np.float64) if "packet_values" in rec else decode_columns(rec)


def path(name: str) -> Path:
    return DIR / f"{name}.npz"


# Per-packet numbers stored as differences from the packet before (``<name>_diff``): the steps,
# indices and offsets of a recording of every step rise by one (or by one width) a packet, which
# deflate alone keeps at ~3 KB an array and as differences at ~50 bytes
DIFFERENCED = ("packet_step", "packet_index", "packet_global_step", "packet_offset")


def save(target: Path, arrays: Dict[str, np.ndarray]) -> None:
    """Write a recording (``record_corpus.record``'s arrays) as :func:`load` reads it back,
    atomically (a partial file is never left under the run's name)."""
    stored = {(f"{k}_diff" if k in DIFFERENCED else k): (np.diff(v, prepend=0).astype(v.dtype) if k in DIFFERENCED
                                                         else v) for k, v in arrays.items()}
    tmp = target.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **stored)
    tmp.replace(target)


def load(name: str) -> Dict[str, np.ndarray]:
    return read(path(name))


def read(source: Path) -> Dict[str, np.ndarray]:
    """A recording's arrays, as ``record_corpus.record`` made them (whatever :func:`save` stored)."""
    with np.load(source, allow_pickle=False) as z:
        rec = {k: z[k] for k in z.files}
    for k in DIFFERENCED:
        if f"{k}_diff" in rec:
            diff = rec.pop(f"{k}_diff")
            rec[k] = np.cumsum(diff, dtype=diff.dtype)
    return rec


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
