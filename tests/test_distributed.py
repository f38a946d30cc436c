"""Multi-rank snapshots under torch.distributed, on real processes (gloo, 2 and 4 ranks).

Each test launches its ranks with :func:`crashtests.ranks.launch`; the ranks write
what they saw to files the test then checks. States are small: this is about the
protocol (parts, one commit, agreement on restore), not throughput.
"""

from __future__ import annotations

import os
import pathlib

import msgpack
import pytest

import agck
from agck import sharded
from agck.stores import open_store
from conftest import ci_subset
from crashtests.ranks import launch

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

HERE = __name__


def _target(fn) -> str:
    return f"{HERE}:{fn.__name__}"


# -- what the ranks run --------------------------------------------------------------

def loop(rank, world, url, opts, run, total, every, out, mode="sync", resume=True):
    """A pipeline whose every step draws from the global RNG and accumulates into
    rank-specific state; writes what it ended with to out/rank<r>.bin."""
    torch.manual_seed(1000 + rank)
    store = open_store(url, **opts)
    state = {"rank": rank, "x": torch.full((256,), float(rank)), "log": []}
    snap = agck.Snapshotter(store, run, every=every, mode=mode, resume=resume)
    state = snap.restore(state)
    started = snap.start_step
    rejected = [r.as_dict() for r in snap.recovery.rejected] if snap.recovery else []
    for i in snap.steps(total):
        noise = torch.rand(4)
        state["x"] += noise.sum()
        state["log"].append([i, float(noise[0])])
    snap.close()
    store.close()
    result = {"started": started, "durable": snap.last_durable_step, "x": state["x"].numpy().tobytes(),
              "log": state["log"], "rejected": rejected, "epoch": snap.epoch}
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb(result))


def restore_only(rank, world, url, opts, run, out):
    store = open_store(url, **opts)
    snap = agck.Snapshotter(store, run, every=1)
    try:
        snap.restore({"rank": rank, "x": torch.zeros(256), "log": []})
        result = {"ok": True, "step": snap.start_step}
    except agck.AgckError as e:
        result = {"ok": False, "type": type(e).__name__, "message": str(e)}
    snap.close()
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb(result))


def different_steps(rank, world, url, out):
    """Rank 0 writes step 10 while rank 1 writes step 20: no commit may bind them."""
    from agck.distributed import Group, ShardedRun
    store = open_store(url)
    run = ShardedRun(store, "r", Group())
    epoch = run.begin_epoch()
    try:
        run.write(10 if rank == 0 else 20, {"x": rank}, meta=None, parent=None, epoch=epoch)
        result = {"ok": True}
    except agck.AgckError as e:
        result = {"ok": False, "type": type(e).__name__, "message": str(e)}
    result["steps"] = store.steps("r")
    run.close()
    store.close()
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb(result))


def group_messages(rank, world, out):
    """Messages shorter and longer than one inline frame, each way."""
    from agck.distributed import Group
    g = Group()
    ok = []
    for v in [None, {"a": 1}, "x" * (Group.INLINE - 8), "y" * 5000, b"\0" * 3000]:
        ok.append(g.broadcast(v if rank == 0 else None) == v)
        got = g.all_gather(v if rank == 0 else [rank, "z" * (2000 * rank)])
        ok.append(got[0] == v and all(got[r] == [r, "z" * (2000 * r)] for r in range(1, world)))
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb(ok))


def dtensor_loop(rank, world, url, run, total, out, world_mesh=None):
    """Sharded state: a DTensor and a module whose parameters are DTensors, trained a little."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    torch.manual_seed(7)
    mesh = init_device_mesh("cpu", (world_mesh or world,))
    model = distribute_module(torch.nn.Linear(8, 8), mesh)          # replicated parameters, as DTensors
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]), "model": model, "opt": opt}
    snap = agck.Snapshotter(open_store(url), run, every=2)
    try:
        state = snap.restore(state)
    except agck.AgckError as e:
        pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb({"error": str(e)}))
        return
    started = snap.start_step
    for i in snap.steps(total):
        with torch.no_grad():
            state["w"].to_local().add_(float(i + 1))
        x = torch.full((2, 8), float(i))
        loss = model(distribute_tensor(x, mesh, model.weight.placements)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    snap.close()
    result = {"started": started, "w": state["w"].to_local().numpy().tobytes(),
              "weight": model.weight.to_local().detach().numpy().tobytes()}
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb(result))


def dtensor_mismatch(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from agck.snapshot import capture, restore_into
    mesh = init_device_mesh("cpu", (world,))
    saved = capture({"w": distribute_tensor(torch.arange(32.).reshape(8, 4), mesh, [Shard(0)])})
    live = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}
    restore_into(live, saved)
    same = bool(torch.equal(live["w"].full_tensor(), torch.arange(32.).reshape(8, 4)))
    try:
        restore_into({"w": distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()])}, saved)
        err = None
    except agck.UsageError as e:
        err = str(e)
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb({"same": same, "error": err}))


def _results(out, world) -> list[dict]:
    return [msgpack.unpackb(pathlib.Path(out, f"rank{r}.bin").read_bytes()) for r in range(world)]


@pytest.fixture
def out(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    return d


def _clear(out):
    for f in pathlib.Path(out).iterdir():
        f.unlink()


def _reference(spec, out, world, total, every, run="reference"):
    """The uninterrupted run's final per-rank results."""
    _, url, opts = spec
    assert launch(_target(loop), world, (url, opts, run, total, every, str(out))) == [0] * world
    ref = _results(out, world)
    _clear(out)
    return ref


# -- tests ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_ranks_commit_each_step_once_and_resume_bit_exactly(store_spec, out, mode):
    kind, url, opts = store_spec
    ci_subset((kind, mode), {("file", "sync"), ("sqlite", "async"), ("postgres", "sync"), ("s3", "async"),
                             ("postgres-s3", "sync")})
    assert launch(_target(loop), 2, (url, opts, "r", 7, 3, str(out), mode)) == [0, 0]
    first = _results(out, 2)
    assert [r["durable"] for r in first] == [7, 7]
    store = open_store(url, **opts)
    try:
        assert store.steps("r") == [3, 6, 7]                 # commit records only: parts are elsewhere
        assert store.runs() == ["r"]
        commit = sharded.as_commit(store.read("r", 7))
        assert commit.world_size == 2 and [p.rank for p in commit.parts] == [0, 1]
        for rank in (0, 1):
            part = sharded.read_part(store, commit, rank)
            assert part.state["state"]["rank"] == rank
        rec = agck.recover(store, "r")
        assert rec.step == 7 and not rec.rejected
        assert sharded.partial_parts(store, "r") == []
    finally:
        store.close()
    # a second job continues the run from its last step, each rank from its own part
    _clear(out)
    assert launch(_target(loop), 2, (url, opts, "r", 12, 3, str(out), mode)) == [0, 0]
    resumed = _results(out, 2)
    assert [r["started"] for r in resumed] == [7, 7]
    assert [r["epoch"] for r in resumed] == [2, 2]
    ref = _reference(store_spec, out, 2, 12, 3)
    for r in range(2):
        assert resumed[r]["x"] == ref[r]["x"]                # bit-exact, RNG included
        assert resumed[r]["log"] == ref[r]["log"]


def test_four_ranks(tmp_path, out):
    url = str(tmp_path / "store")
    assert launch(_target(loop), 4, (url, {}, "r", 4, 2, str(out)), timeout=180) == [0] * 4
    res = _results(out, 4)
    assert len({r["x"] for r in res}) == 4                   # four different states, one per rank
    with open_store(url) as store:
        commit = sharded.as_commit(store.read("r", 4))
        assert commit.world_size == 4
        assert agck.recover(store, "r").step == 4
    # restored by 2 ranks: refused, naming both world sizes
    _clear(out)
    assert launch(_target(restore_only), 2, (url, {}, "r", str(out))) == [0, 0]
    for r in _results(out, 2):
        assert not r["ok"] and r["type"] == "UsageError"
        assert "checkpointed by 4 ranks" in r["message"] and "this job has 2" in r["message"]


def test_dtensor_shards_are_saved_and_restored_in_place(tmp_path, out):
    url = str(tmp_path / "store")
    assert launch(_target(dtensor_loop), 2, (url, "r", 3, str(out))) == [0, 0]
    _clear(out)
    assert launch(_target(dtensor_loop), 2, (url, "r", 6, str(out))) == [0, 0]
    resumed = _results(out, 2)
    assert [r["started"] for r in resumed] == [3, 3]
    with open_store(url) as store:
        commit = sharded.as_commit(store.read("r", 6))
        part = sharded.read_part(store, commit, 1)
        saved = part.state["state"]["w"]
        assert saved["placements"] == ["S(0)"] and tuple(saved["local"].shape) == (4, 4)
    _clear(out)
    assert launch(_target(dtensor_loop), 2, (str(tmp_path / "ref"), "r", 6, str(out))) == [0, 0]
    ref = _results(out, 2)
    assert [(r["w"], r["weight"]) for r in resumed] == [(r["w"], r["weight"]) for r in ref]


def test_a_dtensor_laid_out_otherwise_is_refused_not_resharded(out):
    assert launch(_target(dtensor_mismatch), 1, (str(out),)) == [0]
    [r] = _results(out, 1)
    assert r["same"] and "cannot reshard" in r["error"] and "S(0)" in r["error"] and "R" in r["error"]


def test_a_single_process_cannot_resume_a_multi_rank_run(tmp_path, out):
    url = str(tmp_path / "store")
    assert launch(_target(loop), 2, (url, {}, "r", 2, 2, str(out))) == [0, 0]
    snap = agck.Snapshotter(url, "r", every=1, handle_signals=False)
    with pytest.raises(agck.UsageError, match="with world size 2, and this process runs alone"):
        snap.restore({})
    snap.close()


def test_a_single_process_refused_a_multi_rank_run_is_told_both_world_sizes(tmp_path):
    """As the README says: the error names the run, the step, the world size it was
    checkpointed with and this process's (1). A commit record of 3 ranks made by hand."""
    url = str(tmp_path / "store")
    with open_store(url) as store:
        epoch = store.begin_epoch("r")
        refs = []
        for rank in range(3):
            pr = sharded.part_run("r", epoch, rank)
            store.parts_store().put(pr, 4, {"rank": rank}, meta=sharded.part_meta("r", 4, epoch, rank, 3, f"n{rank}"))
            refs.append(sharded.PartRef(rank, pr, f"n{rank}"))
        store.put("r", 4, sharded.Commit(run="r", step=4, epoch=epoch, world_size=3, parts=refs).state(), epoch=epoch)
    snap = agck.Snapshotter(url, "r", every=1, handle_signals=False)
    try:
        with pytest.raises(agck.UsageError) as e:
            snap.restore({})
    finally:
        snap.close()
    text = str(e.value)
    assert "run 'r' step 4" in text and "world size 3" in text and "world size 1" in text, text


@pytest.mark.parametrize("point", ["dist.before_commit", "dist.after_part"])
def test_a_rank_killed_before_the_commit_leaves_no_step(store_spec, out, point):
    """Rank 0 killed between the parts and the commit, or rank 1 right after its
    part: the step is not visible; the next job resumes from the step before,
    removes the dead incarnation's parts, and ends bit-identical to an
    uninterrupted run."""
    kind, url, opts = store_spec
    ci_subset((kind, point), {("file", "dist.before_commit"), ("sqlite", "dist.after_part"),
                              ("postgres", "dist.before_commit"), ("s3", "dist.after_part"),
                              ("postgres-s3", "dist.before_commit")})
    victim = 0 if point == "dist.before_commit" else 1
    codes = launch(_target(loop), 2, (url, opts, "r", 9, 3, str(out)),
                   env={victim: {"AGCK_FAILPOINTS": f"{point}=kill@2"}}, kill_rest_after=3)
    assert codes[victim] == -9 and codes[1 - victim] != 0
    with open_store(url, **opts) as store:
        assert store.steps("r") == [3]                        # step 6 never became visible
        partial = sharded.partial_parts(store, "r")
        assert {(p.step, p.epoch) for p in partial} == {(6, 1)}
        assert not any(p.removable for p in partial)         # epoch 1 is still the newest: 6 may be in flight
    _clear(out)
    assert launch(_target(loop), 2, (url, opts, "r", 9, 3, str(out))) == [0, 0]
    resumed = _results(out, 2)
    assert [r["started"] for r in resumed] == [3, 3]
    with open_store(url, **opts) as store:
        assert sharded.partial_parts(store, "r") == []        # the new incarnation removed them
        assert store.steps("r") == [3, 6, 9]
    ref = _reference(store_spec, out, 2, 9, 3)
    assert [r["x"] for r in resumed] == [r["x"] for r in ref]


def test_a_damaged_part_walks_every_rank_back(tmp_path, out):
    url = str(tmp_path / "store")
    assert launch(_target(loop), 2, (url, {}, "r", 6, 3, str(out)), env={}) == [0, 0]
    with open_store(url, incremental=False) as store:
        commit = sharded.as_commit(store.read("r", 6))
        path = store.parts_store().ref(commit.parts[1].run, 6)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    with open_store(url) as store:
        rec = agck.recover(store, "r")
        assert rec.step == 3 and rec.rejected[0].step == 6 and "rank 1" in rec.rejected[0].reason
    _clear(out)
    assert launch(_target(loop), 2, (url, {}, "r", 6, 3, str(out))) == [0, 0]
    res = _results(out, 2)
    assert [r["started"] for r in res] == [3, 3]              # rank 0's part of 6 was fine: both go back
    assert all(r["rejected"][0]["step"] == 6 and "rank 1" in r["rejected"][0]["reason"] for r in res)


def test_a_fenced_incarnation_commits_nothing(tmp_path, out):
    url = str(tmp_path / "store")
    assert launch(_target(loop), 2, (url, {}, "r", 3, 3, str(out))) == [0, 0]
    with open_store(url) as store:
        store.begin_epoch("r")        # as a newer job would, while the old ranks keep going
    assert launch(_target(stale_writer), 2, (url, "r", str(out))) == [0, 0]
    assert [r["error"] for r in _results(out, 2)] == ["StaleEpochError"] * 2
    with open_store(url) as store:
        assert store.steps("r") == [3]


def rewriter(rank, world, url, run, out):
    from agck.distributed import Group, ShardedRun
    store = open_store(url)
    sr = ShardedRun(store, run, Group())
    epoch = sr.begin_epoch()
    sr.write(5, {"rank": rank, "v": 1}, meta=None, parent=None, epoch=epoch)
    try:
        sr.write(5, {"rank": rank, "v": 2}, meta=None, parent=None, epoch=epoch)
        err = None
    except agck.AgckError as e:
        err = str(e)
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb({"error": err}))
    store.close()


def test_a_committed_step_is_not_rewritten_in_its_epoch(tmp_path, out):
    """Rewriting a part the commit record binds would unbind an acknowledged step."""
    url = str(tmp_path / "store")
    assert launch(_target(rewriter), 2, (url, "r", str(out))) == [0, 0]
    assert all("already committed in epoch 1" in r["error"] for r in _results(out, 2))
    with open_store(url) as store:
        assert agck.recover(store, "r").step == 5
        commit = sharded.as_commit(store.read("r", 5))
        assert [sharded.read_part(store, commit, r).state["v"] for r in (0, 1)] == [1, 1]


def stale_writer(rank, world, url, run, out):
    from agck.distributed import Group, ShardedRun
    store = open_store(url)
    sr = ShardedRun(store, run, Group())
    try:
        sr.write(10, {"rank": rank}, meta=None, parent=3, epoch=1)
        err = None
    except agck.AgckError as e:
        err = type(e).__name__
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb({"error": err}))
    store.close()


def test_cli_lists_and_cleans_partial_steps(tmp_path, out):
    from agck.cli import main
    url = str(tmp_path / "store")
    launch(_target(loop), 2, (url, {}, "r", 6, 3, str(out)), env={0: {"AGCK_FAILPOINTS": "dist.before_commit=kill@2"}},
           kill_rest_after=3)
    with open_store(url) as store:
        store.begin_epoch("r")         # the dead job's incarnation is over: its parts can never commit
    import io
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["ls", url]) == 0
    assert "partial" in buf.getvalue() and "6" in buf.getvalue()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["recover", url, "--clean"])
    assert "partial" in buf.getvalue()
    with open_store(url) as store:
        assert sharded.partial_parts(store, "r") == []
        assert agck.recover(store, "r").step == 3


def test_ranks_writing_different_steps_commit_nothing_and_all_raise(tmp_path, out):
    assert launch(_target(different_steps), 2, (str(tmp_path / "store"), str(out))) == [0, 0]
    results = _results(out, 2)
    assert [r["ok"] for r in results] == [False, False] and [r["steps"] for r in results] == [[], []]
    assert all(r["type"] == "SnapshotError" and "wrote step" in r["message"] for r in results)


def test_a_part_of_the_current_epoch_below_the_newest_step_may_be_in_flight(tmp_path):
    """A resumed job rewriting a step below a rejected newer one: its part, not yet
    bound, is kept by the cleaner until a newer epoch begins."""
    with open_store(str(tmp_path / "s")) as store:
        parts = store.parts_store()
        e1 = store.begin_epoch("r")
        for step in (100, 150):
            pr = sharded.part_run("r", e1, 0)
            parts.put(pr, step, {"x": step}, meta=sharded.part_meta("r", step, e1, 0, 1, "n%d" % step))
            commit = sharded.Commit(run="r", step=step, epoch=e1, world_size=1,
                                    parts=[sharded.PartRef(0, pr, "n%d" % step)])
            store.put("r", step, commit.state(), epoch=e1)
        e2 = store.begin_epoch("r")
        parts.put(sharded.part_run("r", e2, 0), 120, {"x": 120}, meta=sharded.part_meta("r", 120, e2, 0, 1, "m"))
        [p] = sharded.partial_parts(store, "r")
        assert (p.step, p.epoch, p.removable) == (120, e2, False)
        assert sharded.clean_partial(store, "r") == [] and parts.steps(sharded.part_run("r", e2, 0)) == [120]
        store.begin_epoch("r")
        assert [p.removable for p in sharded.partial_parts(store, "r")] == [True]


def test_ranks_that_read_two_commit_records_of_one_step_restore_nothing(tmp_path):
    """A newer incarnation rewrote the step's commit record between two ranks' reads:
    the restore refuses to mix parts of two attempts (rank 0's side, the other rank's
    answer given by a stand-in group)."""
    from agck.distributed import ShardedRun

    class TwoRanks:
        rank, size = 0, 2

        def __init__(self, other):
            self.other = other

        def broadcast(self, value):
            return value

        def all_gather(self, mine):
            return [mine, self.other(mine)]

        def barrier(self):
            pass

        def close(self):
            pass

    with open_store(str(tmp_path / "s")) as store:
        parts = store.parts_store()
        e1 = store.begin_epoch("r")
        refs = []
        for rank in range(2):
            pr = sharded.part_run("r", e1, rank)
            parts.put(pr, 3, {"rank": rank}, meta=sharded.part_meta("r", 3, e1, rank, 2, f"n{rank}"))
            refs.append(sharded.PartRef(rank, pr, f"n{rank}"))
        store.put("r", 3, sharded.Commit(run="r", step=3, epoch=e1, world_size=2, parts=refs).state(), epoch=e1)
        commit, part, _, _ = ShardedRun(store, "r", TwoRanks(lambda mine: mine)).find()
        assert commit.step == 3 and part.state == {"rank": 0}
        other = ShardedRun(store, "r", TwoRanks(lambda mine: {**mine, "commit": [e1 + 1, ["m0", "m1"]]}))
        with pytest.raises(agck.SnapshotError, match="changed while the ranks read it"):
            other.find()


def test_group_messages_of_any_length(out):
    assert launch(_target(group_messages), 3, (str(out),)) == [0, 0, 0]
    assert _results(out, 3) == [[True] * 10] * 3


def test_part_run_names_round_trip():
    assert sharded.parse_part_run(sharded.part_run("a.e1.r2", 3, 4)) == ("a.e1.r2", 3, 4)
    assert sharded.parse_part_run("plain") is None
    with pytest.raises(agck.UsageError, match="too long"):
        sharded.part_run("a" * 195, 1, 0)


def test_a_malformed_commit_record_is_a_verdict(tmp_path):
    with open_store(str(tmp_path / "s")) as store:
        store.put("r", 1, {"x": 1})
        store.put("r", 2, {sharded.COMMIT_KEY: {"version": 1, "kind": "snapshot", "epoch": 1, "world_size": 2,
                                                "parts": [["r.e1.r0", "aa"]]}})
        rec = agck.recover(store, "r")
        assert rec.step == 1 and rec.rejected[0].section == "commit"
        assert "1 parts for 2 ranks" in rec.rejected[0].reason
    assert os.path.isdir(tmp_path / "s")


def test_readme_multirank_example_runs_under_torchrun_and_resumes(tmp_path):
    """The README's example, as a user runs it: torchrun, two ranks, twice."""
    import re
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    [example] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "init_process_group" in b]
    (tmp_path / "multirank.py").write_text(example)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "multirank.py"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        assert sorted(re.findall(r"rank (\d): last durable step (\d+)", r.stdout)) == [("0", "50"), ("1", "50")]
    with open_store(str(tmp_path / "ckpts")) as store:
        assert store.steps("sharded-pipeline") == [10, 20, 30, 40, 50]
        commit = sharded.as_commit(store.read("sharded-pipeline", 50))
        assert commit.world_size == 2 and commit.epoch == 1     # the second run wrote nothing
        assert store.epoch("sharded-pipeline") == 2
        assert sharded.partial_parts(store) == []


def ambiguous_committer(rank, world, url, run, out):
    """Rank 0's commit raises "may or may not have been written": at step 5 after the
    record was written, at step 6 before."""
    from agck import sharded as sharded_mod
    from agck.distributed import Group, ShardedRun
    from agck.errors import DurabilityError
    real = sharded_mod.commit_step

    def flaky(store, run_, step, *a, **kw):
        if step == 5:
            real(store, run_, step, *a, **kw)
        raise DurabilityError("the connection failed during COMMIT: the checkpoint may or may not have been "
                              "written", ref=store.ref(run_, step))
    sharded_mod.commit_step = flaky
    store = open_store(url)
    sr = ShardedRun(store, run, Group())
    epoch = sr.begin_epoch()
    got = {}
    for step in (5, 6):
        try:
            got[step] = ["ok", sr.write(step, {"rank": rank, "v": step}, meta=None, parent=None, epoch=epoch)]
        except agck.AgckError as e:
            got[step] = [type(e).__name__, str(e)]
    sharded_mod.commit_step = real
    try:     # step 5 committed: rewriting it in its epoch would unbind it
        sr.write(5, {"rank": rank, "v": 9}, meta=None, parent=None, epoch=epoch)
        got["rewrite"] = None
    except agck.AgckError as e:
        got["rewrite"] = str(e)
    pathlib.Path(out, f"rank{rank}.bin").write_bytes(msgpack.packb({str(k): v for k, v in got.items()}))
    store.close()


def test_an_ambiguous_commit_is_judged_by_what_the_store_holds(tmp_path, out):
    """A commit that failed with its outcome unknown is looked up in the store: the
    record binding this step's parts is there (the step is committed, on every rank)
    or it is not (the step failed), whatever this process remembers."""
    url = str(tmp_path / "store")
    assert launch(_target(ambiguous_committer), 2, (url, "r", str(out))) == [0, 0]
    for r in _results(out, 2):
        assert r["5"][0] == "ok", r
        assert r["6"][0] == "SnapshotError" and "may or may not" in r["6"][1], r
        assert "already committed in epoch 1" in r["rewrite"], r
    with open_store(url) as store:
        assert store.steps("r") == [5] and agck.recover(store, "r").step == 5
