"""Content shared between the checkpoints of a store: chunked checkpoints.

A store keeps a checkpoint as a *chunked container* (FORMAT.md, version 1.1):
a small AGCK container listing, by BLAKE3-256 address, the chunks that the
checkpoint's standalone v1.0 container splits into (:mod:`agck.chunking`).
Chunks are kept once per store, in the store's object table, and shared by
every checkpoint that holds the same bytes: an unchanged tensor, the prefix of
a list that only grew, a frozen model.

The rules every backend keeps, whatever its storage:

1. A chunked container commits only after every chunk it lists is durable.
2. A chunk is deleted only when no committed chunked container lists it, and
   never while a writer that may be about to list it is between checking that
   it exists and committing (file store: a shared lock held by writers, an
   exclusive one by the collector; Postgres: the same with a transaction
   advisory lock; SQLite: writers and the collector each in one BEGIN
   IMMEDIATE transaction, which SQLite serialises).
3. Deleting a checkpoint removes its chunked container first; its chunks are
   collected later (:meth:`Store.collect_garbage`), so a crash between the two
   leaves only unreferenced chunks, collected by the next run.

This module is the part that does not depend on the backend: splitting a
container into chunks for a writer, and rebuilding and verifying a container
from chunks for a reader. What is done about damaged chunks (checks of reused
chunks at put time, quarantine, scrub) is :mod:`agck.stores.damage`.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable, Collection, Iterable

import msgpack
import numpy as np

from .. import checkpoint, chunkcodec, chunking, codec, format, memory, thresholds
from ..checkpoint import Checkpoint
from ..errors import (ContentChangedError, CorruptCheckpointError, DamagedChunkError, FormatError,
                      MalformedCheckpointError, StoreError, UnsupportedVersionError)

log = logging.getLogger("agck")

@dataclass
class Chunks:
    """What a writer learned splitting one container: every chunk's address and
    size in order, and the chunks the store did not hold yet."""

    addresses: list[bytes]
    sizes: list[int]
    new_bytes: int = 0
    new_chunks: int = 0

    @property
    def total(self) -> int:
        return sum(self.sizes)


@dataclass
class Collected:
    """What a garbage collection found and removed."""

    listings: int          # chunked checkpoints whose chunks were kept
    live_chunks: int       # distinct chunks they list
    deleted_chunks: int
    deleted_bytes: int
    damaged: list = field(default_factory=list)   # refs of listings that fail verification (their chunks kept)
    unreadable: list = field(default_factory=list)   # refs of listings nothing can be read from: nothing deleted

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class WriteCache:
    """What a store remembers of a run's last checkpoint, so the next one costs what
    changed: the chunks of its pieces (:class:`agck.chunking.Chunker`), the
    digests of its blobs, and the encoding of its long lists
    (:class:`agck.codec.EncodeMemo`). All of it is derived from content and
    confirmed against content, so a stale or missing cache costs time, never
    correctness. One put uses a cache at a time (:class:`WriteCaches`)."""

    def __init__(self):
        self.chunker = chunking.Chunker()
        self.digests: dict = {}       # piece key -> _PieceDigests, the blob digests found there
        self.encoding = codec.EncodeMemo()
        self.puts = 0                 # puts of the run through this store object (full_every)
        self.split = False            # the chunker and digests hold a checkpoint's (see split_container)


class WriteCaches:
    """A store's write caches, one per run. :meth:`take` hands a run's cache to one
    put (a concurrent put of the same run gets a fresh one); :meth:`give` returns it."""

    _MAX_RUNS = 64

    def __init__(self):
        self._by_run: dict[str, WriteCache] = {}
        self._lock = threading.Lock()     # a store's threads put at once (a Postgres store's pool)

    def take(self, run: str) -> WriteCache:
        with self._lock:
            return self._by_run.pop(run, None) or WriteCache()

    def peek(self, run: str) -> WriteCache | None:
        with self._lock:
            return self._by_run.get(run)

    def give(self, run: str, cache: WriteCache) -> None:
        with self._lock:
            if len(self._by_run) >= self._MAX_RUNS:
                self._by_run.pop(next(iter(self._by_run)), None)
            self._by_run[run] = cache


class _PieceDigests:
    """The blob digests of one piece of the last container: per part, its offset in
    the piece and, for a blob, its XXH3-64 (None for padding)."""
    __slots__ = ("bounds", "digests", "_by_place")

    def __init__(self, bounds: list[int], digests: list):
        self.bounds, self.digests, self._by_place = bounds, digests, None

    def at(self, start: int, end: int):
        """The digest of the blob that was at [start, end) of the piece, if any."""
        if self._by_place is None:
            b = self.bounds
            self._by_place = {(b[i], b[i + 1]): d for i, d in enumerate(self.digests) if d is not None}
        return self._by_place.get((start, end))


def cannot_confirm(ref: str | None) -> ContentChangedError:
    """For a put given ``expect_unchanged`` tensors with nothing to confirm them against."""
    return ContentChangedError("tensors were passed as unchanged, but this put has no earlier checkpoint of the "
                               "run to confirm them against (a standalone put, or the first of this store "
                               "object)", ref=ref)


def _address(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _large_key(w: format.ContainerWriter, blob_at: dict, entry) -> tuple:
    """The piece key of a blob cut on its own: the blob's key (its tensor's path) and
    size, which stay the same from one checkpoint to the next whether its bytes are
    a staging copy or the tensor itself (an index would shift whenever a piece
    before it came or went). A key found again with other bytes costs a fresh cut,
    never a wrong chunk: bytes are always confirmed."""
    offset, buf, _ = entry
    i = blob_at.get(offset)
    return ("large", None if i is None else w.blob_keys[i], buf.nbytes)


def _private(a: bytes, c: chunking.PieceChunk, expect: Collection[int], ref: str | None) -> memoryview:
    """The bytes to write for chunk ``c``. Chunks cut this time hold bytes that were
    hashed into their address; with tensors passed as unchanged (live memory that
    the pipeline may be writing to by now), a chunk taken from the last checkpoint
    but missing from the store is copied and its address checked before it is written."""
    view = c.view()
    if not expect or c.fresh:
        return view
    copy = memoryview(bytes(view))
    if chunking.address(copy) != a:
        raise ContentChangedError("a chunk of a tensor passed as unchanged changed while it was written", ref=ref)
    return copy


def split_container(w: format.ContainerWriter, cache: WriteCache | None = None, *,
                    expect_unchanged: Collection[int] = (), ref: str | None = None,
                    large: tuple[int, int, int] = chunking.LARGE) -> list[chunking.PieceChunks]:
    """The container ``w`` as chunks, in order, computing the blobs' digests and
    its footer on the way. Pieces, each cut on its own (:mod:`agck.chunking`):
    the header, metadata and padding (:func:`_head_pieces`); each run of blobs
    under ``LARGE_PART`` bytes with the padding between them; each larger blob;
    the footer (joined with the metadata's end when there is no payload). A blob
    whose bytes the chunker found unchanged at the same place of the same piece
    keeps its digest from last time.

    ``expect_unchanged``: the memory addresses of blobs the caller did not copy
    because a cheap signal said they had not changed since the run's last put
    (:class:`agck.snapshot.Snapshotter`). Each must be a large blob whose bytes the
    chunker's pass found, all of them, in chunks of that put (XXH3-128 against
    what it remembered), or :class:`ContentChangedError` is raised before anything
    is written."""
    if expect_unchanged and (cache is None or not cache.split):
        raise cannot_confirm(ref)
    expect = set(expect_unchanged)
    confirmed: set[int] = set()
    chunker = cache.chunker if cache is not None else chunking.Chunker(remember=False)
    known = cache.digests if cache is not None else {}
    digests_now: dict = {}
    layout = w.layout()
    head = _head_pieces(w, layout[:3])
    # with no payload the metadata's end and the footer are one piece: both change
    # at every checkpoint, and a store pays per chunk as well as per byte
    last = head.pop() if not w.blobs else None
    out = [chunker.split_piece(key, bufs, chunking.HEAD, grows=grows)[0] for key, bufs, grows in head]
    rest = layout[3:]
    blob_at = {w.header.payload_offset + off: i for i, off in enumerate(w.offsets)}
    itemsizes = getattr(w, "blob_itemsizes", None)
    groups = [(_large_key(w, blob_at, rest[members[0]]) if key[0] == "large" else key, [rest[i] for i in members],
               sizes)
              for key, members, sizes in chunking.pieces([buf.nbytes for _, buf, _ in rest], large)]
    digests: list[int] = []
    for key, entries, sizes in groups:
        bufs = [buf for _, buf, _ in entries]
        chunks, unchanged = chunker.split_piece(key, bufs, sizes)
        chunks.itemsize = _common_itemsize(itemsizes, blob_at, entries)
        out.append(chunks)
        base = entries[0][0]
        bounds = [off - base for off, _, _ in entries]
        bounds.append(bounds[-1] + bufs[-1].nbytes)
        old = known.get(key)
        # the parts before the first changed one: same bytes at the same offsets as last time
        m = unchanged.index(False) if False in unchanged else len(unchanged)
        if old is not None and m and old.bounds[:m + 1] == bounds[:m + 1]:
            ds = old.digests[:m]
        else:
            ds, m = [], 0
        for i in range(m, len(entries)):
            ds.append(old.at(bounds[i], bounds[i + 1]) if old is not None and unchanged[i] else None)
        for i, (_, buf, is_blob) in enumerate(entries):
            if not is_blob:
                ds[i] = None
                continue
            if ds[i] is None:
                ds[i] = format.digest(buf)
            if expect and key[0] == "large" and (addr := _address(buf)) in expect:
                # its bytes were all found in chunks of the last checkpoint, confirmed by
                # XXH3-128 as they were read; nothing of it is cut afresh from live memory
                if not unchanged[i]:
                    raise ContentChangedError(
                        f"a tensor of {buf.nbytes} bytes passed as unchanged differs from the run's last checkpoint",
                        ref=ref, addresses=[addr])
                confirmed.add(addr)
        digests.extend(d for d in ds if d is not None)
        digests_now[key] = _PieceDigests(bounds, ds)
    if expect - confirmed:
        raise ContentChangedError(f"{len(expect - confirmed)} tensor(s) passed as unchanged are not blobs of "
                                  f"{chunking.LARGE_PART} bytes or more of their own in this checkpoint, so they "
                                  "cannot be confirmed", ref=ref)
    footer = w.finish(digests)
    if last is None:
        out.append(chunker.split_piece("footer", [footer], chunking.HEAD)[0])
    else:
        out.append(chunker.split_piece(last[0], last[1] + [footer], chunking.HEAD)[0])
    chunker.done()
    if cache is not None:
        cache.digests = digests_now
        cache.split = True
    return out


def _common_itemsize(itemsizes, blob_at: dict, entries: list) -> int | None:
    """The one float element size of every blob among ``entries`` (their padding is
    64-byte aligned, so every element keeps its byte order across the piece); None
    if they have none or several."""
    if not itemsizes:
        return None
    found = {itemsizes[blob_at[off]] if off in blob_at else None for off, _, is_blob in entries if is_blob}
    return found.pop() if len(found) == 1 else None


def _head_pieces(w: format.ContainerWriter, head: list) -> list[tuple]:
    """The header, metadata and padding as pieces (key, buffers), cut where they
    change apart: the header with the first keys (they change at every checkpoint),
    the tensor descriptors, the state up to its first segment packed whole, each run
    of such segments of at least ``chunking.HEAD[1]`` bytes, the items after the last
    one, and the rest (the blob table). So a checkpoint of a list that only grew
    rewrites the small pieces around what changed, not the chunks (4-64 KiB) that
    happen to hold them. Each piece comes with whether it usually grows at its end
    (descriptors, runs of segments, a list's open end: ``Chunker.split_piece``)."""
    header, meta, pad = (buf for _, buf, _ in head)
    base = format.HEADER_SIZE
    cuts = []
    spans = w.meta_spans
    if "tensors" in spans and "state" in spans and spans["tensors"][1] < spans["tensors"][2]:
        cuts += [(spans["tensors"][1], "tensors", True), (spans["tensors"][2], "state", False)]
    last = cuts[-1][0] if cuts else base
    for off, key, kind in w.meta_cuts:
        if kind != "joined" or off - last >= chunking.HEAD[1]:
            cuts.append((off, key, kind != "end"))
            last = off
    if cuts and "state" in spans:
        cuts.append((spans["state"][2], "after state", False))
    pieces, start, key, grows = [], base, "head", False
    for off, nxt, nxt_grows in cuts:
        if off > start:
            pieces.append((key, [meta[start - base:off - base]], grows))
            start = off
        key, grows = nxt, nxt_grows
    pieces.append((key, [meta[start - base:], pad], grows))
    pieces[0][1].insert(0, header)
    return pieces


def store_chunks(w: format.ContainerWriter, has: Callable[[bytes, int], bool],
                 add: Callable[[bytes, memoryview, int | None], None], cache: WriteCache | None = None, *,
                 expect_unchanged: Collection[int] = (), ref: str | None = None) -> Chunks:
    """Split the container ``w`` into chunks, and ``add(address, bytes, itemsize)`` each
    one ``has(address, size)`` says is missing (once, even if it occurs twice;
    ``itemsize``: :attr:`agck.chunking.PieceChunks.itemsize`, for compressing it). The
    caller makes the added chunks durable before committing the listing."""
    out = Chunks([], [])
    seen: set[bytes] = set()
    for piece in split_container(w, cache, expect_unchanged=expect_unchanged, ref=ref):
        out.addresses += piece.addresses
        out.sizes += piece.sizes
        for i, a in enumerate(piece.addresses):
            if a in seen:
                continue
            seen.add(a)
            if not has(a, piece.sizes[i]):
                c = piece.chunk(i)
                add(a, _private(a, c, expect_unchanged, ref), piece.itemsize)
                out.new_bytes += c.nbytes
                out.new_chunks += 1
    return out


@dataclass
class Plan:
    """A container split into chunks before asking the store anything, for stores
    that answer "which of these do you hold?" for many chunks at once (one query)
    rather than one at a time. ``distinct`` holds each chunk's address once, in
    order of first occurrence, with where its bytes are (:meth:`chunk`); they stay
    readable while the plan is held."""

    chunks: Chunks
    distinct: dict[bytes, tuple[chunking.PieceChunks, int]]
    expect_unchanged: Collection[int] = ()
    ref: str | None = None

    def chunk(self, address: bytes) -> chunking.PieceChunk:
        piece, i = self.distinct[address]
        return piece.chunk(i)

    def size(self, address: bytes) -> int:
        piece, i = self.distinct[address]
        return piece.sizes[i]

    def itemsize(self, address: bytes) -> int | None:
        """The float element size of the chunk's piece, if one (for compressing it)."""
        return self.distinct[address][0].itemsize

    def upload(self, address: bytes) -> memoryview:
        """The bytes to write for one chunk the store lacks (see :meth:`count_new`)."""
        return _private(address, self.chunk(address), self.expect_unchanged, self.ref)

    def count_new(self, addresses: Collection[bytes]) -> None:
        """Record ``addresses`` as the chunks this put wrote (``chunks.new_*``)."""
        self.chunks.new_chunks = len(addresses)
        self.chunks.new_bytes = sum(self.size(a) for a in addresses)

    def missing(self, present) -> list[tuple[bytes, memoryview]]:
        """The chunks not in ``present`` (a set of addresses), in order, with their
        bytes; also counted in ``chunks.new_chunks`` and ``chunks.new_bytes``."""
        out = [(a, _private(a, self.chunk(a), self.expect_unchanged, self.ref)) for a in self.distinct
               if a not in present]
        self.chunks.new_chunks = len(out)
        self.chunks.new_bytes = sum(v.nbytes for _, v in out)
        return out


def encode_chunks(items: list[tuple[bytes, memoryview]], encoding,
                  itemsize: Callable[[bytes], int | None]) -> list[tuple[bytes, int, object]]:
    """``items`` (address, raw bytes: :meth:`Plan.missing`) as ``encoding``
    (:class:`agck.stores.compression.ChunkEncoding`) stores them: (address, raw size,
    bytes to write), in order; compressed (and verified) on a few threads (zstd and
    BLAKE3 release the GIL) when the store compresses and there is enough to share.
    ``itemsize(address)``: the chunk's float element size (:meth:`Plan.itemsize`)."""
    def one(item):
        a, view = item
        return a, view.nbytes, encoding.encode(a, view, itemsize(a)).stored

    if not encoding.on:
        return [(a, v.nbytes, v) for a, v in items]
    k = min(memory.threads(), len(items))
    if k <= 1 or sum(v.nbytes for _, v in items) < thresholds.PARALLEL_READ:
        return list(map(one, items))
    with ThreadPoolExecutor(max_workers=k, thread_name_prefix="agck-compress") as pool:
        return list(pool.map(one, items))


def plan_chunks(w: format.ContainerWriter, cache: WriteCache | None = None, *,
                expect_unchanged: Collection[int] = (), ref: str | None = None,
                large: tuple[int, int, int] = chunking.LARGE) -> Plan:
    """Split the container ``w`` into chunks (large blobs on the grid ``large``); the
    store then sends only :meth:`Plan.missing`."""
    out = Plan(Chunks([], []), {}, expect_unchanged, ref)
    for piece in split_container(w, cache, expect_unchanged=expect_unchanged, ref=ref, large=large):
        out.chunks.addresses += piece.addresses
        out.chunks.sizes += piece.sizes
        # a repeated address keeps its first place; any occurrence has the same bytes
        out.distinct.update(zip(piece.addresses, zip(repeat(piece), range(len(piece)))))
    return out


def listing(w: format.ContainerWriter, chunks: Chunks, *, run, step, parent, meta, framed: bool = False) -> bytes:
    """The chunked container that lists ``chunks`` as the bytes of ``w``: version 1.1,
    or with ``framed`` (the store compresses chunks) 1.2 with flag FRAMED (rule 12.8)."""
    return format.dumps_chunked(run=run, step=step, parent=parent, meta=meta,
                                addresses=chunks.addresses, sizes=chunks.sizes,
                                created_at_ns=w.header.created_at_ns, framed=framed)


def assemble(listed: format.ChunkedContainer, fetch: Callable[[bytes, int], object], *,
             ref: str | None, fetch_into: Callable[[bytes, memoryview], int | None] | None = None,
             threads: int | None = None, checked: chunking.CheckedChunks | None = None,
             authenticated: bool = False) -> memoryview:
    """The listed container's bytes, rebuilt from its chunks. ``fetch(address,
    size)`` returns a chunk's bytes (or None if the store lacks it); a store that
    can read a chunk straight into its place passes ``fetch_into(address, view)``
    instead (returns the chunk's size, or None). Sizes are checked here (FORMAT.md
    12.3: DamagedChunkError); addresses and the container by :func:`decode`. With
    ``fetch_into`` and ``checked``, each chunk is also hashed by the thread that read
    it, while others are still in flight, and ``checked`` notes those that match.
    ``authenticated``: every chunk ``fetch_into`` places was opened under the store's
    key, its tag checked (FORMAT.md 18.5): ``checked`` notes it without a hash."""
    buf, first = _buffer_for(listed, fetch, ref, fetch_into)
    view = memoryview(buf)
    if fetch_into is not None:
        _read_into(listed, fetch_into, view, ref, threads, checked, first, authenticated)
        return buf
    pos = 0
    for i, (a, n) in enumerate(zip(listed.addresses, listed.sizes)):
        data = first if i == 0 and first is not None else _fetched(i, a, n, fetch(a, n), ref)
        view[pos:pos + n] = memoryview(data).cast("B")
        pos += n
    if pos != listed.length:
        raise CorruptCheckpointError(f"chunks add up to {pos} bytes, the listing says {listed.length}", ref=ref,
                                     section="chunk")
    return buf


def _check_got(i: int, address: bytes, size: int, got: int | None, ref: str | None) -> None:
    """Chunk ``i`` was there (``got``: its size; None: missing) at its listed size (12.3)."""
    if got is None:
        raise _chunk_error(i, address, "is missing from the store", ref, missing=True)
    if got != size:
        raise _chunk_error(i, address, f"holds {got} bytes, its listing says {size}", ref)


def _fetched(i: int, address: bytes, size: int, data, ref: str | None):
    """Chunk ``i`` as ``fetch`` returned it, checked to be there at its listed size (12.3),
    decoded first if it is stored compressed (12.9)."""
    if data is not None and memoryview(data).nbytes < size:
        data = _unframe(i, address, size, data, ref)
    _check_got(i, address, size, None if data is None else memoryview(data).nbytes, ref)
    return data


def _unframe(i: int, address: bytes, size: int, stored, ref: str | None, out=None):
    """Chunk ``i``, stored compressed (``stored``: shorter than its listed ``size``, rule
    12.9), decoded (into ``out`` when given). A frame that does not decode, whatever its
    header says, is damage to that chunk (rule 12.11)."""
    try:
        if out is None:
            return chunkcodec.decode(stored, encoded=True, raw_size=size)
        chunkcodec.decode_into(stored, out, encoded=True)
        return out
    except CorruptCheckpointError as e:
        raise _chunk_error(i, address, f"is stored as {memoryview(stored).nbytes} bytes of {size} and is not a "
                                       f"compressed chunk that decodes ({e.reason})", ref) from None


def _placed(i: int, address: bytes, size: int, got: int | None, view: memoryview, ref: str | None) -> None:
    """Chunk ``i`` was read into ``view`` (its listed ``size`` bytes) by a ``fetch_into``
    that returned ``got``: checked there at its size (12.3), and if it was stored
    compressed (its first ``got`` bytes, fewer than ``size``: 12.9), decoded in place."""
    if got is not None and got < size:
        _unframe(i, address, size, bytes(view[:got]), ref, out=view)
        got = size
    _check_got(i, address, size, got, ref)


def _buffer_for(listed: format.ChunkedContainer, fetch: Callable[[bytes, int], object], ref: str | None,
                fetch_into=None) -> tuple[np.ndarray, object]:
    """The buffer for a listed container's bytes, and its first chunk if that was read
    to get it. A listing of a few hundred bytes can claim terabytes (up to 2^24 chunks
    of 4 GiB each): before a large buffer is mapped, its first chunk must be in the
    store at the listed size, so a damaged or forged listing fails on its chunks, not
    by mapping and filling the memory it claims. That read is the chunk's one read:
    the caller places it rather than fetching it again (a ``fetch`` may hand each
    chunk out once, :func:`fetcher`), made the way the caller reads every other one
    (``fetch_into`` where given: a ``fetch`` may see only some of the chunks). A buffer
    the machine cannot give fails as an AgckError."""
    first = None
    if listed.length >= thresholds.LISTING_PROBE:
        a, n = listed.addresses[0], listed.sizes[0]
        if fetch_into is None:
            first = _fetched(0, a, n, fetch(a, n), ref)
        else:
            first = memoryview(bytearray(n))
            _placed(0, a, n, fetch_into(a, first), first, ref)
    try:
        return memory.new_buffer(listed.length), first   # a uint8 array, not zero-filled
    except MemoryError:
        raise StoreError(f"cannot allocate the {listed.length:,} bytes the checkpoint's listing names",
                         ref=ref, hint="read it on a machine with more memory; if it should be smaller, "
                                       "its listing is damaged: run agck verify") from None


def _in_shares(listed: format.ChunkedContainer, work: Callable[[int, int, list[int]], object], *,
               ref: str | None, name: str, threads: int | None = None) -> list:
    """``work(lo, hi, starts)`` over the listed chunks: for a large container on a few
    threads, each over a contiguous share of them (reads and BLAKE3 release the
    GIL); ``starts[i]`` is where chunk i begins. Returns each share's result, in order."""
    starts = [0]
    for n in listed.sizes:
        starts.append(starts[-1] + n)
    if starts[-1] != listed.length:
        raise CorruptCheckpointError(f"chunks add up to {starts[-1]} bytes, the listing says {listed.length}",
                                     ref=ref, section="chunk")
    count = len(listed.sizes)
    if threads is not None:     # a store whose reads wait on the network more than on the CPU
        k = max(1, min(threads, count))
    else:
        k = memory.threads() if listed.length >= thresholds.PARALLEL_READ and count > 1 else 1
    if k == 1:
        return [work(0, count, starts)]
    bounds = [0] + [bisect_left(starts, listed.length * j // k) for j in range(1, k)] + [count]
    with ThreadPoolExecutor(max_workers=k, thread_name_prefix=name) as pool:
        return [f.result() for f in [pool.submit(work, lo, hi, starts) for lo, hi in zip(bounds, bounds[1:])
                                     if hi > lo]]


def _read_into(listed: format.ChunkedContainer, fetch_into, view: memoryview, ref: str | None,
               threads: int | None = None, checked: chunking.CheckedChunks | None = None,
               first=None, authenticated: bool = False) -> None:
    """Each chunk read into its place (:func:`_in_shares`); hashed there too when
    ``checked`` is given (a mismatch is left for :func:`_raise_mismatch` to report).
    ``first``: chunk 0, already read (:func:`_buffer_for`), copied into place."""

    def read(lo: int, hi: int, starts: list[int]) -> int:
        hashed = 0
        for i in range(lo, hi):
            a, n = listed.addresses[i], listed.sizes[i]
            if i == 0 and first is not None:
                view[:n] = memoryview(first).cast("B")
                got = n
            else:
                got = fetch_into(a, view[starts[i]:starts[i] + n])
            _placed(i, a, n, got, view[starts[i]:starts[i] + n], ref)
            if checked is not None and a not in checked.addresses and (
                    authenticated or chunking.address(view[starts[i]:starts[i] + n]) == a):
                checked.addresses.add(a)     # a set's add is atomic: the reading threads share it
                hashed += 0 if authenticated else n
        return hashed

    hashed = _in_shares(listed, read, ref=ref, name="agck-read", threads=threads)
    if checked is not None:
        checked.hashed_bytes += sum(hashed)


def found_into(found: dict) -> Callable[[bytes, memoryview], int | None]:
    """A ``fetch_into`` for :func:`decode` over chunks already read (``found``: address ->
    stored bytes): each copied into its place, by the thread that then decodes it if it
    is stored compressed (12.9), so a large checkpoint's chunks decode on a few threads."""
    def into(address: bytes, view: memoryview) -> int | None:
        data = found.get(address)
        if data is None:
            return None
        d = memoryview(data).cast("B")
        n = min(d.nbytes, view.nbytes)
        view[:n] = d[:n]
        return d.nbytes

    return into


def fetcher(found: dict, addresses: list[bytes]) -> Callable[[bytes, int], object]:
    """A ``fetch`` for :func:`decode` over chunks already read (``found``: address ->
    bytes), that drops each chunk after its last use in ``addresses``."""
    uses: dict[bytes, int] = {}
    for a in addresses:
        uses[a] = uses.get(a, 0) + 1

    def fetch(address: bytes, size: int):
        left = uses.get(address, 0) - 1
        if left > 0:
            uses[address] = left
            return found.get(address)
        uses.pop(address, None)
        return found.pop(address, None)

    return fetch


@dataclass
class Live:
    """What a collector keeps (:func:`live_chunks`): every address a listing names."""

    addresses: set = field(default_factory=set)
    listings: int = 0                                  # listings read
    damaged: list = field(default_factory=list)        # refs of listings that fail verification (counted)
    unreadable: list = field(default_factory=list)     # refs of stored containers nothing can be read from

    @property
    def complete(self) -> bool:
        """Whether ``addresses`` is all that the store's listings name: when it is not,
        a collector deletes nothing (a chunk an unreadable listing names may be any)."""
        return not self.unreadable

    def collected(self, deleted_chunks: int = 0, deleted_bytes: int = 0) -> Collected:
        return Collected(listings=self.listings, live_chunks=len(self.addresses), deleted_chunks=deleted_chunks,
                         deleted_bytes=deleted_bytes, damaged=list(self.damaged), unreadable=list(self.unreadable))


def live_chunks(listings: Iterable[tuple[str, Callable[[], object]]]) -> Live:
    """What a collector keeps: every address any stored listing names, whatever its
    verdict. A verdict of damage deletes nothing by itself: the verdict may be wrong
    (a bug, a flaky read), and the listing's chunks are what a repair would need. A
    listing that fails verification is reported in ``damaged`` and its addresses
    kept as far as they can be read (:func:`agck.format.salvage_addresses`); one
    nothing can be read from goes to ``unreadable``, and the collector deletes
    nothing. ``listings`` gives each checkpoint's ref and a function returning its
    stored container's bytes (None: a standalone container, or gone meanwhile); a
    standalone container lists nothing. One of a newer format stops the collection
    (StoreError) before anything is deleted."""
    live = Live()
    for ref, load in listings:
        try:
            buf = load()
        except (CorruptCheckpointError, FormatError):     # its bytes could not be had whole
            live.unreadable.append(ref)
            continue
        if buf is None:
            continue
        try:
            addresses = listed_addresses(buf, verify=True, ref=ref)
        except UnsupportedVersionError as e:
            raise StoreError(f"a checkpoint of a newer format: {e.reason}", ref=ref,
                             hint="collect garbage with the agck version that wrote it") from None
        except (CorruptCheckpointError, FormatError):
            addresses = format.salvage_addresses(buf)
            if addresses is None:
                live.unreadable.append(ref)
                continue
            if not addresses:       # a damaged standalone container: it names no chunk (agck verify reports it)
                continue
            live.damaged.append(ref)
        if addresses is not None:
            live.addresses.update(addresses)
            live.listings += 1
    if live.unreadable:
        log.warning("agck: garbage collection deleted nothing: %d stored checkpoint(s) cannot be read, so the "
                    "chunks they may list are unknown (%s); run agck verify, and delete what you are sure of",
                    len(live.unreadable), ", ".join(live.unreadable[:3]))
    return live


def listed_addresses(buf, *, verify: bool, ref: str | None) -> list[bytes] | None:
    """The addresses a stored container lists, in order; None for a standalone one."""
    h = format.parse_header(buf, ref=ref)
    if not format.is_chunked(h):
        return None
    return format.open_chunked(format.open_container(buf, verify=bool(verify), ref=ref)).addresses


def decode(buf, fetch: Callable[[bytes, int], object], *, verify: bool, map_location, ref: str | None,
           fetch_into: Callable[[bytes, memoryview], int | None] | None = None,
           fetch_threads: int | None = None, authenticated: bool = False) -> Checkpoint:
    """Decode a stored container: a 1.0 container as it is, a chunked one by
    rebuilding its content from the store (``fetch``) first (FORMAT.md rules
    12.1-12.5). Verifying, every chunk is checked against its address (12.3:
    BLAKE3, about a quarter of the speed of the XXH3 pass it comes with), once
    for all the reads sharing ``verify`` when it is a CheckedChunks."""
    map_location = codec.check_map_location(map_location)   # before anything is read
    c = format.open_container(buf, verify=bool(verify), ref=ref)
    if not format.is_chunked(c.header):
        ck = checkpoint.decode(c, copy=False, map_location=map_location)
        ck.container = buf if verify else None
        return ck
    listed = format.open_chunked(c)                                  # 12.1, 12.2
    shared = isinstance(verify, chunking.CheckedChunks)
    checked = (verify if shared else chunking.CheckedChunks()) if verify else None
    # 12.3: every chunk there, of its size; read over a network, hashed as it arrives
    # (an encrypted store's chunks were opened, their tags checked: ``authenticated``, 18.5)
    authenticated = authenticated and fetch_into is not None
    inner = assemble(listed, fetch, ref=ref, fetch_into=fetch_into, threads=fetch_threads,
                     checked=checked if fetch_threads is not None or authenticated else None,
                     authenticated=authenticated)
    if verify:   # 12.3: and of the bytes its address names (those not hashed on arrival)
        _raise_mismatch(checked, listed, inner, ref)
    try:
        # 12.4. Many checkpoints verified together (``shared``): their chunks match their
        # addresses, so the payload is what its writer checksummed and is not hashed
        # again (header, metadata and footer are still checked).
        ic = format.open_container(inner, verify=bool(verify) and not shared, ref=ref)
        if format.is_chunked(ic.header):
            raise MalformedCheckpointError("the listed content is itself a chunked container (FORMAT.md 12.4)",
                                           ref=ref, section="chunk")
        ck = checkpoint.decode(ic, copy=False, map_location=map_location)
    except (CorruptCheckpointError, FormatError) as e:
        if not verify:   # unverified chunks: name a damaged one rather than what its bytes broke
            _raise_mismatch(chunking.CheckedChunks(), listed, inner, ref)
        if isinstance(e, UnsupportedVersionError) or not isinstance(e, FormatError):
            raise
        raise MalformedCheckpointError(f"the listed content is not an AGCK container ({e.reason})", ref=ref,
                                       section="chunk") from None
    for name in ("run", "step", "parent", "meta"):                    # 12.5
        if _packed(getattr(ck, name)) != _packed(getattr(listed, name)):
            says = "the listing's meta differs from its content's" if name == "meta" else \
                f"the listing says {name} {getattr(listed, name)!r}, its content {getattr(ck, name)!r}"
            raise MalformedCheckpointError(f"{says} (FORMAT.md 12.5)", ref=ref, section="chunk")
    ck.container = inner if verify else None
    return ck


def _raise_mismatch(checked: chunking.CheckedChunks, listed: format.ChunkedContainer, inner, ref) -> None:
    """Raise the chunk-level error naming the first chunk of ``inner`` whose bytes do
    not match its address, and carrying every such chunk's address (skipping those
    ``checked`` already knows); return if each matches. FORMAT.md 12.3."""
    view = memoryview(inner).cast("B")

    def check(lo: int, hi: int, starts: list[int]) -> tuple[int, list[int]]:
        share = chunking.CheckedChunks()
        share.addresses = checked.addresses     # one set: a chunk one share found intact, the others skip
        bad = share.mismatches(listed.addresses[lo:hi], listed.sizes[lo:hi], view[starts[lo]:starts[hi]])
        return share.hashed_bytes, [lo + i for i in bad]

    shares = _in_shares(listed, check, ref=ref, name="agck-hash")
    checked.hashed_bytes += sum(n for n, _ in shares)
    bad = [i for _, found in shares for i in found]
    if bad:
        i = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DamagedChunkError(f"chunk {i} ({listed.addresses[i].hex()[:16]}) does not match its address{more}",
                                ref=ref, damaged=tuple(dict.fromkeys(listed.addresses[j] for j in bad)))


def _chunk_error(i: int, address: bytes, what: str, ref: str | None, *, missing: bool = False) -> DamagedChunkError:
    return DamagedChunkError(f"chunk {i} ({address.hex()[:16]}) {what}", ref=ref,
                             **({"missing": (address,)} if missing else {"damaged": (address,)}))


def _packed(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True, unicode_errors="surrogatepass")
