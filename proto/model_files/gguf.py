"""The GGUF container (llama.cpp's model file): header, metadata, tensor directory.

Layout (little-endian, versions 2 and 3): ``b"GGUF"``, uint32 version, uint64 tensor count,
uint64 metadata count; then the metadata (key string, uint32 value type, value), then one entry
per tensor (name, uint32 n_dims, uint64 dims with the fastest-varying first, uint32 ggml type,
uint64 offset into the data section), then the data section, aligned to
``general.alignment`` (default 32) bytes. Strings are a uint64 length and UTF-8 bytes.

Only the standard library: the file is mapped, never read whole, and every read is bounds-
checked, so a truncated or corrupt file is a ``ModelLoadError`` naming what is wrong rather
than a struct error or a read past the end. Tensor bytes come back as memoryviews into the map
(``gguf_quant`` turns them into numbers).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagekv.proto.model_files.errors import ModelLoadError
from pagekv.proto.model_files.ggml_types import ggml_type_name, tensor_nbytes

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types: id -> (name, struct format or None for the variable-sized ones).
_VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("uint8", "<B"), 1: ("int8", "<b"), 2: ("uint16", "<H"), 3: ("int16", "<h"),
    4: ("uint32", "<I"), 5: ("int32", "<i"), 6: ("float32", "<f"), 7: ("bool", "<?"),
    8: ("string", None), 9: ("array", None), 10: ("uint64", "<Q"), 11: ("int64", "<q"),
    12: ("float64", "<d"),
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # ggml tensors have at most four dimensions


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy/torch order: the GGUF dims reversed)
    ggml_type: int
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(
            f"GGUF file {self.path.name} is truncated or corrupt: {what} (at byte {self.pos} of "
            f"{len(self.buf)})"
        )

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{what} needs {n} bytes past the end of the file")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(size, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"the length of {what}")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8") from exc

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            item_type = self.unpack("<I", f"the item type of {what}")
            count = self.unpack("<Q", f"the item count of {what}")
            if item_type not in _VALUE_TYPES:
                raise self.fail(f"{what} has unknown item type {item_type}")
            fmt = _VALUE_TYPES[item_type][1]
            if fmt is not None:  # fixed-size items: one bounds check, one unpack
                size = struct.calcsize(fmt)
                if count * size > len(self.buf) - self.pos:
                    raise self.fail(f"{what} declares {count} items, more than the file holds")
                raw = self.take(count * size, what)
                return list(struct.unpack(f"<{count}{fmt[1]}", raw))
            if count > len(self.buf) - self.pos:  # each item takes at least one byte
                raise self.fail(f"{what} declares {count} items, more than the file holds")
            return [self.value(item_type, f"{what}[{i}]") for i in range(count)]
        if vtype not in _VALUE_TYPES:
            raise self.fail(f"{what} has unknown value type {vtype}")
        fmt = _VALUE_TYPES[vtype][1]
        assert fmt is not None  # the two variable-sized types (string, array) returned above
        return self.unpack(fmt, what)


class GGUFFile:
    """An open GGUF file: ``metadata`` (key -> value), ``tensors`` (name -> TensorInfo) and
    ``tensor_data(info)``. Close it (or use ``with``) to release the map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < 24:
                    raise ModelLoadError(
                        f"{self.path.name} is not a GGUF file: {size} bytes, shorter than the header"
                    )
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {exc}") from exc
        self._buf = memoryview(self._map)
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> None:
        cur = _Cursor(self._buf, self.path)
        magic = bytes(cur.take(4, "the magic"))
        if magic != MAGIC:
            raise ModelLoadError(
                f"{self.path.name} is not a GGUF file: it starts with {magic!r}, not {MAGIC!r}"
            )
        self.version = cur.unpack("<I", "the version")
        if self.version not in SUPPORTED_VERSIONS:
            hint = (" (a big-endian file?)" if self.version > 0xFFFF else "")
            raise ModelLoadError(
                f"unsupported GGUF version {self.version} in {self.path.name}{hint}; supported: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}"
            )
        n_tensors = cur.unpack("<Q", "the tensor count")
        n_kv = cur.unpack("<Q", "the metadata count")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.unpack("<I", f"the type of {key!r}")
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.unpack("<I", f"the rank of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
            dims = [cur.unpack("<Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
            ggml_type = cur.unpack("<I", f"the type of tensor {name!r}")
            offset = cur.unpack("<Q", f"the offset of tensor {name!r}")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise cur.fail(f"general.alignment={align!r} is not a power of two")
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise cur.fail(f"tensor {name!r} is listed twice")
            nbytes = tensor_nbytes(ggml_type, shape, name)  # raises on a type it cannot size
            start = data_start + offset
            if start + nbytes > len(self._buf):
                raise ModelLoadError(
                    f"GGUF file {self.path.name} is truncated: tensor {name!r} needs bytes "
                    f"[{start}, {start + nbytes}) but the file has {len(self._buf)}"
                )
            self.tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)

    def tensor_data(self, info: TensorInfo) -> memoryview:
        """The raw bytes of one tensor (a view into the map: valid until ``close``)."""
        return self._buf[info.offset : info.offset + info.nbytes]

    def close(self) -> None:
        buf = getattr(self, "_buf", None)
        if buf is None:
            return
        self._buf = None  # type: ignore[assignment]
        try:
            buf.release()
            self._map.close()
        except BufferError:
            pass  # a tensor view is still alive: the map goes when the last view does

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
