"""Multi-rank checkpoints over tiers (agck/replicas.py), on real processes: 4 gloo ranks
in 2 "hosts" (ranks 0-1 and 2-3, each host its own local directory), a SQLite
durable tier shared by both.

A step is acknowledged local once every part is in its host's tier and in a peer
host's; it becomes durable in the background (parts first, then the commit record);
after a host is lost (its directory deleted) the replacement restores from its
peers' replicas, bit-exactly; a damaged replica is read past to the durable tier.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import msgpack
import pytest

import agck
from agck import sharded
from agck.stores import open_store
from crashtests.ranks import launch
from storehelpers import corrupt_payload

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

TARGET = f"{__name__}:pipeline"
WORLD = 4


def host_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"host{rank // 2}")


def pipeline(rank, world, root, durable, total, every, durable_every, out, keep_bytes=None):
    """Steps that draw from the global RNG into rank-specific state, checkpointed through
    a TieredStore whose local tier is this rank's host's directory."""
    torch.manual_seed(1000 + rank)
    store = agck.TieredStore(host_dir(root, rank), durable, durable_every=durable_every, keep_local=3,
                             keep_local_bytes=keep_bytes)
    state = {"x": torch.full((50_000,), float(rank)), "log": []}
    snap = agck.Snapshotter(store, "job", every=every, mode="sync")
    state = snap.restore(state)
    started, source = snap.start_step, snap._target.sharded.restored_from
    rejected = [r.as_dict() for r in snap.recovery.rejected] if snap.recovery else []
    for i in snap.steps(total):
        noise = torch.rand(4)
        state["x"] += noise.sum()
        state["log"].append([i, float(noise[0])])
    snap.close()
    assert store.flush(timeout=60)
    durable_step = store.last_durable_step("job")     # after flush: the same on every rank
    store.close()
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb({
        "started": started, "source": source, "rejected": rejected, "durable": durable_step,
        "x": state["x"].numpy().tobytes(), "log": state["log"]}))


def run(root, durable, out, total, *, every=1, durable_every=1, keep_bytes=None) -> list[dict]:
    for f in pathlib.Path(out).glob("rank*.bin"):
        f.unlink()
    codes = launch(TARGET, WORLD, (root, durable, total, every, durable_every, out, keep_bytes), timeout=180)
    assert codes == [0] * WORLD, codes
    got = [msgpack.unpackb(pathlib.Path(out, f"rank{r}.bin").read_bytes()) for r in range(WORLD)]
    assert len({g["durable"] for g in got}) == 1, [g["durable"] for g in got]     # flush means one thing
    return got


@pytest.fixture
def tiers(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return str(tmp_path / "hosts"), f"sqlite:///{tmp_path}/durable.db", str(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same pipeline run to step 9 without a crash, on the durable store alone."""
    root = tmp_path_factory.mktemp("whole")
    out = root / "out"
    out.mkdir()
    return run(str(root / "hosts"), f"sqlite:///{root}/durable.db", str(out), 9)


def test_each_part_is_on_its_host_and_a_peer_and_the_durable_copy_verifies(tiers):
    root, durable, out = tiers
    run(root, durable, out, 6)
    for host, own, kept in ((0, (0, 1), (2, 3)), (1, (2, 3), (0, 1))):
        local = open_store(os.path.join(root, f"host{host}"))
        assert local.steps("job")[-1] == 6                     # the commit record, on every host
        parts = local.parts_store(create=False)
        names = {sharded.parse_part_run(n)[2] for n in parts.runs()}
        assert names == set(own) | set(kept)                   # its own ranks' parts and a peer host's
        assert len(local.steps("job")) <= 3                    # keep_local
    d = open_store(durable)
    assert d.steps("job")[-1] == 6
    commit = sharded.as_commit(d.read("job", 6))
    sharded.verify_parts(d, commit)                            # every part durable, bound, verified
    # one process reading a host's tiers (agck recover): every part verified, from either tier
    shutil.rmtree(os.path.join(root, "host1"))
    t = agck.TieredStore(os.path.join(root, "host0"), durable)
    assert agck.recover(t, "job").step == 6
    t.close()


def test_a_lost_host_restores_from_its_peers_bit_exactly(tiers, uninterrupted):
    root, durable, out = tiers
    run(root, durable, out, 5, durable_every=1000)              # nothing durable: peers are the only copy
    assert open_store(durable).steps("job") == []
    shutil.rmtree(os.path.join(root, "host1"))                 # host 1 lost; its replacement starts empty
    got = run(root, durable, out, 9, durable_every=1000)
    assert [g["started"] for g in got] == [5] * WORLD
    assert [g["source"] for g in got] == ["local", "local", "peer", "peer"]
    for g, whole in zip(got, uninterrupted):
        assert g["x"] == whole["x"] and g["log"][-4:] == whole["log"][-4:]
    healed = open_store(os.path.join(root, "host1")).parts_store(create=False)
    assert {sharded.parse_part_run(n)[2] for n in healed.runs()} >= {2, 3}


def test_a_damaged_replica_is_read_past_to_the_durable_tier(tiers):
    root, durable, out = tiers
    run(root, durable, out, 7, durable_every=3)                 # durable: 3 and 6; local: 5..7
    shutil.rmtree(os.path.join(root, "host1"))
    parts = open_store(os.path.join(root, "host0")).parts_store(create=False)
    for name in parts.runs():
        if sharded.parse_part_run(name)[2] in (2, 3):          # host 1's ranks' replicas, on host 0
            for s in parts.steps(name):
                corrupt_payload(("file",), parts, name, s)
    got = run(root, durable, out, 8, durable_every=3)
    # step 7 is whole nowhere for ranks 2 and 3 (their host lost, the replicas damaged,
    # not durable): every rank walks back to 6, ranks 2-3 taking the durable tier's parts
    assert [g["started"] for g in got] == [6] * WORLD
    assert [g["source"] for g in got] == ["local", "local", "durable", "durable"]
    assert got[0]["rejected"] and got[0]["rejected"][0]["step"] == 7


def test_a_damaged_part_on_its_own_host_is_taken_from_a_peer(tiers, uninterrupted):
    root, durable, out = tiers
    run(root, durable, out, 5, durable_every=1000)              # nothing durable
    parts = open_store(os.path.join(root, "host0")).parts_store(create=False)
    mine = next(n for n in parts.runs() if sharded.parse_part_run(n)[2] == 0)
    corrupt_payload(("file",), parts, mine, 5)                  # rank 0's own copy of step 5, on its host
    got = run(root, durable, out, 9, durable_every=1000)
    assert [g["started"] for g in got] == [5] * WORLD
    assert [g["source"] for g in got] == ["peer", "local", "local", "local"]
    for g, whole in zip(got, uninterrupted):
        assert g["x"] == whole["x"]


def test_the_local_tier_keeps_to_its_bytes_and_its_chunks_are_collected(tiers):
    root, durable, out = tiers
    part = 50_000 * 4           # one rank's part: its tensor's bytes (and a little more)
    run(root, durable, out, 8, keep_bytes=5 * part)             # about 5 parts: 4 per step on a host
    for host in (0, 1):
        local = open_store(os.path.join(root, f"host{host}"))
        steps = local.steps("job")
        assert steps[-1] == 8 and len(steps) <= 2               # 2 steps of 4 parts are over the budget
        parts = local.parts_store(create=False)
        kept = {s for n in parts.runs() for s in parts.steps(n)}
        assert kept <= set(steps) and min(kept) >= min(steps)
        objects = os.path.join(parts.root, ".objects")
        chunks = sum(len(os.listdir(os.path.join(objects, d))) for d in os.listdir(objects)
                     if os.path.isdir(os.path.join(objects, d)))
        held = sum(len(parts.steps(n)) for n in parts.runs())
        # a 200 KB part is about 6 chunks, none shared between steps (every value changes):
        # the dropped steps' chunks were collected
        assert 0 < chunks <= 8 * held, (chunks, held)
    d = open_store(durable)
    assert d.steps("job")[-1] == 8 and len(d.steps("job")) == 8  # the durable tier keeps what it keeps


def stale_writer(rank, world, root, durable, out):
    """A rank of an incarnation that a newer one fenced (its epoch begun meanwhile) writes a step."""
    from agck.replicas import TieredShardedRun
    from agck.distributed import Group
    store = agck.TieredStore(host_dir(root, rank), durable)
    sr = TieredShardedRun(store, "job", Group())
    epoch = sr.begin_epoch()
    sr.group.barrier()
    if rank == 0:
        store.begin_epoch("job")        # a newer job, in the durable tier and rank 0's host's tier
    sr.group.barrier()
    try:
        sr.write(7, {"x": rank}, meta=None, parent=None, epoch=epoch)
        err = None
    except agck.AgckError as e:
        err = type(e).__name__
    sr.close()
    store.close()
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb({"error": err}))


def test_a_fenced_incarnation_commits_nothing_over_tiers(tiers):
    root, durable, out = tiers
    codes = launch(f"{__name__}:stale_writer", WORLD, (root, durable, out), timeout=120)
    assert codes == [0] * WORLD
    got = [msgpack.unpackb(pathlib.Path(out, f"rank{r}.bin").read_bytes())["error"] for r in range(WORLD)]
    assert got == ["StaleEpochError"] * WORLD
    assert 7 not in open_store(os.path.join(root, "host0")).steps("job")
