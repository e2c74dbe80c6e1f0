"""The header of a GGUF file read in one pass: its metadata and its tensor table, each tensor's
bytes a view of the memory-mapped file (nothing of them is read until used).

``gguf.GGUFReader`` reads the same, but makes a numpy view of the file for every part of every
value, some 300,000 for SmolLM2-135M's vocabulary and merges: 2.2 s an open on a 2-core VM
(5 s with another process busy), and the engine opens the file in each process that needs it
(the configuration, every tensor-parallel rank). Here a string is a Python string: 0.1 s.
The tests check both readers agree (tests/unit/test_gguf_checkpoint.py).

    "GGUF" · version u32 (2 or 3) · tensor count u64 · metadata count u64
    metadata entry:  key (u64 length, UTF-8) · value type u32 · value
                     (an array: item type u32 · count u64 · items)
    tensor entry:    name · dimension count u32 · each u64, innermost first · type u32 ·
                     offset u64 (from the data's start)
    data:            from the end of the table, rounded up to ``general.alignment`` (32)

Little-endian files only (llama.cpp's converter writes big-endian ones only when asked).
"""

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

V = GGUFValueType
_SCALARS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.UINT64: "<Q", V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<?",
}  # fmt: skip


class GGUFError(ValueError):
    """A GGUF file Baton cannot serve; the message says what it found."""


@dataclass(frozen=True)
class TensorEntry:
    name: str  # llama.cpp's
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # as PyTorch orders it: [rows, columns], or [n]
    data: np.ndarray = field(repr=False)  # its bytes, [rows, bytes a row] (or [bytes]), mapped


@dataclass(frozen=True)
class Header:
    fields: dict[str, Any]  # metadata: numbers, strings, bools, lists of them
    tensors: list[TensorEntry]


def read_header(path: Path) -> Header:
    """The metadata and tensor table of the GGUF file at ``path``; refuses a file that is not
    GGUF, is cut short (a tensor's bytes past its end), or holds a type id ``gguf`` does not
    know."""
    size = path.stat().st_size
    if size == 0:
        raise GGUFError(f"{path} is empty (truncated)")
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buf, path)
    magic, version = cursor.take("<4s"), cursor.take("<I")
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (it starts with {magic!r})")
    if version not in (2, 3):
        endian = " (big-endian?)" if version & 0xFFFF == 0 else ""
        raise GGUFError(f"{path}: GGUF version {version}{endian} is not supported (2 or 3)")
    n_tensors, n_fields = cursor.take("<Q"), cursor.take("<Q")
    fields = {cursor.string(): cursor.value(cursor.kind()) for _ in range(n_fields)}
    table = [cursor.tensor_entry() for _ in range(n_tensors)]
    align = int(fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    start = cursor.at + -cursor.at % align
    return Header(fields, [_tensor(buf, path, start, *entry) for entry in table])


def _tensor(
    buf: mmap.mmap, path: Path, start: int, name: str, dims: tuple[int, ...], raw: int, at: int
) -> TensorEntry:
    try:
        qtype = GGMLQuantizationType(raw)
    except ValueError:
        raise GGUFError(f"tensor {name!r} of {path} has type id {raw}, which no GGML type of "
                        "the installed gguf has (a newer llama.cpp's?)") from None  # fmt: skip
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise GGUFError(f"tensor {name!r}: rows of {dims[0]} values do not fill {qtype.name} "
                        f"blocks of {block}")  # fmt: skip
    n_bytes = int(np.prod(dims)) // block * type_size
    begin, end = start + at, start + at + n_bytes
    if end > len(buf):
        raise GGUFError(f"{path} is truncated: tensor {name!r} ends at byte {end:,}, past the "
                        f"file's end at {len(buf):,}")  # fmt: skip
    shape = tuple(reversed(dims))
    data = np.frombuffer(buf, np.uint8, n_bytes, begin)
    if len(dims) > 1:
        data = data.reshape(*shape[:-1], dims[0] // block * type_size)
    return TensorEntry(name, qtype, shape, data)


class _Cursor:
    """Reads values one after another from the mapped file; running past its end is a
    truncated file."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.at = buf, path, 0

    def take(self, fmt: str) -> Any:
        self._need(struct.calcsize(fmt))
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self._need(n)
        self.at += n
        return str(self.buf[self.at - n : self.at], "utf-8", errors="replace")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == V.STRING:
            return self.string()
        if kind != V.ARRAY:
            return self.take(_SCALARS[kind])
        item, count = self.kind(), self.take("<Q")
        if item in (V.STRING, V.ARRAY):
            return [self.value(item) for _ in range(count)]
        dtype = np.dtype(_SCALARS[item])
        self._need(count * dtype.itemsize)
        values = np.frombuffer(self.buf, dtype, count, self.at)
        self.at += count * dtype.itemsize
        return values.tolist()

    def kind(self) -> GGUFValueType:
        raw = self.take("<I")
        try:
            return V(raw)
        except ValueError:
            raise GGUFError(f"{self.path} is damaged: a value of unknown type {raw} at byte "
                            f"{self.at - 4:,}") from None  # fmt: skip

    def tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name, n_dims = self.string(), self.take("<I")
        dims = tuple(self.take("<Q") for _ in range(n_dims))
        return name, dims, self.take("<I"), self.take("<Q")

    def _need(self, n: int) -> None:
        if self.at + n > len(self.buf):
            raise GGUFError(f"{self.path} is truncated: its header runs past the file's end "
                            f"({len(self.buf):,} bytes)")  # fmt: skip
