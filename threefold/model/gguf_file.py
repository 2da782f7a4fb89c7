"""A minimal GGUF reader: metadata as Python values, tensors as numpy views of a memory map.

gguf.GGUFReader builds numpy views for every element of every metadata array
(~300k for a Qwen vocab: 10 s); a sequential parse with struct takes a fraction
of a second. Layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv × (string key | u32 type | value)           strings: u64 length + utf-8
    n_tensors × (string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset)
    padding to general.alignment (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from threefold.errors import ThreefoldError

# GGUF metadata value types -> struct format (8 STRING and 9 ARRAY are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    """Row-major (numpy/torch) shape: GGUF's dims reversed, e.g. [out_features, in_features]."""
    data: np.ndarray
    """Read-only view of the file: the element dtype for F32/F16, else uint8 blocks per row."""


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        self.pos += length
        return bytes(self.buf[self.pos - length : self.pos]).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALARS and item_type != 7:
                array = np.frombuffer(self.buf, dtype=np.dtype(_SCALARS[item_type]), count=count, offset=self.pos)
                self.pos += array.nbytes
                return array.tolist()
            return [self.value(item_type) for _ in range(count)]
        return self.unpack(_SCALARS[value_type])


class GGUFFile:
    """`metadata`: key -> value; `tensors`: in file order. Keeps the file mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mmap = np.memmap(path, dtype=np.uint8, mode="r")
        cursor = _Cursor(self.mmap.data)  # a memoryview of the mapped bytes
        if bytes(self.mmap[:4]) != b"GGUF":
            raise ThreefoldError(f"{path} is not a GGUF file (bad magic)", param="model")
        cursor.pos = 4
        self.version = cursor.unpack("<I")
        num_tensors, num_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.unpack("<I"))
        infos = [self._tensor_info(cursor) for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    @staticmethod
    def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        return name, dims, cursor.unpack("<I"), cursor.unpack("<Q")

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
        tensor_type = GGMLQuantizationType(type_id)
        shape = tuple(reversed(dims))
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        num_bytes = int(np.prod(shape)) // block_size * type_size
        raw = self.mmap[data_start + offset : data_start + offset + num_bytes]
        if tensor_type in _PLAIN_DTYPES:
            data = raw.view(_PLAIN_DTYPES[tensor_type]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
        return GGUFTensor(name, tensor_type, shape, data)
