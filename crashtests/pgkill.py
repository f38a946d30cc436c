"""Fault kind ``pgkill``: the private Postgres server killed while a workload commits or COPYs.

The campaign's cluster holds every COMMIT of its ``crash`` database between the WAL
insert and the flush (``commit_delay``). A trial runs a workload against it and
kills the server, by SIGKILL to its processes or ``pg_ctl stop -m immediate``
(alternately), at one of these instants; then restarts it (WAL recovery):

* ``commit``  the workload's backend is inside its N-th COMMIT;
* ``random``  a random instant of the run (every third trial; with the large profile
              every fourth);
* ``copy``    with the large profile, every other trial: the workload's backend is
              streaming its first put's chunks into the server (``COPY ... FROM STDIN``),
              and has sent a random share of the state's 190 MiB so far
              (``pg_stat_progress_copy``). The trial's point says how far it had got.

Contract: :func:`trials` runs ``cfg.n("postgres", "pgkill")`` trials one after
another (they share the one server), only when the cluster runs; a trial not
started before the time limit is skipped. Each is judged as a ``kill`` trial is
(:meth:`crashtests.trialkit.TrialKit.check`), and every earlier kill, failpoint
and pgkill run on Postgres must still recover to the step it recovered to before
this server kill (else that earlier trial is corrupt). A note says how many kills
landed mid-COPY.
"""

from __future__ import annotations

import os
import subprocess
import time

from .checker import Trial
from .trialkit import TrialKit


def trials(c: TrialKit) -> None:
    if "pgkill" not in c.cfg.faults or c.cluster is None:
        return
    c.server_kill_trials("postgres", "pgkill", "p", "Postgres server", trial, c.revive_cluster)
    if c.cfg.profile == "large":
        copies = [t for t in c.trials if t.fault == "pgkill" and "@copy:" in t.point]
        c.notes.append(f"pgkill: {len(copies)} of {sum(t.fault == 'pgkill' and t.reached for t in c.trials)} "
                       f"server kills landed mid-COPY of a put" + (
                           f" (after {min(_copied(t) for t in copies)}-{max(_copied(t) for t in copies)} MiB "
                           f"of it had been sent)" if copies else ""))


def _copied(t: Trial) -> int:
    return int(t.point.split("@copy:")[1].split("MiB")[0])


def _when(c: TrialKit, i: int) -> str:
    if c.cfg.profile == "large":
        return ("copy", "commit", "copy", "random")[i % 4]
    return "random" if i % 3 == 2 else "commit"


def trial(c: TrialKit, t: Trial, i: int) -> None:
    cfg = c.cfg
    cluster = c.cluster
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    how = "immediate" if i % 2 else "sigkill"
    when = _when(c, i)
    nputs = max(1, cfg.steps // cfg.every)
    target = c.rng.randint(1, nputs)
    p = c.spawn(c.workload_cmd(c.client_url(t), t.run, d, c.rng.choice(("sync", "async"))), d)
    killed_at = None
    try:
        if when == "commit":
            killed_at = _watch_commit(c, p, target)
        elif when == "copy":
            # a share of the first put's COPY, which carries the whole state to the trial's empty store
            from crashtests.workload import LARGE_BYTES
            killed_at = _watch_copy(c, p, t.run, int(LARGE_BYTES * c.rng.uniform(0.05, 0.9)))
        else:
            c.wait_started(p, d)
            try:
                p.wait(timeout=c.kill_delay("postgres"))
            except subprocess.TimeoutExpired:
                killed_at = "random"
        if killed_at is None and when == "random":
            killed_at = "idle"     # the run ended first: crash the server with everything committed
        if killed_at is not None and (p.poll() is None or killed_at == "idle"):
            cluster.kill(how)
            t.reached = True
            t.in_flight = when in ("commit", "copy")
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
    c.check(t, d)
    # an older run's recovery must not change because the server crashed later
    c.recheck_older(t, ("kill", "failpoint", "pgkill"))
    c.own.done(t)


def _monitor(c: TrialKit):
    import psycopg2
    mon = psycopg2.connect(c.cluster.dsn("postgres"))
    mon.autocommit = True
    return mon


def _watch_commit(c: TrialKit, p, target: int) -> str | None:
    """Until the workload's backend is inside its ``target``-th COMMIT (held there by commit_delay:
    its commit record is in the WAL buffers, not yet flushed, and the client is not answered)."""
    mon = _monitor(c)
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
                return f"commit#{len(seen)}"
            time.sleep(0.003)
    finally:
        mon.close()
    return None


def _watch_copy(c: TrialKit, p, run: str, target: int) -> str | None:
    """Until the workload's backend, in a COPY into the server, has received ``target`` bytes of it;
    the server is then killed at once, while the COPY goes on."""
    mon = _monitor(c)
    cur = mon.cursor()
    deadline = time.monotonic() + 300
    try:
        while p.poll() is None and time.monotonic() < deadline:
            cur.execute("SELECT g.bytes_processed FROM pg_stat_progress_copy g JOIN pg_stat_activity a "
                        "ON a.pid = g.pid WHERE a.application_name = %s AND g.command = 'COPY FROM'", (run,))
            row = cur.fetchone()
            if row is not None and row[0] >= target:
                return f"copy:{row[0] >> 20}MiB"
            time.sleep(0.002)
    finally:
        mon.close()
    return None
