"""AppendLog: results accumulated in a snapshotted state, stored once per segment:
resume after a SIGKILL equal to an uninterrupted run on every journal store, a
checkpoint's size independent of the run's length, a damaged segment rejected with
a walk back, a failed segment written again, and what cannot be stored refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import agck
from agck import journalrec as jr
from agck.errors import EncodeError, UsageError

from conftest import worker_url

torch = pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PIPELINE = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import agck
    url, mode, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = np.random.default_rng(0)
    state = {"done": 0, "rng": rng, "results": agck.AppendLog(name="results")}
    with agck.Snapshotter(url, "sum", every=25, mode=mode, max_in_flight=3) as snap:
        state = snap.restore(state)
        for i in snap.steps(300):
            state["results"].append({"i": i, "draw": float(state["rng"].random()), "v": np.arange(i % 3)})
            state["done"] = i + 1
            if i == kill_at:
                os.kill(os.getpid(), 9)
    print(json.dumps([[r["i"], r["draw"], r["v"].tolist()] for r in state["results"]]))
""")


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres", "s3"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sigkilled_pipeline_resumes_equal_to_an_uninterrupted_one(tmp_path, kind, mode, request):
    script = tmp_path / "pipeline.py"
    script.write_text(_PIPELINE)
    url = worker_url(kind, request, tmp_path)
    env = {**os.environ, "PYTHONPATH": ROOT}       # (after the store's server set its credentials)

    def run(url, kill_at):
        return subprocess.run([sys.executable, str(script), url, mode, str(kill_at)], env=env, capture_output=True,
                              text=True, timeout=180)

    whole = run(str(tmp_path / "alone"), -1)
    assert whole.returncode == 0, whole.stderr
    for kill_at in (60, 61, 187):        # killed twice, once right after a checkpoint
        killed = run(url, kill_at)
        assert killed.returncode == -9, killed.stderr
    resumed = run(url, -1)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout) == json.loads(whole.stdout)


def test_a_checkpoint_holds_a_reference_whose_size_does_not_grow(tmp_path):
    store = agck.open_store(str(tmp_path / "s"))
    state = {"results": agck.AppendLog()}
    with agck.Snapshotter(store, "r", every=100, capture_rng=False) as snap:
        state = snap.restore(state)
        for i in snap.steps(5000):
            state["results"].append({"i": i, "text": "y" * 100})
    infos = {c.step: c.size for c in store.list("r")}
    assert infos[5000] <= infos[100] + 16        # a count grows by a few bytes, nothing else does
    data, _ = store.log_read("r")
    found = jr.scan(data)
    assert [e.kind for _, e in found.entries] == ["s"] * 50       # one segment per checkpoint
    produced = sum(len(agck.codec.plain_packed({"i": i, "text": "y" * 100})) for i in range(5000))
    assert len(data) < 1.1 * produced           # each item written once
    back = agck.Snapshotter(store, "r", every=100)
    restored = back.restore({"results": agck.AppendLog()})
    assert list(restored["results"]) == [{"i": i, "text": "y" * 100} for i in range(5000)]
    back.close()
    store.close()


def test_a_damaged_segment_rejects_the_checkpoints_that_count_it(tmp_path):
    """FORMAT.md 17.11: an item only a damaged record holds rejects the checkpoint."""
    path = tmp_path / "s"
    store = agck.open_store(str(path))
    state = {"results": agck.AppendLog()}
    with agck.Snapshotter(store, "r", every=10) as snap:
        state = snap.restore(state)
        for i in snap.steps(30):
            state["results"].append(i)
    log_path = store.log_ref("r")
    data = bytearray(open(log_path, "rb").read())
    last = jr.scan(bytes(data)).entries[-1][0]
    data[last + 20] ^= 0xFF                      # the segment of items 20..29
    open(log_path, "wb").write(bytes(data))
    snap = agck.Snapshotter(store, "r", every=10)
    restored = snap.restore({"results": agck.AppendLog()})
    assert snap.start_step == 20 and list(restored["results"]) == list(range(20))
    [rj] = snap.recovery.rejected
    assert rj.step == 30 and "item 20" in rj.reason and "AppendLog" in rj.reason
    for i in snap.steps(30):                      # the lost items are written again, in a new generation
        restored["results"].append(i)
    snap.close()
    again = agck.Snapshotter(store, "r", every=10)
    assert list(again.restore({"results": agck.AppendLog()})["results"]) == list(range(30))
    assert again.start_step == 30
    again.close()
    store.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_segment_not_written_is_written_with_the_next_snapshot(tmp_path, mode, monkeypatch):
    store = agck.open_store(str(tmp_path / "s"))
    real = store.log_append
    calls = {"n": 0}

    def flaky(run, records, *, sync=True):
        calls["n"] += 1
        if calls["n"] == 2:
            raise agck.errors.DurabilityError("injected: the disk said no", ref="test")
        return real(run, records, sync=sync)

    monkeypatch.setattr(store, "log_append", flaky)
    state = {"results": agck.AppendLog()}
    snap = agck.Snapshotter(store, "r", every=5, mode=mode)
    state = snap.restore(state)
    failed = 0
    for i in range(20):
        state["results"].append(i)
        try:
            snap.completed(i + 1, state)
            if mode == "async" and i in (9, 10, 11):
                snap.flush()
        except agck.AgckError as e:     # sync: the store's error; async: a SnapshotError naming the step
            assert "injected" in str(e)
            failed += 1
    snap.close()
    assert failed == 1
    back = agck.Snapshotter(store, "r", every=5)
    restored = back.restore({"results": agck.AppendLog()})
    assert back.start_step == 20 and list(restored["results"]) == list(range(20))
    back.close()
    store.close()


def test_items_with_tensors_and_what_cannot_be_stored(tmp_path):
    store = agck.open_store(str(tmp_path / "s"))
    state = {"results": agck.AppendLog([{"emb": torch.arange(4.0)}, np.ones(3, np.float16)])}
    with agck.Snapshotter(store, "r", every=1) as snap:
        state = snap.restore(state)
        snap.completed(1, state)
        state["results"].append(object())
        with pytest.raises(EncodeError, match="AppendLog .*item"):
            snap.completed(2, state)
    back = agck.Snapshotter(store, "r", every=1)
    got = back.restore({"results": agck.AppendLog()})["results"]
    assert torch.equal(got[0]["emb"], torch.arange(4.0)) and got[1].dtype == np.float16 and len(got) == 2
    back.close()
    with pytest.raises(UsageError, match="snapshotter"):
        agck.capture.capture({"x": agck.AppendLog([1])})
    with pytest.raises(EncodeError):
        agck.dumps({"x": agck.AppendLog([1])})      # never pickled
    store.close()


def test_the_reference_mark_is_capture_s_and_import_agck_leaves_torch_alone():
    import subprocess
    import sys
    from agck import applog, capture
    assert applog.TAG == capture.TAG
    done = subprocess.run([sys.executable, "-c", "import sys, agck; assert 'torch' not in sys.modules"],
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres", "s3"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_log_in_two_snapshotters_and_carried_into_another_run_restores_every_checkpoint(tmp_path, kind, mode,
                                                                                          request):
    """What each destination's checkpoints count is written into that destination: the
    same log snapshotted into two stores, then restored and carried into a new run,
    restores whole from each (it once restored [] from the second, with every
    checkpoint skipped as missing its items)."""
    url = worker_url(kind, request, tmp_path)
    other = str(tmp_path / "other")
    state = {"results": agck.AppendLog(name="results")}
    with agck.Snapshotter(url, "a", every=1, mode=mode, handle_signals=False) as a, \
            agck.Snapshotter(other, "b", every=2, mode=mode, handle_signals=False) as b:
        for i in range(6):
            state["results"].append({"i": i})
            a.completed(i + 1, state)
            b.completed(i + 1, state)
    for where, run in ((url, "a"), (other, "b")):
        with agck.Snapshotter(where, run, every=1, handle_signals=False) as s:
            got = s.restore({"results": None})
            assert s.start_step == 6 and list(got["results"]) == [{"i": i} for i in range(6)], (where, run)
    with agck.Snapshotter(other, "b", every=1, handle_signals=False) as s:    # restored, carried into run c
        carried = s.restore({"results": None})
    with agck.Snapshotter(url, "c", every=1, mode=mode, handle_signals=False) as c:
        c.restore(carried)
        for i in range(6, 8):
            carried["results"].append({"i": i})
            c.completed(i + 1, carried)
    with agck.Snapshotter(url, "c", every=1, handle_signals=False) as s:
        got = s.restore({"results": None})
        assert s.start_step == 8 and list(got["results"]) == [{"i": i} for i in range(8)]
    for where in (url, other):        # every reader agrees: each checkpoint verifies, with its items
        with agck.open_store(where) as st:
            assert agck.recovery.verify_store(st).rejected == []


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres", "s3"])
def test_every_reader_judges_a_checkpoint_by_the_items_it_counts(tmp_path, kind, request, monkeypatch, capsys):
    """FORMAT.md 17.11. A checkpoint counting items that only a damaged record holds is rejected alike by
    agck.recover, `agck recover`, `agck verify` and Snapshotter.restore (the last alone
    once walked back; the others accepted it)."""
    from agck.cli import main as cli
    url = worker_url(kind, request, tmp_path)
    with agck.Snapshotter(url, "r", every=10, mode="sync", handle_signals=False) as snap:
        state = snap.restore({"results": agck.AppendLog(name="results")})
        for i in snap.steps(30):
            state["results"].append(i)
    cls = type(agck.open_store(url))
    real = cls.log_read

    def damaged(self, run, start=0):      # every reader's view of the log: the middle segment rotted
        data, end = real(self, run, start)
        data = bytearray(data)
        data[jr.scan(bytes(data)).entries[1][0] + 20] ^= 0xFF
        return bytes(data), end

    monkeypatch.setattr(cls, "log_read", damaged)
    rec = agck.recover(url, "r")
    assert rec.step == 10 and [r.step for r in rec.rejected] == [30, 20]
    assert all("item 10" in r.reason for r in rec.rejected)
    capsys.readouterr()
    assert cli(["recover", url, "--run", "r", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["runs"][0]["step"] == 10
    assert cli(["verify", url, "--run", "r", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["corrupt"] == 2
    with agck.Snapshotter(url, "r", every=10, handle_signals=False) as snap:
        got = snap.restore({"results": None})
        assert snap.start_step == 10 and list(got["results"]) == list(range(10))


@pytest.mark.parametrize("chain,count", [
    ([[bytes(16), 1]], 2),                       # the first generation does not start at item 0
    ([[bytes(15), 0]], 2),                       # a generation that is not 16 bytes
    ([[bytes(16), 0], [b"\x01" * 16, 5]], 3),    # a generation past the count
    ([[bytes(16), 2], [b"\x01" * 16, 0]], 3),    # out of order
    ([[bytes(16), True]], 1),                    # a bool is not an int
])
def test_a_malformed_reference_is_a_verdict(tmp_path, chain, count):
    """FORMAT.md 17.10: a reference whose chain is not as the rule says is CorruptCheckpointError."""
    from agck import applog
    from agck.errors import CorruptCheckpointError
    store = agck.open_store(str(tmp_path))
    store.log_append("r", [jr.record("s", "L", bytes(16), 0, *jr.encode_value([0, 1, 2]))])
    tree = {"state": {"L": {"__agck__": "log", "name": "L", "count": count, "chain": chain}}}
    with pytest.raises(CorruptCheckpointError):
        applog.resolve(store, "r", tree, "ref")
