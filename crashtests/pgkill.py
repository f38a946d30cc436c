"""Fault kind ``pgkill``: the private Postgres server killed while a workload commits.

The campaign's cluster holds every COMMIT of its ``crash`` database between the WAL
insert and the flush (``commit_delay``). A trial runs a workload against it and
kills the server, by SIGKILL to its processes or ``pg_ctl stop -m immediate``
(alternately), either while the workload's backend is inside its N-th COMMIT or
at a random instant of the run (every third trial); then restarts it (WAL
recovery).

Contract: :func:`trials` runs ``cfg.n("postgres", "pgkill")`` trials one after
another (they share the one server), only when the cluster runs; a trial not
started before the time limit is skipped. Each is judged as a ``kill`` trial is
(:meth:`crashtests.campaign.Campaign._check`), and every earlier kill, failpoint
and pgkill run on Postgres must still recover to the step it recovered to before
this server kill (else that earlier trial is corrupt).
"""

from __future__ import annotations

import os
import subprocess
import time

from .campaign import Campaign
from .checker import Trial


def trials(c: Campaign) -> None:
    if "pgkill" not in c.cfg.faults or c.cluster is None:
        return
    c.server_kill_trials("postgres", "pgkill", "p", "Postgres server", trial, c.revive_cluster)


def trial(c: Campaign, t: Trial, i: int) -> None:
    import psycopg2
    cfg = c.cfg
    cluster = c.cluster
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    how = "immediate" if i % 2 else "sigkill"
    when = "random" if i % 3 == 2 else "commit"
    nputs = max(1, cfg.steps // cfg.every)
    target = c.rng.randint(1, nputs)
    p = c._spawn(c._workload_cmd(c._client_url(t), t.run, d, c.rng.choice(("sync", "async"))), d)
    killed_at = None
    try:
        if when == "commit":
            # watch for our workload's backend executing COMMIT (held there by commit_delay): its
            # commit record is in the WAL buffers, not yet flushed, and the client is not answered
            mon = psycopg2.connect(cluster.dsn("postgres"))
            mon.autocommit = True
            cur = mon.cursor()
            seen = set()
            deadline = time.monotonic() + 120
            try:
                while p.poll() is None and time.monotonic() < deadline:
                    cur.execute("SELECT pid, xact_start FROM pg_stat_activity WHERE datname = 'crash' "
                                "AND state = 'active' AND query = 'COMMIT'")
                    seen.update(cur.fetchall())
                    if len(seen) >= target:
                        time.sleep(c.rng.uniform(0, 0.05))
                        killed_at = f"commit#{len(seen)}"
                        break
                    time.sleep(0.003)
            finally:
                mon.close()
        else:
            c._wait_started(p, d)
            try:
                p.wait(timeout=c._kill_delay("postgres"))
            except subprocess.TimeoutExpired:
                killed_at = "random"
        if killed_at is None and when == "random":
            killed_at = "idle"     # the run ended first: crash the server with everything committed
        if killed_at is not None and (p.poll() is None or killed_at == "idle"):
            cluster.kill(how)
            t.reached = True
            t.in_flight = when == "commit"
            t.point = f"{how}@{killed_at}"
        else:
            t.detail = "the workload finished before the server kill"
        try:
            p.wait(timeout=60)   # the client sees its connection drop and fails
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if cluster.proc is None or cluster.proc.poll() is not None:
            restart = cluster.restart()
            t.detail = (t.detail + f" restart {restart:.1f}s").strip()
    c._check(t, d)
    # an older run's recovery must not change because the server crashed later
    c.recheck_older(t, ("kill", "failpoint", "pgkill"))
