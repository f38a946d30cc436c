"""The crash campaign's core: configure, run each fault kind's trials, judge, report.

Fault kinds, one module each (each trial gets its own run name, so trials never
disturb each other):

* ``kill``       (:mod:`crashtests.kill`) the workload subprocess SIGKILLed at a random
                 instant of its run;
* ``failpoint``  (:mod:`crashtests.kill`) the workload kills itself (or gets EIO) at a
                 named fail point of the store's write path, on its N-th hit;
* ``pgkill``     (:mod:`crashtests.pgkill`) the private Postgres server killed while a
                 workload commits, restarted;
* ``pgload``     (:mod:`crashtests.pgload`) many threads and processes on one Postgres
                 store, their connections dropped and the server killed under them;
* ``s3kill``     (:mod:`crashtests.s3kill`) the private SeaweedFS server killed while a
                 workload writes to it, restarted;
* ``netcut``     (:mod:`crashtests.netcut`) the connections to the object store reset
                 mid-request by a proxy, client and server left up;
* ``powerloss``  (:mod:`crashtests.powerloss`) file store on SimFS, power cut at operation N;
* ``corrupt``    (:mod:`crashtests.corrupt`) a stored checkpoint damaged; recovery must
                 reject it and walk back to the newest intact one;
* ``stale``      (:mod:`crashtests.stale`) the workload stopped while a second one takes
                 the run over: it must commit nothing after the takeover (fencing);
* ``dist``       (:mod:`crashtests.dist`) the workload as a job of ``ranks`` processes:
                 ranks killed, failed at fail points, or the whole job stopped and taken over;
* ``distpower``  (:mod:`crashtests.powerloss`) multi-rank checkpoints written on SimFS,
                 power cut: a step is recovered with every part or not at all;
* ``chunkrot``   (:mod:`crashtests.chunkrot`) stored chunks of a frozen base damaged
                 between checkpoints, then detected;
* ``journal``    (:mod:`crashtests.journalfault`) step journals SIGKILLed, killed at fail
                 points, under a Postgres server kill, or power-cut (SimFS, and the preload
                 shim under the file and SQLite stores), then resumed;
* ``failover``   (:mod:`crashtests.pgfailover`) the Postgres primary SIGKILLed during puts,
                 its synchronous standby promoted, the store carrying on or the pipeline resumed;
* ``dbpower``    (:mod:`crashtests.dbpower`) the power cut under SQLite and a Postgres server
                 (unsynced writes dropped or torn by an LD_PRELOAD shim), then reopened;
* ``applog``     (:mod:`crashtests.applogfault`) a snapshotted pipeline holding an AppendLog
                 SIGKILLed, or killed between a segment and its checkpoint, then resumed;
* ``journalrot`` (:mod:`crashtests.journalrot`) one bit of an acknowledged journal record
                 flipped where it is stored; every reader must report it, the resume run
                 that step alone again.

Profiles. ``cfg.profile`` sizes the workload's state: ``small`` (about 355 KiB) or
``large`` (about 190 MiB more: :data:`crashtests.workload.LARGE`), passed to every
workload subprocess and used for the in-process trees; with ``large`` every trial of
``kill``, ``failpoint``, ``pgkill``, ``s3kill``, ``netcut`` and ``chunkrot`` writes to
a store of its own (:mod:`crashtests.trialstores`), and ``dbpower`` writes a 128 MiB
base, on Postgres into tables of its own. :func:`run_campaigns` runs
campaigns of several profiles one after another and reports them as one, each
trial's row naming its profile.

Contract. :class:`Campaign` is a :class:`crashtests.trialkit.TrialKit` (what the fault
kinds share: the servers, the workload subprocess, the reference run, the checks)
that runs them all. Each fault module has ``trials(c)``, which runs that kind's
trials of campaign ``c`` (a no-op when the kind is not configured); the fault
modules import :mod:`crashtests.trialkit`, and this module alone imports them.
:meth:`Campaign.run` calls them in a fixed order, then the CLI cross-check and the
resumes, classifies every trial (:func:`crashtests.checker.classify`) and returns
:func:`crashtests.report.report`; the report functions are importable from here too.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from . import (applogfault, checker, chunkrot, corrupt, dbpower, dist, journalfault, journalrot, kill, netcut,
               pgfailover, pgkill, pgload, powerloss, s3kill, stale)
from .report import exit_code, markdown, report, write_report
from .trialkit import FAULTS, PG_STORES, PREFIX, PROFILES, STORES, Config, TrialKit, log

__all__ = ["STORES", "FAULTS", "PREFIX", "PG_STORES", "PROFILES", "Config", "Campaign", "run_campaigns", "report",
           "markdown", "write_report", "exit_code"]


class Campaign(TrialKit):
    """Every configured fault kind's trials, in a fixed order, then the CLI cross-check,
    the resumes and the classification (:meth:`execute`); :meth:`run` reports them."""

    # -- resumes --------------------------------------------------------------------------------
    def resumes(self) -> None:
        cfg = self.cfg
        picks, done = [], set()
        for t in self.trials:
            key = (t.store, t.fault)
            if t.reached and t.recovered != "raised" and key not in done and not self.own.gone(t.url) \
                    and sum(1 for p in picks if (p.store, p.fault) == key) < cfg.resume_samples:
                picks.append(t)
                if sum(1 for p in picks if (p.store, p.fault) == key) >= cfg.resume_samples:
                    done.add(key)
        sub = [p for p in picks if p.fault in ("kill", "failpoint", "pgkill")]
        multi = [p for p in picks if p.fault == "dist"]
        if multi:
            log(cfg, f"resuming {len(multi)} crashed multi-rank runs to the end")
            self.pool(lambda item: dist.resume(self, item[0]), [(p,) for p in multi],
                       workers=max(1, cfg.jobs // cfg.ranks), trials=False)
        inproc = [p for p in picks if p.fault in ("powerloss", "corrupt")]   # (distpower: checked, not resumed)
        if sub:
            log(cfg, f"resuming {len(sub)} crashed runs to the end")
            self.pool(lambda item: kill.resume(self, item[0]), [(p,) for p in sub], trials=False)
        for p in inproc:
            if not self.time_left():
                break
            store = self.open(p.url)
            try:
                p.resume = self.resume_inprocess(store, p.run)
                want = p.recovered or 0
                if p.resume["ok"] and p.resume["from"] != want:
                    p.resume.update(ok=False, why=f"resumed from {p.resume['from']}, recovery said {want}")
            except Exception as e:
                p.resume = {"ok": False, "error": True, "why": f"{type(e).__name__}: {e}"}
            finally:
                store.close()

    # -- the whole campaign --------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.monotonic()
        self.execute()
        return report(self, time.monotonic() - t0)

    def timed(self, what: str, fn, *args) -> None:
        """``fn(*args)``, its wall time added to ``self.seconds[what]`` (where a CI budget goes)."""
        t0 = time.monotonic()
        try:
            fn(*args)
        finally:
            took = time.monotonic() - t0
            if took >= 0.05:
                self.seconds[what] = self.seconds.get(what, 0.0) + took

    def execute(self) -> None:
        """Every configured trial run, checked and classified."""
        cfg = self.cfg
        self.seconds: dict[str, float] = {}
        try:
            self.timed("setup", self.setup)
            if set(cfg.faults) & {"kill", "failpoint", "pgkill", "s3kill", "stale", "netcut"} and self.time_left():
                self.timed("reference", self.reference)
            for kind in (kill, netcut, stale, dist, pgkill, pgload, pgfailover, s3kill, powerloss, dbpower,
                         corrupt, chunkrot, journalfault, applogfault, journalrot):
                self.timed(kind.__name__.rpartition(".")[2], kind.trials, self)
            self.timed("cli checks", self.cli_checks)
            self.timed("resumes", self.resumes)
            if self.own.summary():
                self.notes.append(self.own.summary())
        finally:
            self.timed("cleanup", self.cleanup)
        for t in self.trials:
            checker.classify(t)
            if t.fault == "kill" and t.reached:
                t.point = f"after-ack-{t.last_ack}" + ("+in-flight" if t.in_flight else "")


def run_campaigns(cfgs: list) -> dict:
    """The campaigns of ``cfgs`` one after another (each with its own servers; trial ids go
    on from one to the next), reported as one: the first's configuration, every trial, the
    notes and server kills of all. Each trial's row names its profile."""
    t0 = time.monotonic()
    done: list[Campaign] = []
    for cfg in cfgs:
        c = Campaign(cfg, first_id=done[-1].last_id if done else 0)
        c.execute()
        done.append(c)
    if len(done) == 1:
        return report(done[0], time.monotonic() - t0)
    notes = [n for c in done for n in c.notes]
    for c in done[1:]:
        counts = ", ".join(f"{k}: {v}" for k, v in c.cfg.counts.items()) or f"{c.cfg.trials} per store and fault"
        notes.append(f"a campaign of the {c.cfg.profile} profile followed ({', '.join(c.cfg.faults)}; {counts}"
                     + (f"; every store with compress={c.cfg.compress!r}" if c.cfg.compress else "")
                     + ("; every store encrypted" if c.cfg.encrypt else "") + ")")
    both = SimpleNamespace(cfg=cfgs[0], trials=[t for c in done for t in c.trials], notes=notes,
                           pg_kills=sum(getattr(c, "pg_kills", 0) or 0 for c in done) if any(
                               getattr(c, "pg_kills", None) is not None for c in done) else None,
                           s3_kills=sum(c.s3_kills for c in done),
                           seconds={f"{c.cfg.profile}: {k}": v for c in done for k, v in c.seconds.items()})
    return report(both, time.monotonic() - t0)
