"""Incremental (chunked) checkpoints on every backend: exact round trips, content
shared between checkpoints, garbage collection that never removes a live chunk,
and damage that is detected and walked past."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest

import agck
from agck import chunking, codec, errors, format
from agck.stores import content
from agck.recovery import recover_run
from agck.stores import open_store

torch = pytest.importorskip("torch")


def growing(step: int, width: int = 16384) -> dict:
    """The state after ``step`` steps of a pipeline that appends one result per step."""
    rng = np.random.default_rng(0)
    out = [rng.random(width, dtype=np.float32) for _ in range(step)]
    return {"out": out, "records": [{"doc": f"doc-{i}", "score": i / 7} for i in range(step * 20)],
            "step": step, "model": torch.arange(4096, dtype=torch.float32)}


def assert_growing(ck, step: int) -> None:
    want = growing(step)
    assert ck.state["step"] == step
    assert len(ck.state["out"]) == step
    for a, b in zip(ck.state["out"], want["out"]):
        np.testing.assert_array_equal(a, b)
    assert ck.state["records"] == want["records"]
    assert torch.equal(ck.state["model"], want["model"])


def test_round_trip_of_many_checkpoints(store):
    for s in range(0, 60, 10):
        store.put("r", s, growing(s), meta={"s": s}, parent=s - 10 if s else None)
    for s in range(0, 60, 10):
        ck = store.get("r", s)
        assert_growing(ck, s)
        assert ck.meta == {"s": s} and ck.parent == (s - 10 if s else None)
    assert [i.step for i in store.list("r")] == list(range(0, 60, 10))
    assert all(i.size and i.size > 4096 * 4 for i in store.list("r"))  # the checkpoint's size, not its listing's


def test_delete_and_collect_keep_every_other_checkpoint(store):
    for s in range(1, 9):
        store.put("r", s, growing(s * 3))
    for s in (2, 3, 5, 8):
        store.delete("r", s)
    store.collect_garbage()
    for s in (1, 4, 6, 7):
        assert_growing(store.get("r", s), s * 3)
    store.put("r", 9, growing(27))          # a new checkpoint may reuse what survived
    assert_growing(store.get("r", 9), 27)


def test_prune_collects_and_the_newest_still_reads(store):
    for s in range(1, 11):
        store.put("r", s, growing(s))
    assert store.prune("r", keep_last=2) == list(range(1, 9))
    for s in (9, 10):
        assert_growing(store.get("r", s), s)


def test_overwrite_with_other_content(store):
    store.put("r", 1, growing(5))
    store.put("r", 1, growing(7), overwrite=True)
    store.collect_garbage()
    ck = store.get("r", 1)
    assert len(ck.state["out"]) == 7


def test_standalone_and_chunked_checkpoints_live_side_by_side(store_spec, store):
    kind, url, opts = store_spec
    plain = open_store(url, **{**opts, "incremental": False, "init": False} if kind == "postgres"
                       else {**opts, "incremental": False})
    try:
        plain.put("r", 1, growing(3))
        store.put("r", 2, growing(4))
        store.collect_garbage()
        assert_growing(store.get("r", 1), 3)
        assert_growing(plain.get("r", 2), 4)
    finally:
        plain.close()


# --- the file store: what is written, and what a reader of another version sees ---------

def _objects_bytes(root: str) -> int:
    total = 0
    for d, _, files in os.walk(os.path.join(root, ".objects")):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files if f != "lock")
    return total


def test_file_store_writes_what_changed(tmp_path):
    """200 steps appending 64 KiB each, every 10: the store holds about what the
    pipeline produced (12.5 MiB), not the sum of every checkpoint (130 MiB)."""
    store = open_store(str(tmp_path / "s"))
    out, produced, written = [], 0, []
    rng = np.random.default_rng(3)
    for step in range(1, 201):
        out.append(rng.random(16384, dtype=np.float32))
        produced += 65536
        if step % 10 == 0:
            store.put("r", step, {"out": out, "step": step})
            written.append(store.last_put.new_bytes)
    held = _objects_bytes(store.root)
    assert held < 1.25 * produced, (held, produced)
    assert max(written[1:]) < 10 * 65536 + 4 * chunking.SMALL[2]   # each checkpoint: its 10 new arrays and a little
    assert len(store.get("r", 200).state["out"]) == 200


def test_a_growing_list_of_records_writes_the_pieces_around_its_end(store_spec):
    """Records appended to a long list: a checkpoint writes the small pieces that
    changed (header, list length, the list's open end, footer), not the 4-64 KiB
    chunks that would hold them if the metadata were cut by content alone. (Chunked
    from the first checkpoint on: by default one under 64 KiB is written whole.)"""
    _, url, opts = store_spec
    store = open_store(url, **opts, min_chunked=0)
    records, new = [], []
    for step in range(1, 301):
        records.append({"doc": f"document {step:08d} of the corpus", "tokens": step * 7, "scores": [0.5] * 12})
        if step % 10 == 0:
            store.put("r", step, {"out": records})
            new.append(store.last_put.new_bytes)
    produced = len(msgpack.packb(records[:10]))                  # what ten records add
    seg = codec.EncodeMemo.SEGMENT * len(msgpack.packb(records[0]))
    assert max(new[-10:]) < seg + 2 * produced, new           # at most a segment, when one fills up
    assert sorted(new[-10:])[5] < 2 * produced, new            # usually the new records and a few small pieces
    assert store.get("r", 300).state["out"] == records
    store.close()


def test_frozen_model_is_stored_once(tmp_path):
    store = open_store(str(tmp_path / "s"))
    model = torch.randn(4 << 20)          # 16 MiB, never changes
    for s in range(5):
        store.put("r", s, {"model": model, "adapter": torch.full((256,), float(s))})
    assert _objects_bytes(store.root) < 1.1 * model.numel() * 4
    assert torch.equal(store.get("r", 4).state["model"], model)


def test_a_reader_without_chunked_support_refuses_cleanly(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "s"))
    store.put("r", 1, growing(2))
    raw = open(store.ref("r", 1), "rb").read()
    h = format.parse_header(raw)
    assert (h.major, h.minor, h.flags) == (1, 1, format.FLAG_CHUNKED)
    monkeypatch.setattr(format, "KNOWN_REQUIRED_FLAGS", 0)    # a 1.0 reader
    with pytest.raises(errors.UnsupportedVersionError):
        agck.loads(raw)


def test_save_and_dumps_stay_standalone(tmp_path):
    agck.save(tmp_path / "x.agck", growing(3))
    h = format.parse_header(open(tmp_path / "x.agck", "rb").read(64))
    assert (h.minor, h.flags) == (0, 0)
    assert format.parse_header(agck.dumps(growing(2))).flags == 0


def test_loading_a_listing_alone_says_where_its_content_is(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.put("r", 1, growing(2))
    with pytest.raises(errors.UsageError, match="store"):
        agck.load(store.ref("r", 1))


def _chunk_files(root):
    d = os.path.join(root, ".objects")
    return sorted(os.path.join(a, f) for a, _, fs in os.walk(d) for f in fs if f not in ("lock", "generation"))


def test_a_damaged_or_missing_chunk_is_corruption_and_recovery_walks_back(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.put("r", 1, {"x": np.zeros(10)})
    before = set(_chunk_files(store.root))
    store.put("r", 2, {"x": np.ones(300_000)})
    mine = sorted(set(_chunk_files(store.root)) - before)
    assert mine
    with open(mine[0], "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(errors.CorruptCheckpointError) as e:
        store.read("r", 2)
    assert e.value.section == "chunk"
    assert isinstance(e.value, errors.DamagedChunkError) and "quarantined" in e.value.reason
    assert not os.path.exists(mine[0])     # the read quarantined it: missing from now on
    rec = recover_run(store, "r")
    assert rec.step == 1 and rec.rejected[0].section == "chunk"
    with pytest.raises(errors.CorruptCheckpointError, match="missing"):
        store.read("r", 2)


def test_damage_to_the_first_byte_of_the_content_names_the_chunk(tmp_path):
    """The magic of the rebuilt container damaged reads as "not a container"; it is
    still corruption of a chunk, named by its address, and recovery walks past it."""
    store = open_store(str(tmp_path / "s"))
    store.put("r", 1, {"x": np.zeros(10)})
    store.put("r", 2, {"x": np.ones(300_000)})
    path = store.objects.path(store.last_put.addresses[0])     # the head chunk: header first
    data = bytearray(open(path, "rb").read())
    data[0] ^= 1
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(errors.CorruptCheckpointError) as e:
        store.read("r", 2)
    assert e.value.section == "chunk" and "chunk 0" in str(e.value)
    assert recover_run(store, "r").step == 1


def test_collect_garbage_removes_only_unlisted_chunks_and_leftovers(tmp_path):
    store = open_store(str(tmp_path / "s"))
    store.put("r", 1, {"x": np.arange(500_000)})
    store.put("r", 2, {"x": np.arange(500_000) * 2})
    kept = set(_chunk_files(store.root))
    leftover = os.path.join(store.root, ".objects", "ab", ".cd.tmp.1.dead")
    os.makedirs(os.path.dirname(leftover), exist_ok=True)
    open(leftover, "wb").write(b"x")
    store.delete("r", 1)
    got = store.collect_garbage()
    assert got.deleted_chunks >= 2 and not os.path.exists(leftover)
    assert set(_chunk_files(store.root)) < kept
    np.testing.assert_array_equal(store.get("r", 2).state["x"], np.arange(500_000) * 2)


@pytest.mark.parametrize("at", [80, -100, 10])   # the listing's metadata, its footer, its header
def test_a_damaged_listing_keeps_its_chunks_and_a_newer_one_stops_collection(tmp_path, at):
    """A verdict of damage deletes nothing: the chunks a damaged listing names stay, so
    when the verdict was wrong (here: the damage is undone) the checkpoint reads whole."""
    import struct
    store = open_store(str(tmp_path / "s"))
    store.put("r", 1, {"x": np.arange(400_000)})
    store.put("r", 2, {"y": np.arange(400_000) + 1})
    p1 = store.ref("r", 1)
    good = open(p1, "rb").read()
    data = bytearray(good)
    data[at] ^= 0xFF
    open(p1, "wb").write(data)
    chunks = set(_chunk_files(store.root))
    got = store.collect_garbage()
    assert p1 in got.damaged + got.unreadable and got.deleted_chunks == 0
    assert set(_chunk_files(store.root)) == chunks
    np.testing.assert_array_equal(store.get("r", 2).state["y"], np.arange(400_000) + 1)
    open(p1, "wb").write(good)
    np.testing.assert_array_equal(open_store(str(tmp_path / "s")).get("r", 1).state["x"], np.arange(400_000))
    p2 = store.ref("r", 2)
    data = bytearray(open(p2, "rb").read())
    struct.pack_into("<I", data, 8, format.FLAG_CHUNKED | (1 << 14))   # a required flag of a newer agck
    struct.pack_into("<Q", data, 56, format.digest(bytes(data[:56])))
    open(p2, "wb").write(data)
    n = len(_chunk_files(store.root))
    with pytest.raises(errors.StoreError, match="newer"):
        store.collect_garbage()
    assert len(_chunk_files(store.root)) == n


# --- two processes: a writer and a collector ---------------------------------------------

_WRITER = """
import sys, numpy as np
from agck.stores import open_store
kind, url, opts, n = sys.argv[1], sys.argv[2], eval(sys.argv[3]), int(sys.argv[4])
s = open_store(url, **opts)
base = np.arange(200_000, dtype=np.int64)
for i in range(n):
    s.put("w", i, {"base": base, "i": np.full(1000, i)})   # base's chunks are shared by every step
    s.delete("w", i - 1) if i else None
print("ok")
"""


def test_collector_beside_a_writer_never_removes_a_chunk_a_checkpoint_needs(store_spec, store):
    kind, url, opts = store_spec
    opts = {**opts, "init": False} if kind == "postgres" else opts
    p = subprocess.Popen([sys.executable, "-c", _WRITER, kind, url, repr(opts), "40"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    errs = []

    def collect():
        while not stop.is_set():
            try:
                store.collect_garbage()
            except Exception as e:  # noqa: BLE001 - reported below
                errs.append(e)

    t = threading.Thread(target=collect)
    t.start()
    out, err = p.communicate(timeout=300)
    stop.set()
    t.join()
    assert p.returncode == 0 and "ok" in out, err
    assert not errs, errs
    store.collect_garbage()
    ck = store.get("w", 39)
    np.testing.assert_array_equal(ck.state["base"], np.arange(200_000, dtype=np.int64))
    assert int(ck.state["i"][0]) == 39


def test_sigkill_mid_put_leaves_the_previous_checkpoint_and_collectable_leftovers(tmp_path):
    root = str(tmp_path / "s")
    store = open_store(root)
    store.put("r", 1, {"x": np.arange(100)})
    code = f"""
import numpy as np
from agck.stores import open_store
open_store({root!r}).put("r", 2, {{"x": np.arange(2_000_000)}})
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "AGCK_FAILPOINTS": "file.chunks_before_dir_fsync=kill"})
    assert p.returncode == -9, p.stderr
    assert store.steps("r") == [1]
    assert recover_run(store, "r").step == 1
    n = len(_chunk_files(root))
    got = store.collect_garbage()
    assert got.deleted_chunks > 0 and len(_chunk_files(root)) < n
    np.testing.assert_array_equal(store.get("r", 1).state["x"], np.arange(100))



@pytest.mark.parametrize("direct_chunks", [False, True], ids=["buffered", "background-direct-chunks"])
def test_power_loss_at_every_operation_of_a_put_then_a_prune(tmp_path, monkeypatch, direct_chunks):
    """Step 1 is durable; then put(2), prune to the newest and collect. A power cut at
    every file-system operation, with every way unsynced operations can reach the
    disk: the store never holds a checkpoint that fails to read, and once put(2)
    has returned, step 2 survives. Also with the put made as a snapshot writer's,
    whose chunk files (here those of 16 KiB or more) are written with O_DIRECT."""
    import random

    from agck import durable
    from agck.stores.file import objects as objectdir
    from crashtests.simfs import MODES, Crash, SimFS
    if direct_chunks:
        monkeypatch.setattr(objectdir, "DIRECT_CHUNK_MIN", 16 << 10)
        monkeypatch.setattr(durable, "DIRECT_CHUNK", 64 << 10)
        monkeypatch.setattr(durable, "DIRECT_IO", "auto")
    one = {"x": np.arange(100_000), "shared": np.ones(60_000)}
    two = {"x": np.arange(100_000) * 3, "shared": np.ones(60_000)}

    def scenario(root, fs, acked):
        durable.writes_in_background(direct_chunks)
        try:
            store = open_store(root, fs=fs)
            store.put("r", 2, two)
            acked.append(2)
            store.prune("r", keep_last=1)
        finally:
            durable.writes_in_background(False)

    def fresh(name):
        root = str(tmp_path / name)
        open_store(root).put("r", 1, one)
        return root

    # The header chunk holds the creation time, so which chunk directories a run
    # touches (and so the number of operations) varies by one or two: crash at
    # every operation until a run completes.
    crash_at = 0
    while True:
        crash_at += 1
        root = fresh(f"c{crash_at}")
        sim = SimFS(root, crash_at=crash_at)
        acked = []
        try:
            scenario(root, sim, acked)
            break
        except Crash:
            pass
        rng = random.Random(crash_at)
        for mode in MODES:
            after = str(tmp_path / f"c{crash_at}-{mode}")
            sim.image(after, rng, mode)
            store = open_store(after)
            steps = store.steps("r")
            for s in steps:                       # no listed checkpoint may fail to read
                ck = store.get("r", s)
                np.testing.assert_array_equal(ck.state["x"], (one if s == 1 else two)["x"])
            assert steps, (crash_at, sim.crash_op, mode)
            if acked:
                assert 2 in steps, (crash_at, sim.crash_op, mode)
    assert crash_at > 100       # every operation of the put, the prune and the collection was a crash point


# --- deciding what changed never misses a change, whatever path changed it ---

def _mutations():
    """(name, make state, mutate it in place). Each state holds a large tensor (a
    piece of its own), small ones (a run of blobs) and records."""
    def base():
        torch.manual_seed(0)
        lin = torch.nn.Linear(64, 64)
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
        lin(torch.randn(4, 64)).sum().backward()
        opt.step()
        return {"big": torch.randn(1 << 21), "small": [torch.randn(300) for _ in range(40)],
                "arr": np.arange(5000.0), "model": lin.state_dict(), "lin": lin, "opt": opt,
                "records": [{"i": i, "x": 0.5} for i in range(600)]}

    def optimizer_step(s):
        s["lin"](torch.randn(4, 64)).sum().backward()
        s["opt"].step()

    def load_state_dict(s):
        other = torch.nn.Linear(64, 64)
        s["lin"].load_state_dict(other.state_dict())

    return [
        ("in-place op on a large tensor", lambda s: s["big"][12345].add_(1.0)),
        ("in-place op on a small tensor", lambda s: s["small"][17].mul_(2.0)),
        (".data of a large tensor", lambda s: s["big"].data.__setitem__(7, 99.0)),
        (".data assignment", lambda s: setattr(s["small"][3], "data", torch.zeros(300))),
        ("numpy view of a CPU tensor", lambda s: s["big"].numpy().__setitem__(2 ** 20, -5.0)),
        ("numpy view of a small tensor", lambda s: s["small"][39].numpy().__setitem__(0, 7.0)),
        ("numpy array through a view", lambda s: s["arr"][10:20].__setitem__(slice(None), 0.25)),
        ("optimizer.step()", optimizer_step),
        ("load_state_dict", load_state_dict),
        ("a record changed in place", lambda s: s["records"][3].__setitem__("x", -0.5)),
        ("a record's value changed type only", lambda s: s["records"][4].__setitem__("i", 4.0)),
    ], base


def _saved(state):
    s = {k: v for k, v in state.items() if k not in ("lin", "opt")}
    s["lin"] = state["lin"].state_dict()
    s["opt"] = state["opt"].state_dict()
    return s


@pytest.mark.parametrize("name", [m[0] for m in _mutations()[0]])
def test_every_way_of_changing_state_is_seen(store, name):
    mutations, base = _mutations()
    mutate = dict(mutations)[name]
    state = base()
    store.put("r", 1, _saved(state))
    before = agck.dumps(_saved(state))
    mutate(state)
    store.put("r", 2, _saved(state))
    want = agck.loads(agck.dumps(_saved(state))).state
    assert agck.dumps(_saved(state)) != before, "the mutation changed nothing"
    got = store.get("r", 2).state
    _assert_same_tree(got, want)
    _assert_same_tree(store.get("r", 1).state, agck.loads(before).state)


def _assert_same_tree(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same_tree(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_tree(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b and type(a) is type(b)


def test_a_collection_voids_what_a_writer_knows_of_the_chunks(store_spec):
    """A chunk this store object committed and a collection by another one then
    deleted is written again by the next put, not assumed present (file store: the
    objects' generation file; Postgres: the gc generation row)."""
    kind, url, opts = store_spec
    writer = open_store(url, **opts)
    other = open_store(url, **opts)          # another process, say: deletes run a, collects
    try:
        model = torch.randn(1 << 20)
        writer.put("a", 1, {"m": model})
        other.delete("a", 1)
        assert other.collect_garbage().deleted_chunks > 0
        writer.put("a", 2, {"m": model})
        assert writer.last_put.new_bytes >= model.numel() * 4
        assert torch.equal(other.get("a", 2).state["m"], model)
        writer.put("a", 3, {"m": model})     # no collection since: nothing sent again
        assert writer.last_put.new_bytes < 100_000
    finally:
        writer.close()
        other.close()


def test_full_every_bounds_what_one_damaged_shared_chunk_can_reach(store_spec):
    """Damage to a chunk every incremental checkpoint shares: recovery names each
    checkpoint it reaches and walks back to the newest standalone one, which
    full_every=K puts in every K checkpoints (the first of the run included)."""
    kind, url, opts = store_spec
    store = open_store(url, full_every=4, **opts)
    try:
        model = np.random.default_rng(0).random(300_000)           # shared by every checkpoint
        standalone = []
        for s in range(1, 12):
            store.put("r", s, {"model": model, "s": s})
            if store.last_put is None:
                standalone.append(s)
        assert standalone == [1, 5, 9]
        plan = content.plan_chunks(agck.checkpoint.encode({"model": model, "s": 11}, run="r", step=11))
        shared = max(plan.distinct, key=lambda a: plan.chunk(a).nbytes)
        _damage_chunk(store, kind, shared)
        rec = recover_run(store, "r")
        assert rec.step == 9
        assert [r.step for r in rec.rejected] == [11, 10]
        assert all(r.section == "chunk" for r in rec.rejected)
    finally:
        store.close()
    with pytest.raises(errors.UsageError):
        open_store(url, full_every=0, **opts)


def _damage_chunk(store, kind, address: bytes) -> None:
    """Flip a bit of a stored chunk's first byte, where the store keeps it."""
    from crashtests import chunkrot
    data = bytearray(chunkrot._stored(store, address))
    data[0] ^= 1
    chunkrot._store_raw(store, address, bytes(data))


def test_verify_checks_each_shared_chunk_once_and_names_every_checkpoint_it_reaches(store_spec, monkeypatch):
    from agck.recovery import verify_store
    kind, url, opts = store_spec
    store = open_store(url, **opts)
    try:
        model = np.random.default_rng(0).random(300_000)           # shared by every checkpoint
        for s in range(1, 7):
            store.put("r", s, {"model": model, "s": s, "out": [np.full(1000, i) for i in range(s)]})
        hashed = []
        real = chunking.address
        monkeypatch.setattr(chunking, "address", lambda b: hashed.append(bytes(b)) or real(b))
        rep = verify_store(store, "r")
        assert [s for _, s in rep.ok] == [1, 2, 3, 4, 5, 6] and not rep.rejected
        assert len(hashed) == len(set(hashed))                      # no chunk hashed twice
        plan = content.plan_chunks(agck.checkpoint.encode({"model": model, "s": 6}, run="r", step=6))
        shared = max(plan.distinct, key=lambda a: plan.chunk(a).nbytes)
        _damage_chunk(store, kind, shared)
        rep = verify_store(store, "r")
        assert [r.step for r in rep.rejected] == [1, 2, 3, 4, 5, 6]
        assert all(r.section == "chunk" and shared.hex()[:16] in r.reason for r in rep.rejected)
    finally:
        store.close()


def test_a_chunk_that_fails_on_a_writer_thread_fails_the_put_and_leaves_nothing(tmp_path):
    """Chunks are written by several threads: one failing fsync fails the put with
    DurabilityError once every other chunk write has ended, and leaves no temp file."""
    from agck import durable
    from agck.stores.file.store import FileStore

    class FailingThird(durable.FileSystem):
        def __init__(self):
            self.calls, self.lock, self.threads = 0, threading.Lock(), set()

        def fsync(self, fd):
            with self.lock:
                self.calls += 1
                n = self.calls
                self.threads.add(threading.current_thread().name)
            if n == 3:
                raise OSError(5, "Input/output error")
            super().fsync(fd)

    fs = FailingThird()
    store = FileStore(tmp_path / "s", fs=fs)
    state = {f"a{i}": np.random.default_rng(i).random(200_000) for i in range(8)}   # ~12 MiB, many chunks
    with pytest.raises(agck.DurabilityError, match="writing a chunk failed"):
        store.put("r", 1, state)
    assert store.steps("r") == []
    assert any(t.startswith("agck-chunks") for t in fs.threads)
    leftovers = [f for _, _, files in os.walk(tmp_path / "s") for f in files if ".tmp" in f or f.startswith(".")]
    assert leftovers == [] and store.orphans() == []
    store.fs = durable.REAL
    store.objects.fs = durable.REAL
    store.put("r", 1, state)              # the same put succeeds afterwards
    assert np.array_equal(store.get("r", 1).state["a3"], state["a3"])


def test_a_run_remembered_while_tensors_shared_memory_loads_right_once_they_no_longer_do(tmp_path):
    """Tensors in one segment of a long list remembered while two earlier tensors shared
    memory (one blob for both), reused after they stopped sharing: every tensor must load
    back as itself (the remembered blob numbers were off by one)."""
    store = open_store(str(tmp_path / "s"))
    xs = [np.full(3 + i % 5, i, dtype=np.float32) for i in range(200)]
    base = np.arange(10, dtype=np.float32)
    xs[10], xs[11] = base[:5], base[5:]                 # two views of one array: one blob
    store.put("r", 1, {"xs": xs})
    store.put("r", 2, {"xs": xs})                       # the later segments are remembered as they are
    xs[10] = np.arange(5, dtype=np.float32) + 100       # no longer sharing
    store.put("r", 3, {"xs": xs})
    got = store.get("r", 3).state["xs"]
    assert [a.tolist() for a in got] == [a.tolist() for a in xs]
