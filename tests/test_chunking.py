"""Content-defined chunking: exact reassembly, and shared chunks where content is shared."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from agck import chunking


def _join(chunks) -> bytes:
    return b"".join(bytes(c) for c in chunks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3 * chunking.SMALL[2]), max_size=12), st.integers(0, 2**32 - 1))
def test_split_reassembles_exactly(sizes, seed):
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    chunks = list(chunking.split(parts))
    assert _join(chunks) == b"".join(parts)
    assert all(c.nbytes > 0 for c in chunks)
    assert all(c.nbytes <= chunking.LARGE[2] for c in chunks)


def test_large_parts_are_cut_in_place_and_bounded():
    big = os.urandom(chunking.LARGE_PART + 12345)
    chunks = list(chunking.split([b"head", big, b"tail"]))
    assert _join(chunks) == b"head" + big + b"tail"
    assert all(c.nbytes <= chunking.LARGE[2] for c in chunks)
    # a large part starts a chunk: its chunks do not depend on what precedes it
    alone = [bytes(c) for c in chunking.split([big])]
    assert alone == [bytes(c) for c in chunks[1:-1]]


def test_a_large_part_is_cut_on_a_fixed_grid_from_its_start():
    """Every ``LARGE_GRID`` bytes from the blob's start, so a chunk of a page-aligned
    blob is page-aligned too (O_DIRECT can write it from where it is), and a change
    in place costs the chunks it touches."""
    big = np.random.default_rng(2).integers(0, 256, 5 * chunking.LARGE_GRID + 777, dtype=np.uint8)
    c = chunking.Chunker()
    first, _ = c.split_piece("t", [big], chunking.LARGE)
    c.done()
    assert first.sizes == [chunking.LARGE_GRID] * 5 + [777]
    assert first.starts == [i * chunking.LARGE_GRID for i in range(6)]
    big[3 * chunking.LARGE_GRID + 5] ^= 1
    again, same = c.split_piece("t", [big], chunking.LARGE)
    assert c.cut_bytes == chunking.LARGE_GRID and not same[0]
    assert [a == b for a, b in zip(again.addresses, first.addresses)] == [True, True, True, False, True, True]
    assert list(again.fresh) == [3]


def test_chunks_stay_valid_while_later_ones_are_produced():
    parts = [os.urandom(50_000) for _ in range(40)]
    kept = [c for c in chunking.split(parts)]          # views held past their turn
    assert _join(kept) == b"".join(parts)


def _addresses(parts) -> list[bytes]:
    return [chunking.address(c) for c in chunking.split(parts)]


def test_appending_shares_all_but_the_last_chunks():
    rng = np.random.default_rng(1)
    items = [rng.random(16384, dtype=np.float32).tobytes() for _ in range(300)]   # 64 KiB each
    before = _addresses([b"H" * 300] + items[:200] + [b"F" * 800])
    after_parts = [b"H" * 301] + items[:220] + [b"F" * 880]
    after = chunking.split(after_parts)
    known = set(before)
    new = sum(c.nbytes for c in after if chunking.address(c) not in known)
    grown = 20 * 64 * 1024
    assert new < grown + 4 * chunking.SMALL[2], (new, grown)


def test_an_unchanged_large_tensor_is_shared_whatever_precedes_it():
    model = os.urandom(3 * chunking.LARGE_PART)
    own = set(_addresses([model]))
    assert own <= set(_addresses([os.urandom(1000), model, b"x"]))
    assert own <= set(_addresses([os.urandom(777_777), b"z" * 5, model, b"yy"]))


def test_address_is_blake3_256():
    blake3 = pytest.importorskip("blake3")
    assert chunking.address(b"abc") == blake3.blake3(b"abc").digest()
    assert len(chunking.address(b"")) == chunking.DIGEST_SIZE == 32


# --- a Chunker that remembers: the same chunks as a fresh split, at the cost of what changed ---

def _split_all(chunker, pieces):
    out = []
    for key, buffers, sizes in pieces:
        chunks, same = chunker.split_piece(key, buffers, sizes)
        out.append(([(c.address, bytes(c.view())) for c in chunks], same))
    chunker.done()
    return out


_SIZES = [chunking.HEAD, chunking.SMALL, (8192, 8192, 8192)]   # the last: a fixed grid, as LARGE is


def _edit(rng, buffers):
    """One edit a pipeline's state may see between two checkpoints."""
    buffers = [bytearray(b) for b in buffers]
    kind = rng.integers(0, 6)
    if kind == 0:                       # append items
        buffers += [bytearray(rng.integers(0, 256, rng.integers(1, 90_000), dtype=np.uint8).tobytes())
                    for _ in range(rng.integers(1, 4))]
    elif kind == 1 and buffers:         # change bytes in place (same length)
        b = buffers[rng.integers(0, len(buffers))]
        if b:
            i = rng.integers(0, len(b))
            b[i] ^= 0xFF
    elif kind == 2 and buffers:         # insert an item in the middle: everything after shifts
        buffers.insert(rng.integers(0, len(buffers)), bytearray(os.urandom(int(rng.integers(1, 5000)))))
    elif kind == 3 and len(buffers) > 1:   # drop the last items
        buffers = buffers[:rng.integers(1, len(buffers))]
    elif kind == 4 and buffers:         # grow one item at its end
        buffers[-1] += os.urandom(int(rng.integers(1, 3000)))
    return [bytes(b) for b in buffers]  # kind 5: nothing changed


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2))
def test_remembered_chunks_are_exactly_a_fresh_split(seed, which):
    rng = np.random.default_rng(seed)
    sizes = _SIZES[which]
    buffers = [os.urandom(int(n)) for n in rng.integers(1, 60_000, rng.integers(1, 8))]
    remembering = chunking.Chunker()
    before = None
    for _ in range(6):
        pieces = [("p", buffers, sizes)]
        got = _split_all(remembering, pieces)
        want = _split_all(chunking.Chunker(remember=False), pieces)
        assert [c for c, _ in got] == [c for c, _ in want]
        # a buffer reported unchanged holds the same bytes at the same place as last time
        if before is not None:
            old = b"".join(before)
            pos = 0
            for b, same in zip(buffers, got[0][1]):
                if same:
                    assert old[pos:pos + len(b)] == b
                pos += len(b)
        before = buffers
        buffers = _edit(rng, buffers)


def test_an_unchanged_piece_is_not_cut_or_hashed_again():
    rng = np.random.default_rng(3)
    items = [rng.random(16384, dtype=np.float32).tobytes() for _ in range(100)]
    c = chunking.Chunker()
    c.split_piece("run", items, chunking.SMALL)
    c.done()
    c.split_piece("run", items + [os.urandom(65536)], chunking.SMALL)
    assert c.reused_bytes >= 100 * 65536 - chunking.SMALL[2]     # all but the open last chunk
    assert c.cut_bytes <= 65536 + chunking.SMALL[2]


def test_a_piece_under_another_key_or_sizes_is_not_compared():
    data = [os.urandom(200_000)]
    c = chunking.Chunker()
    c.split_piece("a", data, chunking.SMALL)
    c.done()
    c.split_piece("b", data, chunking.SMALL)
    c.split_piece("a", data, chunking.HEAD)
    assert c.reused_bytes == 0


def test_a_piece_that_only_grew_is_confirmed_in_one_pass(monkeypatch):
    """The bytes up to the last chunk cut by content are confirmed by one XXH3 over
    them, not chunk by chunk; a change anywhere in them falls back to chunk by chunk."""
    rng = np.random.default_rng(5)
    items = [rng.random(16384, dtype=np.float32).tobytes() for _ in range(200)]
    c = chunking.Chunker()
    c.split_piece("run", items, chunking.SMALL)
    c.done()
    checks = []
    real = chunking.Chunker._check
    monkeypatch.setattr(chunking.Chunker, "_check", lambda self, p, s, e: checks.append(s) or real(self, p, s, e))
    grown = items + [os.urandom(65536)]
    got, same = c.split_piece("run", grown, chunking.SMALL)
    c.done()
    assert len(checks) <= 4                               # the open last chunk and the new ones only
    assert all(same[:199]) and not same[-1]
    want = chunking.Chunker(remember=False).split_piece("run", grown, chunking.SMALL)[0]
    assert got.addresses == want.addresses and got.sizes == want.sizes
    changed = list(grown)
    changed[50] = os.urandom(65536)
    checks.clear()
    got, same = c.split_piece("run", changed, chunking.SMALL)
    assert len(checks) > 100                              # the prefix did not match: chunk by chunk
    assert not same[50] and all(same[:45])               # (a chunk may span the edge of item 50)
    want = chunking.Chunker(remember=False).split_piece("run", changed, chunking.SMALL)[0]
    assert got.addresses == want.addresses


def test_a_growing_piece_keeps_its_last_chunk_and_cuts_only_what_was_appended():
    """``grows``: the chunk that ended where the piece ended is kept when its bytes
    are there again, so an append writes the appended bytes only; every chunk still
    holds the bytes at its place."""
    data = os.urandom(40_000)
    c = chunking.Chunker()
    first, _ = c.split_piece("tail", [data], chunking.HEAD, grows=True)
    c.done()
    more = data + os.urandom(2_000)
    got, _ = c.split_piece("tail", [more], chunking.HEAD, grows=True)
    assert got.addresses[:len(first)] == first.addresses          # all of the old chunks, the last one too
    assert got.sizes[len(first):] == [2_000]                       # and one new chunk: the appended bytes
    assert c.cut_bytes == 2_000
    pos = 0
    for a, n in zip(got.addresses, got.sizes):
        assert chunking.address(more[pos:pos + n]) == a
        pos += n
    c.done()
    fresh = chunking.Chunker()                                     # without grows: a fresh split, always
    fresh.split_piece("tail", [data], chunking.HEAD)
    fresh.done()
    again, _ = fresh.split_piece("tail", [more], chunking.HEAD)
    want = chunking.Chunker(remember=False).split_piece("tail", [more], chunking.HEAD)[0]
    assert again.addresses == want.addresses
