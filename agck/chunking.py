"""Content-defined chunking of a container's bytes, and the chunks' content addresses.

A store that shares content between checkpoints keeps each checkpoint as the
list of chunks its container's bytes split into (FORMAT.md, "Chunked
containers"). Chunk boundaries are chosen by the content (FastCDC, a gear
rolling hash), not by offsets, so bytes an earlier checkpoint already held come
out as the same chunks even when what precedes them grew or shifted: a tensor
that did not change, the prefix of a list of records that only grew. Chunks
are named by BLAKE3-256 of their bytes.

A container is split as *pieces*, each starting and ending a chunk: the head
(header and metadata), each run of small blobs, each large blob, the footer.
So a large tensor's chunks do not depend on what precedes it, and the metadata
growing does not move the blobs' chunks. A large blob is cut on a fixed grid
(every ``LARGE_GRID`` bytes from its start), not by content: a tensor changes
in place or grows at its end, so the grid shares what content-defined cuts
would, without the rolling hash (the largest CPU cost of a checkpoint of new
tensors, 2.5 GB/s against BLAKE3's 6.7), and its chunks stay page-aligned
wherever the blob is, so they can be written with O_DIRECT straight from it.

Splitting is the CPU cost of a checkpoint that changed little, so a
:class:`Chunker` remembers the chunks of the last container it split, piece by
piece. A remembered chunk is taken again, without running the rolling hash or
BLAKE3 over it, when the new piece has a boundary at its start and the same
bytes up to its end, confirmed by a seeded XXH3-128 of those bytes (about 4x
cheaper than BLAKE3 and 8x cheaper than cutting). The result is exactly the
chunks a fresh split gives (a chunk's end depends only on its start and its
bytes), so remembering changes the cost, never the output. The seed is secret
to the process, so content cannot be crafted to collide with what it replaces.

Pure: buffers in, chunks (views) out. Which chunks a store already holds, and
durability, belong to the stores.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from itertools import accumulate
from typing import Hashable, Iterable, Iterator, Sequence

import blake3
import xxhash
from fastcdc import fastcdc_cy

from . import thresholds

DIGEST_SIZE = 32

# (min, avg, max) chunk sizes. Metadata changes in small places (a step number, the
# end of a growing list), so its chunks are small; inside a large blob, larger
# chunks keep the chunk count (and the listing) small at the same dedup rate.
HEAD = thresholds.HEAD_CHUNKS
SMALL = thresholds.SMALL_CHUNKS
LARGE_GRID = thresholds.LARGE_GRID
LARGE = (LARGE_GRID, LARGE_GRID, LARGE_GRID)   # min == max: a fixed grid, not content-defined
LARGE_PART = thresholds.LARGE_PART          # a part this big is a piece of its own, cut with LARGE sizes
_WINDOW_CHUNKS = 4            # bytes spread over several buffers are gathered this many max chunks at a time


def address(chunk) -> bytes:
    """A chunk's content address: BLAKE3-256 of its bytes (32 bytes)."""
    return blake3.blake3(chunk).digest()


class CheckedChunks:
    """Addresses of chunks whose bytes were found to match them. Passed as
    ``verify`` to a store's ``read``, it makes each chunk be hashed once across
    all the checkpoints read with it (``agck verify`` of a run whose
    checkpoints share most of their chunks): a chunked checkpoint whose chunks
    all match their addresses holds exactly the bytes its writer checksummed."""

    def __init__(self):
        self.addresses: set[bytes] = set()
        self.hashed_bytes = 0

    def __bool__(self) -> bool:   # it means "verify"
        return True

    def mismatches(self, addresses: Sequence[bytes], sizes: Sequence[int], data) -> list[int]:
        """The indexes of the chunks of ``data`` (the chunks' bytes, in order) that do
        not match their address, checking only those not checked before."""
        view = memoryview(data).cast("B")
        pos, bad, wrong = 0, [], set()
        for i, (a, n) in enumerate(zip(addresses, sizes)):
            if a in wrong:
                bad.append(i)
            elif a not in self.addresses:
                if address(view[pos:pos + n]) != a:
                    bad.append(i)
                    wrong.add(a)
                else:
                    self.addresses.add(a)
                    self.hashed_bytes += n
            pos += n
        return bad


def _byte_view(part) -> memoryview:
    v = part if isinstance(part, memoryview) else memoryview(part)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


class _Piece:
    """The bytes of one piece, held as consecutive buffers (no copy)."""

    def __init__(self, buffers: Sequence):
        self.buffers = [_byte_view(b) for b in buffers]
        self.starts = [0] + list(accumulate(b.nbytes for b in self.buffers))
        self.length = self.starts[-1]

    def views(self, s: int, e: int) -> Iterator[memoryview]:
        i = bisect_right(self.starts, s) - 1
        while s < e:
            b, b0 = self.buffers[i], self.starts[i]
            take = min(e, b0 + b.nbytes)
            if take > s:
                yield b[s - b0:take - b0]
            s = take
            i += 1

    def contiguous(self, s: int, e: int) -> memoryview:
        """Bytes [s, e): a view when one buffer holds them, else a copy."""
        parts = list(self.views(s, e))
        if len(parts) == 1:
            return parts[0]
        return memoryview(b"".join(parts))


class PieceChunk:
    """One chunk of a piece: its address and size; :meth:`view` gives its bytes
    (a view, or a copy where the chunk spans buffers: made only when asked, as
    a store asks only for the chunks it lacks)."""

    __slots__ = ("address", "nbytes", "fresh", "_piece", "_start", "_view")

    def __init__(self, address: bytes, piece: _Piece, start: int, end: int, view: memoryview | None = None):
        self.address = address
        self.nbytes = end - start
        self.fresh = view is not None   # cut, and its address computed, from these bytes this time
        self._piece, self._start, self._view = piece, start, view

    def view(self) -> memoryview:
        if self._view is None:
            self._view = self._piece.contiguous(self._start, self._start + self.nbytes)
        return self._view


class PieceChunks:
    """The chunks of one piece, in order, as parallel lists (a piece of a large
    state has thousands: no object per chunk unless asked, :meth:`__iter__`)."""

    __slots__ = ("piece", "starts", "sizes", "addresses", "fresh", "itemsize")

    def __init__(self, piece: _Piece):
        self.piece = piece
        # the element size of the floating-point values the piece holds, when all of them
        # share one (2, 4 or 8: how a store may compress its chunks); None otherwise
        self.itemsize: int | None = None
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.addresses: list[bytes] = []
        self.fresh: dict[int, memoryview] = {}   # chunks cut this time: their bytes, already gathered

    def __len__(self) -> int:
        return len(self.addresses)

    def chunk(self, i: int) -> PieceChunk:
        s = self.starts[i]
        return PieceChunk(self.addresses[i], self.piece, s, s + self.sizes[i], self.fresh.get(i))

    def __iter__(self) -> Iterator[PieceChunk]:
        return map(self.chunk, range(len(self.addresses)))


class _Memory:
    """The chunks of one piece of the last container (parallel lists: start, end,
    address and seeded XXH3-128 of each), and an XXH3-128 state over the piece's
    bytes up to ``prefix_end``: the end of its last chunk that was cut by content
    (not by the piece's end). A new piece whose first ``prefix_end`` bytes hash
    the same takes all those chunks at once: a list that only grew costs one pass
    of XXH3 and no work per chunk."""
    __slots__ = ("length", "starts", "ends", "addresses", "checks", "_by_start", "prefix_end", "prefix_count",
                 "prefix_hash", "failed")

    def __init__(self, length: int, starts, ends, addresses, checks, prefix_hash, failed: bool):
        self.length, self.failed = length, failed
        self.starts, self.ends, self.addresses, self.checks = starts, ends, addresses, checks
        self._by_start = None
        n = len(starts)
        if n and ends[-1] == length:
            n -= 1
        self.prefix_count = n
        self.prefix_end = ends[n - 1] if n else 0
        self.prefix_hash = prefix_hash   # an xxh3_128 over [0, prefix_end)

    def at(self, start: int) -> int | None:
        """The index of the chunk that started at ``start``, if one did."""
        if self._by_start is None:
            self._by_start = {s: i for i, s in enumerate(self.starts)}
        return self._by_start.get(start)


class Chunker:
    """Splits the successive containers of one run into chunks.

    Call :meth:`split_piece` for each piece of a container in order, then
    :meth:`done`: the chunks of the pieces split since the last ``done`` become
    what the next container is compared with (by piece key)."""

    def __init__(self, remember: bool = True):
        self.remember = remember
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._last: dict[Hashable, _Memory] = {}
        self._next: dict[Hashable, _Memory] = {}
        self.reused_bytes = 0        # bytes taken from remembered chunks, since the last done()
        self.cut_bytes = 0           # bytes cut and hashed afresh

    def split_piece(self, key: Hashable, buffers: Sequence, sizes: tuple[int, int, int], *,
                    grows: bool = False) -> tuple[PieceChunks, list[bool]]:
        """The piece's chunks, and for each buffer whether all its bytes were found
        unchanged at the same place of the last container's piece ``key``.

        ``grows``: the piece usually grows at its end (the open end of a list that is
        appended to). Its last chunk, cut by the piece's end rather than by content,
        is kept when the same bytes are there again, and only what follows it is cut:
        a checkpoint then writes what was appended, not the last chunk again. The
        chunks then depend on how the piece grew, not on its bytes alone (any split
        is valid); a piece that is not ``grows`` is always cut as a fresh split."""
        p = _Piece(buffers)
        out = PieceChunks(p)
        mem = self._last.get((key, sizes))
        starts, ends, addresses, checks = [], [], [], []   # what is remembered for next time
        kept: list[tuple[int, int]] = []
        pos = 0
        prefix = None     # (end, hash state) of bytes known to equal the last piece's
        failed = False
        # A piece cut on a fixed grid has few, large chunks: they are confirmed one by one
        # (which stops at the first changed one), not by one pass over the whole prefix
        # that, when the piece changed, finds out only at the end and hashes it all again.
        grid = sizes[0] == sizes[2]
        if mem is not None and not grid and mem.prefix_count and mem.prefix_end <= p.length and not mem.failed:
            # (after a miss the check is skipped once, so a piece that always changes pays it half the time)
            h = xxhash.xxh3_128(seed=self._seed)
            for v in p.views(0, mem.prefix_end):
                h.update(v)
            if h.intdigest() == mem.prefix_hash.intdigest():
                n = mem.prefix_count
                starts, ends, addresses, checks = mem.starts[:n], mem.ends[:n], mem.addresses[:n], mem.checks[:n]
                kept.append((0, mem.prefix_end))
                pos = mem.prefix_end
                prefix = (pos, h)
                self.reused_bytes += pos
            else:
                failed = True
        last_len = 0 if mem is None else mem.length
        while pos < p.length:
            i = None if mem is None else mem.at(pos)
            # A remembered chunk that ended where its piece ended was cut by the end, not
            # by its content: it is the same chunk only if this piece ends there too.
            if i is not None:
                end = mem.ends[i]
                if (end <= p.length and (end < last_len or end == p.length or grows)
                        and self._check(p, pos, end) == mem.checks[i]):
                    starts.append(pos)
                    ends.append(end)
                    addresses.append(mem.addresses[i])
                    checks.append(mem.checks[i])
                    if kept and kept[-1][1] == pos:
                        kept[-1] = (kept[-1][0], end)
                    else:
                        kept.append((pos, end))
                    self.reused_bytes += end - pos
                    pos = end
                    continue
            for s, e, view in _cut(p, pos, sizes, stop=mem):
                out.fresh[len(starts)] = view
                starts.append(s)
                ends.append(e)
                addresses.append(address(view))
                checks.append(self._check(p, s, e) if self.remember else 0)
                self.cut_bytes += e - s
                pos = e
        out.starts, out.addresses = starts, addresses
        out.sizes = [e - s for s, e in zip(starts, ends)]
        if self.remember and grid:
            self._next[(key, sizes)] = _Memory(p.length, starts, ends, addresses, checks, None, failed)
        elif self.remember:
            n = len(ends) - (1 if ends and ends[-1] == p.length else 0)
            end = ends[n - 1] if n else 0
            start, h = prefix if prefix is not None and prefix[0] <= end else (0, xxhash.xxh3_128(seed=self._seed))
            for v in p.views(start, end):
                h.update(v)
            self._next[(key, sizes)] = _Memory(p.length, starts, ends, addresses, checks, h, failed)
        return out, _covered(p.starts, kept)

    def done(self) -> None:
        """The pieces split since the last call are what the next container is compared with."""
        self._last, self._next = self._next, {}
        self.reused_bytes = self.cut_bytes = 0

    def _check(self, p: _Piece, s: int, e: int) -> int:
        i = bisect_right(p.starts, s) - 1
        if e <= p.starts[i + 1]:
            b0 = p.starts[i]
            return xxhash.xxh3_128_intdigest(p.buffers[i][s - b0:e - b0], self._seed)
        h = xxhash.xxh3_128(seed=self._seed)
        for v in p.views(s, e):
            h.update(v)
        return h.intdigest()


def _cut(p: _Piece, pos: int, sizes, stop: _Memory | None) -> Iterator[tuple[int, int, memoryview]]:
    """Fresh chunks of ``p`` from ``pos`` (a boundary) until the piece ends or a
    chunk ends where a remembered one starts (the caller then tries that one).
    Bytes spread over several buffers are gathered a window at a time; the last
    chunk of a window that is not the piece's end was cut by the window, so it
    is cut again from its start with the next window."""
    lo, avg, hi = sizes
    if lo == hi:     # a fixed grid: a chunk ends at the next multiple of ``hi`` (the piece starts on one)
        while pos < p.length:
            e = min(p.length, pos + hi - pos % hi)
            yield pos, e, p.contiguous(pos, e)
            if stop is not None and stop.at(e) is not None:
                return
            pos = e
        return
    while pos < p.length:
        i = bisect_right(p.starts, pos) - 1
        end = p.length if p.starts[i + 1] == p.length else min(p.length, pos + _WINDOW_CHUNKS * hi)
        window = p.contiguous(pos, end)
        if window.nbytes <= lo:
            yield pos, end, window
            return
        done = pos
        for c in fastcdc_cy.chunk_generator(window, lo, avg, hi, False, None):
            s, e = pos + c.offset, pos + c.offset + c.length
            if e == end < p.length:
                break
            yield s, e, window[c.offset:c.offset + c.length]
            if stop is not None and stop.at(e) is not None:
                return
            done = e
        pos = done


def _covered(starts: list[int], kept: list[tuple[int, int]]) -> list[bool]:
    """For each buffer (``starts``: their offsets, then the end): is it inside one of
    the ``kept`` ranges (sorted, disjoint, adjacent ones merged)?"""
    out = []
    j, n = 0, len(kept)
    for b0, b1 in zip(starts, starts[1:]):
        while j < n and kept[j][1] < b1:
            j += 1
        out.append(b0 == b1 or (j < n and kept[j][0] <= b0))
    return out


MAX_CHUNK = 64 << 20      # not a threshold: the largest chunk any grid cuts (grid's bound); reads are bounded by it


def grid(nbytes: int) -> tuple[int, int, int]:
    """The chunk sizes of a fixed grid of ``nbytes`` (a power of two from 256 KiB to
    64 MiB): what a store that pays per request cuts large blobs with (LARGE is 1 MiB)."""
    ok = isinstance(nbytes, int) and (256 << 10) <= nbytes <= MAX_CHUNK   # not a threshold: the grids accepted
    if not ok or nbytes & (nbytes - 1):
        raise ValueError(f"a chunk grid is a power of two from 256 KiB to 64 MiB, not {nbytes!r}")
    return (nbytes, nbytes, nbytes)


def pieces(sizes: Sequence[int], large: tuple[int, int, int] = LARGE
           ) -> list[tuple[Hashable, list[int], tuple[int, int, int]]]:
    """How consecutive parts of ``sizes`` bytes group into pieces: (key, the parts'
    indices, chunk sizes). A part of ``LARGE_PART`` bytes or more is a piece of its
    own cut with ``large`` sizes (``LARGE``: every 1 MiB); each run of smaller parts
    one piece cut with ``SMALL`` sizes. Keys number the pieces in order."""
    out: list = []
    run: list[int] = []
    for i, n in enumerate(sizes):
        if n >= LARGE_PART:
            if run:
                out.append((("run", len(out)), run, SMALL))
                run = []
            out.append((("large", len(out)), [i], large))
        else:
            run.append(i)
    if run:
        out.append((("run", len(out)), run, SMALL))
    return out


def split(parts: Iterable) -> Iterator[memoryview]:
    """The concatenation of ``parts`` as consecutive chunks (views), with no memory
    of earlier splits: each part of ``LARGE_PART`` bytes or more a piece of its
    own cut with ``LARGE`` sizes, each run of smaller parts one piece cut with
    ``SMALL`` sizes."""
    views = [_byte_view(p) for p in parts]
    chunker = Chunker(remember=False)
    for key, members, sizes in pieces([v.nbytes for v in views]):
        yield from (c.view() for c in chunker.split_piece(key, [views[i] for i in members], sizes)[0])
