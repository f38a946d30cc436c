"""Fault kind ``failover``: the Postgres primary SIGKILLed during puts, its standby promoted.

A private primary and a synchronous standby (:class:`crashtests.pgreplica.PgPair`)
serve one store object, opened once with the pair's multi-host URL (``host=A,B``,
``target_session_attrs=read-write``) and kept across every trial: after each
failover it must carry on against the new primary with nothing but its own
reconnects. A trial puts the pipeline's checkpoints (the campaign's in-process
trees) in a writer thread while the harness kills the primary during the N-th put,
at one of three instants in turn:

* ``during``   a random instant of that put;
* ``syncrep``  while its COMMIT waits for the standby's flush (``wait_event``
               ``SyncRep``), the primary's commit record on its own disk, not yet
               on the standby's; when the wait is missed, right after the ack;
* ``ack``      right after the put was acknowledged.

then promotes the standby and rebuilds the dead node as the new standby. Half the
trials carry on: the writer waits for the failover, settles the put that failed
and puts the rest. A put that raised "may or may not have been written" must be
found whole (verified, the state it put) or not at all; one that raised any other
error must have left nothing. The other half stop at the failure and resume the
pipeline (``checkpoint_every``) against the new primary from what recovery finds,
to the end, bit-exact with the uninterrupted run.

Judged (:func:`crashtests.checker.classify`): every acknowledged step is there and
verifies with the state it was put with (else **lost**); recovery returns at
least the last acknowledged step; nothing that reported failure committed, and no
step reads back other than it was put (else **corrupt**).

Contract: :func:`trials` runs ``cfg.n("postgres", "failover")`` trials one after
another (they share the pair), when a private cluster can be started here. The
pair lives until the campaign's cleanup, so the CLI cross-check recovers each
run through the multi-host URL. ``python -m crashtests.pgfailover --asynchronous``
runs the same trials on an asynchronous standby and reports how many acknowledged
checkpoints each failover lost (what ``synchronous_standby_names=''`` costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from . import pgcluster
from .checker import Trial
from .pgreplica import PgPair
from .trialkit import Config, TrialKit, log

WHEN = ("during", "syncrep", "ack")
SETTLE_TIMEOUT = 120.0


def trials(c: TrialKit) -> None:
    cfg = c.cfg
    if "failover" not in cfg.faults or "postgres" not in cfg.stores:
        return
    n = cfg.n("postgres", "failover")
    if not c.time_left():
        c.skip_rest("postgres", "failover", n)
        return
    reason = pgcluster.available()
    if reason:
        c.notes.append(f"failover skipped: {reason}")
        return
    log(cfg, f"Postgres failovers (synchronous standby): {n}")
    run_trials(c, n, synchronous=True)


def run_trials(c: TrialKit, n: int, *, synchronous: bool) -> list[Trial]:
    """``n`` failover trials on a new pair, kept on the campaign (``c.pair``) for the checks after."""
    from agck.stores.postgres.store import PostgresStore
    c.pair = pair = PgPair(synchronous=synchronous).start(databases=("crash",))
    url = pair.dsn("crash")
    store = PostgresStore(url, init=True)
    trees = c.trees()
    done = []
    try:
        for i in range(n):
            t = c.new_trial("postgres", "failover", "fo", url)
            if not c.time_left():
                c.skip(t)
                continue
            try:
                trial(c, pair, store, t, i, trees)
            except Exception as e:
                t.reasons.append(f"harness error: {type(e).__name__}: {e}")
                t.recovered = "raised"
                pair.revive()
            done.append(t)
    finally:
        store.close()
    return done


class _Writer(threading.Thread):
    """Puts ``trees`` in step order on ``store``; on a failure waits for the failover, settles
    what the failed put left, and (``carry_on``) puts it again, else stops."""

    def __init__(self, store, run: str, trees: dict, carry_on: bool, failed_over: threading.Event):
        super().__init__(daemon=True)
        self.store, self.run_name, self.trees, self.carry_on = store, run, trees, carry_on
        self.steps = sorted(trees)
        self.failed_over = failed_over
        self.started = [threading.Event() for _ in self.steps]
        self.acked_ev = [threading.Event() for _ in self.steps]
        self.acked: list[int] = []
        self.put_seconds: list[float] = []
        self.failures: list[tuple[int, str, bool]] = []   # (step, error, ambiguous)
        self.findings: list[str] = []
        self.stopped_at: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:     # reported by the trial, never lost with the thread
            self.error = e
        finally:
            for ev in self.started + self.acked_ev:
                ev.set()        # nobody waits for a put that will not come

    def _run(self) -> None:
        from agck.errors import AgckError
        parent = None
        for j, step in enumerate(self.steps):
            self.started[j].set()
            while True:
                t0 = time.perf_counter()
                try:
                    self.store.put(self.run_name, step, self.trees[step], meta={"snapshot": True}, parent=parent)
                except AgckError as e:
                    ambiguous = "may or may not" in str(e)
                    self.failures.append((step, f"{type(e).__name__}: {e}", ambiguous))
                    if not self.failed_over.wait(SETTLE_TIMEOUT):
                        raise RuntimeError(f"step {step}'s put failed and no failover came: {e}") from None
                    if self._settle(step, ambiguous):
                        break          # it committed after all: a whole checkpoint, as put
                    if not self.carry_on:
                        self.stopped_at = step
                        return
                    continue
                self.put_seconds.append(time.perf_counter() - t0)
                self.acked.append(step)
                self.acked_ev[j].set()
                break
            parent = step

    def _settle(self, step: int, ambiguous: bool) -> bool:
        """Whether the failed put of ``step`` committed: found whole, or not at all (never half)."""
        from crashtests.workload import state_hash
        steps = _retry(lambda: self.store.steps(self.run_name))
        if step not in steps:
            return False
        if not ambiguous:
            self.findings.append(f"step {step}'s put raised an error that says it was not written, "
                                 f"yet it is there")
        try:
            got = _retry(lambda: self.store.read(self.run_name, step, verify=True, map_location="cpu"))
        except Exception as e:
            self.findings.append(f"step {step}, found after an ambiguous put, does not read back: {e}")
            return True
        if state_hash(got.state) != state_hash(self.trees[step]):
            self.findings.append(f"step {step}, found after an ambiguous put, holds another state")
        return True


def _retry(fn, timeout: float = SETTLE_TIMEOUT):
    """``fn()`` until it stops raising a connection error (the new standby may still be joining)."""
    from agck.errors import StoreConnectionError
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except StoreConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def trial(c: TrialKit, pair: PgPair, store, t: Trial, i: int, trees: dict) -> None:
    import psycopg2

    from . import checker
    from crashtests.workload import state_hash
    when = WHEN[i % len(WHEN)]
    if when == "syncrep" and not pair.synchronous:
        when = "ack"
    carry_on = i % 2 == 0
    failed_over = threading.Event()
    w = _Writer(store, t.run, trees, carry_on, failed_over)
    target = c.rng.randrange(len(w.steps))
    w.start()
    w.started[target].wait(SETTLE_TIMEOUT)
    point = when
    if when == "during":
        typical = statistics.median(w.put_seconds) if w.put_seconds else 0.01
        time.sleep(c.rng.uniform(0, 1.5 * typical))
    elif when == "syncrep":
        mon = psycopg2.connect(pair.leader.dsn("postgres"))
        mon.autocommit = True
        try:
            cur = mon.cursor()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not w.acked_ev[target].is_set():
                cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = 'crash' "
                            "AND wait_event = 'SyncRep'")
                if cur.fetchone()[0]:
                    break
            else:
                point = "syncrep-missed"
        finally:
            mon.close()
    else:
        w.acked_ev[target].wait(SETTLE_TIMEOUT)
    in_flight = not w.acked_ev[target].is_set()
    phases = pair.failover()
    failed_over.set()
    w.join(SETTLE_TIMEOUT * 2)
    if w.is_alive():
        raise RuntimeError("the writer did not finish after the failover")
    if w.error is not None:
        raise w.error
    t.reached = True
    t.in_flight = in_flight
    t.point = f"{point}@put{target + 1}" + ("" if carry_on else "/resume")
    t.acked = list(w.acked)
    amb = [f for f in w.failures if f[2]]
    t.detail = (f"promote {phases['promote']:.2f}s rebuild {phases['rebuild']:.1f}s; {len(w.failures)} failed puts"
                + (f" ({len(amb)} ambiguous)" if amb else ""))
    for f in w.findings:
        t.hash_ok = False
        t.reasons.append(f)
    # every acknowledged checkpoint, on the new primary, whole and as it was put
    for step in t.acked:
        try:
            got = store.read(t.run, step, verify=True, map_location="cpu")
        except Exception as e:
            t.unreadable.append(step)
            t.reasons.append(f"acknowledged step {step} lost in the failover: {type(e).__name__}: {e}")
            continue
        if state_hash(got.state) != state_hash(trees[step]):
            t.hash_ok = False
            t.reasons.append(f"acknowledged step {step} holds another state after the failover")
    checker.check_library(store, t, c.full)
    if not carry_on and isinstance(t.recovered, int):
        want = t.recovered
        try:
            t.resume = c.resume_inprocess(store, t.run)
            if t.resume["ok"] and t.resume["from"] != want:
                t.resume.update(ok=False, why=f"resumed from {t.resume['from']}, recovery said {want}")
        except Exception as e:
            t.resume = {"ok": False, "error": True, "why": f"{type(e).__name__}: {e}"}


def lost_acks(t: Trial) -> int:
    """Acknowledged checkpoints a trial's failover lost."""
    return len(t.unreadable)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Postgres failover trials on their own, synchronous or not: "
                                            "how many acknowledged checkpoints each failover lost")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--asynchronous", action="store_true", help="an asynchronous standby")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the per-trial outcomes here")
    a = p.parse_args(argv)
    from .checker import classify
    c = TrialKit(Config(stores=("postgres",), faults=("failover",), seed=a.seed, quiet=True))
    t0 = time.monotonic()
    try:
        ts = run_trials(c, a.trials, synchronous=not a.asynchronous)
    finally:
        c.cleanup()
    for t in ts:
        classify(t)
    lost = [lost_acks(t) for t in ts]
    acked = sum(len(t.acked) for t in ts)
    by_when: dict[str, list[int]] = {}
    for t, n in zip(ts, lost):
        by_when.setdefault(t.point.split("@")[0], []).append(n)
    out = {"standby": "asynchronous" if a.asynchronous else "synchronous", "failovers": len(ts),
           "acknowledged": acked, "lost_acknowledged": sum(lost), "failovers_that_lost": sum(1 for n in lost if n),
           "most_lost_in_one": max(lost, default=0),
           "by_instant": {k: {"failovers": len(v), "lost": sum(v), "failovers_that_lost": sum(1 for n in v if n)}
                          for k, v in sorted(by_when.items())},
           "outcomes": {o: sum(t.outcome == o for t in ts) for o in ("ok", "indeterminate", "lost", "corrupt",
                                                                      "error")},
           "resumes_ok": f"{sum(bool(t.resume and t.resume.get('ok')) for t in ts)}/"
                         f"{sum(t.resume is not None for t in ts)}",
           "seconds": round(time.monotonic() - t0, 1)}
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": out, "trials": [t.as_dict() for t in ts]}, f, indent=1)
    bad = [t for t in ts if t.outcome in ("corrupt", "error") or (t.outcome == "lost" and not a.asynchronous)]
    for t in bad:
        print(f"trial {t.id} {t.point}: {t.outcome}: {'; '.join(t.reasons)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
