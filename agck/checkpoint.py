"""Checkpoints as values: dumps/loads, save/load of standalone files, inspect.

Joins the codec (state <-> tensors and tree) and the container format
(tree and tensors <-> verified bytes). Files are written through
:mod:`agck.durable`, the one place that owns fsync and rename.
"""

from __future__ import annotations

import errno
import mmap as _mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from . import codec, durable, format, memory, thresholds
from .errors import (CorruptCheckpointError, FormatError, MalformedCheckpointError, StoreConnectionError,
                     UsageError)
from .names import MAX_STEP, check_step

# Metadata keys the format reserves (FORMAT.md, "Metadata").
_RESERVED = ("blobs", "tensors", "state", "run", "step", "parent", "meta")


@dataclass
class Checkpoint:
    """A decoded checkpoint. ``state`` is the value that was saved."""

    state: Any
    meta: Any
    run: str | None
    step: int | None
    parent: int | None
    created_at: float                    # seconds since the epoch
    version: str                         # "major.minor" of the container
    tensors: list = field(default_factory=list, repr=False)   # descriptors, with digests
    header: format.Header | None = field(default=None, repr=False)
    ref: str | None = None
    nbytes: int = 0
    # a store's verified read: the container's bytes, its tensors views of them (what a
    # replica is sent as, without encoding it again); None otherwise
    container: Any = field(default=None, repr=False, compare=False)


def encode(state: Any, *, run: str | None = None, step: int | None = None, parent: int | None = None,
           meta: Any = None, created_at_ns: int | None = None,
           memo: codec.EncodeMemo | None = None) -> format.ContainerWriter:
    """Lay out a container for ``state``; iterate ``.parts()`` to get its bytes.

    ``step`` and ``parent`` are integers in [0, 2**63) (numpy integers too; a bad
    one raises :class:`UsageError`); ``meta`` is plain data (:func:`codec.encode_plain`).
    ``memo`` carries what the last encode of the same run found (:class:`codec.EncodeMemo`)."""
    if run is not None and not isinstance(run, str):
        raise codec.EncodeError(f"run must be a str, not {type(run).__name__}")
    step = None if step is None else check_step(step)
    parent = None if parent is None else check_step(parent, "parent")
    codec.encode_plain(meta, "meta")
    enc = codec.encode_state(state, memo=memo)
    m = {"run": run, "step": step, "parent": parent, "meta": meta, "tensors": enc.tensors, "state": enc.tree}
    keys: list = [None] * len(enc.blobs)
    for d in enc.tensors:          # a blob is named by the path of the first tensor stored in it
        if keys[d["blob"]] is None:
            keys[d["blob"]] = d["path"]
    w = format.ContainerWriter(m, enc.blobs, created_at_ns=created_at_ns, meta_cuts={"state": enc.cuts},
                               blob_keys=keys)
    w.keepalive = enc  # the blobs are views of the encoder's buffers
    sizes: list = [None] * len(enc.blobs)
    for d in enc.tensors:   # a blob's values' element size, when all its tensors agree on one float type
        size = FLOAT_ITEMSIZES.get(d["dtype"], 0)
        b = d["blob"]
        sizes[b] = size if sizes[b] in (None, size) else 0
    w.blob_itemsizes = [s or None for s in sizes]
    return w


#: Element sizes of the floating-point dtypes (complex ones: of their parts), which a
#: store may cut into byte planes to compress (agck.chunkcodec).
FLOAT_ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 4, "complex128": 8}


def dumps(state: Any, *, run: str | None = None, step: int | None = None, parent: int | None = None,
          meta: Any = None) -> bytes:
    """Encode ``state`` as one AGCK container in memory."""
    return _to_bytes(encode(state, run=run, step=step, parent=parent, meta=meta))


def _to_bytes(w: format.ContainerWriter) -> bytes:
    """One allocation at the final size and one copy of each part.

    For a large state the fresh output's page faults cost more than the copy,
    so it is filled by :mod:`agck.memory` (huge pages when free, a few threads
    copying and hashing); small states are simply joined."""
    total = w.total_len
    made = memory.new_bytes(total) if total >= memory.PARALLEL_MIN else None
    if made is None:
        out = b"".join(w.parts())
    else:
        out, view = made
        layout, pos = w.layout(), 0
        for off, buf, _ in layout:   # every byte of the new object is written: no gap, no overlap
            if off != pos:
                raise RuntimeError(f"container layout has a gap or overlap at byte {pos} (next piece at {off})")
            pos += buf.nbytes
        if pos != w.header.footer_offset:
            raise RuntimeError(f"container layout ends at {pos}, the footer starts at {w.header.footer_offset}")
        digests = memory.fill(view, layout, format.new_hasher)
        footer = w.finish(digests)
        view[total - len(footer):] = np.frombuffer(footer, dtype=np.uint8)
        del view
    if len(out) != total:  # the writer's layout and its parts disagree: never return it
        raise RuntimeError(f"container parts add up to {len(out)} bytes, expected {total}")
    return out


def stream(w: format.ContainerWriter) -> Iterator:
    """The container's bytes as parts for a sink (a file, a COPY stream).

    A large container's blobs are hashed on another thread while the sink takes
    the bytes, so the footer's digests cost no time on the writing thread; a
    small one is hashed slice by slice on the way (``w.parts()``)."""
    if w.total_len < memory.PARALLEL_MIN or memory.threads() == 1:
        yield from w.parts()
        return
    try:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agck-hash")
        digests = pool.submit(lambda: [format.digest(b) for b in w.blobs])
    except RuntimeError:  # the interpreter is shutting down (a last snapshot at exit): no new threads
        yield from w.parts()
        return
    with pool:
        for _, buf, _ in w.layout():
            for i in range(0, buf.nbytes, _WRITE_SLICE):
                yield buf[i:i + _WRITE_SLICE]
        yield w.finish(digests.result())


_WRITE_SLICE = thresholds.WRITE_SLICE  # one giant write(2) is throttled badly by some kernels


def loads(data, *, verify: bool = True, copy: bool = True, map_location=None, ref: str | None = None) -> Checkpoint:
    """Decode a container from a bytes-like object.

    ``verify`` checks every tensor's checksum (header, metadata and footer are
    always checked). The default returns owned, writable arrays and tensors.
    ``copy=False`` returns views of ``data``: numpy arrays read-only when ``data``
    is (``bytes``), torch tensors only when ``data`` is writable; over read-only
    ``data`` torch tensors are copies, as torch has no read-only tensors and a
    write must never change ``data``. ``map_location`` (a device, a dict from
    saved device to device, or a callable) is checked before anything is read:
    a device this machine cannot use raises :class:`UsageError`."""
    map_location = codec.check_map_location(map_location)
    c = format.open_container(data, verify=verify, ref=ref)
    return _decode(c, copy=copy, map_location=map_location)


def _decode(c: format.Container, *, copy: bool, map_location) -> Checkpoint:
    if format.is_chunked(c.header):
        format.open_chunked(c)   # a damaged listing is corruption; a sound one needs its store
        raise UsageError("a chunked checkpoint: its content is kept in the store it was written to",
                         ref=c.ref, hint="read it through its store (agck.open_store(...).get(run, step)), "
                         "or `agck export STORE --run R --step S --to out.agck` for a standalone file")
    m = c.meta
    bad = lambda msg: MalformedCheckpointError(msg, ref=c.ref, section="metadata")  # noqa: E731
    run, step, parent, tree = m.get("run"), m.get("step"), m.get("parent"), m.get("state")
    if run is not None and type(run) is not str:
        raise bad("run is not a string")
    for name, v in (("step", step), ("parent", parent)):
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_STEP):
            raise bad(f"{name} is not an integer in [0, 2**63)")
    if type(tree) is not bytes:
        raise bad("state is missing or not bytes")
    state = codec.decode_state(tree, m.get("tensors"), c.blob, len(c.blobs), copy=copy,
                               map_location=map_location, ref=c.ref)
    return Checkpoint(state=state, meta=m.get("meta"), run=run, step=step, parent=parent,
                      created_at=c.header.created_at_ns / 1e9,
                      version=f"{c.header.major}.{c.header.minor}",
                      tensors=_tensor_table(c), header=c.header, ref=c.ref, nbytes=c.header.total_len)


def _tensor_table(c: format.Container) -> list[dict]:
    out = []
    tensors = c.meta.get("tensors")
    if type(tensors) is not list:
        return out
    for d in tensors:
        if type(d) is not dict:
            continue
        row = dict(d)
        b = d.get("blob")
        if type(b) is int and 0 <= b < len(c.blobs):
            off, n = c.blobs[b]
            row["blob_offset"] = c.header.payload_offset + off
            row["blob_nbytes"] = n
            row["xxh3"] = f"{c.digests[b]:016x}"
        out.append(row)
    return out


def save(path: str | os.PathLike, state: Any, *, run: str | None = None, step: int | None = None,
         parent: int | None = None, meta: Any = None, overwrite: bool = True) -> int:
    """Write ``state`` to ``path`` atomically and durably; returns the byte size.

    temp file in the same directory, write, fsync, rename, fsync(directory): a
    crash at any instant leaves the old file or the new one, never a torn one."""
    path = file_path(path)
    w = encode(state, run=run, step=step, parent=parent, meta=meta)
    durable.write_atomic(path, stream(w), overwrite=overwrite, size=w.total_len)
    return w.total_len


def load(path: str | os.PathLike, *, verify: bool = True, mmap: bool = True, map_location=None) -> Checkpoint:
    """Load a checkpoint file. With ``mmap`` (default) tensors are zero-copy views
    of a private copy-on-write mapping: writable, and writes never reach the file.
    ``map_location`` is checked before the file is read, as for :func:`loads`."""
    map_location = codec.check_map_location(map_location)
    path = file_path(path)
    buf = read_file(path, mmap=mmap)
    c = format.open_container(buf, verify=verify, ref=path)
    return _decode(c, copy=False, map_location=map_location)


def file_path(path: str | os.PathLike) -> str:
    """``path`` as a str; one the OS cannot take (a NUL character, not text) is a UsageError."""
    try:
        path = os.fspath(path)
    except TypeError:
        raise UsageError(f"a checkpoint path must be a str or os.PathLike, not {type(path).__name__}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if "\x00" in path:
        raise UsageError(f"a path with a NUL character in it: {path!r}"[:200], hint="check the path")
    return path


def read_file(path: str, *, mmap: bool = True):
    """The file's bytes: a private mapping, or a bytearray read in one go."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:      # rule 10.1: a buffer shorter than a header that starts like one, from nothing
                raise CorruptCheckpointError("truncated: an empty file, shorter than the 64-byte header", ref=path,
                                             section="header")
            if mmap:
                return _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY)
            buf = memory.new_buffer(size)  # not zero-filled, unlike bytearray; pages in place
            n = f.readinto(memoryview(buf))
            return buf[:n]
    except FileNotFoundError:
        raise FormatError("no such file", ref=path, hint="check the path") from None
    except IsADirectoryError:
        raise FormatError("is a directory, not a checkpoint file", ref=path,
                          hint="to read a store, use agck.open_store(path)") from None
    except PermissionError:  # this process's rights, not the file's bytes: never a verdict on it
        raise StoreConnectionError("permission denied", ref=path, hint="check the file's permissions") from None
    except OSError as e:
        if e.errno == errno.EIO:   # the bytes cannot be read back: a verdict, as damage is
            raise CorruptCheckpointError(f"cannot read the file: {e.strerror}", ref=path, section="file",
                                         hint="the storage returned an I/O error; an earlier checkpoint is used"
                                         ) from None
        raise StoreConnectionError(f"cannot read the file: {e.strerror or e}", ref=path,
                                   hint="the file itself was not judged; fix the cause and read it again") from None


def inspect(path_or_bytes, *, verify: bool = False) -> dict:
    """Header, metadata and tensor index, without decoding the state or hashing
    the payload (unless ``verify``)."""
    if isinstance(path_or_bytes, (str, os.PathLike)):
        ref = file_path(path_or_bytes)
        buf = read_file(ref, mmap=True)
    else:
        ref, buf = None, path_or_bytes
    c = format.open_container(buf, verify=verify, ref=ref)
    m = c.meta
    return {
        "path": ref,
        "header": c.header.as_dict(),
        "run": m.get("run"), "step": m.get("step"), "parent": m.get("parent"), "meta": m.get("meta"),
        "tensors": _tensor_table(c),
        "state_tree_bytes": len(m["state"]) if type(m.get("state")) is bytes else None,
        "verified": verify,
    }


def iter_parts(state: Any, **kw) -> tuple[int, Iterator]:
    """(total_len, parts) for stores that stream a container to their own sink."""
    w = encode(state, **kw)
    return w.total_len, stream(w)


__all__ = ["Checkpoint", "dumps", "loads", "save", "load", "inspect", "encode", "CorruptCheckpointError"]


def read_head(path: str) -> tuple[format.Header, dict]:
    """Header and metadata of a file, reading neither payload nor footer."""
    try:
        with open(path, "rb") as f:
            head = f.read(format.HEADER_SIZE)
            h = format.parse_header(head, ref=path)
            meta_bytes = f.read(h.meta_len)
    except OSError as e:
        raise FormatError(f"cannot read: {e.strerror}", ref=path) from None
    return h, _head_meta(h, meta_bytes, path)


def parse_head(data, ref: str | None = None) -> tuple[format.Header, dict]:
    """Header and metadata from the first bytes of a container (at least
    ``HEADER_SIZE + meta_len`` of them; more are ignored)."""
    view = memoryview(data)
    h = format.parse_header(view[:format.HEADER_SIZE], ref=ref)
    return h, _head_meta(h, view[format.HEADER_SIZE:format.HEADER_SIZE + h.meta_len], ref)


def _head_meta(h: format.Header, meta_bytes, ref: str | None) -> dict:
    if len(meta_bytes) != h.meta_len:
        raise CorruptCheckpointError("truncated inside the metadata", ref=ref, section="metadata")
    if format.digest(meta_bytes) != h.meta_digest:
        raise CorruptCheckpointError("metadata checksum mismatch", ref=ref, section="metadata")
    return format.decode_metadata(meta_bytes, ref=ref)


def decode(c: format.Container, *, copy: bool = False, map_location=None) -> Checkpoint:
    """Decode a parsed (and, as the caller chose, verified) 1.0 container."""
    return _decode(c, copy=copy, map_location=map_location)
