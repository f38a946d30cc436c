"""Fault kind ``journal``: step journals (agck.Journal) crashed mid-run, then resumed.

The workload is :mod:`crashtests.journalwork` (results, streamed steps, in sync or
group commit, drawn per trial). Each trial crashes it one way, drawn in turn from
what its store can suffer:

* ``kill``       SIGKILL at a random instant of the run (every journal store);
* ``failpoint``  killed at a fail point of the journal's append path, on its N-th hit
                 (``journal.<store>.*`` in :data:`agck.failpoints.POINTS`);
* ``pgkill``     the private Postgres server killed (SIGKILL or an immediate stop) at a
                 random instant, then restarted (Postgres);
* ``powerloss``  the file store on SimFS, the power cut at operation N and the
                 post-crash image built with the unsynced writes dropped, partly
                 applied, reordered or torn (in-process);
* ``shimcut``    the workload's own file or SQLite store (a directory of the trial)
                 under the preload shim (:mod:`crashtests.powercut`), SIGKILLed at a
                 random instant, then its files left as a power cut would have left
                 them (unsynced writes dropped, a prefix, torn or a subset; the mode
                 goes round per trial).

then runs the workload again to the end on what survived. A trial is judged:

* lost: a result (or a whole stream) acknowledged before the crash whose function
  ran again after it, or that the journal no longer holds;
* corrupt: the resumed pipeline's values (every result and item, in order) differ
  from an uninterrupted run's, or the journal at the end does not hold every step.

Contract: :func:`trials` runs ``cfg.n(store, "journal")`` trials per journal store
(file, sqlite, postgres, s3; pgs3 keeps its journals in Postgres, as postgres), the subprocess ones
``cfg.jobs`` at a time, the Postgres server kills one after another. Each trial's
counts go to ``Trial.load`` (judged by :func:`crashtests.checker.classify` as a
``pgload`` trial is).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

from . import checker, journalwork, powercut
from .checker import Trial
from .trialkit import TrialKit, log

STORES = ("file", "sqlite", "postgres", "s3")
KINDS = {"file": ("kill", "failpoint", "powerloss", "shimcut"), "sqlite": ("kill", "failpoint", "shimcut"),
         "postgres": ("kill", "failpoint", "pgkill"), "s3": ("kill", "failpoint")}
POINTS = {"file": ("journal.file.before_write", "journal.file.before_sync", "journal.file.after_sync"),
          "sqlite": ("journal.sqlite.before_commit", "journal.sqlite.after_commit"),
          "postgres": ("journal.pg.before_append", "journal.pg.after_append"),
          "s3": ("journal.s3.before_put", "journal.s3.after_put")}
STEPS = 40
SLEEP = 0.02
DAY_MS = 86_400_000     # the longest group-commit wait a Journal takes: in the power cuts the count flushes


def trials(c: TrialKit) -> None:
    cfg = c.cfg
    if not c.starts("journal"):
        return
    ref = journalwork.reference(STEPS)
    plan = {s: [KINDS[s][i % len(KINDS[s])] for i in range(cfg.n(s, "journal"))] for s in STORES if s in cfg.stores}
    if "postgres" in plan and c.cluster is None:
        plan.pop("postgres")
    pool, serial = [], []
    for store, kinds in plan.items():
        for kind in kinds:
            t = c.new_trial(store, "journal", "j", c.urls[store])
            commit = c.rng.choice(("sync", "group"))
            (serial if kind == "pgkill" else pool).append((t, kind, commit, c.rng.random()))
    log(cfg, f"journal trials: {len(pool) + len(serial)} ({', '.join(f'{s}: {len(k)}' for s, k in plan.items())})")
    c.pool(lambda item: trial(c, ref, *item), pool)
    for item in serial:           # they share the one server
        if not c.time_left():
            c.skip(item[0])
            continue
        try:
            trial(c, ref, *item)
        except Exception as e:
            item[0].reasons.append(f"harness error: {type(e).__name__}: {e}")
            item[0].recovered = "raised"
            c.revive_cluster()


def trial(c: TrialKit, ref: str, t: Trial, kind: str, commit: str, u: float) -> None:
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    t.point = f"{kind}/{commit}"
    if kind == "powerloss":
        return _powerloss(c, ref, t, commit, d, u)
    if kind == "shimcut":
        return _shimcut(c, ref, t, commit, d, u)
    url = c.client_url(t)
    cmd = [sys.executable, "-m", "crashtests.journalwork", url, t.run, d, commit, str(STEPS), str(SLEEP)]
    fp = None
    if kind == "failpoint":
        point = POINTS[t.store][int(u * len(POINTS[t.store]))]
        nth = c.rng.randint(1, STEPS + STEPS // journalwork.STREAM_EVERY * 4 if commit == "sync" else STEPS // 2)
        fp = f"{point}=kill@{nth}"
        t.point += f" {point}@{nth}"
    p = c.spawn(cmd, d, fp)
    try:
        if kind in ("kill", "pgkill"):
            _wait_ran(p, d)
            try:
                p.wait(timeout=u * STEPS * SLEEP * 1.2)
            except subprocess.TimeoutExpired:
                if kind == "kill":
                    p.kill()
                else:
                    c.cluster.kill("immediate" if t.id % 2 else "sigkill")
                    t.point += " server killed"
                t.reached = True
            if kind == "pgkill":
                c.finish(p, 60)
                if c.cluster.proc is None or c.cluster.proc.poll() is not None:
                    c.cluster.restart()
        c.finish(p, 120)
    finally:
        c.crashed(t, p, kind == "failpoint")
    _resume(c, ref, t, cmd, d)


def _resume(c: TrialKit, ref: str, t: Trial, cmd: list, d: str) -> None:
    """Run the crashed pipeline ``cmd`` on to its end, then judge the trial."""
    # (a server kill may fail a resume's first try: once more after it)
    for attempt in range(3):
        p = c.spawn(cmd, d)
        hung = c.finish(p, 180)
        if p.returncode == 0:
            break
        if t.store == "postgres":
            c.revive_cluster()
    if p.returncode != 0:
        t.reasons.append(f"the resumed run failed (exit {p.returncode}{', hung' if hung else ''}): "
                         f"{c.stderr(d)[-400:]}")
        t.recovered = "raised"
        return
    with open(os.path.join(d, "out.json")) as f:
        out = json.load(f)
    store = c.open(t.url)
    try:
        _judge(t, ref, journalwork.incarnations(os.path.join(d, "ran")),
               journalwork.incarnations(os.path.join(d, "acks")), out, store)
    finally:
        store.close()


def _wait_ran(p: subprocess.Popen, d: str, timeout: float = 120) -> None:
    """Until the workload has run its first step (imports done)."""
    path = os.path.join(d, "ran")
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 12:
            return
        time.sleep(0.005)


def _shimcut(c: TrialKit, ref: str, t: Trial, commit: str, d: str, u: float) -> None:
    reason = powercut.available()
    if reason:
        t.skipped = True
        t.detail = f"the preload shim is not available: {reason}"
        return
    tracked = os.path.join(d, "store")
    os.makedirs(tracked)
    t.url = tracked if t.store == "file" else f"sqlite:///{tracked}/s.db"
    log = os.path.join(d, "cut.log")
    cmd = [sys.executable, "-m", "crashtests.journalwork", t.url, t.run, d, commit, str(STEPS), str(SLEEP)]
    err = open(os.path.join(d, "stderr"), "wb")
    try:
        p = subprocess.Popen(cmd, cwd=checker.REPO, env=powercut.env(c.env(), tracked, log),
                             stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
    finally:
        err.close()
    try:
        _wait_ran(p, d)
        try:
            p.wait(timeout=u * STEPS * SLEEP * 1.5)
            t.detail = "finished before the kill"
        except subprocess.TimeoutExpired:
            t.reached = True
    finally:
        c.crashed(t, p, False)
    if p.returncode not in (0, -9):
        t.reasons.append(f"the workload failed under the shim (exit {p.returncode}): {c.stderr(d)[-400:]}")
        t.recovered = "raised"
        return
    mode = powercut.MODES[t.id % len(powercut.MODES)]
    cut = powercut.cut(tracked, log, mode, c.rng)
    t.reached = True        # the cut itself is the fault, killed mid-run or not
    t.point += f" {mode}: {cut['unsynced']} unsynced ops, {cut['dropped']} dropped, {cut['torn']} torn"
    _resume(c, ref, t, cmd, d)


def _powerloss(c: TrialKit, ref: str, t: Trial, commit: str, d: str, u: float) -> None:
    from agck.journal import Journal
    from agck.stores.file.store import FileStore
    from crashtests.simfs import MODES, Crash, SimFS, materialize
    ran: list[list[str]] = [[]]
    acks: list[list[str]] = [[]]
    count = SimFS(os.path.join(d, "count"))      # a dry run counts the operations
    with Journal(FileStore(count.root, fs=count), t.run, commit=commit, every=4, ms=DAY_MS) as j:
        journalwork.pipeline(j, STEPS, lambda _: None, lambda _: None)
    crash_at = max(1, int(u * count.ops))
    sim = SimFS(os.path.join(d, "live"), crash_at=crash_at)
    store = FileStore(sim.root, fs=sim)
    try:
        j = Journal(store, t.run, commit=commit, every=4, ms=DAY_MS)   # flushed by count: one recorded order
        journalwork.pipeline(j, STEPS, ran[0].append, acks[0].append)
        t.detail = "finished before the power cut"
    except Crash:
        t.reached = True
    mode = MODES[t.id % len(MODES)]
    rng = random.Random(t.id)
    image = os.path.join(d, "image")
    _, chosen, desc = sim.choose(rng, mode)
    materialize(sim.image_tree(chosen), image)
    t.point += f" op {crash_at}/{count.ops} ({sim.crash_op}), {desc}"
    ran.append([])
    acks.append([])
    back = FileStore(image)
    with Journal(back, t.run, commit=commit, every=4, ms=20) as j2:
        digest = journalwork.pipeline(j2, STEPS, ran[1].append, acks[1].append)
        damaged = list(j2.damaged)
    _judge(t, ref, ran, acks, {"hash": digest, "damaged": damaged}, back)
    back.close()


def _judge(t: Trial, ref: str, ran: list, acks: list, out: dict, store) -> None:
    from agck.journal import inspect_journal
    lost = corrupt = 0
    acked: set[str] = set()
    before_end = set().union(*acks[:-1]) if len(acks) > 1 else set()    # what a crash could lose
    for k, (ran_k, acks_k) in enumerate(zip(ran, acks)):
        if k:
            # a stream cut short runs again from its start (its replayed items dropped): only a
            # stream acknowledged whole must not
            again = [lab for lab in ran_k if (lab[0] == "r" and lab in acked)
                     or (lab[0] == "s" and "e" + lab[1:].split(".")[0] in acked)]
            if again:
                lost += len(again)
                t.reasons.append(f"incarnation {k + 1} ran again what was acknowledged before: {again[:5]}")
        acked.update(acks_k)
    if out["hash"] != ref:
        corrupt += 1
        t.reasons.append(f"the resumed pipeline's values differ from an uninterrupted run's ({out['hash']} != {ref})")
    rep = inspect_journal(store, t.run)
    streams = (STEPS + journalwork.STREAM_EVERY - 1) // journalwork.STREAM_EVERY
    if rep["results"] != STEPS or rep["streams_complete"] != streams:
        corrupt += 1
        t.reasons.append(f"the journal holds {rep['results']} results and {rep['streams_complete']} complete "
                         f"streams at the end, not {STEPS} and {streams}")
    if out["damaged"] or rep["damaged"]:
        t.detail = (t.detail + f" {len(rep['damaged'])} unacknowledged record(s) found damaged").strip()
    t.load = {"runs": [], "last": None, "acknowledged": len(before_end), "lost": lost, "corrupt": corrupt}
