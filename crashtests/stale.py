"""Fault kind ``stale``: the run is taken over while its old writer hangs.

A workload (the old incarnation) is stopped (SIGSTOP, as a hung node is) at a
random instant after its first acknowledged checkpoint; a second one resumes the
run to the end, taking a new epoch; then the old one is let go (SIGCONT).

Contract: :func:`trials` runs ``cfg.n(store, "stale")`` trials per store, two
workload processes each, ``cfg.jobs`` at a time (all skipped when the reference
run was not made because the time limit had passed). A trial is judged on every
checkpoint acknowledged by either incarnation (recovery must cover them,
bit-identical to the reference run); the new incarnation must end bit-identical
to the uninterrupted run (its resume); and a step the old writer acknowledges
after the takeover, past the step the new one resumed from, is a fencing failure
(corrupt).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from . import checker
from .checker import Trial
from .trialkit import TrialKit, log


def trials(c: TrialKit) -> None:
    cfg = c.cfg
    if "stale" not in cfg.faults:
        return
    if not c.ref:            # no reference run: the time limit had passed before it
        return c.skip_all("stale")
    jobs = [(c.new_trial(store, "stale", "s", c.urls[store]), c.rng.choice(("sync", "async")))
            for store in cfg.stores for _ in range(cfg.n(store, "stale"))]
    if jobs:
        log(cfg, f"stale-writer trials: {len(jobs)}, two workload processes each")
        c.pool(lambda j: trial(c, *j), jobs)


def trial(c: TrialKit, t: Trial, mode: str) -> None:
    """The old writer must acknowledge nothing more once let go (its next put is refused:
    StaleEpochError), and the run must end bit-identical to the uninterrupted one. If the
    old one was stopped inside its commit, the takeover waits for it (safety before
    liveness): it is let go after a while, finishes that one commit, and then stops
    being able to commit."""
    from crashtests.workload import read_acks   # (imports torch: only in the workers' parent when needed)
    base = os.path.join(c.work, "t", str(t.id))
    d_old, d_new = os.path.join(base, "old"), os.path.join(base, "new")
    os.makedirs(d_old)
    os.makedirs(d_new)
    url = c.client_url(t)
    old = c.spawn(c.workload_cmd(url, t.run, d_old, mode), d_old)
    new = None
    try:
        acks = os.path.join(d_old, "acks")
        deadline = time.monotonic() + 300
        while old.poll() is None and time.monotonic() < deadline and not read_acks(acks):
            time.sleep(0.005)
        time.sleep(c.rng.uniform(0, c.ref["seconds"] - c.ref["first_ack"]) / 2)
        if old.poll() is not None:
            t.detail = "finished before the fault"
            c.check(t, d_old)
            return
        old.send_signal(signal.SIGSTOP)
        t.reached = True
        before = read_acks(acks)
        new = c.spawn(c.workload_cmd(url, t.run, d_new, mode), d_new)
        waited = False
        try:
            new.wait(timeout=max(10.0, 3 * c.ref["seconds"]))
        except subprocess.TimeoutExpired:
            waited = True      # the old one holds the commit the takeover waits for
        old.send_signal(signal.SIGCONT)
        new.wait(timeout=300)
        old.wait(timeout=300)
    finally:
        for p in (old, new):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    after = read_acks(acks)
    late = after[len(before):]
    t.point = "stopped inside a commit" if waited else f"stopped after ack {before[-1] if before else None}"
    err = c.stderr(d_old)
    if old.returncode != 0 and "StaleEpochError" not in err and "epoch" not in err:
        t.reasons.append(f"the old writer failed otherwise (exit {old.returncode}): {err.strip()[-300:]}")
        t.recovered = "raised"
    if new.returncode != 0:
        t.reasons.append(f"the new incarnation failed (exit {new.returncode}): {c.stderr(d_new)[-300:]}")
        t.recovered = "raised"
        return
    with open(os.path.join(d_new, "out.json")) as f:
        out = json.load(f)
    ok = out["final_hash"] == c.ref["final_hash"]
    t.resume = {"ok": ok, "from": out["resumed_from"],
                "why": None if ok else f"final hash {out['final_hash']} (uninterrupted {c.ref['final_hash']})"}
    # Every acknowledged checkpoint of the run, old writer's and new's, must be covered.
    t.acked = sorted(set(after) | set(read_acks(os.path.join(d_new, "acks"))))
    c.check_store(t, checker.check_library, c.ref["full"])
    # An old writer may log, once let go, the ack of a commit it made before it was
    # stopped or while the takeover waited for it: the new incarnation, which begins
    # its epoch before it recovers, then resumed from that step or a later one. A
    # step acknowledged by the old writer past that point was committed after the
    # takeover: fencing failed.
    stale = [k for k in late if k > (out["resumed_from"] or 0)]
    if stale:
        t.hash_ok = False
        t.reasons.append(f"the old writer committed steps {stale} after the run was taken over "
                         f"(the new incarnation resumed from {out['resumed_from']})")
