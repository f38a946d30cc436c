"""Fault kind ``pgload``: many threads and processes on one Postgres store, the server
killed under them and their connections dropped.

A trial starts :data:`PROCS` workload processes (:mod:`crashtests.loadworker`), each
running :data:`THREADS` conversations on one store object whose pool has fewer
connections than it has threads (the first process's as asyncio tasks on one event
loop, through the store's async methods), against the campaign's private cluster (every
COMMIT held there by ``commit_delay``, so many are in flight at once). While they
run, the harness drops every one of their connections (``pg_terminate_backend``)
one to three times, then kills the server (SIGKILL to its processes or ``pg_ctl
stop -m immediate``, alternately) and restarts it after a pause. The workers try
each failed put again until it commits (one that finds its step there must find
the very state it put) and acknowledge a step only then.

Judged on a clean connection after the workers end: every conversation's history
is whole (steps 0..STEPS-1, nothing missing, nothing else), every acknowledged
step is there (else **lost**), and every step reads back verified and equal to the
state its worker put (else **corrupt**); ``agck recover`` (the campaign's CLI
cross-check) must recover every conversation to its last step. A worker that exits
non-zero is an error (with its stderr). Trials run one after another: they share
the one server.
"""

from __future__ import annotations

import os
import sys
import time

from .checker import Trial
from .trialkit import TrialKit

PROCS = 3         # workload processes per trial
THREADS = 6       # conversations (threads) per process
POOL = 3          # connections per process: threads share them
STEPS = 10        # checkpoints per conversation


def trials(c: TrialKit) -> None:
    if "pgload" not in c.cfg.faults or c.cluster is None:
        return
    c.server_kill_trials("postgres", "pgload", "L", "concurrent load", trial, c.revive_cluster)


def _drop_connections(c: TrialKit) -> int:
    """End every workload backend of the crash database; how many there were."""
    import psycopg2
    conn = psycopg2.connect(c.cluster.dsn("postgres"))
    conn.autocommit = True
    try:
        cur = conn.cursor()
        cur.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = 'crash' "
                    "AND application_name = 'agck' AND pid <> pg_backend_pid()")
        return cur.fetchone()[0]
    finally:
        conn.close()


def trial(c: TrialKit, t: Trial, i: int) -> None:
    d = os.path.join(c.work, "t", str(t.id))
    os.makedirs(d)
    acks = os.path.join(d, "acks")
    procs = []
    for k in range(PROCS):       # a directory each, for its stderr
        os.makedirs(os.path.join(d, str(k)))
        mode = "asyncio" if k == 0 else "threads"     # one process's conversations on an event loop
        procs.append(c.spawn([sys.executable, "-m", "crashtests.loadworker", t.url, t.run, str(k), str(THREADS),
                               str(STEPS), str(POOL), acks, mode], os.path.join(d, str(k))))
    how = "immediate" if i % 2 else "sigkill"
    drops = dropped = 0
    killed = False
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (os.path.exists(acks) and os.path.getsize(acks) > 0) \
                and all(p.poll() is None for p in procs):
            time.sleep(0.01)
        for _ in range(c.rng.randint(1, 3)):
            time.sleep(c.rng.uniform(0.05, 0.6))
            if all(p.poll() is not None for p in procs):
                break
            dropped += _drop_connections(c)
            drops += 1
        time.sleep(c.rng.uniform(0.0, 0.8))
        if any(p.poll() is None for p in procs):
            c.cluster.kill(how)
            killed = True
            time.sleep(c.rng.uniform(0.1, 1.5))    # the workers find no server for a while
            restart = c.cluster.restart()
            t.detail = f"restart {restart:.1f}s"
        for p in procs:
            if c.finish(p, 300):
                t.reasons.append("a workload process hung")
                t.hung = True
    finally:
        for p in procs:
            c.finish(p, 0)
        c.revive_cluster()
    t.reached = killed or dropped > 0
    t.point = f"{drops} drops ({dropped} connections)" + (f", server {how}" if killed else "")
    for k, p in enumerate(procs):
        if p.returncode != 0:
            err = c.stderr(os.path.join(d, str(k))).strip()[-400:]
            t.reasons.append(f"workload process {k} exited {p.returncode}: {err}")
            t.recovered = "raised"
    check(c, t, acks)
    # an older run's recovery must not change because the server crashed later
    c.recheck_older(t, ("kill", "failpoint", "pgkill"))


def check(c: TrialKit, t: Trial, acks: str) -> None:
    """Every history whole, every acknowledged step there and equal to what was put."""
    from crashtests.loadworker import same, state_for
    acked: dict[str, set[int]] = {}
    if os.path.exists(acks):
        with open(acks) as f:
            for line in f:
                run, _, step = line.strip().rpartition(" ")
                acked.setdefault(run, set()).add(int(step))
    runs = [f"{t.run}-p{k}-t{j}" for k in range(PROCS) for j in range(THREADS)]
    lost = corrupt = 0
    store = c.open(t.url)
    try:
        stored_runs = {r for r in store.runs() if r.startswith(f"{t.run}-")}
        strays = stored_runs - set(runs)
        if strays:
            corrupt += len(strays)
            t.reasons.append(f"runs nobody wrote: {sorted(strays)[:3]}")
        for run in runs:
            steps = store.steps(run)
            missing = sorted(acked.get(run, set()) - set(steps))
            if missing:
                lost += len(missing)
                t.reasons.append(f"{run}: acknowledged steps {missing[:5]} missing")
            if t.recovered != "raised" and steps != list(range(STEPS)):
                extra = sorted(set(steps) - set(range(STEPS)))
                gaps = sorted(set(range(STEPS)) - set(steps) - set(missing))
                if extra:
                    corrupt += 1
                    t.reasons.append(f"{run}: steps nobody put {extra[:5]}")
                if gaps:
                    lost += len(gaps)
                    t.reasons.append(f"{run}: history has gaps {gaps[:5]}")
            for s in steps:
                try:
                    back = store.read(run, s).state
                except Exception as e:
                    corrupt += 1
                    t.reasons.append(f"{run} step {s}: {type(e).__name__}: {e}")
                    continue
                if s < STEPS and not same(back, state_for(run, s)):
                    corrupt += 1
                    t.reasons.append(f"{run} step {s}: read back a state nobody put")
    finally:
        store.close()
    t.acked = sorted(s for v in acked.values() for s in v)
    t.load = {"runs": runs, "last": STEPS - 1, "acknowledged": sum(len(v) for v in acked.values()), "lost": lost,
              "corrupt": corrupt}
    if t.recovered != "raised":
        t.recovered = sum(len(v) for v in acked.values())
