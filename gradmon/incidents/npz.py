"""A ``.npz`` file written and read without NumPy, holding only plain numeric arrays.

gradmon does not depend on NumPy, and a bundle comes from an untrusted run: the reader
accepts only the few dtypes the writer makes (little-endian float32, int64, uint8, C
order, no object arrays), so nothing in a bundle is ever unpickled. ``numpy.load(path,
allow_pickle=False)`` reads the same file; a member that is not ``.npy`` (the bundle's
JSON) comes back from it as bytes.
"""

from __future__ import annotations

import ast
import ctypes
import struct
import zipfile
from typing import IO, Dict, Mapping, Tuple

import torch

MAGIC = b"\x93NUMPY\x01\x00"
_DTYPES = {torch.float32: "<f4", torch.int64: "<i8", torch.uint8: "|u1"}
_TORCH = {v: k for k, v in _DTYPES.items()}
MAX_HEADER = 4096


class BadFile(ValueError):
    """The file is not a bundle this reader accepts (said in the message)."""


def npy_bytes(array: torch.Tensor) -> bytes:
    """One array in the ``.npy`` format, version 1.0."""
    t = array.detach().cpu().contiguous()
    if t.dtype not in _DTYPES:
        t = t.to(torch.float32)
    header = repr({"descr": _DTYPES[t.dtype], "fortran_order": False, "shape": tuple(t.shape)})
    pad = 64 - (len(MAGIC) + 2 + len(header) + 1) % 64
    text = (header + " " * pad + "\n").encode("latin1")
    # the tensor's own memory, copied once (NumPy is not a dependency to call .tobytes() on)
    body = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
    return MAGIC + struct.pack("<H", len(text)) + text + body


def write(out: IO[bytes], arrays: Mapping[str, torch.Tensor], texts: Mapping[str, bytes]) -> None:
    """Members stored uncompressed, so that the size written is known beforehand."""
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        for name, data in texts.items():
            z.writestr(name, data)
        for name, array in arrays.items():
            z.writestr(name + ".npy", npy_bytes(array))


def _parse_header(raw: bytes, member: str) -> Tuple[torch.dtype, Tuple[int, ...], int]:
    if raw[:8] != MAGIC:
        raise BadFile(f"member {member!r} is not a version 1.0 .npy array")
    (length,) = struct.unpack("<H", raw[8:10])
    if length > MAX_HEADER or len(raw) < 10 + length:
        raise BadFile(f"member {member!r} has a malformed header")
    try:
        header = ast.literal_eval(raw[10:10 + length].decode("latin1"))  # literals only: never code
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise BadFile(f"member {member!r} has a malformed header") from None
    if not isinstance(header, dict) or header.get("fortran_order") is not False:
        raise BadFile(f"member {member!r} is not a C-order array")
    dtype = _TORCH.get(header.get("descr"))  # type: ignore[arg-type]
    shape = header.get("shape")
    if dtype is None:
        raise BadFile(f"member {member!r} has a dtype this reader does not accept ({header.get('descr')!r})")
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and 0 <= d < 2 ** 31 for d in shape):
        raise BadFile(f"member {member!r} has a malformed shape")
    return dtype, shape, 10 + length


def read(path: str, max_bytes: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, bytes]]:
    """Every ``.npy`` member as a tensor, every other member as bytes; refuses (BadFile)
    anything malformed or, uncompressed, larger than ``max_bytes`` in all."""
    arrays: Dict[str, torch.Tensor] = {}
    texts: Dict[str, bytes] = {}
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            if sum(i.file_size for i in infos) > max_bytes:
                raise BadFile(f"its members take more than {max_bytes} bytes uncompressed")
            for info in infos:
                raw = z.read(info)
                if not info.filename.endswith(".npy"):
                    texts[info.filename] = raw
                    continue
                dtype, shape, start = _parse_header(raw, info.filename)
                body = raw[start:]
                itemsize = torch.empty((), dtype=dtype).element_size()
                count = 1
                for d in shape:
                    count *= d
                if len(body) != count * itemsize:
                    raise BadFile(f"member {info.filename!r} holds {len(body)} bytes, its shape needs "
                                  f"{count * itemsize}")
                flat = torch.frombuffer(bytearray(body), dtype=dtype) if count else torch.empty(0, dtype=dtype)
                arrays[info.filename[:-4]] = flat.reshape(shape)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError) as exc:
        raise BadFile(f"it is not a readable zip (.npz) file: {exc}") from None
    return arrays, texts
