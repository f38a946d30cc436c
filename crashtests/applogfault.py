"""Fault kind ``applog``: a snapshotted pipeline holding an AppendLog, crashed mid-run,
then resumed.

The workload is :mod:`crashtests.applogwork` (sync or async snapshots, drawn per
trial). Each trial crashes it one way, in turn:

* ``kill``       SIGKILL at a random instant of the run;
* ``failpoint``  killed at a fail point of the segment's path (the journal append
                 that makes the AppendLog's new items durable, in the store's
                 ``journal.<store>.*`` points) or of the snapshot (``snapshot.*``),
                 on its N-th hit: between a segment and the checkpoint that counts it;

then runs the workload again to the end on what survived. A trial is judged:

* lost: a checkpoint acknowledged before the crash that no longer verifies with
  every item it counts (read as every reader reads it:
  :func:`agck.recovery.read_verified`), or a resume that started before the newest
  acknowledged step;
* corrupt: an acknowledged checkpoint whose items differ from an uninterrupted run's
  first ones, or a resumed run whose items, all of them, differ from an
  uninterrupted run's.

Contract: :func:`trials` runs ``cfg.n(store, "applog")`` trials per journal store
(file, sqlite, postgres, s3), ``cfg.jobs`` at a time; counts go to ``Trial.load``
(judged by :func:`crashtests.checker.classify` as a ``pgload`` trial is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from . import applogwork
from .checker import Trial
from .trialkit import TrialKit, log

STORES = ("file", "sqlite", "postgres", "s3")
POINTS = {"file": ("journal.file.before_sync", "journal.file.after_sync"),
          "sqlite": ("journal.sqlite.before_commit", "journal.sqlite.after_commit"),
          "postgres": ("journal.pg.before_append", "journal.pg.after_append"),
          "s3": ("journal.s3.before_put", "journal.s3.after_put")}
SNAPSHOT_POINTS = ("snapshot.after_stage", "snapshot.before_ack")
STEPS = 40
SLEEP = 0.02


def reference() -> list[dict]:
    """An uninterrupted run's items, in order."""
    rng = np.random.default_rng(7)
    return [applogwork.item(i, rng) for i in range(STEPS)]


def trials(c: TrialKit) -> None:
    cfg = c.cfg
    if not c.starts("applog"):
        return
    ref = reference()
    plan = [(s, ("kill", "failpoint")[i % 2]) for s in STORES if s in cfg.stores for i in range(cfg.n(s, "applog"))]
    if c.cluster is None:
        plan = [p for p in plan if p[0] != "postgres"]
    items = []
    for store, kind in plan:
        t = c.new_trial(store, "applog", "a", c.urls[store])
        items.append((t, kind, c.rng.choice(("sync", "async")), c.rng.random()))
    log(cfg, f"AppendLog trials: {len(items)}")
    c.pool(lambda item: trial(c, ref, *item), items)


def trial(c: TrialKit, ref: list[dict], t: Trial, kind: str, mode: str, u: float) -> None:
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    t.point = f"{kind}/{mode}"
    cmd = [sys.executable, "-m", "crashtests.applogwork", c.client_url(t), t.run, d, mode, str(STEPS), str(SLEEP)]
    fp = None
    if kind == "failpoint":
        points = POINTS[t.store] + (SNAPSHOT_POINTS if mode == "async" else SNAPSHOT_POINTS[1:])
        point = points[int(u * len(points))]
        fp = f"{point}=kill@{c.rng.randint(1, STEPS // applogwork.EVERY)}"
        t.point += f" {fp.split('=')[0]}@{fp.split('@')[1]}"
    p = c.spawn(cmd, d, fp)
    try:
        if kind == "kill":
            time.sleep(1.5 + u * STEPS * SLEEP * 1.5)     # imports first, then a random instant of the run
            if p.poll() is None:
                p.kill()
                t.reached = True
        c.finish(p, 120)
    finally:
        c.crashed(t, p, kind == "failpoint")
    p = c.spawn(cmd, d)
    hung = c.finish(p, 180)
    if p.returncode != 0:
        t.reasons.append(f"the resumed run failed (exit {p.returncode}{', hung' if hung else ''}): "
                         f"{c.stderr(d)[-400:]}")
        t.recovered = "raised"
        return
    with open(os.path.join(d, "out.json")) as f:
        out = json.load(f)
    store = c.open(t.url)
    try:
        _judge(t, ref, applogwork.acks(os.path.join(d, "acks")), out, store)
    finally:
        store.close()


def _judge(t: Trial, ref: list[dict], acks: list[list[int]], out: dict, store) -> None:
    from agck.recovery import read_verified
    lost = corrupt = 0
    before = [s for inc in acks[:-1] for s in inc]     # acknowledged before the last incarnation began
    if before and out["start"] < max(before):
        lost += 1
        t.reasons.append(f"resumed from step {out['start']}, but step {max(before)} was acknowledged")
    acked = sorted({s for inc in acks for s in inc})
    for s in acked:
        try:
            ck = read_verified(store, t.run, s)
            items = list(ck.state["state"]["results"])
        except Exception as e:
            lost += 1
            t.reasons.append(f"acknowledged step {s} does not restore: {type(e).__name__}: {e}")
            continue
        if applogwork.digest(items) != applogwork.digest(ref[:s]):
            corrupt += 1
            t.reasons.append(f"acknowledged step {s} restores {len(items)} items that differ from the reference")
    if out["hash"] != applogwork.digest(ref):
        corrupt += 1
        t.reasons.append(f"the resumed run's {out['count']} items differ from an uninterrupted run's {len(ref)}")
    t.recovered = out["start"]
    t.load = {"runs": [], "last": None, "acknowledged": len(before), "lost": lost, "corrupt": corrupt}
