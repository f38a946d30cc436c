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
