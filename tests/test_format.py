"""The container: corruption, truncation, hostile headers and metadata, fuzzing, the golden file."""

import os
import struct
import sys
import time
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agck
from agck import checkpoint, format
from agck.errors import (AgckError, CorruptCheckpointError, FormatError, MalformedCheckpointError,
                         UnsupportedVersionError)

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import make_golden  # noqa: E402

H = xxhash.xxh3_64_intdigest


def small_state():
    s = torch.arange(12, dtype=torch.float32)
    return {"a": np.arange(5, dtype=np.float32), "b": torch.arange(7, dtype=torch.int16),
            "shared": [s[:6], s[4:].reshape(2, 4).t()], "c": np.ones((3, 3), np.uint8),
            "opt": {"lr": 0.1, "betas": (0.9, 0.999), "step": 2 ** 70}}


SMALL = checkpoint.encode(small_state(), run="r", step=3, meta={"k": [1, 2]}, created_at_ns=1)
DATA = b"".join(bytes(p) for p in SMALL.parts())
HDR = SMALL.header


def regions():
    """(name, start, end) covering every byte of DATA exactly once."""
    out = [("header", 0, 64), ("metadata", 64, 64 + HDR.meta_len),
           ("meta_pad", 64 + HDR.meta_len, HDR.payload_offset)]
    pos = 0
    for i, (off, n) in enumerate(format.open_container(DATA).blobs):
        if off > pos:
            out.append((f"blob_pad{i}", HDR.payload_offset + pos, HDR.payload_offset + off))
        out.append((f"blob{i}", HDR.payload_offset + off, HDR.payload_offset + off + n))
        pos = off + n
    out.append(("footer", HDR.footer_offset, HDR.total_len))
    return out


def test_small_container_has_every_region():
    r = regions()
    assert sum(e - s for _, s, e in r) == len(DATA) and r[-1][2] == len(DATA)
    assert all(r[i][2] == r[i + 1][1] for i in range(len(r) - 1))
    kinds = {n.rstrip("0123456789") for n, s, e in r if e > s}
    assert kinds == {"header", "metadata", "meta_pad", "blob", "blob_pad", "footer"}
    assert len(DATA) < 2048


def test_small_container_roundtrips():
    ck = agck.loads(DATA)
    make_golden.assert_same(small_state(), ck.state)
    assert (ck.run, ck.step, ck.meta) == ("r", 3, {"k": [1, 2]})


# --- truncation and bit flips ---------------------------------------------------

def test_every_truncation_is_detected():
    for n in range(len(DATA)):
        for verify in (True, False):
            with pytest.raises(AgckError):
                agck.loads(DATA[:n], verify=verify)


def test_trailing_bytes_are_refused():
    for extra in (b"\x00", b"AGCK_END", DATA):
        with pytest.raises(CorruptCheckpointError, match="after the footer"):
            agck.loads(DATA + extra)


@pytest.mark.parametrize("name, start, end", regions(), ids=[r[0] for r in regions()])
def test_every_bit_flip_is_detected(name, start, end):
    payload_only = name.startswith("blob")  # blob bytes and the padding between blobs
    for i in range(start, end):
        bad = bytearray(DATA)
        bad[i] ^= 1 << (i % 8)
        with pytest.raises(AgckError):
            agck.loads(bad, verify=True)
        if payload_only:
            # unverified loads trust the payload: it must decode, never crash
            try:
                agck.loads(bad, verify=False)
            except AgckError:
                pass
        else:
            with pytest.raises(AgckError):
                agck.loads(bad, verify=False)


def test_blob_flip_names_the_tensor():
    start = HDR.payload_offset
    bad = bytearray(DATA)
    bad[start] ^= 0x80
    with pytest.raises(CorruptCheckpointError) as ei:
        agck.loads(bad)
    assert ei.value.section == "payload"


@pytest.mark.parametrize("data", [b"", b"A", b"AGCK", b"\x00" * 64, b"PK\x03\x04" + bytes(100),
                                  b"AGCK" + bytes(60), bytes(range(256)) * 4, b"\x80\x03}q\x00."])
def test_garbage(data):
    with pytest.raises(AgckError):
        agck.loads(data)


def test_wrong_magic_is_a_format_error():
    with pytest.raises(FormatError, match="magic"):
        agck.loads(b"XGCK" + DATA[4:])


# --- crafting containers with valid checksums -----------------------------------

def header(*, major=1, minor=0, flags=0, blob_count=0, meta_len=0, payload_offset=None, payload_len=0,
           created_at_ns=0, meta_digest=0) -> bytes:
    if payload_offset is None:
        payload_offset = format.align(64 + meta_len)
    head = struct.pack("<4sHHIIQQQqQ", b"AGCK", major, minor, flags, blob_count, meta_len,
                       payload_offset, payload_len, created_at_ns, meta_digest)
    return head + struct.pack("<Q", H(head))


def assemble(meta, blobs=(), *, table=None, raw_meta=None, **hdr) -> bytes:
    """A container with every checksum right: ``meta`` (a dict, packed here unless
    ``raw_meta`` is given) over ``blobs`` laid out canonically. ``table`` overrides
    the blob table written into the metadata; ``hdr`` overrides header fields."""
    offsets, pos = [], 0
    for b in blobs:
        pos = format.align(pos)
        offsets.append(pos)
        pos += len(b)
    m = dict(meta)
    m["blobs"] = [[o, len(b)] for o, b in zip(offsets, blobs)] if table is None else table
    mb = raw_meta if raw_meta is not None else msgpack.packb(m, use_bin_type=True)
    fields = dict(blob_count=len(blobs), meta_len=len(mb), payload_len=pos, meta_digest=H(mb))
    fields.update(hdr)
    head = header(**fields)
    payload = bytearray()
    for o, b in zip(offsets, blobs):
        payload += bytes(o - len(payload)) + b
    digests = [H(b) for b in blobs]
    digests += [0] * max(0, fields["blob_count"] - len(digests))  # a header may claim more blobs
    total = format.align(64 + fields["meta_len"]) + fields["payload_len"] + 8 * fields["blob_count"] + 32
    body = struct.pack(f"<{len(digests)}Q", *digests) + head[56:] + struct.pack("<Q", total)
    footer = body + struct.pack("<Q", H(body)) + b"AGCK_END"
    pad = bytes(format.align(64 + len(mb)) - 64 - len(mb))
    return head + mb + pad + bytes(payload) + footer


def base_meta():
    """The small container's metadata, decoded: the starting point for hostile edits."""
    c = format.open_container(DATA)
    m = dict(c.meta)
    m.pop("blobs")
    blobs = [bytes(c.blob(i)) for i in range(len(c.blobs))]
    return m, blobs


def test_assemble_reproduces_a_valid_container():
    m, blobs = base_meta()
    assert assemble(m, blobs, created_at_ns=1)[64:] == DATA[64:]
    make_golden.assert_same(small_state(), agck.loads(assemble(m, blobs)).state)


def bounded(fn, *, seconds=2.0, megabytes=64):
    """Run fn, which must raise an AgckError, quickly and without a big allocation."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(AgckError) as ei:
            fn()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < seconds
    assert peak < megabytes << 20, f"peak allocation {peak} bytes"
    return ei.value


# --- hostile headers ------------------------------------------------------------

STATE_NONE = {"state": msgpack.packb(None), "tensors": []}


@pytest.mark.parametrize("fields, error", [
    (dict(meta_len=2 ** 60), MalformedCheckpointError),
    (dict(meta_len=2 ** 64 - 1, payload_offset=0), MalformedCheckpointError),
    (dict(payload_len=2 ** 60), MalformedCheckpointError),
    (dict(payload_len=2 ** 64 - 1), MalformedCheckpointError),
    (dict(payload_len=2 ** 40), CorruptCheckpointError),          # plausible, but the data is not there
    (dict(blob_count=2 ** 32 - 1), MalformedCheckpointError),
    (dict(blob_count=2 ** 20), CorruptCheckpointError),
    (dict(payload_offset=0), MalformedCheckpointError),
    (dict(payload_offset=64), MalformedCheckpointError),
    (dict(payload_offset=2 ** 64 - 1), MalformedCheckpointError),
    (dict(meta_len=3), CorruptCheckpointError),
    (dict(major=2), UnsupportedVersionError),
    (dict(major=0), UnsupportedVersionError),
    (dict(major=65535), UnsupportedVersionError),
])
def test_hostile_header(fields, error):
    mb = msgpack.packb({**STATE_NONE, "blobs": []}, use_bin_type=True)
    f = dict(meta_len=len(mb), meta_digest=H(mb))
    f.update(fields)
    data = header(**f) + mb + bytes(format.align(64 + len(mb)) - 64 - len(mb)) + bytes(40)
    e = bounded(lambda: agck.loads(data))
    assert isinstance(e, error), repr(e)


def test_header_digest_is_checked_before_the_version():
    data = bytearray(assemble(STATE_NONE))
    data[4] = 9  # major 9 without fixing the digest: damage, not a newer version
    with pytest.raises(CorruptCheckpointError, match="header checksum"):
        agck.loads(bytes(data))


@pytest.mark.parametrize("bit", range(2, 16))   # bit 0 is CHUNKED (version 1.1), bit 1 FRAMED (1.2)
def test_unknown_required_flag_is_refused(bit):
    with pytest.raises(UnsupportedVersionError, match="required flag"):
        agck.loads(assemble(STATE_NONE, flags=1 << bit))


def test_framed_flag_on_a_plain_container_is_malformed():
    with pytest.raises(MalformedCheckpointError, match="FRAMED"):
        agck.loads(assemble(STATE_NONE, flags=2))


def test_chunked_flag_on_a_plain_container_is_malformed():
    with pytest.raises(MalformedCheckpointError, match="chunk listing"):
        agck.loads(assemble(STATE_NONE, flags=1))


@pytest.mark.parametrize("bit", range(16, 32))
def test_unknown_optional_flag_is_ignored(bit):
    assert agck.loads(assemble(STATE_NONE, flags=1 << bit)).state is None


def test_newer_minor_version_and_unknown_keys_are_read():
    m, blobs = base_meta()
    m["added_in_1_7"] = {"anything": [1, 2, 3]}
    ck = agck.loads(assemble(m, blobs, minor=7))
    assert ck.version == "1.7"
    make_golden.assert_same(small_state(), ck.state)


def test_negative_created_at_is_read():
    assert agck.loads(assemble(STATE_NONE, created_at_ns=-5)).created_at == -5e-9


# --- hostile metadata with valid checksums ---------------------------------------

def desc(i=0, **changes):
    """The base metadata with tensors[i] changed (a value of ... deletes the key)."""
    m, blobs = base_meta()
    tensors = [dict(t) for t in m["tensors"]]
    for k, v in changes.items():
        if v is ...:
            tensors[i].pop(k, None)
        else:
            tensors[i][k] = v
    m["tensors"] = tensors
    return m, blobs


def with_state(tree: bytes):
    m, blobs = base_meta()
    m["state"] = tree
    return m, blobs


def ext(code, payload):
    return msgpack.ExtType(code, payload)


def pk(x):
    return msgpack.packb(x, use_bin_type=True)


def nested_ext(depth):
    """``depth`` tuples, each holding the next: valid in every respect but depth."""
    x = pk([])
    for _ in range(depth):
        x = pk([ext(1, x)])
    return pk(ext(1, x))


NP_T, PT_T, SHARED_T = 0, 1, 2  # tensors[0]: numpy float32 [5]; [1]: torch int16 [7]; [2]: shared view


HOSTILE_META = {
    # blob table
    "table_offset_outside": lambda: (base_meta(), dict(table=[[0, 20], [64, 14], [128, 48], [2 ** 40, 9]])),
    "table_overlap": lambda: (base_meta(), dict(table=[[0, 100], [64, 14], [128, 48], [192, 9]])),
    "table_unaligned": lambda: (base_meta(), dict(table=[[0, 20], [32, 14], [128, 48], [192, 9]])),
    "table_gap": lambda: (base_meta(), dict(table=[[0, 20], [128, 14], [128, 48], [192, 9]])),
    "table_negative": lambda: (base_meta(), dict(table=[[0, -20], [64, 14], [128, 48], [192, 9]])),
    "table_short": lambda: (base_meta(), dict(table=[[0, 20]])),
    "table_not_list": lambda: (base_meta(), dict(table={"0": 1})),
    "table_entry_types": lambda: (base_meta(), dict(table=[[0.0, 20], [64, 14], [128, 48], [192, 9]])),
    "table_past_end": lambda: (base_meta(), dict(table=[[0, 20], [64, 14], [128, 48], [192, 2 ** 62]])),
    # descriptors
    "shape_negative": lambda: (desc(NP_T, shape=[-5]), {}),
    "shape_absurd": lambda: (desc(NP_T, shape=[2 ** 40, 2 ** 40]), {}),
    "shape_huge_with_zero": lambda: (desc(PT_T, shape=[0, 2 ** 61, 2 ** 61]), {}),
    "shape_rank_65": lambda: (desc(NP_T, shape=[1] * 65), {}),
    "shape_not_list": lambda: (desc(NP_T, shape="5"), {}),
    "shape_too_big_for_blob": lambda: (desc(NP_T, shape=[6]), {}),
    "shape_too_big_torch": lambda: (desc(PT_T, shape=[8]), {}),
    "dtype_unknown_np": lambda: (desc(NP_T, dtype="float7"), {}),
    "dtype_unknown_pt": lambda: (desc(PT_T, dtype="float7"), {}),
    "dtype_object": lambda: (desc(NP_T, dtype="object"), {}),
    "dtype_structured": lambda: (desc(NP_T, dtype="[('a', '<i4')]"), {}),
    "dtype_not_str": lambda: (desc(NP_T, dtype=5), {}),
    "dtype_torch_attr": lambda: (desc(PT_T, dtype="__class__"), {}),
    "lib_unknown": lambda: (desc(NP_T, lib="jax"), {}),
    "blob_out_of_range": lambda: (desc(NP_T, blob=4), {}),
    "blob_negative": lambda: (desc(NP_T, blob=-1), {}),
    "blob_missing": lambda: (desc(NP_T, blob=...), {}),
    "offset_negative": lambda: (desc(NP_T, offset=-4), {}),
    "offset_huge": lambda: (desc(NP_T, offset=2 ** 63), {}),
    "offset_past_blob": lambda: (desc(NP_T, offset=4), {}),
    "strides_escape": lambda: (desc(NP_T, strides=[8]), {}),
    "strides_negative_escape": lambda: (desc(NP_T, strides=[-4]), {}),
    "strides_wrong_len": lambda: (desc(NP_T, strides=[4, 4]), {}),
    "strides_not_int": lambda: (desc(NP_T, strides=[4.0]), {}),
    "strides_huge_negative": lambda: (desc(NP_T, shape=[2, 2], strides=[-2 ** 63, 4]), {}),
    "strides_huge": lambda: (desc(NP_T, shape=[1, 2], strides=[2 ** 64 - 1, 4]), {}),
    "strides_torch_negative": lambda: (desc(PT_T, strides=[-2], offset=12), {}),
    "strides_torch_misaligned": lambda: (desc(PT_T, strides=[3], shape=[2]), {}),
    "offset_torch_misaligned": lambda: (desc(PT_T, offset=1, shape=[6]), {}),
    "desc_not_map": lambda: ((lambda m, b: ({**m, "tensors": [1, 2, 3, 4]}, b))(*base_meta()), {}),
    "tensors_not_list": lambda: ((lambda m, b: ({**m, "tensors": {"0": 1}}, b))(*base_meta()), {}),
    "tensors_missing": lambda: ((lambda m, b: ({k: v for k, v in m.items() if k != "tensors"}, b))(
        *base_meta()), {}),
    # the value tree
    "tensor_ref_out_of_range": lambda: (with_state(pk({"x": ext(5, pk(99))})), {}),
    "tensor_ref_negative": lambda: (with_state(pk({"x": ext(5, pk(-1))})), {}),
    "tensor_ref_not_int": lambda: (with_state(pk({"x": ext(5, pk("0"))})), {}),
    "ext_unknown": lambda: (with_state(pk({"x": ext(42, b"")})), {}),
    "ext_zero": lambda: (with_state(pk(ext(0, b"\x00"))), {}),
    "ext_negative": lambda: (with_state(b"\xd4\xfb\x00"), {}),
    "ext_tuple_bad_payload": lambda: (with_state(pk(ext(1, b"\xc1"))), {}),
    "ext_tuple_not_list": lambda: (with_state(pk(ext(1, pk(5)))), {}),
    "ext_np_scalar_len": lambda: (with_state(pk(ext(6, pk(["float32", b"\x00"])))), {}),
    "ext_np_scalar_dtype": lambda: (with_state(pk(ext(6, pk(["object", b"\x00" * 8])))), {}),
    "ext_np_scalar_shape": lambda: (with_state(pk(ext(6, pk([1, 2, 3])))), {}),
    "ext_complex_types": lambda: (with_state(pk(ext(7, pk([1, "x"])))), {}),
    "ext_torch_dtype": lambda: (with_state(pk(ext(8, pk("nn")))), {}),
    "ext_torch_size": lambda: (with_state(pk(ext(9, pk(["a"])))), {}),
    "ext_torch_device": lambda: (with_state(pk(ext(10, pk("bogus:x")))), {}),
    "ext_np_dtype": lambda: (with_state(pk(ext(11, pk("O")))), {}),
    "ext_set_unhashable": lambda: (with_state(pk(ext(2, pk([[1]])))), {}),
    "unhashable_key": lambda: (with_state(b"\x81\x91\x01\x02"), {}),
    "deep_ext_nesting": lambda: (with_state(nested_ext(300)), {}),
    "very_deep_ext_nesting": lambda: (with_state(nested_ext(3000)), {}),
    "deep_list_nesting": lambda: (with_state(b"\x91" * 5000 + b"\xc0"), {}),
    "state_truncated": lambda: (with_state(pk({"a": [1, 2, 3]})[:-1]), {}),
    "state_trailing": lambda: (with_state(pk(1) + b"\x01"), {}),
    "state_not_bytes": lambda: (with_state("text"), {}),
    # reserved keys
    "run_not_str": lambda: ((lambda m, b: ({**m, "run": 5}, b))(*base_meta()), {}),
    "step_not_int": lambda: ((lambda m, b: ({**m, "step": "3"}, b))(*base_meta()), {}),
    "state_missing": lambda: ((lambda m, b: ({k: v for k, v in m.items() if k != "state"}, b))(
        *base_meta()), {}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_META))
def test_hostile_metadata(case):
    (m, blobs), kw = HOSTILE_META[case]()
    data = assemble(m, blobs, **kw)
    for verify in (True, False):
        e = bounded(lambda: agck.loads(data, verify=verify))
        assert isinstance(e, MalformedCheckpointError), repr(e)
        with pytest.raises(MalformedCheckpointError):
            agck.loads(data, verify=verify, copy=False)


@pytest.mark.parametrize("raw", [
    b"\x90",                                 # an array, not a map
    b"\xc0",                                 # nil
    b"\x81\xa1a",                            # truncated
    b"\x80\x80",                             # trailing data
    b"\x81\xa1a\xd4\x05\x00",                # an extension type in the metadata
    b"\xc1",                                 # never-used msgpack byte
    b"\xdf\xff\xff\xff\xff",                 # a map claiming 2**32-1 entries
    b"\xdd\xff\xff\xff\xff",                 # an array claiming 2**32-1 entries
    b"\x81\xa5state\xc6\xff\xff\xff\xff",    # a bin claiming 4 GiB
])
def test_hostile_metadata_bytes(raw):
    e = bounded(lambda: agck.loads(assemble({}, raw_meta=raw)))
    assert isinstance(e, MalformedCheckpointError), repr(e)


def test_tensor_sharing_a_blob_partially_is_valid():
    # a descriptor covering part of its blob is how sharing is written, not an error
    m, blobs = desc(NP_T, shape=[2], offset=8)
    got = agck.loads(assemble(m, blobs)).state
    assert got["a"].tolist() == [2.0, 3.0]


# --- fuzzing --------------------------------------------------------------------

def loads_only_agck_errors(data, **kw):
    try:
        agck.loads(data, **kw)
    except AgckError:
        pass


# AGCK_FUZZ_EXAMPLES raises the count for a longer fuzzing session.
FUZZ = settings(max_examples=int(os.environ.get("AGCK_FUZZ_EXAMPLES", 1000)), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes(data):
    loads_only_agck_errors(data)
    loads_only_agck_errors(b"AGCK" + data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, len(DATA)), st.booleans())
def test_fuzz_mutated_container(edits, cut, verify):
    bad = bytearray(DATA)
    for pos, val in edits:
        bad[pos] = val
    loads_only_agck_errors(bytes(bad), verify=verify)
    loads_only_agck_errors(bytes(bad[:cut]), verify=verify)


META_BYTES = DATA[64:64 + HDR.meta_len]


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(META_BYTES) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.booleans())
def test_fuzz_metadata_with_valid_checksums(edits, copy):
    # mutations past the checksums: exercises the structural checks and the decoder
    m, blobs = base_meta()
    raw = bytearray(msgpack.packb({**m, "blobs": [list(x) for x in format.open_container(DATA).blobs]},
                                  use_bin_type=True))
    for pos, val in edits:
        raw[pos % len(raw)] = val
    data = assemble({}, blobs, raw_meta=bytes(raw))
    loads_only_agck_errors(data, copy=copy)


@FUZZ
@given(st.binary(min_size=1, max_size=64), st.integers(0, 10 ** 6))
def test_fuzz_state_tree_with_valid_checksums(tree, seed):
    m, blobs = base_meta()
    base = bytearray(m["state"])
    r = np.random.default_rng(seed)
    for _ in range(int(r.integers(1, 4))):
        base[int(r.integers(len(base)))] = int(r.integers(256))
    for candidate in (tree, bytes(base)):
        m["state"] = candidate
        loads_only_agck_errors(assemble(m, blobs))


# --- golden file ----------------------------------------------------------------

def test_golden_file_decodes_to_the_golden_state():
    data = make_golden.GOLDEN.read_bytes()
    ck = agck.loads(data)
    assert ck.version == "1.0"
    assert (ck.run, ck.step, ck.parent, ck.meta) == (make_golden.RUN, make_golden.STEP, make_golden.PARENT,
                                                      make_golden.META)
    assert ck.header.created_at_ns == make_golden.CREATED_AT_NS
    make_golden.assert_same(make_golden.golden_state(), ck.state)
    tied = ck.state["torch"]["tied"]
    assert tied[0] is tied[1] and type(tied[0]) is torch.nn.Parameter
    views = ck.state["torch"]["views"]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    shared = ck.state["numpy"]["shared"]
    assert all(np.shares_memory(shared[0], v) for v in shared[1:])


def test_golden_file_loads_from_disk_lazily():
    ck = agck.load(make_golden.GOLDEN, verify=False)
    make_golden.assert_same(make_golden.golden_state(), ck.state)


# --- rules FORMAT.md makes exact ---------------------------------------------------

def raw_map(*pairs) -> bytes:
    """A msgpack map of already-packed (key, value) byte pairs: duplicates allowed."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


def bigint(n: int):
    return ext(4, n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True))


P61 = 2 ** 61 - 1   # hash(int) is the int modulo this


def colliding(n):
    """n distinct big ints with one Python hash."""
    return [k * P61 + 12345 for k in range(1, n + 1)]


FLOOD = {
    "bigint_keys": lambda n: pk({bigint(k): 0 for k in colliding(n)}),
    "set_items": lambda n: pk(ext(2, pk([bigint(k) for k in colliding(n)]))),
    "frozenset_items": lambda n: pk(ext(3, pk([bigint(k) for k in colliding(n)]))),
    "tuple_keys": lambda n: pk({ext(1, pk([1, bigint(k)])): 0 for k in colliding(n)}),
    "frozenset_keys": lambda n: pk({ext(3, pk([bigint(k)])): 0 for k in colliding(n)}),
    "complex_keys": lambda n: pk({ext(7, pk([float(5 - 1000003 * i), float(i)])): 0 for i in range(1, n + 1)}),
    "float_keys": lambda n: pk({2.0 ** (61 * k): 0 for k in range(-16, -16 + n)}),
}


@pytest.mark.parametrize("case", sorted(FLOOD))
def test_keys_sharing_a_hash_are_refused_quickly(case):
    n = 33 if case == "float_keys" else 20000   # 33 floats is every float with hash 1
    m, blobs = with_state(FLOOD[case](n))
    data = assemble(m, blobs)
    # Refusing takes under a second here; building the map first (each key compared
    # with every earlier one, quadratic) takes 6-9 s for these 20,000 keys and grows 4x
    # per doubling, so 5 s still tells them apart on a loaded machine.
    e = bounded(lambda: agck.loads(data), seconds=5.0)
    assert isinstance(e, MalformedCheckpointError) and "share a hash" in str(e), repr(e)


@pytest.mark.parametrize("case", sorted(FLOOD))
def test_eight_keys_may_share_a_hash_nine_may_not(case):
    for n, ok in ((format.MAX_SAME_HASH, True), (format.MAX_SAME_HASH + 1, False)):
        data = assemble(*with_state(FLOOD[case](n)))
        if ok:
            got = agck.loads(data).state
            assert len(got) == n
            assert agck.loads(agck.dumps(got)).state == got   # and the writer takes it
        else:
            with pytest.raises(MalformedCheckpointError, match="share a hash"):
                agck.loads(data)


def test_writer_refuses_what_the_reader_refuses_for_sharing_a_hash():
    for state in ({k: 0 for k in colliding(9)}, set(colliding(9)), [frozenset(colliding(9))],
                  {(1, k): 0 for k in colliding(9)}, {"x": {2.0 ** (61 * k) for k in range(9)}}):
        with pytest.raises(agck.EncodeError, match="share one hash"):
            agck.dumps(state)


def test_metadata_keys_sharing_a_hash_are_refused():
    m, blobs = base_meta()
    m["added_later"] = {2.0 ** (61 * k): k for k in range(-16, 17)}
    e = bounded(lambda: agck.loads(assemble(m, blobs)))
    assert isinstance(e, MalformedCheckpointError) and "share a hash" in str(e)


def test_many_distinct_ints_load():
    state = {"keys": {k * 7919: k for k in range(100000)}, "set": set(range(-50000, 50000)),
             "tuples": {(k, -k): k for k in range(20000)}, "big": {2 ** 64 + k: k for k in range(20000)}}
    assert agck.loads(agck.dumps(state)).state == state


@pytest.mark.parametrize("tree", [
    raw_map((pk(1), pk(0)), (pk(1), pk(1))),                    # the same key twice
    raw_map((pk(1), pk(0)), (pk(1.0), pk(1))),                  # 1 and 1.0 are one key
    raw_map((pk(True), pk(0)), (pk(1), pk(1))),                 # and true
    raw_map((pk("a"), pk(0)), (pk(ext(1, pk([1]))), pk(0)), (pk(ext(1, pk([1.0]))), pk(1))),
    pk(ext(2, pk([1, 2, 1]))),
    pk(ext(3, pk([0, 0.0]))),
    b"\x92" + pk(1) + raw_map((pk(b"k"), pk(0)), (pk(b"k"), pk(0))),
], ids=["same", "int_float", "bool_int", "tuples", "set", "frozenset", "nested"])
def test_duplicate_keys_in_the_state_are_refused(tree):
    with pytest.raises(MalformedCheckpointError, match="duplicate"):
        agck.loads(assemble(*with_state(tree)))


def packed_map_plus(m: dict, *extra: tuple) -> bytes:
    """``m`` packed, followed by more (key, value) entries, which may repeat its keys."""
    raw = pk(m)
    assert raw[0] == 0x80 | len(m) and len(m) + len(extra) < 16
    return bytes([0x80 | (len(m) + len(extra))]) + raw[1:] + b"".join(pk(k) + pk(v) for k, v in extra)


def test_duplicate_keys_in_the_metadata_are_refused():
    m, blobs = base_meta()
    m["blobs"] = [list(b) for b in format.open_container(DATA).blobs]
    for extra in ([("step", 4)], [("blobs", m["blobs"])], [("later", 1), ("later", 2)]):
        e = bounded(lambda: agck.loads(assemble({}, blobs, raw_meta=packed_map_plus(m, *extra))))
        assert isinstance(e, MalformedCheckpointError) and "duplicate" in str(e), repr(e)
    # in a tensor descriptor
    d0 = packed_map_plus(m["tensors"][0], ("offset", 0))
    tensors = bytes([0x90 | len(m["tensors"])]) + d0 + b"".join(pk(d) for d in m["tensors"][1:])
    rest = {k: v for k, v in m.items() if k != "tensors"}
    raw = bytes([pk(rest)[0] + 1]) + pk(rest)[1:] + pk("tensors") + tensors
    with pytest.raises(MalformedCheckpointError, match="duplicate"):
        agck.loads(assemble({}, blobs, raw_meta=raw))


@pytest.mark.parametrize("where", ["meta", "unknown_key", "nested_meta"])
def test_msgpack_timestamps_in_the_metadata_are_refused(where):
    m, blobs = base_meta()
    ts = msgpack.Timestamp(1, 2)
    if where == "meta":
        m["meta"] = ts
    elif where == "unknown_key":
        m["later"] = [1, ts]
    else:
        m["meta"] = {"k": [ts]}
    e = bounded(lambda: agck.loads(assemble(m, blobs)))
    assert isinstance(e, MalformedCheckpointError), repr(e)


@pytest.mark.parametrize("tree", [
    pk(msgpack.Timestamp(1, 0)), pk([msgpack.Timestamp(1, 0)]), pk({"k": msgpack.Timestamp(0, 5)}),
    pk({msgpack.Timestamp(3, 0): 1}), pk(ext(1, pk([msgpack.Timestamp(2 ** 40, 0)]))),
    pk(ext(2, pk([msgpack.Timestamp(1, 0)]))), b"\xd4\xff\x00",
], ids=["root", "list", "value", "key", "tuple", "set", "bad_length"])
def test_msgpack_timestamps_in_the_state_are_refused(tree):
    with pytest.raises(MalformedCheckpointError):
        agck.loads(assemble(*with_state(tree)))


@pytest.mark.parametrize("name", ["step", "parent"])
@pytest.mark.parametrize("value, ok", [(-1, False), (-(2 ** 63), False), (2 ** 63, False), (2 ** 64 - 1, False),
                                       (2 ** 63 - 1, True), (0, True), (None, True), (1.0, False), (True, False)])
def test_step_and_parent_are_nil_or_in_range(name, value, ok):
    m, blobs = base_meta()
    m[name] = value
    data = assemble(m, blobs)
    if ok:
        assert getattr(agck.loads(data), name) == value
    else:
        with pytest.raises(MalformedCheckpointError, match=name):
            agck.loads(data)


@pytest.mark.parametrize("data, error", [
    (b"", CorruptCheckpointError), (b"A", CorruptCheckpointError), (b"AGC", CorruptCheckpointError),
    (b"AGCK" + bytes(59), CorruptCheckpointError), (DATA[:63], CorruptCheckpointError),
    (b"X", FormatError), (b"AGX", FormatError), (b"AGCX", FormatError), (b"XGCK" + bytes(59), FormatError),
    (b"\x80\x03}q\x00.", FormatError),
])
def test_short_buffers(data, error):
    with pytest.raises(error) as ei:
        agck.loads(data)
    assert type(ei.value) is error


def test_only_tensors_state_and_blobs_are_required():
    ck = agck.loads(assemble({"tensors": [], "state": pk([1])}))
    assert (ck.run, ck.step, ck.parent, ck.meta, ck.state) == (None, None, None, None, [1])
    for key in ("tensors", "state"):
        m = {"tensors": [], "state": pk(1)}
        del m[key]
        with pytest.raises(MalformedCheckpointError):
            agck.loads(assemble(m))
    with pytest.raises(MalformedCheckpointError, match="blob table"):
        agck.loads(assemble({}, raw_meta=pk({"tensors": [], "state": pk(1)})))


@pytest.mark.parametrize("i, changes, ok", [
    (NP_T, dict(shape=[1, 5], strides=[2 ** 63 - 1, 4]), True),     # a size-1 dimension: any stride in range
    (NP_T, dict(shape=[1, 5], strides=[-2 ** 63, 4]), True),
    (NP_T, dict(shape=[1, 5], strides=[2 ** 63, 4]), False),
    (NP_T, dict(shape=[0, 5], strides=[2 ** 63 - 1, -2 ** 63]), True),   # size 0: checked, moves nothing
    (NP_T, dict(shape=[0, 5], strides=[2 ** 64 - 1, 4]), False),
    (PT_T, dict(shape=[1, 7], strides=[2 ** 63 - 2, 2]), True),
    (PT_T, dict(shape=[1, 7], strides=[-2, 2]), False),              # never negative for torch
    (PT_T, dict(shape=[0, 7], strides=[3, 2]), False),               # nor off the itemsize
    (NP_T, dict(shape=[2 ** 61, 0]), False),                         # non-zero entries x itemsize >= 2**63
    (PT_T, dict(shape=[2 ** 61, 4, 0]), False),
    (PT_T, dict(shape=[2 ** 60, 3, 0]), True),
    (NP_T, dict(shape=[2 ** 61, 0], dtype="uint8"), True),
])
def test_stride_and_shape_ranges(i, changes, ok):
    data = assemble(*desc(i, **changes))
    if ok:
        agck.loads(data)
    else:
        with pytest.raises(MalformedCheckpointError):
            agck.loads(data)


def test_writer_refuses_shapes_the_reader_refuses():
    with pytest.raises(agck.EncodeError, match="2\\*\\*63"):
        agck.dumps(torch.empty((2 ** 61, 0)))
    assert agck.loads(agck.dumps(torch.empty((2 ** 61, 0), dtype=torch.bool))).state.shape == (2 ** 61, 0)


@pytest.mark.parametrize("i, changes, ok", [
    (NP_T, dict(grad=True), False), (NP_T, dict(param=False), False), (NP_T, dict(device="cpu"), False),
    (PT_T, dict(grad=1), False), (PT_T, dict(param="yes"), False), (PT_T, dict(device=5), False),
    (PT_T, dict(device="cuda:01"), False), (PT_T, dict(device="cuda:128"), False), (PT_T, dict(device="CUDA"), False),
    (PT_T, dict(grad=True), False),                     # int16 cannot require grad
    (PT_T, dict(param=True, grad=False), True), (PT_T, dict(device="cuda:3"), True),
    (PT_T, dict(device="someaccel:127"), True),       # informational: any well-formed device string
    (PT_T, dict(grad=True, dtype="float16", shape=[3]), True),
])
def test_descriptor_fields(i, changes, ok):
    data = assemble(*desc(i, **changes))
    if not ok:
        with pytest.raises(MalformedCheckpointError):
            agck.loads(data)
        return
    t = agck.loads(data).state["b"]
    assert t.device.type == "cpu" and t.requires_grad == bool(changes.get("grad"))
    assert type(t) is (torch.nn.Parameter if changes.get("param") else torch.Tensor)


def test_float32_reads_as_the_same_double():
    tree = msgpack.packb([1.1, ext(7, msgpack.packb([0.1, -2.5], use_single_float=True))], use_single_float=True)
    got = agck.loads(assemble(*with_state(tree))).state
    f32 = float(np.float32(1.1))
    assert got == [f32, complex(float(np.float32(0.1)), -2.5)]
    m, blobs = base_meta()
    raw = msgpack.packb({**m, "meta": [0.5, 1.1], "blobs": [list(b) for b in format.open_container(DATA).blobs]},
                        use_bin_type=True, use_single_float=True)
    assert agck.loads(assemble({}, blobs, raw_meta=raw)).meta == [0.5, f32]


def test_byte_order_is_not_stored():
    state = [np.dtype(">i4"), np.arange(3, dtype=">f8"), np.array(5, ">u2")[()]]
    dt, arr, scalar = agck.loads(agck.dumps(state)).state
    assert dt == np.dtype("int32") and dt.isnative
    assert arr.dtype == np.dtype("float64") and arr.dtype.isnative and arr.tolist() == [0.0, 1.0, 2.0]
    assert scalar.dtype.isnative and scalar == 5


def test_bool_bytes_are_checked_in_scalars_not_in_arrays():
    m, blobs = desc(NP_T, dtype="bool", shape=[5])
    blobs[NP_T] = b"\x00\x01\x02\xff\x01" + blobs[NP_T][5:]
    got = agck.loads(assemble(m, blobs)).state["a"]     # loaded as stored, unchecked
    assert got.view(np.uint8).tolist() == [0, 1, 2, 255, 1]
    with pytest.raises(MalformedCheckpointError, match="bool"):
        agck.loads(assemble(*with_state(pk(ext(6, pk(["bool", b"\x02"]))))))
    assert agck.loads(assemble(*with_state(pk(ext(6, pk(["bool", b"\x01"])))))).state is np.True_


def nested(n, leaf=b"\xc0", level=b"\x91"):
    return level * n + leaf


def nested_tuples(n, leaf):
    x = leaf
    for _ in range(n):
        x = pk(ext(1, b"\x91" + x))
    return x


@pytest.mark.parametrize("tree, ok", [
    (nested(256), True), (nested(257), False),
    (nested(256, level=b"\x81\xc0"), True), (nested(257, level=b"\x81\xc0"), False),
    (nested_tuples(256, pk(2 ** 64 - 1)), True), (nested_tuples(257, pk(1)), False),
    (nested_tuples(256, pk(bigint(2 ** 70))), True),    # a leaf extension value below depth 256
    (nested_tuples(256, pk(ext(7, pk([1.0, 2.0])))), True),
    (nested_tuples(255, pk([bigint(5)])), True), (nested_tuples(255, pk([[1]])), False),
    (nested(128, nested_tuples(128, pk(1))), True), (nested(128, nested_tuples(129, pk(1))), False),
    (nested(200, pk({ext(1, pk(list(range(3)))): 1})), True),     # a tuple key is a container too
    (nested(255, pk({ext(1, pk([ext(1, pk([]))])): 1})), False),
], ids=["lists_256", "lists_257", "maps_256", "maps_257", "tuples_256", "tuples_257", "bigint_at_257",
        "complex_at_257", "list_at_256", "list_at_257", "mixed_256", "mixed_257", "tuple_key", "tuple_key_257"])
def test_depth_counts_containers_from_one(tree, ok):
    data = assemble(*with_state(tree))
    if ok:
        agck.loads(data)
    else:
        e = bounded(lambda: agck.loads(data))
        assert isinstance(e, MalformedCheckpointError) and "deeper" in str(e), repr(e)


def test_writer_and_reader_agree_on_depth():
    def lists(n, leaf):
        x = leaf
        for _ in range(n):
            x = [x]
        return x

    def tuples(n, leaf):
        x = leaf
        for _ in range(n):
            x = (x,)
        return x

    for ok in (lists(256, 1), tuples(256, 2 ** 100), tuples(256, np.float32(1)), lists(255, (torch.ones(1),)),
               tuples(128, lists(127, {1: "x"}))):
        agck.loads(agck.dumps(ok))
    for bad in (lists(257, 1), tuples(257, 1), lists(256, {}), tuples(128, lists(129, None))):
        with pytest.raises(agck.EncodeError, match="nesting"):
            agck.dumps(bad)
    meta_ok, meta_bad = lists(255, 1), lists(256, 1)   # the metadata map is depth 1
    assert agck.loads(agck.dumps(None, meta=meta_ok)).meta == meta_ok
    with pytest.raises(agck.EncodeError, match="nesting"):
        agck.dumps(None, meta=meta_bad)
    m, blobs = base_meta()
    m["later"] = lists(256, 1)
    with pytest.raises(MalformedCheckpointError, match="deeper"):
        agck.loads(assemble(m, blobs))


def test_unreadable_file_is_not_a_verdict(monkeypatch, tmp_path):
    path = tmp_path / "c.agck"
    agck.save(path, {})

    def denied(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint, "open", denied, raising=False)
    with pytest.raises(AgckError) as ei:
        agck.load(path)
    assert not ei.value.verdict


_plain = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text()
                      | st.binary(max_size=300),
                      lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
                      max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _plain, max_size=6), st.binary(max_size=70_000))
def test_writer_metadata_is_msgpack_of_the_map_with_spans_of_each_value(meta, state):
    meta = dict(meta, state=state)
    w = format.ContainerWriter(meta, [])
    full = dict(meta, blobs=[])
    assert w.meta_bytes == msgpack.packb(full, use_bin_type=True)
    for k, (start, inner, end) in w.meta_spans.items():
        value = w.meta_bytes[start - format.HEADER_SIZE:end - format.HEADER_SIZE]
        assert value == msgpack.packb(full[k], use_bin_type=True)
        if type(full[k]) is bytes:     # the content, after the bin header
            assert w.meta_bytes[inner - format.HEADER_SIZE:end - format.HEADER_SIZE] == full[k]
