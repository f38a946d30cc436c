"""FORMAT.md sections 12 (chunked containers) and 13 (multi-rank checkpoints),
rule by rule, through a file store. Each test names the rules it holds agck to."""

from __future__ import annotations

import os
import struct

import msgpack
import numpy as np
import pytest

import agck
from agck import chunking, format, recovery, sharded
from agck.errors import (CorruptCheckpointError, DamagedChunkError, MalformedCheckpointError,
                         UnsupportedVersionError, UsageError)
from agck.stores import content, open_store

from test_format import assemble

RUN = "r"


# --- crafting what a store holds -------------------------------------------------------------

def put_chunks(store, inner: bytes, cuts=()) -> tuple[list[bytes], list[int]]:
    """Write ``inner``'s chunks (cut at the offsets ``cuts``) into the file store's
    objects, as a put would; their addresses and sizes."""
    bounds = [0, *cuts, len(inner)]
    addresses, sizes = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        chunk = inner[lo:hi]
        a = chunking.address(chunk)
        path = store.objects.path(a)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(chunk)
        addresses.append(a)
        sizes.append(len(chunk))
    return addresses, sizes


def listing_map(addresses, sizes, /, **fields) -> dict:
    """The listing's metadata as agck writes it, with ``fields`` changed (``...`` drops one)."""
    m = {"run": RUN, "step": 2, "parent": None, "meta": None, "chunks": b"".join(addresses),
         "sizes": list(sizes), "length": sum(sizes), "blobs": []}
    for k, v in fields.items():
        if v is ...:
            m.pop(k)
        else:
            m[k] = v
    return m


def write_listing(store, step: int, data: bytes) -> str:
    path = store.ref(RUN, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def plant(store, at: int, inner: bytes, /, *, cuts=(), minor=1, flags=format.FLAG_CHUNKED, raw=None,
          **fields) -> str:
    """A chunked checkpoint at (RUN, ``at``) whose content is ``inner``: its chunks
    and a listing of them (agck's, with ``fields`` changed; ``raw`` packs the map)."""
    addresses, sizes = put_chunks(store, inner, cuts)
    m = listing_map(addresses, sizes, **{"step": at, **fields})
    packed = raw(m) if raw is not None else msgpack.packb(m, use_bin_type=True)
    return write_listing(store, at, assemble({}, raw_meta=packed, minor=minor, flags=flags))


def inner_of(step: int, state=None, **kw) -> bytes:
    kw.setdefault("run", RUN)
    return agck.dumps({"x": np.arange(1000) + step} if state is None else state, step=step, **kw)


def set_header(data: bytes, **fields) -> bytes:
    """``data`` with header fields (minor, flags) changed and its header digest made right."""
    out = bytearray(data)
    for name, (off, fmt) in {"minor": (6, "<H"), "flags": (8, "<I")}.items():
        if name in fields:
            struct.pack_into(fmt, out, off, fields[name])
    header_digest = format.digest(bytes(out[:56]))
    struct.pack_into("<Q", out, 56, header_digest)
    blob_count, payload_offset, payload_len = struct.unpack_from("<I", out, 12)[0], *struct.unpack_from("<QQ", out, 24)
    footer = payload_offset + payload_len       # the footer keeps a copy of the header digest
    struct.pack_into("<Q", out, footer + 8 * blob_count, header_digest)
    tail = footer + 8 * blob_count + 16
    struct.pack_into("<Q", out, tail, format.digest(bytes(out[footer:tail])))
    return bytes(out)


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "s"), min_chunked=0)
    s.put(RUN, 1, {"x": np.arange(1000) + 1})         # what recovery walks back to
    return s


def rejected_at(store, step: int):
    rec = agck.recover(store, RUN)
    assert rec.step == 1 and [r.step for r in rec.rejected] == [step], rec.as_dict()
    return rec.rejected[0]


# --- section 12 -------------------------------------------------------------------------------

def test_12_4_a_listing_of_a_chunked_container_is_a_verdict_and_recovery_walks_past_it(store):
    """FORMAT.md 12.4: a listing never lists another chunked container."""
    listing = open(store.ref(RUN, 1), "rb").read()
    assert format.is_chunked(format.parse_header(listing))
    plant(store, 2, listing)
    with pytest.raises(MalformedCheckpointError, match="itself a chunked container") as e:
        store.get(RUN, 2)
    assert e.value.section == "chunk" and e.value.verdict
    assert rejected_at(store, 2).section == "chunk"


def test_12_3_a_chunk_holding_another_valid_container_is_refused(store):
    """FORMAT.md 12.3: addresses are checked on every verifying read, so a chunk whose
    bytes were replaced by another container that verifies (same size) is refused."""
    mine, other = inner_of(2), inner_of(2, {"x": np.arange(1000) * 7})
    assert len(mine) == len(other) and mine != other
    path = plant(store, 2, mine)
    (address,) = format.open_chunked(format.open_container(open(path, "rb").read())).addresses
    with open(store.objects.path(address), "wb") as f:
        f.write(other)
    agck.loads(other)                                  # a container that verifies on its own
    with pytest.raises(DamagedChunkError, match="does not match its address") as e:
        store.get(RUN, 2)
    assert e.value.section == "chunk" and e.value.damaged == (address,)
    assert rejected_at(store, 2).section == "chunk"


def test_12_3_verifying_many_checkpoints_hashes_each_shared_chunk_once(tmp_path):
    """FORMAT.md 12.3 and 12.4: a CheckedChunks shared by several reads checks every
    address once, and the inner containers' payloads are not hashed again."""
    s = open_store(str(tmp_path / "s"), min_chunked=0)
    base = np.random.default_rng(0).random(300_000)
    for step in (1, 2):
        s.put(RUN, step, {"base": base, "step": step})
    sizes = {}
    for step in (1, 2):
        listed = format.open_chunked(format.open_container(open(s.ref(RUN, step), "rb").read()))
        sizes.update(zip(listed.addresses, listed.sizes))
    checked = chunking.CheckedChunks()
    for step in (1, 2):
        assert s.read(RUN, step, verify=checked).state["step"] == step
    assert checked.addresses == set(sizes) and checked.hashed_bytes == sum(sizes.values())


@pytest.mark.parametrize("fields", [dict(step=2.0), dict(step=True), dict(parent=-1), dict(run=5),
                                    dict(chunks=...), dict(sizes=[1]), dict(length=7)],
                         ids=["step_float", "step_bool", "parent_negative", "run_int", "no_chunks", "sizes",
                              "length"])
def test_12_2_listing_keys_of_the_wrong_type_are_malformed(store, fields):
    """FORMAT.md 12.2: 1.0 and true are not steps, in a listing as in a container (10.15)."""
    plant(store, 2, inner_of(2), **fields)
    with pytest.raises(MalformedCheckpointError, match="chunk listing") as e:
        store.get(RUN, 2)
    assert e.value.section == "metadata"
    assert rejected_at(store, 2).section == "metadata"


def test_12_2_other_keys_are_ignored_and_absent_ones_read_as_nil(store):
    """FORMAT.md 12.2 (section 5): a listing without parent and meta, and with keys a
    later minor version may add, tensors and state included (10.15 does not apply)."""
    plant(store, 2, inner_of(2), parent=..., meta=..., later={"k": 1}, tensors=[1], state=b"\x01")
    ck = store.get(RUN, 2)
    assert (ck.step, ck.parent, ck.meta) == (2, None, None)
    assert np.array_equal(ck.state["x"], np.arange(1000) + 2)


def test_12_1_and_12_4_minor_versions_and_optional_flags_are_taken(store):
    """FORMAT.md 12.1, 12.4 (section 4): the CHUNKED flag, not the minor version, makes a
    listing; any minor version and optional flag are accepted, in the listing and in
    its content; an unknown required flag in the content is UnsupportedVersionError."""
    plant(store, 2, inner_of(2), minor=0)
    plant(store, 3, inner_of(3), minor=7, flags=format.FLAG_CHUNKED | 1 << 16)
    plant(store, 4, set_header(inner_of(4), minor=1, flags=1 << 16))
    for step in (2, 3, 4):
        assert store.get(RUN, step).step == step
    plant(store, 5, set_header(inner_of(5), flags=1 << 9))
    with pytest.raises(UnsupportedVersionError):
        store.get(RUN, 5)
    with pytest.raises(UnsupportedVersionError):       # not a verdict: the walk stops there
        agck.recover(store, RUN)


def test_12_1_a_chunked_container_with_a_payload_is_malformed(store):
    """FORMAT.md 12.1: blob_count and payload_len are 0."""
    addresses, sizes = put_chunks(store, inner_of(2))
    m = listing_map(addresses, sizes)
    m.pop("blobs")
    w = format.ContainerWriter(m, [memoryview(b"x" * 8)], minor=1, flags=format.FLAG_CHUNKED)
    write_listing(store, 2, b"".join(bytes(p) for p in w.parts()))
    with pytest.raises(MalformedCheckpointError, match="payload"):
        store.get(RUN, 2)
    assert rejected_at(store, 2).section == "metadata"


def test_12_4_content_that_is_not_a_container_is_malformed_not_a_format_error(store):
    """FORMAT.md 12.4: the stored container is one; content without the magic is
    MalformedCheckpointError, section chunk, even when its chunks match their addresses."""
    plant(store, 2, b"XGCK" + inner_of(2)[4:])
    with pytest.raises(MalformedCheckpointError, match="not an AGCK container") as e:
        store.get(RUN, 2)
    assert e.value.section == "chunk"
    assert rejected_at(store, 2).section == "chunk"


F32_1_5 = b"\xca" + struct.pack(">f", 1.5)
F64_NAN = b"\xcb" + bytes.fromhex("7ff8000000000001")


def _packed_map(m: dict, meta_bytes: bytes) -> bytes:
    """``m`` packed with its ``meta`` value given as raw msgpack bytes."""
    out = bytes([0x80 | len(m)])
    for k, v in m.items():
        out += msgpack.packb(k) + (meta_bytes if k == "meta" else msgpack.packb(v, use_bin_type=True))
    return out


@pytest.mark.parametrize("inner_meta, listed_meta, ok", [
    ({"a": 1}, b"\x81\xa1a\x01", True),
    ({"a": 1}, b"\x81\xa1a" + msgpack.packb(1.0), False),            # 1 is not 1.0
    ({"a": 1}, b"\x81\xa1a\xc3", False),                              # nor true
    ({"a": 1.5}, b"\x81\xa1a" + F32_1_5, True),                       # a float 32 reads as the float 64
    ([float("nan")], b"\x91" + F64_NAN, False),                       # a NaN of other bits
    ([struct.unpack(">d", F64_NAN[1:])[0]], b"\x91" + F64_NAN, True),  # a NaN equals itself, bit for bit
    ([0.0], b"\x91" + msgpack.packb(-0.0), False),
    ({"a": 1, "b": 2}, msgpack.packb({"b": 2, "a": 1}), False),       # maps in their order
], ids=["same", "int_float", "int_bool", "float32", "nan_other_bits", "nan_same_bits", "signed_zero",
        "key_order"])
def test_12_5_meta_is_compared_by_its_packed_bytes(store, inner_meta, listed_meta, ok):
    """FORMAT.md 12.5."""
    plant(store, 2, inner_of(2, meta=inner_meta), raw=lambda m: _packed_map(m, listed_meta))
    if ok:
        assert store.get(RUN, 2).step == 2
        return
    with pytest.raises(MalformedCheckpointError, match="the listing's meta differs") as e:
        store.get(RUN, 2)
    assert e.value.section == "chunk"


@pytest.mark.parametrize("fields", [dict(parent=1), dict(run="other"), dict(step=...)])
def test_12_5_run_step_and_parent_equal_the_contents(store, fields):
    """FORMAT.md 12.5: an absent step reads as nil, which is not the content's 2."""
    plant(store, 2, inner_of(2), **fields)
    with pytest.raises(MalformedCheckpointError, match="the listing says") as e:
        store.get(RUN, 2)
    assert e.value.section == "chunk"


def test_12_6_a_listing_read_alone_is_a_usage_error_once_it_verifies(store):
    """FORMAT.md 12.6: agck.load checks 10.1-10.12, 12.1 and 12.2, then says where the
    content is; that is not a verdict."""
    path = store.ref(RUN, 1)
    with pytest.raises(UsageError, match="store") as e:
        agck.load(path)
    assert not e.value.verdict
    data = open(path, "rb").read()
    c = format.open_container(data)
    m = dict(c.meta, sizes=[1] * len(c.meta["sizes"]))        # a listing that breaks 12.2
    with pytest.raises(MalformedCheckpointError, match="chunk listing"):
        agck.loads(assemble({}, raw_meta=msgpack.packb(m, use_bin_type=True), minor=1,
                            flags=format.FLAG_CHUNKED))


def test_12_7_materializing_is_the_chunks_and_export_writes_the_checkpoint_anew(store, tmp_path):
    """FORMAT.md 12.7: store.get decodes the chunks' concatenation; agck export writes
    the same values as a new 1.0 container, with its own created_at_ns."""
    from agck.export import export
    listed = format.open_chunked(format.open_container(open(store.ref(RUN, 1), "rb").read()))
    inner = bytes(content.assemble(listed, store.objects.get, ref=None))
    ck = store.get(RUN, 1)
    assert ck.header == format.parse_header(inner) and ck.nbytes == len(inner)
    out = tmp_path / "out.agck"
    export(ck, out)
    again = agck.load(out)
    assert np.array_equal(again.state["x"], ck.state["x"]) and (again.run, again.step) == (RUN, 1)
    assert again.header.created_at_ns != ck.header.created_at_ns and out.read_bytes() != inner


# --- section 13 -------------------------------------------------------------------------------

NONCES = ["a1b2c3d4e5f60718293a4b5c", "0f1e2d3c4b5a69788796a5b4"]


def multi_rank(store, step: int, *, world=2, epoch=None, body=None, part_meta=None, state=None):
    """Parts of ``step`` for ``world`` ranks and the commit record binding them;
    ``body(record)`` edits the record's agck.commit map, ``part_meta(rank, meta)``
    a part's meta. Returns the epoch."""
    epoch = store.begin_epoch(RUN) if epoch is None else epoch
    parts = store.parts_store()
    refs = []
    for rank in range(world):
        pr = sharded.part_run(RUN, epoch, rank)
        meta = sharded.part_meta(RUN, step, epoch, rank, world, NONCES[rank])
        if part_meta is not None:
            meta = part_meta(rank, meta)
        own = {"rank": rank, "w": np.random.default_rng(rank).random(50_000)}     # no chunk shared between ranks
        parts.put(pr, step, own if state is None else state, meta=meta)
        refs.append(sharded.PartRef(rank, pr, NONCES[rank]))
    record = sharded.Commit(run=RUN, step=step, epoch=epoch, world_size=world, parts=refs).state()
    if body is not None:
        body(record[sharded.COMMIT_KEY])
    store.put(RUN, step, record, epoch=epoch)
    return epoch


def test_13_1_a_state_with_the_commit_key_beside_others_is_an_ordinary_checkpoint(store):
    """FORMAT.md 13.1."""
    record = sharded.Commit(run=RUN, step=2, epoch=1, world_size=1,
                            parts=[sharded.PartRef(0, sharded.part_run(RUN, 1, 0), "n")]).state()
    store.put(RUN, 2, {**record, "mine": 1})               # no part was ever written
    ck = store.get(RUN)
    assert ck.step == 2 and sharded.as_commit(ck) is None and not sharded.is_commit(ck)


@pytest.mark.parametrize("edit", [
    lambda b: b.update(kind="someone-elses"),
    lambda b: b.pop("extra"),
    lambda b: b.update(later=[1, 2]),
], ids=["unknown_kind", "no_extra", "other_key"])
def test_13_3_any_kind_no_extra_and_other_keys_are_accepted(store, edit):
    """FORMAT.md 13.3: parts are judged the same whatever the kind."""
    multi_rank(store, 2, body=edit)
    ck = store.get(RUN)
    commit = sharded.as_commit(ck)
    assert ck.step == 2 and commit.world_size == 2
    assert [sharded.read_part(store, commit, r).state["rank"] for r in (0, 1)] == [0, 1]


@pytest.mark.parametrize("edit, why", [
    (lambda b: b["parts"][1].__setitem__(0, b["parts"][1][0].replace(".e1.", ".e01.")), "part 1"),
    (lambda b: b["parts"][0].__setitem__(0, b["parts"][0][0].replace(".r0", ".r00")), "part 0"),
    (lambda b: b.update(epoch=True), "epoch"),
    (lambda b: b.update(epoch=1.0), "epoch"),
    (lambda b: b.update(world_size=2.0), "world_size"),
    (lambda b: b.update(version=True), "version"),
    (lambda b: b.update(kind=None), "kind"),
    (lambda b: b["parts"][1].__setitem__(1, 7), "part 1"),
], ids=["epoch_leading_zero", "rank_leading_zero", "epoch_bool", "epoch_float", "world_float", "version_bool",
        "kind_nil", "nonce_int"])
def test_13_3_a_malformed_commit_record_is_a_verdict(store, edit, why):
    """FORMAT.md 13.3: one name per part (no leading zeros), ints that are ints."""
    multi_rank(store, 2, body=edit)
    with pytest.raises(CorruptCheckpointError, match=why) as e:
        sharded.as_commit(store.read(RUN, 2))
    assert e.value.section == "commit"
    assert rejected_at(store, 2).section == "commit"


def test_13_2_a_commit_record_that_does_not_verify_is_rejected_as_any_checkpoint(store):
    """FORMAT.md 13.2: the record's own verdict, with its section; no part is read."""
    multi_rank(store, 2)
    _flip(store.ref(RUN, 2), 80)                       # in the record's (listing's) metadata
    with pytest.raises(CorruptCheckpointError, match="metadata checksum") as e:
        store.get(RUN, 2)
    assert e.value.section == "metadata"
    assert rejected_at(store, 2).section == "metadata"


def test_13_3_a_newer_commit_version_is_not_a_verdict(store):
    """FORMAT.md 13.3."""
    multi_rank(store, 2, body=lambda b: b.update(version=2))
    with pytest.raises(UnsupportedVersionError):
        agck.recover(store, RUN)


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("incremental", [False, True], ids=["standalone_part", "chunked_part"])
def test_13_4_a_part_that_does_not_verify_is_section_part_with_its_reason(tmp_path, incremental):
    """FORMAT.md 13.4: a flipped byte in a part (a standalone container: its metadata)
    or in a chunk of a part is reported as section part, naming the rank, with the
    part's own error in the message."""
    store = open_store(str(tmp_path / "s"), incremental=incremental, min_chunked=0)
    store.put(RUN, 1, {"x": 1})
    multi_rank(store, 2)
    parts = store.parts_store()
    commit = sharded.as_commit(store.read(RUN, 2))
    if incremental:
        listed = format.open_chunked(format.open_container(open(parts.ref(commit.parts[1].run, 2), "rb").read()))
        biggest = max(range(len(listed.sizes)), key=listed.sizes.__getitem__)
        _flip(parts.objects.path(listed.addresses[biggest]), listed.sizes[biggest] // 2)
        underlying = "does not match its address"
    else:
        _flip(parts.ref(commit.parts[1].run, 2), 80)
        underlying = "metadata checksum mismatch"
    with pytest.raises(CorruptCheckpointError) as e:
        sharded.read_part(store, commit, 1)
    assert e.value.section == "part" and "rank 1's part" in e.value.reason and underlying in e.value.reason
    r = rejected_at(store, 2)       # (a damaged chunk was quarantined by the read: missing now)
    assert r.section == "part" and "rank 1's part does not verify" in r.reason


@pytest.mark.parametrize("edit", [
    lambda rank, m: {**m, sharded.PART_KEY: {**m[sharded.PART_KEY], "epoch": 1.0}} if rank else m,
    lambda rank, m: {**m, sharded.PART_KEY: {**m[sharded.PART_KEY], "rank": True}} if rank else m,
    lambda rank, m: {**m, sharded.PART_KEY: {**m[sharded.PART_KEY], "nonce": "other"}} if rank else m,
    lambda rank, m: {**m, sharded.PART_KEY: {**m[sharded.PART_KEY], "later": 1}} if rank else m,
], ids=["epoch_float", "rank_bool", "nonce", "other_key"])
def test_13_4_a_part_binds_only_with_exactly_its_values(store, edit):
    """FORMAT.md 13.4: the six keys, each equal and of the same msgpack type."""
    multi_rank(store, 2, part_meta=edit)
    with pytest.raises(CorruptCheckpointError, match="not the one the commit record binds") as e:
        sharded.read_part(store, sharded.as_commit(store.read(RUN, 2)), 1)
    assert e.value.section == "part"
    assert rejected_at(store, 2).section == "part"


def test_13_5_only_the_reads_that_judge_a_step_read_its_parts(store):
    """FORMAT.md 13.5: store.get(R, k) returns the record whatever its parts; get(R),
    recover and verify judge them."""
    multi_rank(store, 2)
    commit = sharded.as_commit(store.read(RUN, 2))
    store.parts_store().delete(commit.parts[0].run, 2)
    assert sharded.is_commit(store.get(RUN, 2))
    assert store.get(RUN).step == 1
    assert rejected_at(store, 2).section == "part"
    rep = recovery.verify_store(store, RUN)
    assert rep.ok == [(RUN, 1)] and [(r.step, r.section) for r in rep.rejected] == [(2, "part")]
    with pytest.raises(CorruptCheckpointError, match="rank 0's part is missing"):
        sharded.read_part(store, commit, 0)


def test_13_6_a_partial_part_is_removable_once_its_epoch_is_older_than_the_runs(store):
    """FORMAT.md 13.6: bound parts are kept; an unbound part of the current epoch is kept
    at any step (it may be in flight); an older epoch's is removed."""
    e1 = multi_rank(store, 4, world=1)
    parts = store.parts_store()
    parts.put(sharded.part_run(RUN, e1, 0), 3, {"x": 3}, meta=sharded.part_meta(RUN, 3, e1, 0, 1, "n3"))
    parts.put(sharded.part_run(RUN, e1, 0), 9, {"x": 9}, meta=sharded.part_meta(RUN, 9, e1, 0, 1, "n9"))
    found = sorted((p.step, p.removable) for p in sharded.partial_parts(store, RUN))
    assert found == [(3, False), (9, False)]                   # below and above the newest committed step
    assert sharded.clean_partial(store, RUN) == []
    store.begin_epoch(RUN)
    assert sorted(p.step for p in sharded.partial_parts(store, RUN)) == [3, 9]
    assert len(sharded.clean_partial(store, RUN)) == 2
    assert parts.steps(sharded.part_run(RUN, e1, 0)) == [4]    # the bound part stays
    assert agck.recover(store, RUN).step == 4


def test_13_dcp_item_keys_are_the_fqn_and_the_offsets_of_every_tensor(tmp_path):
    """FORMAT.md section 13, kind "dcp": a tensor saved whole is keyed by zero offsets,
    a 0-d one by none, a bytes item by its fqn; storage_data names each key."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from agck.dcp import StorageWriter
    import warnings
    s = open_store(str(tmp_path / "s"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2, 3), "s": torch.tensor(1.0), "b": 5},
                 storage_writer=StorageWriter(s, RUN, 1), no_dist=True)
    commit = sharded.as_commit(s.read(RUN, 1))
    assert commit.kind == "dcp"
    part = sharded.read_part(s, commit, 0)
    assert set(part.state) == {"w@0,0", "s@", "b"} and isinstance(part.state["b"], bytes)
    keys = {e[0]: e[4] for e in commit.extra["storage_data"]}
    assert keys == {"w": "w@0,0", "s": "s@", "b": "b"}


def test_a_part_of_a_newer_format_is_not_a_verdict(store):
    """FORMAT.md 13.4: UnsupportedVersionError passes through read_part."""
    multi_rank(store, 2, state={"x": 1})
    commit = sharded.as_commit(store.read(RUN, 2))
    path = store.parts_store().ref(commit.parts[1].run, 2)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(set_header(data, flags=format.parse_header(data).flags | 1 << 9))
    with pytest.raises(UnsupportedVersionError):
        sharded.read_part(store, commit, 1)
