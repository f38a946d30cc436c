"""Content-defined chunking of a container's bytes, and the chunks' content addresses.

A store that shares content between checkpoints keeps each checkpoint as the
list of chunks its container's bytes split into (FORMAT.md, "Chunked
containers"). Chunk boundaries are chosen by the content (FastCDC, a gear
rolling hash), not by offsets, so bytes an earlier checkpoint already held come
out as the same chunks even when what precedes them grew or shifted: a tensor
that did not change, the prefix of a list of records that only grew. Chunks
are named by BLAKE3-256 of their bytes.

Pure: buffers in, chunks (views) out. Which chunks a store already holds, and
durability, belong to the stores.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import blake3
from fastcdc import fastcdc_cy

DIGEST_SIZE = 32

# (min, avg, max) chunk sizes. Metadata, the state tree, small blobs and the footer
# change in small places, so their chunks are small; inside a large blob, larger
# chunks keep the chunk count (and the listing) small at the same dedup rate.
SMALL = (16 << 10, 64 << 10, 256 << 10)
LARGE = (256 << 10, 1 << 20, 4 << 20)
LARGE_PART = 4 << 20          # a part this big is chunked in place, with its own boundaries
_WINDOW = 4 * SMALL[2]        # small parts are gathered until this much is pending


def address(chunk) -> bytes:
    """A chunk's content address: BLAKE3-256 of its bytes (32 bytes)."""
    return blake3.blake3(chunk).digest()


def _cut(view: memoryview, sizes: tuple[int, int, int]) -> list[memoryview]:
    lo, avg, hi = sizes
    if view.nbytes <= lo:
        return [view]
    return [view[c.offset:c.offset + c.length] for c in fastcdc_cy.chunk_generator(view, lo, avg, hi, False, None)]


def split(parts: Iterable) -> Iterator[memoryview]:
    """The concatenation of ``parts`` as consecutive chunks (views).

    A part of ``LARGE_PART`` bytes or more starts and ends a chunk and is cut
    in place; smaller parts are gathered into a window (one copy) and cut
    together, carrying the last, open-ended chunk into the next window so every
    boundary depends on content alone. Each chunk stays valid after the next
    one is produced."""
    window = bytearray()
    for part in parts:
        view = memoryview(part).cast("B") if not isinstance(part, memoryview) or part.format != "B" else part
        if view.nbytes >= LARGE_PART:
            if window:
                yield from _cut(memoryview(window), SMALL)
                window = bytearray()
            yield from _cut(view, LARGE)
            continue
        window += view
        if len(window) >= _WINDOW:
            pieces = _cut(memoryview(window), SMALL)
            yield from pieces[:-1]
            window = bytearray(pieces[-1])  # a new object: the views already produced stay valid
    if window:
        yield from _cut(memoryview(window), SMALL)
