"""Fault kinds ``kill`` and ``failpoint``: the workload subprocess dies mid-run.

* ``kill``: the workload is SIGKILLed at a random instant of its run proper
  (restore, steps, checkpoints, close); with ``min_kills``, random kills that came
  after the run ended are topped up until that many SIGKILLs were delivered per store.
* ``failpoint``: the workload kills itself (or, one trial in ten, gets EIO) at a
  named fail point of the store's write path or the snapshotter, on its N-th hit
  (``AGCK_FAILPOINTS=point=kill@N``); every fail point lies between the start of a
  put and its ack, so the trial has a checkpoint in flight.

Contract: :func:`trials` runs both kinds' trials of a campaign, shuffled across the
stores and run ``cfg.jobs`` at a time; each trial is judged from the workload's ack
log by recovering its run (:meth:`crashtests.trialkit.TrialKit.check`); a large
trial's store is then handed to :mod:`crashtests.trialstores`. A trial not started
before the time limit is skipped. :func:`resume` runs a crashed run to the
end and compares it with the uninterrupted reference run (also used for ``pgkill``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from .checker import Trial
from .trialkit import PREFIX, TrialKit, log


def trials(c: TrialKit) -> None:
    from agck.failpoints import POINTS
    cfg = c.cfg
    jobs = []
    nputs = max(1, cfg.steps // cfg.every)
    for store in cfg.stores:
        if "kill" in cfg.faults:
            for _ in range(cfg.n(store, "kill")):
                t = c.new_trial(store, "kill", "k", c.trial_url(store))
                jobs.append((t, None, c.rng.choice(("sync", "async"))))
        if "failpoint" in cfg.faults:
            points = [p for p in POINTS if p.startswith(PREFIX[store] + ("snapshot.",))]
            for j in range(cfg.n(store, "failpoint")):
                point = points[j % len(points)]
                action = "raise" if j % 10 == 9 else "kill"   # now and then an EIO instead
                spec = f"{point}={action}@{c.rng.randint(1, nputs)}"
                mode = "async" if point == "snapshot.after_stage" else c.rng.choice(("sync", "async"))
                t = c.new_trial(store, "failpoint", "f", c.trial_url(store))
                jobs.append((t, spec, mode))
    if not jobs:
        return
    c.rng.shuffle(jobs)   # interleave stores so that parallel trials contend like real ones
    log(cfg, f"kill/failpoint trials: {len(jobs)} workload processes, {cfg.jobs} at a time")
    c.pool(lambda j: trial(c, *j), jobs)
    if "kill" not in cfg.faults or not cfg.min_kills:
        return
    for _ in range(3):       # random kills that came after the run ended are topped up, boundedly
        if not c.time_left():
            return           # a top-up is not a planned trial: none is made, none is skipped
        extra = []
        for store in cfg.stores:
            got = sum(1 for t in c.trials if t.store == store and t.fault in ("kill", "failpoint")
                      and t.reached and (t.fault == "kill" or t.point.split("=")[1].startswith("kill")))
            for _ in range(min(cfg.min_kills - got, 20)):
                t = c.new_trial(store, "kill", "k", c.trial_url(store))
                extra.append((t, None, c.rng.choice(("sync", "async"))))
        if not extra:
            return
        log(cfg, f"topping up SIGKILLs: {len(extra)} more workload processes")
        c.pool(lambda j: trial(c, *j), extra)


def trial(c: TrialKit, t: Trial, spec: str | None, mode: str) -> None:
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    p = c.spawn(c.workload_cmd(c.client_url(t), t.run, d, mode), d, spec)
    t0 = None
    try:
        if spec is None:
            t0 = c.wait_started(p, d)
            try:
                p.wait(timeout=c.kill_delay(t.store))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    took = time.monotonic() - t0 if t0 is not None else None
    rc = p.returncode
    if rc == -signal.SIGKILL:
        t.reached = True
        if spec is not None:
            t.in_flight = True       # every fail point lies between the start of a put and its ack
            t.point = spec
    elif spec is not None and rc != 0:
        t.reached = True             # an injected EIO: the workload failed the way a bad disk fails it
        t.in_flight = True
        t.point = spec
        t.detail = c.stderr(d).strip().splitlines()[-1][:300] if c.stderr(d).strip() else ""
    elif rc != 0:
        t.detail = f"workload exited {rc}: {c.stderr(d)[-300:]}"
        t.reasons.append(f"workload failed on its own (exit {rc})")
        t.recovered = "raised"
    else:
        if took is not None:
            with c.lock:
                c.est[t.store] = max(c.est[t.store], took * 1.05)
        t.detail = "finished before the fault"
    c.check(t, d)
    c.own.done(t)


def resume(c: TrialKit, t: Trial) -> None:
    """Run ``t``'s crashed run to the end in a new workload; it must resume from the step
    recovery chose and end bit-identical to the reference run."""
    d = os.path.join(c.work, "t", f"{t.id}-resume")
    os.makedirs(d)
    p = c.spawn(c.workload_cmd(c.client_url(t), t.run, d), d)
    try:
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    if p.returncode != 0:
        t.resume = {"ok": False, "error": True, "why": f"exit {p.returncode}: {c.stderr(d)[-300:]}"}
        return
    with open(os.path.join(d, "out.json")) as f:
        out = json.load(f)
    want = t.recovered if isinstance(t.recovered, int) else 0
    ok = out["final_hash"] == c.ref["final_hash"] and out["resumed_from"] == want
    why = None if ok else (f"final hash {out['final_hash']} (uninterrupted {c.ref['final_hash']}), "
                           f"resumed from {out['resumed_from']}, recovery said {want}")
    t.resume = {"ok": ok, "from": out["resumed_from"], "why": why}
