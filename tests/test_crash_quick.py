"""A quick crash campaign (every fault kind, a few trials each), unit tests of the simulated FS, and the
size of the large profile's state.

The full campaign is ``scripts/crash_campaign`` (``--ci`` for the short one).
"""

from __future__ import annotations

import os
import random

import pytest

from agck import durable
from crashtests import campaign, pgcluster, s3server
from crashtests.simfs import MODES, Crash, SimFS, crash_at_every_operation


# --- simfs --------------------------------------------------------------------------

def _write(sim: SimFS, path: str, data: bytes, *, fsync: bool) -> None:
    fd = sim.open_new(path)
    sim.write(fd, data)
    if fsync:
        sim.fsync(fd)
    sim.close(fd)


def test_unsynced_write_is_dropped_at_crash(tmp_path):
    sim = SimFS(str(tmp_path / "root"))
    p = os.path.join(sim.root, "f")
    _write(sim, p, b"hello world", fsync=False)
    sim.fsync_dir(sim.root)          # the name is durable, the data is not
    sim.crash()
    tree = sim.image_tree(sim.choose(random.Random(0), "none")[1])
    assert tree == {"f": b""}
    with pytest.raises(Crash):
        sim.write(0, b"x")           # the machine is off


def test_rmdir_without_parent_fsync_may_be_lost(tmp_path):
    sim = SimFS(str(tmp_path / "root"))
    d = os.path.join(sim.root, "run")
    sim.mkdir(d)
    sim.fsync_dir(sim.root)
    sim.rmdir(d)
    assert not os.path.exists(d)
    sim.crash()
    assert sim.image_tree(sim.choose(random.Random(0), "none")[1]) == {"run": None}
    assert sim.image_tree(sim.choose(random.Random(0), "all")[1]) == {}


def test_rename_without_dir_fsync_may_be_lost(tmp_path):
    sim = SimFS(str(tmp_path / "root"))
    tmp, final = os.path.join(sim.root, "tmp"), os.path.join(sim.root, "final")
    _write(sim, tmp, b"data", fsync=True)
    sim.fsync_dir(sim.root)
    sim.rename(tmp, final)
    sim.crash()
    lost = sim.image_tree(sim.choose(random.Random(0), "none")[1])
    assert lost == {"tmp": b"data"}
    kept = sim.image_tree(sim.choose(random.Random(0), "all")[1])
    assert kept == {"final": b"data"}


def test_crash_at_operation_n_stops_there(tmp_path):
    sim = SimFS(str(tmp_path / "root"), crash_at=3)
    fd = sim.open_new(os.path.join(sim.root, "f"))
    sim.write(fd, b"a")
    with pytest.raises(Crash):
        sim.fsync(fd)
    assert sim.ops == 3 and sim.crash_op == "fsync"


def test_torn_write_keeps_a_prefix(tmp_path):
    sim = SimFS(str(tmp_path / "root"))
    p = os.path.join(sim.root, "f")
    _write(sim, p, b"A" * 100, fsync=False)
    sim.fsync_dir(sim.root)
    sim.crash()
    for seed in range(20):
        data = sim.image_tree(sim.choose(random.Random(seed), "torn")[1])["f"]
        assert len(data) <= 100 and data[:1] in (b"", b"A")
        assert data != b"A" * 100      # a torn write never lands whole


def test_synced_file_always_survives(tmp_path):
    payload = os.urandom(5000)
    for i in range(30):
        root = str(tmp_path / f"r{i}")
        sim = SimFS(root)
        path = os.path.join(root, "ckpt")
        durable.write_atomic(path, [payload[:1000], payload[1000:]], fs=sim)
        # later unsynced activity that a crash may partly apply
        fd = sim.open_new(os.path.join(root, "other"))
        sim.write(fd, b"zzz")
        sim.crash()
        rng = random.Random(i)
        for mode in MODES:
            tree = sim.image_tree(sim.choose(rng, mode)[1])
            assert tree["ckpt"] == payload, mode


def test_early_writeback_is_no_durability_point(tmp_path, monkeypatch):
    """write_atomic starts writeback every WRITEBACK_EVERY bytes; a power cut at (or
    right after) any of those calls still leaves the old file or nothing, never a torn one."""
    monkeypatch.setattr(durable, "WRITEBACK_EVERY", 4096)
    old, new = os.urandom(3000), os.urandom(40_000)
    parts = [new[i:i + 1000] for i in range(0, len(new), 1000)]
    calls = []

    class Recording(SimFS):
        def start_writeback(self, fd, offset, nbytes):
            calls.append((offset, nbytes))
            super().start_writeback(fd, offset, nbytes)

    root = str(tmp_path / "probe")
    os.makedirs(root)
    durable.write_atomic(os.path.join(root, "ckpt"), parts, fs=Recording(root))
    # contiguous ranges of at least 4096 bytes from 0, each started once
    assert calls and calls[0][0] == 0 and all(n >= 4096 for _, n in calls)
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))
    assert calls[-1][0] + calls[-1][1] <= len(new)

    crash_at_every_operation(str(tmp_path / "cut"), {"ckpt": old},
                             lambda root, fs: durable.write_atomic(os.path.join(root, "ckpt"), parts, fs=fs),
                             lambda tree: tree.get("ckpt") in (old, new))


def test_writeback_hint_failures_never_fail_a_write(tmp_path, monkeypatch):
    """start_writeback is only a hint: any error from it is ignored (fsync reports real
    I/O errors), and an 'unsupported' answer stops further calls."""
    import ctypes
    import errno
    monkeypatch.setattr(durable, "WRITEBACK_EVERY", 1000)
    for err, keeps_calling in ((errno.EPERM, True), (errno.EIO, True), (errno.EINVAL, False)):
        calls = []

        def failing(fd, offset, nbytes, flags, err=err):
            calls.append(offset)
            ctypes.set_errno(err)
            return -1
        monkeypatch.setattr(durable, "_sync_file_range", failing)
        path = str(tmp_path / f"f{err}")
        durable.write_atomic(path, [bytes(1000)] * 5)
        assert open(path, "rb").read() == bytes(5000)
        assert len(calls) == (5 if keeps_calling else 1), (err, calls)
        assert (durable._sync_file_range is None) == (not keeps_calling)


# --- the large profile ------------------------------------------------------------------

def test_large_profile_state_is_100_to_300_mib(tmp_path):
    """The large profile's state, built without a campaign: 100-300 MiB, most of it the same
    from step to step and tens of MiB changed by a step (what an incremental put writes);
    the power cuts under the databases write a base of 100 MiB or more; every workload
    the campaign spawns is told the profile."""
    import numpy as np
    import torch
    from crashtests import dbpowerwork
    from crashtests.workload import LARGE_BYTES, build_state, run_step, state_bytes

    state = build_state(4, profile="large")
    assert 100 << 20 <= state_bytes(state) <= 300 << 20
    assert state_bytes(state) - state_bytes(build_state(4)) == LARGE_BYTES

    def blocks(x):     # the 1 MiB pieces of a tensor's bytes, as a chunk grid cuts them
        b = x.reshape(-1).view(torch.uint8).numpy()
        return [b[i:i + (1 << 20)] for i in range(0, len(b), 1 << 20)]
    before = {k: [bytes(p) for p in blocks(v)] for k, v in state["large"].items()}
    run_step(state, 0)
    changed = sum(len(p) for k, v in state["large"].items() for p, old in zip(blocks(v), before[k]) if bytes(p) != old)
    assert 8 << 20 <= changed <= 64 << 20, changed >> 20
    assert dbpowerwork.base("large").nbytes >= 100 << 20 and isinstance(dbpowerwork.base("large"), np.ndarray)

    c = campaign.Campaign(campaign.Config(profile="large", quiet=True))
    try:
        cmd = c.workload_cmd(str(tmp_path / "store"), "r", str(tmp_path))
        assert cmd[cmd.index("--profile") + 1] == "large"
    finally:
        c.cleanup()


# --- the quick campaign ----------------------------------------------------------------
# Every fault kind on every store, a few trials each, for a run of pytest alone. The
# README's test command runs `scripts/crash_campaign --ci` first (the same faults, more
# trials) and deselects these (-m "not campaign").

def _run(tmp_path, stores, faults, counts, seed):
    cfg = campaign.Config(stores=stores, faults=faults, out=str(tmp_path / "report"), seed=seed,
                          counts=counts, quiet=True, chart=False, time_limit=300)
    rep = campaign.Campaign(cfg).run()
    campaign.write_report(rep, cfg.out)
    bad = rep["failures"]
    assert rep["totals"]["lost"] == 0 and rep["totals"]["corrupt"] == 0, campaign.markdown(rep)
    assert rep["totals"]["error"] == 0, bad
    return rep


@pytest.mark.campaign
def test_quick_campaign_file_and_sqlite(tmp_path):
    counts = {"kill": 3, "failpoint": 3, "powerloss": 25, "corrupt": 40, "journal": 3}
    rep = _run(tmp_path, ("file", "sqlite"), ("kill", "failpoint", "powerloss", "corrupt", "journal"), counts, seed=7)
    faults = {(r["store"], r["fault"]) for r in rep["rows"]}
    assert {("file", "kill"), ("file", "failpoint"), ("file", "powerloss"), ("file", "corrupt"),
            ("sqlite", "kill"), ("sqlite", "failpoint"), ("sqlite", "corrupt"), ("file", "journal"),
            ("sqlite", "journal")} <= faults
    assert rep["totals"]["resumes_ok"] == rep["totals"]["resumes_checked"] > 0
    assert os.path.exists(tmp_path / "report" / "crash_report.json")


@pytest.mark.campaign
@pytest.mark.skipif(pgcluster.available() is not None, reason=f"no private Postgres: {pgcluster.available()}")
def test_quick_campaign_postgres(tmp_path):
    counts = {"kill": 2, "failpoint": 2, "pgkill": 1, "pgload": 1, "corrupt": 25, "journal": 3}
    rep = _run(tmp_path, ("postgres",), ("kill", "failpoint", "pgkill", "pgload", "corrupt", "journal"), counts,
               seed=8)
    assert rep["postgres_kills"] == 3        # pgload's two, and the journal's pgkill trial
    assert not any(n.startswith("postgres skipped") for n in rep["notes"])


@pytest.mark.campaign
@pytest.mark.skipif(pgcluster.available() is not None, reason=f"no private Postgres: {pgcluster.available()}")
def test_quick_campaign_failover_and_power_cuts(tmp_path):
    from crashtests import powercut
    if powercut.available() is not None:
        pytest.skip(f"power-cut shim unusable: {powercut.available()}")
    counts = {"failover": 3, "dbpower": 4}
    rep = _run(tmp_path, ("sqlite", "postgres"), ("failover", "dbpower"), counts, seed=10)
    rows = {(r["store"], r["fault"]): r for r in rep["rows"]}
    assert rows[("postgres", "failover")]["faults_delivered"] == 3
    assert rows[("sqlite", "dbpower")]["faults_delivered"] == rows[("postgres", "dbpower")]["faults_delivered"] == 4
    assert rows[("postgres", "failover")]["resumes_ok"] == rows[("postgres", "failover")]["resumes_checked"] == 1


@pytest.mark.campaign
@pytest.mark.skipif(s3server.seaweed_available() is not None, reason=f"no SeaweedFS: {s3server.seaweed_available()}")
def test_quick_campaign_object_store(tmp_path):
    pytest.importorskip("obstore")
    counts = {"kill": 2, "failpoint": 3, "s3kill": 1, "stale": 1, "corrupt": 10, "chunkrot": 2}
    rep = _run(tmp_path, ("s3",), ("kill", "failpoint", "s3kill", "stale", "corrupt", "chunkrot"), counts, seed=9)
    assert rep["s3_kills"] == 1
    assert not any(n.startswith("s3 skipped") for n in rep["notes"])


def test_concurrent_load_judge_finds_lost_and_wrong_steps(tmp_path, pg_dsn, pg_schema):
    """The pgload judge has teeth: an acknowledged step that is not stored is lost, a
    stored step holding a state nobody put is corrupt, a gap in a history is lost."""
    from crashtests import loadworker, pgload
    from crashtests.checker import Trial, classify
    from agck.stores import open_store
    from conftest import pg_prefix

    url = f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}agck_prefix={pg_prefix()}&agck_schema={pg_schema}"
    open_store(url, init=True).close()

    class Harness:      # what pgload.check uses of a TrialKit
        def open(self, u):
            return open_store(u)

    def judged(tamper):
        t = Trial(id=1, store="postgres", fault="pgload", run=f"J{tamper}", url=url)
        acks = tmp_path / f"acks-{tamper}"
        store = open_store(url)
        lines = []
        for k in range(pgload.PROCS):
            for j in range(pgload.THREADS):
                run = f"{t.run}-p{k}-t{j}"
                loadworker.conversation(store, run, pgload.STEPS, lambda r, s: lines.append(f"{r} {s}\n"))
        victim = f"{t.run}-p0-t0"
        if tamper == "lost":
            store.delete(victim, 4)
        elif tamper == "wrong":
            store.put(victim, 4, loadworker.state_for(victim, 5))
        elif tamper == "gap":
            store.delete(victim, 4)
            lines.remove(f"{victim} 4\n")
        store.close()
        acks.write_text("".join(lines))
        pgload.check(Harness(), t, str(acks))
        return classify(t), t.reasons

    assert judged("none") == ("ok", [])
    outcome, reasons = judged("lost")
    assert outcome == "lost" and any("acknowledged steps [4] missing" in r for r in reasons)
    outcome, reasons = judged("wrong")
    assert outcome == "corrupt" and any("a state nobody put" in r for r in reasons)
    outcome, reasons = judged("gap")
    assert outcome == "lost" and any("gaps [4]" in r for r in reasons)


def test_the_journal_judge_has_teeth(tmp_path, monkeypatch):
    """A disk whose flush promises nothing (SimFS's datasync a no-op): the journal's
    power-loss trials must find acknowledged results lost; with the real flush, none."""
    from crashtests import journalfault, journalwork
    from crashtests.checker import Trial, classify
    from crashtests.simfs import SimFS
    ref = journalwork.reference(journalfault.STEPS)

    class _Campaign:
        work = str(tmp_path)

    def run(n):
        outcomes = []
        for i in range(n):
            t = Trial(id=i + 1, store="file", fault="journal", run=f"j{i}", url="")
            d = tmp_path / f"{id(outcomes)}-{i}"
            d.mkdir()
            journalfault._powerloss(_Campaign(), ref, t, "sync", str(d), 0.3 + 0.6 * i / n)
            outcomes.append(classify(t))
        return outcomes

    assert set(run(4)) == {"ok"}
    monkeypatch.setattr(SimFS, "datasync", lambda self, fd: self._tick("datasync"))
    assert "lost" in run(6)


def test_the_applog_judge_has_teeth(tmp_path):
    """An acknowledged checkpoint whose AppendLog segments are gone is lost; one whose
    items differ is corrupt; an untouched run is ok."""
    import shutil
    from crashtests import applogfault, applogwork
    from crashtests.checker import Trial, classify
    import agck
    ref = applogfault.reference()

    def judged(tamper):
        d = tmp_path / tamper
        d.mkdir()
        url = str(d / "store")
        out = applogwork.run(url, "a", str(d), "sync", applogfault.STEPS, 0.0)
        store = agck.open_store(url)
        if tamper == "gone":
            os.remove(store.log_ref("a"))
        t = Trial(id=1, store="file", fault="applog", run="a", url=url)
        wrong = [dict(x, draw=x["draw"] + 1) for x in ref] if tamper == "wrong" else ref
        applogfault._judge(t, wrong, applogwork.acks(str(d / "acks")), out, store)
        store.close()
        shutil.rmtree(d)
        return classify(t), t.reasons

    assert judged("none")[0] == "ok"
    outcome, reasons = judged("gone")
    assert outcome == "lost" and any("does not restore" in r for r in reasons)
    outcome, reasons = judged("wrong")
    assert outcome == "corrupt" and any("differ" in r for r in reasons)
