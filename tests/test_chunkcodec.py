"""Chunk encoding: round trips, verification before a frame is returned, and frames
refused whole (damaged, newer, hostile) with an agck error, never wrong bytes."""

from __future__ import annotations

import os
import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings, strategies as st

from agck import chunkcodec, chunking
from agck.chunkcodec import HEADER_SIZE, MAGIC, Method, decode, decode_into, encode
from agck.errors import AgckError, CorruptCheckpointError, UsageError


def _content(kind: str, n: int, seed: int) -> bytes:
    """Chunks of the kinds a checkpoint holds: floats, text, zeros, noise."""
    rng = np.random.default_rng(seed)
    if kind == "fp32":
        return (rng.standard_normal(n // 4 + 1).astype(np.float32) * 0.02).tobytes()[:n]
    if kind == "bf16":
        words = (rng.standard_normal(n // 2 + 1).astype(np.float32) * 0.02).view(np.uint32) >> 16
        return words.astype("<u2").tobytes()[:n]
    if kind == "text":
        words = [b"the", b"state", b"of", b"a", b"graph", b"message", b"tool", b"call", b"reply"]
        return b" ".join(words[i] for i in rng.integers(0, len(words), n // 2 + 1))[:n]
    if kind == "zeros":
        return bytes(n)
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["fp32", "bf16", "text", "zeros", "noise"]),
       n=st.one_of(st.sampled_from([0, 1, 2, 3, 7, 9, 15, 17]), st.integers(0, 40_000)),
       seed=st.integers(0, 2**32 - 1), itemsize=st.sampled_from([None, 1, 2, 4, 8]),
       mode=st.sampled_from(["auto", "zstd", "none"]), level=st.sampled_from([-3, 1, 3]))
def test_every_mode_round_trips(kind, n, seed, itemsize, mode, level):
    raw = _content(kind, n, seed)
    e = encode(raw, itemsize=itemsize, mode=mode, level=level)
    assert e.address == chunking.address(raw) and e.raw_size == n and e.mismatch is None
    if e.encoded:
        assert mode != "none" and len(e.stored) <= n * (1 - chunkcodec.MIN_SAVING)
        expected = Method.PLANES_ZSTD if mode == "auto" and itemsize in (2, 4, 8) else Method.ZSTD
        assert e.method is expected
    else:
        assert e.stored is raw   # raw chunks are stored as they are, not copied
    assert bytes(decode(e.stored, encoded=e.encoded, raw_size=n, address=e.address)) == raw
    out = bytearray(n)
    decode_into(e.stored, memoryview(out), encoded=e.encoded, address=e.address)
    assert out == raw


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 5000), itemsize=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**32 - 1))
def test_planes_are_bytes_of_each_element_then_the_partial_one(n, itemsize, seed):
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    planes = chunkcodec.split_planes(raw.tobytes(), itemsize)
    whole = n // itemsize * itemsize
    expected = np.concatenate([raw[k:whole:itemsize] for k in range(itemsize)] + [raw[whole:]])
    assert planes.tobytes() == expected.tobytes()
    back = np.empty(n, np.uint8)
    chunkcodec.join_planes(planes.tobytes(), back, itemsize)
    assert back.tobytes() == raw.tobytes()


def test_frame_layout_byte_by_byte():
    """The frame of FORMAT.md rule 12.10, field by field."""
    raw = _content("fp32", 4096 + 3, 1)
    e = encode(raw, itemsize=4)
    assert e.method is Method.PLANES_ZSTD
    assert e.stored[:HEADER_SIZE] == b"AGCZ" + bytes([1, 2, 4]) + struct.pack("<Q", len(raw))
    content = zstandard.ZstdDecompressor().decompress(e.stored[HEADER_SIZE:])
    assert content == chunkcodec.split_planes(raw, 4).tobytes()
    z = encode(bytes(5000), mode="zstd")
    assert z.stored[:HEADER_SIZE] == b"AGCZ" + bytes([1, 1, 0]) + struct.pack("<Q", 5000)
    assert zstandard.ZstdDecompressor().decompress(z.stored[HEADER_SIZE:]) == bytes(5000)
    assert chunkcodec.read_header(z.stored) == chunkcodec.FrameHeader(1, Method.ZSTD, 0, 5000)


def _corrupting(data, level):
    """A compressor that returns a valid zstd frame of bytes one bit away from its input."""
    wrong = bytearray(data)
    wrong[len(wrong) // 2] ^= 0x10
    return zstandard.ZstdCompressor(level=level).compress(bytes(wrong))


@pytest.mark.parametrize("itemsize", [None, 4])
@pytest.mark.parametrize("compressor", [_corrupting, lambda data, level: b"not a zstd frame at all" * 3,
                                        lambda data, level: zstandard.ZstdCompressor(write_content_size=False)
                                        .compress(bytes(data))])
def test_a_compressed_form_that_does_not_decode_to_the_address_is_stored_raw(itemsize, compressor):
    raw = _content("text", 50_000, 7)
    e = encode(raw, itemsize=itemsize, compressor=compressor)
    assert e.method is Method.RAW and not e.encoded and e.stored is raw
    assert e.mismatch is (Method.PLANES_ZSTD if itemsize else Method.ZSTD)
    assert e.address == chunking.address(raw)


def test_an_address_given_by_the_caller_is_what_the_frame_is_verified_against():
    raw = bytes(10_000)
    assert encode(raw, address=chunking.address(raw)).encoded
    e = encode(raw, address=chunking.address(b"other bytes"))
    assert e.method is Method.RAW and e.mismatch is Method.ZSTD


def _small_frames():
    raw = _content("fp32", 2001, 3)   # small, and not a multiple of the itemsize
    planes = encode(raw, itemsize=4)
    text = _content("text", 600, 3)
    plain = encode(text, mode="zstd")
    assert planes.method is Method.PLANES_ZSTD and plain.method is Method.ZSTD
    return [(raw, planes), (text, plain)]


def test_every_single_byte_change_of_a_header_is_refused():
    """With the address checked, no value of any header byte gives bytes back; without
    it, only an itemsize swapped for another plane size decodes (to other bytes)."""
    for raw, e in _small_frames():
        for offset in range(HEADER_SIZE):
            for value in range(256):
                if value == e.stored[offset]:
                    continue
                bad = bytearray(e.stored)
                bad[offset] = value
                with pytest.raises(AgckError):
                    decode(bad, encoded=True, raw_size=len(raw), address=e.address)
                with pytest.raises(AgckError):
                    decode_into(bad, bytearray(len(raw)), encoded=True, address=e.address)
                try:
                    got = decode(bad, encoded=True, raw_size=len(raw))
                except AgckError:
                    continue
                assert offset == 6 and value in (2, 8) and got != raw


def test_a_changed_payload_is_refused_or_decodes_to_bytes_the_address_refuses():
    for raw, e in _small_frames():
        for offset in range(HEADER_SIZE, len(e.stored)):
            for flip in (0x01, 0x80, 0xFF):
                bad = bytearray(e.stored)
                bad[offset] ^= flip
                try:
                    got = decode(bad, encoded=True, raw_size=len(raw))
                except AgckError:
                    continue
                if got != raw:   # zstd took it: the address is what tells
                    with pytest.raises(CorruptCheckpointError, match="do not match its address"):
                        decode(bad, encoded=True, raw_size=len(raw), address=e.address)


def test_a_truncated_or_extended_frame_is_refused():
    for raw, e in _small_frames():
        for cut in range(len(e.stored)):
            with pytest.raises(AgckError):
                decode(e.stored[:cut], encoded=True, raw_size=len(raw))
        with pytest.raises(CorruptCheckpointError):
            decode(e.stored + b"\0", encoded=True, raw_size=len(raw))
        with pytest.raises(CorruptCheckpointError):
            decode(e.stored + e.stored[HEADER_SIZE:], encoded=True, raw_size=len(raw))


@pytest.mark.parametrize("offset,value", [(4, 2), (4, 255), (5, 3), (5, 200)])
def test_an_unknown_version_or_method_is_damage(offset, value):
    """FORMAT.md 12.11: the frame header has no checksum, so a flipped version or method
    byte must not read as a newer format (which no verdict, and no quarantine, follows)."""
    raw, e = _small_frames()[0]
    bad = bytearray(e.stored)
    bad[offset] = value
    with pytest.raises(CorruptCheckpointError) as info:
        decode(bad, encoded=True, raw_size=len(raw))
    assert info.value.verdict


def _zstd_frame_claiming(size: int) -> bytes:
    """A zstd frame whose header claims ``size`` bytes of content, holding 3."""
    descriptor = 0xE0   # an 8-byte content size, single segment (RFC 8878, 3.1.1.1.1)
    return (struct.pack("<IBQ", 0xFD2FB528, descriptor, size)
            + bytes([(3 << 3) | 1, 0, 0]) + b"abc")   # the last block: raw, 3 bytes


def test_a_frame_claiming_a_huge_chunk_is_refused_without_allocating_it():
    huge = 1 << 40
    assert zstandard.frame_content_size(_zstd_frame_claiming(huge)) == huge
    forged = [
        chunkcodec.HEADER.pack(MAGIC, 1, 1, 0, huge) + _zstd_frame_claiming(huge),   # the header claims it
        chunkcodec.HEADER.pack(MAGIC, 1, 1, 0, 3) + _zstd_frame_claiming(huge),      # the zstd frame claims it
        chunkcodec.HEADER.pack(MAGIC, 1, 1, 0, 1 << 63) + _zstd_frame_claiming(3),
    ]
    tracemalloc.start()
    try:
        for stored in forged:
            with pytest.raises(CorruptCheckpointError):
                decode(stored, encoded=True, raw_size=3)
            with pytest.raises(AgckError):   # a listing claiming it too is above any chunk's size
                decode(stored, encoded=True, raw_size=huge)
            with pytest.raises(CorruptCheckpointError):
                decode_into(stored, bytearray(3), encoded=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_chunk_above_the_largest_frame_is_stored_raw(monkeypatch):
    monkeypatch.setattr(chunkcodec, "MAX_RAW_SIZE", 1000)
    assert encode(bytes(1001)).method is Method.RAW
    assert encode(bytes(1000)).encoded
    with pytest.raises(CorruptCheckpointError, match="more than any chunk"):
        decode(chunkcodec.HEADER.pack(MAGIC, 1, 1, 0, 1001) + _zstd_frame_claiming(1001),
               encoded=True, raw_size=1001)


def test_auto_stores_noise_raw_and_compresses_zeros_and_text():
    noise = os.urandom(1 << 20)
    for itemsize in (None, 1, 2, 4, 8):
        assert encode(noise, itemsize=itemsize).method is Method.RAW
    assert encode(bytes(1 << 20), itemsize=4).method is Method.PLANES_ZSTD
    assert encode(bytes(1 << 20)).method is Method.ZSTD
    text = _content("text", 1 << 20, 5)
    e = encode(text)
    assert e.method is Method.ZSTD and len(e.stored) < len(text) // 2
    assert encode(text, mode="none").method is Method.RAW


def test_a_raw_chunk_is_checked_against_its_size_and_address():
    raw = b"abcdef"
    assert decode(raw, encoded=False, raw_size=6) is raw
    with pytest.raises(CorruptCheckpointError):
        decode(raw, encoded=False, raw_size=7)
    with pytest.raises(CorruptCheckpointError):
        decode(raw, encoded=False, raw_size=6, address=chunking.address(b"abcdeF"))
    with pytest.raises(CorruptCheckpointError):
        decode_into(raw, bytearray(5), encoded=False)
    with pytest.raises(CorruptCheckpointError):
        decode(raw, encoded=True, raw_size=6)   # listed as a frame, but it is not one


@pytest.mark.parametrize("call", [
    lambda: encode(b"x", mode="lz4"),
    lambda: encode(b"x", level=99),
    lambda: encode(b"x", level=True),
    lambda: encode(b"x", itemsize=0),
    lambda: encode(b"x", itemsize=4.0),
    lambda: encode(b"x", address=b"short"),
    lambda: encode("text"),
    lambda: encode(b"x", compressor=3),
    lambda: decode(b"x", encoded=False, raw_size=-1),
    lambda: decode_into(b"x", b"y", encoded=False),
    lambda: chunkcodec.frame(b"x", Method.PLANES_ZSTD, itemsize=3),
    lambda: chunkcodec.frame(b"x", Method.RAW),
])
def test_arguments_agck_cannot_honour_are_usage_errors(call):
    with pytest.raises(UsageError):
        call()


def test_encoding_on_several_threads_gives_what_one_thread_gives():
    chunks = [_content(kind, 200_000, i) for i, kind in enumerate(["fp32", "bf16", "text", "zeros"] * 4)]
    one = [encode(c, itemsize=4).stored for c in chunks]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda c: encode(c, itemsize=4).stored, chunks)) == one
