"""Fault kind ``s3kill``: the private SeaweedFS server killed while a workload writes to it.

A trial runs a workload against the campaign's object store and, at a random
instant of its run (or after it, if it ended first), SIGKILLs the server's
whole process group (master, volume, filer and S3 gateway: what a crashed
node looks like), waits
a moment and starts it again on the same data. The workload's requests fail
or are retried by its client meanwhile; it either carries on once the server
is back or fails, as a client whose store vanished does.

Contract: :func:`trials` runs ``cfg.n("s3", "s3kill")`` trials one after another
(they share the one server), only when the server runs; a trial not started
before the time limit is skipped. Each is judged as a ``kill`` trial is
(:meth:`crashtests.trialkit.TrialKit.check`: every acknowledged checkpoint
recovers, bit-identical), and every earlier trial on the object store must
still recover to the step it recovered to before this server kill.
"""

from __future__ import annotations

import os
import subprocess
import time

from .checker import Trial
from .trialkit import TrialKit


def trials(c: TrialKit) -> None:
    if "s3kill" not in c.cfg.faults or c.s3 is None:
        return

    def revive():
        if c.s3.proc is None:
            c.s3.start()
    c.server_kill_trials("s3", "s3kill", "o", "object store server", trial, revive)


def trial(c: TrialKit, t: Trial, i: int) -> None:
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    p = c.spawn(c.workload_cmd(t.url, t.run, d, c.rng.choice(("sync", "async"))), d)
    killed_at = None
    try:
        c.wait_started(p, d)
        try:
            p.wait(timeout=c.kill_delay("s3"))
        except subprocess.TimeoutExpired:
            killed_at = "random"
        if killed_at is None or p.poll() is not None:
            killed_at = "idle"     # the run ended first: crash the server with everything written
            t.detail = "the workload finished before the server kill"
        c.s3.kill()
        c.s3_kills += 1
        t.reached = True
        t.point = f"sigkill@{killed_at}"
        time.sleep(c.rng.uniform(0.1, 2.0))      # down for a while: requests fail and are retried
        c.s3.start()
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.returncode not in (0, None):
            t.detail = (f"workload exited {p.returncode} after the server kill: "
                        f"{c.stderr(d).strip().splitlines()[-1][:200] if c.stderr(d).strip() else ''}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if c.s3.proc is None:
            c.s3.start()
    c.check(t, d)
    # an older run's recovery must not change because the server crashed later
    c.recheck_older(t, ("kill", "failpoint", "s3kill", "stale"))
    c.own.done(t)
