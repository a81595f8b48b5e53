"""The byte container of a .plan: a valid safetensors file, written as a stream.

Layout (the safetensors format): 8-byte little-endian header length N, N bytes of JSON header
(``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}``, padded with spaces),
then the tensor bytes back to back. Any safetensors reader opens a .plan; ``safetensors.save_file``
is not used because it needs every tensor in memory at once, and a 27B model must compile with
bounded memory: ``StreamWriter`` writes the header first (with fixed-width placeholders for the
checksums it cannot know yet), then each tensor as it is produced, then rewrites the header in
place at exactly the same length.

Reading maps the file (``mmap``) and hands out byte views; no pickle, no code in the file.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct

from kestrel.artifacts.errors import ArtifactError, OutputError

# safetensors dtype names <-> IR dtypes (and bytes per element)
ST_DTYPES = {"f32": ("F32", 4), "bf16": ("BF16", 2), "f16": ("F16", 2), "i32": ("I32", 4), "u8": ("U8", 1)}
IR_FROM_ST = {v[0]: k for k, v in ST_DTYPES.items()}
MAX_HEADER = 100_000_000  # the safetensors limit


def tensor_nbytes(dtype: str, shape) -> int:
    n = ST_DTYPES[dtype][1]
    for d in shape:
        n *= d
    return n


class StreamWriter:
    """Write tensors one by one into a safetensors file whose header is known in advance.

    ``entries``: ordered (name, dtype, shape). ``metadata_fn(checksums)`` returns the metadata dict
    given {name: sha256 hex}; it is called once with placeholders (64 zeros) and once at the end,
    and must produce strings of the same length both times.
    """

    def __init__(self, path: str, entries: list[tuple[str, str, tuple]], metadata_fn):
        self.path, self.entries, self.metadata_fn = path, entries, metadata_fn
        self.tmp = f"{path}.partial-{os.getpid()}"
        self.index = {name: i for i, (name, _, _) in enumerate(entries)}
        self.written: dict[str, str] = {}
        self._next = 0
        self._header_len = len(self._header({n: "0" * 64 for n, _, _ in entries}))
        self.f = None
        try:
            with self._io():
                self.f = open(self.tmp, "wb")
                self.f.write(struct.pack("<Q", self._header_len))
                self.f.write(b" " * self._header_len)
        except BaseException:
            self.abort()
            raise

    @contextlib.contextmanager
    def _io(self):
        """A file-system error while writing (a full disk, a read-only filesystem) becomes one line; the
        caller's abort() removes the partial file."""
        try:
            yield
        except OSError as e:
            raise OutputError(f"writing {self.path} failed ({e.strerror or e}); nothing was left behind") from None

    def _header(self, checksums) -> bytes:
        header, off = {"__metadata__": self.metadata_fn(checksums)}, 0
        for name, dtype, shape in self.entries:
            n = tensor_nbytes(dtype, shape)
            header[name] = {"dtype": ST_DTYPES[dtype][0], "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)

    def write(self, name: str, data: bytes | memoryview) -> None:
        """Append the next tensor's raw little-endian bytes (entries must come in declared order)."""
        exp_name, dtype, shape = self.entries[self._next]
        if name != exp_name:
            raise ValueError(f"tensor {name!r} written out of order (expected {exp_name!r})")
        data = memoryview(data).cast("B")
        if data.nbytes != tensor_nbytes(dtype, shape):
            raise ValueError(f"tensor {name!r}: {data.nbytes} bytes, declared {dtype}{list(shape)}")
        with self._io():
            self.f.write(data)
        self.written[name] = hashlib.sha256(data).hexdigest()
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            raise ValueError(f"only {self._next} of {len(self.entries)} tensors were written")
        header = self._header(self.written)
        if len(header) > self._header_len:
            raise ValueError("header grew while writing (metadata_fn must keep lengths fixed)")
        with self._io():
            self.f.seek(8)
            self.f.write(header + b" " * (self._header_len - len(header)))
            self.f.close()
            os.replace(self.tmp, self.path)  # a half-written plan never appears under the final name

    def abort(self) -> None:
        if self.f is not None:
            with contextlib.suppress(OSError):
                self.f.close()
        with contextlib.suppress(OSError):
            os.remove(self.tmp)


class Container:
    """A read-only view of a safetensors file: metadata, tensor table, and byte views over mmap."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            self._f = open(path, "rb")
        except OSError as e:
            raise ArtifactError(f"cannot open {path}: {e.strerror}") from None
        what = f"{path} is not a Kestrel plan"
        if size < 8:
            raise ArtifactError(f"{what} (only {size} bytes)")
        (hlen,) = struct.unpack("<Q", self._f.read(8))
        if hlen > MAX_HEADER or 8 + hlen > size:
            raise ArtifactError(f"{what} or is truncated (header of {hlen} bytes, file of {size})")
        try:
            header = json.loads(self._f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ArtifactError(f"{what} or its header is corrupted (unreadable JSON)") from None
        if not isinstance(header, dict):
            raise ArtifactError(f"{what} (header is not a table)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, tuple[str, tuple, int, int]] = {}
        end = 0
        for name, e in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
            try:
                dtype = IR_FROM_ST[e["dtype"]]
                lo, hi = e["data_offsets"]
                shape = tuple(e["shape"])
            except (KeyError, TypeError, ValueError):
                raise ArtifactError(f"{what}: tensor entry {name!r} is malformed") from None
            if lo != end or hi - lo != tensor_nbytes(dtype, shape):
                raise ArtifactError(f"{path}: tensor {name!r} has inconsistent offsets; the file is corrupted")
            self.tensors[name] = (dtype, shape, lo, hi)
            end = hi
        self.data_start = 8 + hlen
        if size != self.data_start + end:
            raise ArtifactError(f"{path} is truncated or has trailing bytes: the header describes "
                                f"{self.data_start + end} bytes, the file has {size}; rebuild or re-copy it")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def raw(self, name: str) -> memoryview:
        dtype, shape, lo, hi = self.tensors[name]
        return memoryview(self._mm)[self.data_start + lo:self.data_start + hi]

    def sha256(self, name: str) -> str:
        return hashlib.sha256(self.raw(name)).hexdigest()

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the map goes with the last one
                pass
            self._mm = None
        self._f.close()
