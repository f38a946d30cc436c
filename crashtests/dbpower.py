"""Fault kind ``dbpower``: the power cut under SQLite and under a Postgres server.

The writes that reach the database's files through the kernel but were never
fsync'd are what a power cut takes. :mod:`crashtests.powercut` (an LD_PRELOAD
shim) logs every write under the database's directory with what it overwrote,
and after the processes are SIGKILLed rebuilds the directory as the disk would
hold it: everything fsync'd, and of the rest none (``drop``), a prefix
(``prefix``), a prefix and a torn sector-aligned part of the next write
(``torn``), or any subset (``subset``: disks reorder); files created without a
directory fsync may vanish. The mode goes round per trial.

* **sqlite**: a fresh database per trial; the workload (:mod:`crashtests.dbpowerwork`,
  agck's SQLite store with its own settings: WAL, ``synchronous=FULL``) runs under
  the shim and is SIGKILLed at a random instant of its puts; the cut is applied and
  the database opened again.
* **postgres**: one private cluster whose server processes run under the shim
  (:class:`crashtests.pgpower.PowerCluster`; ``fsync=on``, ``full_page_writes=on``);
  each trial's workload puts on it and the whole server is SIGKILLed at a random
  instant, the workload after it; the cut is applied and the server restarted (WAL
  recovery on what survived). With the large profile each trial has tables of its
  own, so that each writes its 128 MiB base (on shared tables only the first would).

Judged as a ``kill`` trial (:func:`crashtests.checker.check_library`): every
acknowledged step must be there and verify with the state it was put with (else
**lost**), recovery returns at least the last acknowledged step, SQLite's
``PRAGMA integrity_check`` says ok (else **corrupt**). At the end every earlier
trial's run on the cluster must still recover to the step it did (a later cut must
not damage what an earlier one left).

Contract: :func:`trials` runs ``cfg.n(store, "dbpower")`` trials on each of the two
stores that is configured, one after another; skipped with the reason where the
shim cannot be built (no gcc) or no private cluster can start.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

from . import checker, pgcluster, powercut
from .checker import Trial
from .trialkit import TrialKit, log

STEPS = 8
DIRS = "linux"      # what makes a new file's directory entry durable (crashtests.powercut.DIR_RULES)


def read_acks(path: str) -> list[int]:
    from crashtests.workload import read_acks
    return read_acks(path)


def trials(c: TrialKit) -> None:
    cfg = c.cfg
    if "dbpower" not in cfg.faults:
        return
    # (a store of no trials starts nothing: a cluster under the shim takes seconds)
    stores = [s for s in ("sqlite", "postgres") if s in cfg.stores and cfg.n(s, "dbpower")]
    if not stores:
        return
    if not c.time_left():
        c.skip_all("dbpower", tuple(stores))
        return
    reason = powercut.available()
    if reason:
        c.notes.append(f"dbpower skipped: {reason}")
        return
    from crashtests.dbpowerwork import tree
    from crashtests.workload import state_hash
    ref = {k: state_hash(tree(k, cfg.profile)) for k in range(1, STEPS + 1)}
    if "sqlite" in stores:
        n = cfg.n("sqlite", "dbpower")
        log(cfg, f"power cuts under SQLite: {n}")
        _sqlite_trials(c, n, ref)
    if "postgres" in stores:
        reason = pgcluster.available()
        if reason:
            c.notes.append(f"dbpower on postgres skipped: {reason}")
            return
        n = cfg.n("postgres", "dbpower")
        log(cfg, f"power cuts under Postgres: {n}")
        _postgres_trials(c, n, ref)


def _spawn(c: TrialKit, url: str, run: str, d: str, tracked: str | None) -> subprocess.Popen:
    env = c.env()
    if tracked is not None:
        env = powercut.env(env, tracked, os.path.join(d, "cut.log"))
    err = open(os.path.join(d, "stderr"), "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "crashtests.dbpowerwork", url, run, str(STEPS),
                                 os.path.join(d, "acks"), c.cfg.profile], cwd=checker.REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    finally:
        err.close()


def _started(p: subprocess.Popen, d: str, timeout: float = 60.0) -> None:
    """Until the workload has imported agck, opened its store and is about to put."""
    acks = os.path.join(d, "acks")
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline and not os.path.exists(acks):
        time.sleep(0.002)


def _dry_run(c: TrialKit, url: str, d: str, tracked: str | None) -> float:
    """Seconds the workload's puts take, uninterrupted (under the shim where ``tracked``)."""
    os.makedirs(os.path.join(d, "db"), exist_ok=True)
    p = _spawn(c, url, "dry", d, tracked)
    _started(p, d)
    t0 = time.monotonic()
    if p.wait(timeout=300) != 0:
        raise RuntimeError(f"the power-cut workload failed: {c.stderr(d)}")
    return time.monotonic() - t0


def _judge(c: TrialKit, store, t: Trial, d: str, ref: dict) -> None:
    t.acked = read_acks(os.path.join(d, "acks"))
    for step in t.acked:
        try:
            store.read(t.run, step, verify=True)
        except Exception as e:
            t.unreadable.append(step)
            t.reasons.append(f"acknowledged step {step} lost in the power cut: {type(e).__name__}: {e}")
    checker.check_library(store, t, ref)


def _kill_at_random(c: TrialKit, p: subprocess.Popen, d: str, est: float, kill) -> bool:
    """Wait a random instant of the workload's puts, then ``kill()``; whether it was still running."""
    _started(p, d)
    try:
        p.wait(timeout=c.rng.uniform(0, est))
    except subprocess.TimeoutExpired:
        pass
    running = p.poll() is None
    kill()
    return running


def _sqlite_trials(c: TrialKit, n: int, ref: dict) -> None:
    from agck.stores.sqlite.store import SqliteStore
    root = os.path.join(c.work, "dbpower-sqlite")
    est = _dry_run(c, f"sqlite:///{root}/dry/db/s.db", os.path.join(root, "dry"), None) * 3   # the shim's cost
    for i in range(n):
        d = os.path.join(root, str(i))
        db = os.path.join(d, "db")
        os.makedirs(db)
        url = f"sqlite:///{db}/s.db"
        t = c.new_trial("sqlite", "dbpower", "sp", url)
        if not c.time_left():
            c.skip(t)
            continue
        mode = powercut.MODES[i % len(powercut.MODES)]
        try:
            p = _spawn(c, url, t.run, d, db)

            def kill():
                if p.poll() is None:
                    p.kill()
                p.wait()
            t.in_flight = _kill_at_random(c, p, d, est, kill)
            if p.returncode not in (0, -9):
                raise RuntimeError(f"the workload failed ({p.returncode}): {c.stderr(d)}")
            cut = powercut.cut(db, os.path.join(d, "cut.log"), mode, c.rng, dirs=DIRS)
            t.reached = True
            t.point = f"{mode}" + ("+in-flight" if t.in_flight else "")
            t.detail = _describe(cut)
            if not os.path.exists(os.path.join(db, "s.db")):
                t.acked = read_acks(os.path.join(d, "acks"))
                t.recovered = None
                if t.acked:
                    t.reasons.append("the database file is gone after the cut")
                continue
            store = SqliteStore(url, create=False)
            try:
                _judge(c, store, t, d, ref)
            finally:
                store.close()
            with sqlite3.connect(os.path.join(db, "s.db")) as conn:
                ok = conn.execute("PRAGMA integrity_check").fetchone()[0]
            if ok != "ok":
                t.hash_ok = False
                t.reasons.append(f"PRAGMA integrity_check: {ok}")
        except Exception as e:
            t.reasons.append(f"harness error: {type(e).__name__}: {e}")
            t.recovered = "raised"


def _postgres_trials(c: TrialKit, n: int, ref: dict) -> None:
    from agck.stores import open_store
    from .pgpower import PowerCluster
    root = os.path.join(c.work, "dbpower-postgres")
    os.makedirs(root)
    c.power = cluster = PowerCluster(settings={"recovery_init_sync_method": "syncfs"}).start()
    done: list[Trial] = []
    cluster.create_db("power")

    shared = cluster.dsn("power")
    open_store(shared, init=True).close()

    def tables(name: str) -> str:
        """The trials' store: one for all, or with the large profile tables of their own."""
        if c.cfg.profile == "small":
            return shared
        url = shared + f"&agck_prefix={name}"
        open_store(url, init=True).close()
        return url
    est = _dry_run(c, tables("dry"), os.path.join(root, "dry"), None) * 1.2
    for i in range(n):
        d = os.path.join(root, str(i))
        os.makedirs(d)
        t = c.new_trial("postgres", "dbpower", "pp", "")
        if not c.time_left():
            c.skip(t)
            continue
        mode = powercut.MODES[i % len(powercut.MODES)]
        p = None
        try:
            t.url = url = tables(t.run)
            p = _spawn(c, url, t.run, d, None)

            def kill():
                cluster.kill("sigkill")          # the server's machine loses power ...
                if p.poll() is None:             # ... and the client never hears back
                    p.kill()
                p.wait()
            t.in_flight = _kill_at_random(c, p, d, est, kill)
            cut = cluster.cut(mode, c.rng)
            t.reached = True
            t.point = f"{mode}" + ("+in-flight" if t.in_flight else "")
            restart = cluster.restart()
            t.detail = f"{_describe(cut)}; restart {restart:.2f}s"
            store = open_store(url)
            try:
                _judge(c, store, t, d, ref)
            finally:
                store.close()
            done.append(t)
        except Exception as e:
            t.reasons.append(f"harness error: {type(e).__name__}: {e}")
            t.recovered = "raised"
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
            if cluster.proc is None or cluster.proc.poll() is not None:
                cluster.cut("drop", c.rng)
                cluster.restart()
    _recheck(done, ref)


def _recheck(done: list[Trial], ref: dict) -> None:
    """Every trial's run still recovers to the step it did before the later cuts."""
    from agck.stores import open_store
    for url in dict.fromkeys(t.url for t in done):
        store = open_store(url)
        try:
            checker.recheck(store, [t for t in done if t.url == url], ref, "the later power cuts")
        finally:
            store.close()


def _describe(cut: dict) -> str:
    return (f"{cut['unsynced']} unsynced writes in {cut['files']} files, {cut['dropped']} dropped"
            + (f", {cut['torn']} torn" if cut.get("torn") else "")
            + (f", {cut['removed']} files removed" if cut.get("removed") else ""))
