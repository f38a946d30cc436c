"""The crash campaign engine: inject faults, recover, check, report.

Fault kinds (each trial gets its own run name, so trials never disturb each other):

* ``kill``       the workload subprocess SIGKILLed at a random instant of its run;
* ``failpoint``  the workload kills itself (or gets EIO) at a named fail point of the
                 store's write path, on its N-th hit (``AGCK_FAILPOINTS=point=kill@N``);
* ``pgkill``     the private Postgres server killed while a workload commits
                 (SIGKILL to its processes, or ``pg_ctl stop -m immediate``), restarted;
* ``powerloss``  file store on :class:`crashtests.simfs.SimFS`, power cut at operation
                 N (moved forward trial by trial), unsynced operations partly applied;
* ``corrupt``    a stored checkpoint damaged (:mod:`crashtests.corrupt`); recovery must
                 reject it and walk back to the newest intact one;
* ``stale``      the workload stopped (SIGSTOP) while a second one takes the run over and
                 finishes it, then let go: it must commit nothing after the takeover
                 (fencing), and the run must end bit-identical to the reference.
* ``dist``       the workload as a job of ``ranks`` processes under torch.distributed
                 (gloo): one rank SIGKILLed at a random instant, every rank at once, or
                 one rank at a fail point of the collective write (after its part, the
                 coordinator before or after the commit) or of the store's write path;
                 the survivors are killed a moment later, as a job agent does; or every
                 rank stopped (SIGSTOP) while a second job takes the run over, then let
                 go (fencing, as ``stale``). No step
                 may be visible without every part, and every part of the recovered
                 step must match the reference run's rank.
* ``chunkrot``   stored chunks of a frozen base damaged between checkpoints, then detected
                 (a read, scrub, verify, or the puts' own checks): every checkpoint put after
                 the detection must read back (:mod:`crashtests.chunkrot`);
* ``distpower``  the parts and commit records of multi-rank checkpoints written to the file
                 store on SimFS in one process, in the collective's order, power cut as
                 for ``powerloss``: a step is recovered with every part or not at all.

One uninterrupted reference run of the workload gives the per-step hashes and the
final hash every trial is compared with.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import checker, chunkrot, corrupt, pgcluster
from .checker import OUTCOMES, Trial

STORES = ("file", "sqlite", "postgres")
FAULTS = ("kill", "failpoint", "pgkill", "powerloss", "corrupt", "stale", "dist", "distpower", "chunkrot")
DIST_KINDS = ("kill-one", "kill-all", "failpoint", "stale")
PREFIX = {"file": "file.", "sqlite": "sqlite.", "postgres": "pg."}
REPO = checker.REPO


@dataclass
class Config:
    trials: int = 10                    # per (store, fault), unless overridden in ``counts``
    stores: tuple = STORES
    faults: tuple = FAULTS
    out: str = "crash-report"
    seed: int = 0
    device: str = "cpu"
    steps: int = 12
    every: int = 2
    step_sleep: float = 0.03
    jobs: int = max(1, min(4, os.cpu_count() or 1))
    counts: dict = field(default_factory=dict)   # {(fault): n} or {(store, fault): n}
    resume_samples: int = 1             # resumed to the end per (store, subprocess fault)
    chart: bool = True
    keep: bool = False                  # keep the work directory
    quiet: bool = False
    time_limit: float = 3600.0          # stop starting new trials after this many seconds
    min_kills: int = 0                  # per store: top random kills up to this many delivered SIGKILLs
    ranks: int = 2                      # processes per job in the ``dist`` trials

    def n(self, store: str, fault: str) -> int:
        return self.counts.get((store, fault), self.counts.get(fault, self.trials))


_T0 = time.monotonic()


def _log(cfg: Config, msg: str) -> None:
    if not cfg.quiet:
        print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Campaign:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self.cluster: pgcluster.PgCluster | None = None
        self.work = tempfile.mkdtemp(prefix="agck-crash-")
        self.urls: dict[str, str] = {}        # store -> URL the subprocess trials use
        self.ref: dict = {}
        self.est: dict[str, float] = {}       # store -> estimated workload duration (s)
        self._lock = threading.Lock()
        self._ids = 0
        self.t0 = time.monotonic()
        self.pg_skipped: str | None = None

    # -- setup -------------------------------------------------------------------------
    def _new_trial(self, store: str, fault: str, run_prefix: str, url: str) -> Trial:
        with self._lock:
            self._ids += 1
            t = Trial(id=self._ids, store=store, fault=fault, run=f"{run_prefix}{self._ids}", url=url)
            self.trials.append(t)
        return t

    def _time_left(self) -> bool:
        return time.monotonic() - self.t0 < self.cfg.time_limit

    def setup(self) -> None:
        cfg = self.cfg
        if "postgres" in cfg.stores:
            reason = pgcluster.available()
            if reason:
                self.pg_skipped = reason
                self.notes.append(f"postgres skipped: {reason}")
                cfg.stores = tuple(s for s in cfg.stores if s != "postgres")
            else:
                _log(cfg, "starting a private Postgres cluster")
                self.cluster = pgcluster.PgCluster().start()
                # commit_delay (max 100 ms) holds each COMMIT between its WAL insert and the flush:
                # a window in which the server can be killed mid-commit on purpose.
                self.cluster.create_db("crash", {"commit_delay": 100000, "commit_siblings": 0})
                self.cluster.create_db("corrupt")
                from agck.stores.postgres import PostgresStore
                for db in ("crash", "corrupt"):
                    PostgresStore(self.cluster.dsn(db), init=True).close()
                self.urls["postgres"] = self.cluster.dsn("crash")
        self.urls["file"] = os.path.join(self.work, "kill-file")
        self.urls["sqlite"] = f"sqlite:///{self.work}/kill.db"

    def cleanup(self) -> None:
        if self.cluster is not None:
            self.pg_kills = self.cluster.kills
            self.cluster.destroy()
            self.cluster = None
        if not self.cfg.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- the workload subprocess --------------------------------------------------------
    def _workload_cmd(self, url: str, run: str, d: str, mode: str = "auto", extra=()) -> list[str]:
        c = self.cfg
        return [sys.executable, "-m", "crashtests.workload", "--store", url, "--run", run,
                "--steps", str(c.steps), "--every", str(c.every), "--device", c.device, "--mode", mode,
                "--step-sleep", str(c.step_sleep), "--ack-log", os.path.join(d, "acks"),
                "--out", os.path.join(d, "out.json"), *extra]

    def _env(self, failpoints: str | None = None) -> dict:
        env = dict(os.environ)
        env.pop("AGCK_FAILPOINTS", None)
        if failpoints:
            env["AGCK_FAILPOINTS"] = failpoints
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS, for bit-exact resume
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def _spawn(self, cmd, d: str, failpoints: str | None = None) -> subprocess.Popen:
        err = open(os.path.join(d, "stderr"), "wb")
        try:
            return subprocess.Popen(cmd, cwd=REPO, env=self._env(failpoints), stdout=subprocess.DEVNULL,
                                    stderr=err, stdin=subprocess.DEVNULL)
        finally:
            err.close()

    def reference(self) -> None:
        """One uninterrupted run: per-step hashes, final hash, and how long the phases take."""
        d = os.path.join(self.work, "reference")
        os.makedirs(d)
        cmd = self._workload_cmd(os.path.join(d, "store"), "reference", d, extra=[
            "--hashes", os.path.join(d, "hashes.json"), "--full-hashes", os.path.join(d, "full.json")])
        t0 = time.monotonic()
        p = self._spawn(cmd, d)
        first_ack = opened = None
        acks = os.path.join(d, "acks")
        while p.poll() is None and time.monotonic() - t0 < 600:
            if opened is None and os.path.exists(acks):
                opened = time.monotonic() - t0
            if first_ack is None and os.path.exists(acks) and os.path.getsize(acks) > 0:
                first_ack = time.monotonic() - t0
            time.sleep(0.005)
        total = time.monotonic() - t0
        if p.returncode != 0:
            raise RuntimeError(f"the reference run failed ({p.returncode}): {self._stderr(d)}")
        with open(os.path.join(d, "out.json")) as f:
            out = json.load(f)
        with open(os.path.join(d, "full.json")) as f:
            full = {int(k): v for k, v in json.load(f).items()}
        with open(os.path.join(d, "hashes.json")) as f:
            hashes = {int(k): v for k, v in json.load(f).items()}
        opened = opened if opened is not None else total * 0.6
        self.ref = {"final_hash": out["final_hash"], "full": full, "hashes": hashes, "seconds": total,
                    "first_ack": first_ack or total * 0.7, "opened": opened}
        slow = 1.0 if self.cfg.jobs == 1 else 1.25
        for s in STORES:
            # every Postgres commit waits commit_delay (100 ms) in the crash database
            extra = 0.12 * (self.cfg.steps // self.cfg.every) if s == "postgres" else 0.0
            self.est[s] = (total - opened + extra) * slow
        _log(self.cfg, f"reference run: {total:.1f}s (imports done at {opened:.1f}s, first ack at "
                       f"{self.ref['first_ack']:.1f}s), final hash {out['final_hash']}")

    def _wait_started(self, p: subprocess.Popen, d: str, timeout: float = 300) -> float:
        """Wait until the workload has imported torch and opened its ack log (the run proper starts);
        returns when that was, on the monotonic clock."""
        acks = os.path.join(d, "acks")
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline and not os.path.exists(acks):
            time.sleep(0.005)
        return time.monotonic()

    def _kill_delay(self, store: str) -> float:
        """A random instant of the run proper (restore, steps, checkpoints, close)."""
        return self.rng.uniform(0, 0.9 * self.est[store])

    def _stderr(self, d: str) -> str:
        try:
            with open(os.path.join(d, "stderr"), "rb") as f:
                return f.read()[-1500:].decode("utf-8", "replace")
        except OSError:
            return ""

    def _open(self, url: str):
        from agck.stores import open_store
        if url.startswith(("postgres", "sqlite:")):
            return open_store(url)
        return open_store(url, create=True)

    def _check(self, t: Trial, d: str) -> None:
        from crashtests.workload import read_acks
        t.acked = read_acks(os.path.join(d, "acks"))
        store = self._open(t.url)
        try:
            checker.check_library(store, t, self.ref["full"])
        finally:
            store.close()

    # -- kill and failpoint trials ----------------------------------------------------------
    def kill_trial(self, t: Trial, spec: str | None, mode: str) -> None:
        d = os.path.join(self.work, "t", str(t.id))
        os.makedirs(d)
        p = self._spawn(self._workload_cmd(self._client_url(t), t.run, d, mode), d, spec)
        t0 = None
        try:
            if spec is None:
                t0 = self._wait_started(p, d)
                try:
                    p.wait(timeout=self._kill_delay(t.store))
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
            t.detail = self._stderr(d).strip().splitlines()[-1][:300] if self._stderr(d).strip() else ""
        elif rc != 0:
            t.detail = f"workload exited {rc}: {self._stderr(d)[-300:]}"
            t.reasons.append(f"workload failed on its own (exit {rc})")
            t.recovered = "raised"
        else:
            if took is not None:
                with self._lock:
                    self.est[t.store] = max(self.est[t.store], took * 1.05)
            t.detail = "finished before the fault"
        if t.store == "postgres":
            self._wait_backend_gone(t)
        self._check(t, d)

    def _client_url(self, t: Trial) -> str:
        """The workload's URL: for Postgres, tagged with the run so that its backend can be found."""
        return f"{t.url}&application_name={t.run}" if t.store == "postgres" else t.url

    def _wait_backend_gone(self, t: Trial, timeout: float = 60.0) -> None:
        """A killed client's backend may still be executing its COMMIT (commit_delay holds it there):
        the outcome of that transaction is only settled once the backend is gone."""
        import psycopg2
        conn = psycopg2.connect(self.cluster.dsn("postgres"))
        conn.autocommit = True
        try:
            cur = conn.cursor()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (t.run,))
                if cur.fetchone()[0] == 0:
                    return
                time.sleep(0.01)
            t.reasons.append(f"the killed workload's backend was still there after {timeout:.0f}s")
        finally:
            conn.close()

    def kill_trials(self) -> None:
        from agck.failpoints import POINTS
        cfg = self.cfg
        jobs = []
        nputs = max(1, cfg.steps // cfg.every)
        for store in cfg.stores:
            if "kill" in cfg.faults:
                for _ in range(cfg.n(store, "kill")):
                    t = self._new_trial(store, "kill", "k", self.urls[store])
                    jobs.append((t, None, self.rng.choice(("sync", "async"))))
            if "failpoint" in cfg.faults:
                points = [p for p in POINTS if p.startswith((PREFIX[store], "snapshot."))]
                for j in range(cfg.n(store, "failpoint")):
                    point = points[j % len(points)]
                    action = "raise" if j % 10 == 9 else "kill"   # now and then an EIO instead
                    spec = f"{point}={action}@{self.rng.randint(1, nputs)}"
                    mode = "async" if point == "snapshot.after_stage" else self.rng.choice(("sync", "async"))
                    t = self._new_trial(store, "failpoint", "f", self.urls[store])
                    jobs.append((t, spec, mode))
        if not jobs:
            return
        self.rng.shuffle(jobs)   # interleave stores so that parallel trials contend like real ones
        _log(cfg, f"kill/failpoint trials: {len(jobs)} workload processes, {cfg.jobs} at a time")
        self._pool(lambda j: self.kill_trial(*j), jobs)
        if "kill" not in cfg.faults or not cfg.min_kills:
            return
        for _ in range(3):       # random kills that came after the run ended are topped up, boundedly
            extra = []
            for store in cfg.stores:
                got = sum(1 for t in self.trials if t.store == store and t.fault in ("kill", "failpoint")
                          and t.reached and (t.fault == "kill" or t.point.split("=")[1].startswith("kill")))
                for _ in range(min(cfg.min_kills - got, 20)):
                    t = self._new_trial(store, "kill", "k", self.urls[store])
                    extra.append((t, None, self.rng.choice(("sync", "async"))))
            if not extra or not self._time_left():
                return
            _log(cfg, f"topping up SIGKILLs: {len(extra)} more workload processes")
            self._pool(lambda j: self.kill_trial(*j), extra)

    # -- stale writers: the run is taken over while its old writer hangs ------------------------
    def stale_trials(self) -> None:
        cfg = self.cfg
        if "stale" not in cfg.faults or not self.ref:
            return
        jobs = [(self._new_trial(store, "stale", "s", self.urls[store]), self.rng.choice(("sync", "async")))
                for store in cfg.stores for _ in range(cfg.n(store, "stale"))]
        if jobs:
            _log(cfg, f"stale-writer trials: {len(jobs)}, two workload processes each")
            self._pool(lambda j: self.stale_trial(*j), jobs)

    def stale_trial(self, t: Trial, mode: str) -> None:
        """A workload (the old incarnation) is stopped (SIGSTOP) at a random instant after
        its first acknowledged checkpoint, as a hung node is; a second one resumes the
        run to the end, taking a new epoch; then the old one is let go (SIGCONT). The
        old one must acknowledge nothing more (its next put is refused: StaleEpochError),
        and the run must end bit-identical to the uninterrupted one. If the old one
        was stopped inside its commit, the takeover waits for it (safety before
        liveness): it is let go after a while, finishes that one commit, and then
        stops being able to commit."""
        from crashtests.workload import read_acks   # (imports torch: only in the workers' parent when needed)
        base = os.path.join(self.work, "t", str(t.id))
        d_old, d_new = os.path.join(base, "old"), os.path.join(base, "new")
        os.makedirs(d_old)
        os.makedirs(d_new)
        url = self._client_url(t)
        old = self._spawn(self._workload_cmd(url, t.run, d_old, mode), d_old)
        new = None
        try:
            acks = os.path.join(d_old, "acks")
            deadline = time.monotonic() + 300
            while old.poll() is None and time.monotonic() < deadline and not read_acks(acks):
                time.sleep(0.005)
            time.sleep(self.rng.uniform(0, self.ref["seconds"] - self.ref["first_ack"]) / 2)
            if old.poll() is not None:
                t.detail = "finished before the fault"
                self._check(t, d_old)
                return
            old.send_signal(signal.SIGSTOP)
            t.reached = True
            before = read_acks(acks)
            new = self._spawn(self._workload_cmd(url, t.run, d_new, mode), d_new)
            waited = False
            try:
                new.wait(timeout=max(10.0, 3 * self.ref["seconds"]))
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
        err = self._stderr(d_old)
        if old.returncode != 0 and "StaleEpochError" not in err and "epoch" not in err:
            t.reasons.append(f"the old writer failed otherwise (exit {old.returncode}): {err.strip()[-300:]}")
            t.recovered = "raised"
        if new.returncode != 0:
            t.reasons.append(f"the new incarnation failed (exit {new.returncode}): {self._stderr(d_new)[-300:]}")
            t.recovered = "raised"
            return
        with open(os.path.join(d_new, "out.json")) as f:
            out = json.load(f)
        ok = out["final_hash"] == self.ref["final_hash"]
        t.resume = {"ok": ok, "from": out["resumed_from"],
                    "why": None if ok else f"final hash {out['final_hash']} (uninterrupted {self.ref['final_hash']})"}
        if t.store == "postgres":
            self._wait_backend_gone(t)
        # Every acknowledged checkpoint of the run, old writer's and new's, must be covered.
        t.acked = sorted(set(after) | set(read_acks(os.path.join(d_new, "acks"))))
        store = self._open(t.url)
        try:
            checker.check_library(store, t, self.ref["full"])
        finally:
            store.close()
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

    def _pool(self, fn, items, workers: int | None = None) -> None:
        def guarded(item):
            if not self._time_left():
                item[0].reasons.append("not run: campaign time limit")
                item[0].recovered = "raised"
                return
            try:
                fn(item)
            except Exception as e:  # a harness failure is reported on its trial, never dropped
                item[0].reasons.append(f"harness error: {type(e).__name__}: {e}")
                item[0].recovered = "raised"
        with ThreadPoolExecutor(max_workers=workers or self.cfg.jobs) as ex:
            list(ex.map(guarded, items))

    # -- multi-rank jobs -------------------------------------------------------------------------
    def _dist_spawn(self, url: str, run: str, d: str, mode: str, failpoints: dict | None = None,
                    extra: dict | None = None) -> list[subprocess.Popen]:
        """The ranks of one job, each with its own directory (ack log, out.json, stderr)."""
        world = self.cfg.ranks
        os.makedirs(d, exist_ok=True)
        rendezvous = os.path.join(d, "rendezvous")
        procs = []
        for r in range(world):
            dr = os.path.join(d, f"r{r}")
            os.makedirs(dr)
            cmd = self._workload_cmd(url, run, dr, mode, extra=[
                "--world", str(world), "--rank", str(r), "--rendezvous", rendezvous, *(extra or {}).get(r, ())])
            procs.append(self._spawn(cmd, dr, (failpoints or {}).get(r)))
        return procs

    @staticmethod
    def _reap(procs: list, grace: float = 3.0, timeout: float = 300.0) -> list[int]:
        """Wait for a job: once a rank has failed the others get ``grace`` seconds (they
        may be blocked in a collective with it) and are then SIGKILLed, as torchrun's
        agent kills a failed job."""
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > grace:
                    break
                time.sleep(0.01)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        return [p.returncode for p in procs]

    def dist_reference(self) -> None:
        """One uninterrupted job: each rank's per-step hashes and final hash."""
        d = os.path.join(self.work, "dist-reference")
        t0 = time.monotonic()
        world = self.cfg.ranks
        procs = self._dist_spawn(os.path.join(d, "store"), "reference", d, "auto",
                                 extra={r: ["--full-hashes", os.path.join(d, f"r{r}", "full.json")]
                                        for r in range(world)})
        opened = first_ack = None
        acks = os.path.join(d, "r0", "acks")
        while any(p.poll() is None for p in procs) and time.monotonic() - t0 < 600:
            if opened is None and os.path.exists(acks):
                opened = time.monotonic() - t0
            if first_ack is None and os.path.exists(acks) and os.path.getsize(acks):
                first_ack = time.monotonic() - t0
            time.sleep(0.005)
        codes = self._reap(procs)
        total = time.monotonic() - t0
        if codes != [0] * world:
            raise RuntimeError(f"the multi-rank reference run failed ({codes}): {self._stderr(os.path.join(d, 'r0'))}")
        full, final = [], []
        for r in range(world):
            with open(os.path.join(d, f"r{r}", "full.json")) as f:
                full.append({int(k): v for k, v in json.load(f).items()})
            with open(os.path.join(d, f"r{r}", "out.json")) as f:
                final.append(json.load(f)["final_hash"])
        self.dist_ref = {"full": full, "final": final, "seconds": total, "first_ack": first_ack or total * 0.7,
                         "run_proper": total - (opened if opened is not None else total * 0.6)}
        _log(self.cfg, f"multi-rank reference run ({world} ranks): {total:.1f}s, first ack at "
                       f"{self.dist_ref['first_ack']:.1f}s")

    def dist_trials(self) -> None:
        from agck.failpoints import POINTS
        cfg = self.cfg
        if "dist" not in cfg.faults:
            return
        self.dist_reference()
        jobs = []
        nputs = max(1, cfg.steps // cfg.every)
        for store in cfg.stores:
            # the collective's own points first, a different one first on each store
            points = [p for p in POINTS if p.startswith("dist.")] + [p for p in POINTS if p.startswith(PREFIX[store])]
            for j in range(cfg.n(store, "dist")):
                kind = DIST_KINDS[j % len(DIST_KINDS)]
                rank = self.rng.randrange(cfg.ranks)
                spec = None
                if kind == "failpoint":
                    point = points[(j // len(DIST_KINDS) + STORES.index(store)) % len(points)]
                    if point.startswith("dist.") and point != "dist.after_part":
                        rank = 0            # the coordinator's commit
                    spec = f"{point}=kill@{self.rng.randint(1, nputs)}"
                t = self._new_trial(store, "dist", "d", self.urls[store])
                jobs.append((t, kind, rank, spec, self.rng.choice(("sync", "async"))))
        if not jobs:
            return
        self.rng.shuffle(jobs)
        jobs_at_once = max(1, cfg.jobs // cfg.ranks)
        _log(cfg, f"multi-rank trials: {len(jobs)} jobs of {cfg.ranks} ranks, {jobs_at_once} at a time")
        self._pool(lambda j: self.dist_trial(*j), jobs, workers=jobs_at_once)

    def dist_trial(self, t: Trial, kind: str, rank: int, spec: str | None, mode: str) -> None:
        if kind == "stale":
            return self.dist_stale_trial(t, mode)
        d = os.path.join(self.work, "t", str(t.id))
        url = self._client_url(t)
        procs = self._dist_spawn(url, t.run, d, mode, failpoints={rank: spec} if spec else None)
        if kind in ("kill-one", "kill-all"):
            self._wait_started(procs[0], os.path.join(d, "r0"))
            delay = self.rng.uniform(0, 0.9 * self.dist_ref["run_proper"])
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                time.sleep(0.005)
            victims = [procs[rank]] if kind == "kill-one" else procs
            if all(p.poll() is None for p in victims):
                for p in victims:
                    p.send_signal(signal.SIGKILL)
        codes = self._reap(procs)
        label = f"{kind} rank {rank}" if kind == "kill-one" else kind
        if spec is not None:
            label = f"rank {rank} {spec}"
        if codes == [0] * len(codes):
            t.detail = "finished before the fault"
        elif any(c == -signal.SIGKILL for c in codes):
            t.reached = True
            t.in_flight = spec is not None
            t.point = label
        else:
            t.detail = f"ranks exited {codes}: {self._stderr(os.path.join(d, f'r{rank}'))[-300:]}"
            t.reasons.append(f"the job failed on its own (exit codes {codes})")
            t.recovered = "raised"
        if t.store == "postgres":
            self._wait_backend_gone(t)
        from crashtests.workload import read_acks
        t.acked = sorted({s for r in range(self.cfg.ranks) for s in read_acks(os.path.join(d, f"r{r}", "acks"))})
        store = self._open(t.url)
        try:
            checker.check_sharded(store, t, self.dist_ref["full"])
        finally:
            store.close()

    def dist_stale_trial(self, t: Trial, mode: str) -> None:
        """Every rank of a job stopped (SIGSTOP) at a random instant after its first
        acknowledged step; a second job takes the run over (a new epoch) and finishes
        it; then the first is let go. It may acknowledge only steps it committed before
        the takeover (at or before the step the second resumed from)."""
        from crashtests.workload import read_acks
        base = os.path.join(self.work, "t", str(t.id))
        url = self._client_url(t)
        old = self._dist_spawn(url, t.run, os.path.join(base, "old"), mode)
        new = None
        acks = [os.path.join(base, "old", f"r{r}", "acks") for r in range(self.cfg.ranks)]
        try:
            deadline = time.monotonic() + 300
            while all(p.poll() is None for p in old) and time.monotonic() < deadline and not read_acks(acks[0]):
                time.sleep(0.005)
            time.sleep(self.rng.uniform(0, self.dist_ref["run_proper"]) / 2)
            if any(p.poll() is not None for p in old):
                self._reap(old)
                t.detail = "finished before the fault"
                t.acked = sorted({s for a in acks for s in read_acks(a)})
                store = self._open(t.url)
                try:
                    checker.check_sharded(store, t, self.dist_ref["full"])
                finally:
                    store.close()
                return
            for p in old:
                p.send_signal(signal.SIGSTOP)
            t.reached = True
            before = {s for a in acks for s in read_acks(a)}
            new = self._dist_spawn(url, t.run, os.path.join(base, "new"), mode)
            deadline = time.monotonic() + max(10.0, 3 * self.dist_ref["seconds"])
            waited = False
            while any(p.poll() is None for p in new):
                if time.monotonic() > deadline:
                    waited = True         # the stopped job holds a commit the takeover waits for
                    break
                time.sleep(0.01)
            for p in old:
                p.send_signal(signal.SIGCONT)
            new_codes = self._reap(new, timeout=300)
            self._reap(old, timeout=120)
        finally:
            for p in old + (new or []):
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait()
        t.point = "stopped inside a commit" if waited else f"stopped after ack {max(before) if before else None}"
        if new_codes != [0] * len(new_codes):
            t.reasons.append(f"the new job failed (exit codes {new_codes}): "
                             f"{self._stderr(os.path.join(base, 'new', 'r0'))[-300:]}")
            t.recovered = "raised"
            return
        outs = []
        for r in range(self.cfg.ranks):
            with open(os.path.join(base, "new", f"r{r}", "out.json")) as f:
                outs.append(json.load(f))
        finals = [o["final_hash"] for o in outs]
        resumed_from = outs[0]["resumed_from"] or 0
        ok = finals == self.dist_ref["final"]
        t.resume = {"ok": ok, "from": resumed_from,
                    "why": None if ok else f"final hashes {finals} (uninterrupted {self.dist_ref['final']})"}
        if t.store == "postgres":
            self._wait_backend_gone(t)
        after = {s for a in acks for s in read_acks(a)}
        new_acks = {s for r in range(self.cfg.ranks) for s in read_acks(os.path.join(base, "new", f"r{r}", "acks"))}
        t.acked = sorted(after | new_acks)
        store = self._open(t.url)
        try:
            checker.check_sharded(store, t, self.dist_ref["full"])
        finally:
            store.close()
        stale = sorted(k for k in after - before if k > resumed_from)
        if stale:
            t.hash_ok = False
            t.reasons.append(f"the old job committed steps {stale} after the run was taken over "
                             f"(the new one resumed from {resumed_from})")

    def resume_dist(self, t: Trial) -> None:
        d = os.path.join(self.work, "t", f"{t.id}-resume")
        codes = self._reap(self._dist_spawn(self._client_url(t), t.run, d, "auto"), timeout=600)
        if codes != [0] * len(codes):
            t.resume = {"ok": False, "error": True,
                        "why": f"exit codes {codes}: {self._stderr(os.path.join(d, 'r0'))[-300:]}"}
            return
        outs = []
        for r in range(self.cfg.ranks):
            with open(os.path.join(d, f"r{r}", "out.json")) as f:
                outs.append(json.load(f))
        want = t.recovered if isinstance(t.recovered, int) else 0
        finals = [o["final_hash"] for o in outs]
        froms = {o["resumed_from"] for o in outs}
        ok = finals == self.dist_ref["final"] and froms == {want}
        t.resume = {"ok": ok, "from": outs[0]["resumed_from"],
                    "why": None if ok else f"final hashes {finals} (uninterrupted {self.dist_ref['final']}), "
                                          f"resumed from {sorted(froms)}, recovery said {want}"}

    # -- Postgres server kills ----------------------------------------------------------------
    def pgkill_trials(self) -> None:
        cfg = self.cfg
        if "pgkill" not in cfg.faults or self.cluster is None:
            return
        n = cfg.n("postgres", "pgkill")
        _log(cfg, f"Postgres server kills: {n}")
        for i in range(n):
            t = self._new_trial("postgres", "pgkill", "p", self.urls["postgres"])
            if not self._time_left():
                t.reasons.append("not run: campaign time limit")
                t.recovered = "raised"
                continue
            try:
                self.pgkill_trial(t, i)
            except Exception as e:
                t.reasons.append(f"harness error: {type(e).__name__}: {e}")
                t.recovered = "raised"
                if self.cluster.proc is None or self.cluster.proc.poll() is not None:
                    self.cluster.restart()

    def pgkill_trial(self, t: Trial, i: int) -> None:
        import psycopg2
        cfg = self.cfg
        c = self.cluster
        d = os.path.join(self.work, "t", str(t.id))
        os.makedirs(d)
        how = "immediate" if i % 2 else "sigkill"
        when = "random" if i % 3 == 2 else "commit"
        nputs = max(1, cfg.steps // cfg.every)
        target = self.rng.randint(1, nputs)
        p = self._spawn(self._workload_cmd(self._client_url(t), t.run, d, self.rng.choice(("sync", "async"))), d)
        killed_at = None
        try:
            if when == "commit":
                # watch for our workload's backend executing COMMIT (held there by commit_delay): its
                # commit record is in the WAL buffers, not yet flushed, and the client is not answered
                mon = psycopg2.connect(c.dsn("postgres"))
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
                            time.sleep(self.rng.uniform(0, 0.05))
                            killed_at = f"commit#{len(seen)}"
                            break
                        time.sleep(0.003)
                finally:
                    mon.close()
            else:
                self._wait_started(p, d)
                try:
                    p.wait(timeout=self._kill_delay("postgres"))
                except subprocess.TimeoutExpired:
                    killed_at = "random"
            if killed_at is None and when == "random":
                killed_at = "idle"     # the run ended first: crash the server with everything committed
            if killed_at is not None and (p.poll() is None or killed_at == "idle"):
                c.kill(how)
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
            if c.proc is None or c.proc.poll() is not None:
                restart = c.restart()
                t.detail = (t.detail + f" restart {restart:.1f}s").strip()
        self._check(t, d)
        # an older run's recovery must not change because the server crashed later
        store = self._open(self.urls["postgres"])
        try:
            for old in self.trials:
                if old is t or old.store != "postgres" or old.fault not in ("kill", "failpoint", "pgkill") \
                        or not isinstance(old.recovered, int):
                    continue
                probe = Trial(id=0, store="postgres", fault=old.fault, run=old.run, url=old.url)
                checker.check_library(store, probe, self.ref["full"])
                if probe.recovered != old.recovered:
                    old.hash_ok = False
                    old.reasons.append(f"after server kill in trial {t.id} recovery says {probe.recovered}, "
                                       f"before it said {old.recovered}")
        finally:
            store.close()

    # -- in-process trials: shared pipeline trees -----------------------------------------------
    def trees(self) -> dict:
        """The snapshot trees the workload writes at each checkpoint step, made in-process (CPU)."""
        if hasattr(self, "_trees"):
            return self._trees
        import torch

        from agck import checkpoint
        from agck.snapshot import capture, rng_state
        from crashtests.workload import build_state, run_step, state_hash
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        cfg = self.cfg
        state = build_state(cfg.steps, "cpu")
        trees, full = {}, {}
        for i in range(cfg.steps):
            state = run_step(state, i)
            k = i + 1
            if k % cfg.every == 0 or k == cfg.steps:
                tree = {"state": capture(state), "step": k, "rng": rng_state()}
                full[k] = state_hash(tree)
                trees[k] = checkpoint.loads(checkpoint.dumps(tree)).state   # a private copy
        self._final_cpu = state_hash(state)
        if self.ref and self.cfg.device == "cpu":
            for k, h in full.items():
                if self.ref["full"].get(k) != h:
                    self.notes.append(f"in-process step {k} hash {h} differs from the reference run's "
                                      f"{self.ref['full'].get(k)}")
        self._trees, self._full = trees, full
        return trees

    def resume_inprocess(self, store, run: str) -> dict:
        """Run the pipeline to the end from what ``run`` recovers to; compare with the uninterrupted run."""
        import logging

        from agck import checkpoint_every
        from crashtests.workload import build_state, run_step, state_hash
        cfg = self.cfg
        self.trees()
        logging.getLogger("agck").setLevel(logging.ERROR)   # the walk-back is expected; the checker judges it

        @checkpoint_every(cfg.every, store=store, run=run, mode="sync", handle_signals=False)
        def step(state, i):
            return run_step(state, i)

        state = build_state(cfg.steps, "cpu")
        for i in range(cfg.steps):
            state = step(state, i)
        start = step.snapshotter.start_step
        step.close()
        h = state_hash(state)
        ok = h == self._final_cpu
        return {"ok": ok, "from": start, "why": None if ok else f"final hash {h}, uninterrupted {self._final_cpu}"}

    # -- power loss ----------------------------------------------------------------------------
    def _pl_plan(self, trees: dict) -> list[tuple]:
        steps = sorted(trees)
        plan = []
        for j, s in enumerate(steps):
            plan.append(("put", s))
            if j == 3:
                plan.append(("prune", 2))    # retention: unlink + fsync of the directory
            if j == 4:
                plan.append(("put", s))      # a resumed run rewriting a step: rename over a file
        return plan

    def _pl_run(self, sim, store, run: str, plan, trees, acked: list) -> None:
        parent = None
        for act, arg in plan:
            if act == "put":
                store.put(run, arg, trees[arg], meta={"snapshot": True}, parent=parent)
                acked.append(arg)
                parent = arg
            else:
                store.prune(run, keep_last=arg)

    def _pl_run_sharded(self, sim, store, run: str, plan, trees, acked: list) -> None:
        """The plan as a job of ``ranks`` ranks would write it (agck.distributed's order,
        one process): every rank's part durable, then the commit record, fenced."""
        from agck import sharded
        epoch = store.begin_epoch(run)
        parent, written = None, set()
        for act, arg in plan:
            if act == "put":
                if arg in written:      # the plan rewrites a step: as a job that resumed does, in a new epoch
                    epoch = store.begin_epoch(run)
                written.add(arg)
                refs = []
                for rank in range(self.cfg.ranks):
                    nonce = sharded.new_nonce()
                    store.parts_store().put(sharded.part_run(run, epoch, rank), arg, self._rank_tree(trees, arg, rank),
                                            parent=parent, meta=sharded.part_meta(run, arg, epoch, rank,
                                                                                  self.cfg.ranks, nonce))
                    refs.append(sharded.PartRef(rank, sharded.part_run(run, epoch, rank), nonce))
                commit = sharded.Commit(run=run, step=arg, epoch=epoch, world_size=self.cfg.ranks, parts=refs)
                store.put(run, arg, commit.state(), meta={"snapshot": True}, parent=parent, epoch=epoch)
                acked.append(arg)
                parent = arg
            else:
                store.prune(run, keep_last=arg, epoch=epoch)

    @staticmethod
    def _rank_tree(trees, step: int, rank: int) -> dict:
        return {**trees[step], "rank": rank}

    def powerloss_trials(self) -> None:
        """Power cuts on the file store: single-process puts (``powerloss``), and the
        parts and commit records of multi-rank checkpoints (``dist`` with power loss:
        reported as fault ``distpower``)."""
        from crashtests.simfs import MODES, Crash, SimFS
        from crashtests.workload import state_hash
        from agck.stores.file import FileStore
        cfg = self.cfg
        if "file" not in cfg.stores:
            return
        kinds = []
        if "powerloss" in cfg.faults:
            kinds.append(("powerloss", self._pl_run, lambda store, t: checker.check_library(store, t, self._full)))
        if "distpower" in cfg.faults:
            def check(store, t):
                refs = [{k: state_hash(self._rank_tree(trees, k, r)) for k in trees} for r in range(cfg.ranks)]
                checker.check_sharded(store, t, refs)
            kinds.append(("distpower", self._pl_run_sharded, check))
        if not kinds:
            return
        trees = self.trees()
        plan = self._pl_plan(trees)
        sims = os.path.join(self.work, "pl-sim")
        images = os.path.join(self.work, "pl-images")
        os.makedirs(images, exist_ok=True)
        for fault, run_plan, check in kinds:
            n = cfg.n("file", fault)
            # a dry run counts the operations a whole plan makes; trial i crashes at about i/n of them
            dry = SimFS(os.path.join(sims, f"dry-{fault}"))
            run_plan(dry, FileStore(dry.root, fs=dry), "dry", plan, trees, [])
            total = dry.ops
            shutil.rmtree(dry.root)
            _log(cfg, f"power-loss simulations ({fault}): {n} (plan of {total} file-system operations)")
            stride = max(1, total // max(1, n))
            for i in range(n):
                if not self._time_left():
                    break
                t = self._new_trial("file", fault, "pl" if fault == "powerloss" else "dpl", images)
                crash_at = min(total, 1 + (i * total) // max(1, n) + self.rng.randrange(stride))
                sim = SimFS(os.path.join(sims, str(t.id)), crash_at=crash_at)
                try:
                    run_plan(sim, FileStore(sim.root, fs=sim), t.run, plan, trees, t.acked)
                except Crash:
                    t.reached = True
                    t.in_flight = True
                mode = MODES[i % len(MODES)]
                desc = sim.image(images, self.rng, mode)
                t.point = f"op{sim.ops}:{sim.crash_op}/{mode}"
                t.detail = desc
                shutil.rmtree(sim.root)
                store = FileStore(images, create=False)
                try:
                    check(store, t)
                finally:
                    store.close()
        self.pl_images = images

    # -- corruption ----------------------------------------------------------------------------
    def corrupt_trials(self) -> None:
        cfg = self.cfg
        if "corrupt" not in cfg.faults:
            return
        from agck.stores.file import FileStore
        from agck.stores.sqlite import SqliteStore
        trees = self.trees()
        steps = sorted(trees)[:3]
        opened = []
        targets = {}
        for s in cfg.stores:
            if s == "file":
                url = os.path.join(self.work, "corrupt-file")
                stores = [FileStore(url)]
            elif s == "sqlite":
                url = f"sqlite:///{self.work}/corrupt.db"
                stores = [SqliteStore(url), SqliteStore(url, chunk_size=65536)]
            else:
                from agck.stores.postgres import PostgresStore
                url = self.cluster.dsn("corrupt")
                stores = [PostgresStore(url), PostgresStore(url, chunk_size=65536)]
            opened += stores
            targets[s] = (url, stores)
        try:
            for s, (url, stores) in targets.items():
                n = cfg.n(s, "corrupt")
                _log(cfg, f"corruption trials on {s}: {n}")
                for st in stores[:1]:
                    for k in steps:
                        st.put("donor", k, trees[k], meta={"snapshot": True})
                for _ in range(n):
                    if not self._time_left():
                        break
                    t = self._new_trial(s, "corrupt", "c", url)
                    try:
                        self.corrupt_trial(t, self.rng.choice(stores), steps, trees)
                    except Exception as e:
                        t.reasons.append(f"harness error: {type(e).__name__}: {e}")
                        t.recovered = "raised"
        finally:
            for st in opened:
                st.close()

    def corrupt_trial(self, t: Trial, store, steps: list[int], trees: dict) -> None:
        rng = self.rng
        parent = None
        for k in steps:
            store.put(t.run, k, trees[k], meta={"snapshot": True}, parent=parent)
            parent = k
        t.acked = list(steps)
        r = rng.random()
        if r < 0.65:
            damaged = steps[-1:]
        elif r < 0.85:
            damaged = steps[-2:]
        elif r < 0.93:
            damaged = steps[1:2]         # an older one: the newest must still be chosen
        else:
            damaged = list(steps)
        labels = []
        for k in damaged:
            for attempt in range(5):
                kind = rng.choice(corrupt.kinds_for(store))
                donor_step = rng.choice([s for s in steps if s != k]) if kind == "swap_step" else k
                try:
                    labels.append(corrupt.corrupt(store, t.run, k, kind, rng, donor_run="donor",
                                                  donor_step=donor_step))
                    break
                except corrupt.Unchanged:   # e.g. swapping in a step that was already swapped for this one
                    continue
            else:
                raise RuntimeError(f"could not damage step {k}")
        t.damaged = list(damaged)
        intact = [k for k in steps if k not in damaged]
        t.expected = max(intact) if intact else None
        t.reached = True
        t.point = ",".join(sorted(set(labels)))
        checker.check_library(store, t, self._full)
        missed = [k for k in damaged if k not in t.rejected and k > (t.recovered or -1)]
        if missed:
            t.reasons.append(f"damaged steps {missed} not reported as rejected")
            t.hash_ok = False

    # -- CLI cross-check and resumes ----------------------------------------------------------
    def cli_checks(self) -> None:
        by_url: dict[str, list[Trial]] = {}
        for t in self.trials:
            if t.recovered != "raised":
                by_url.setdefault(t.url, []).append(t)
        if not by_url:
            return
        _log(self.cfg, f"CLI cross-check: `agck recover STORE --json` on {len(by_url)} stores")

        def one(item):
            url, ts = item
            try:
                steps = checker.cli_recover(url)
            except Exception as e:
                for t in ts:
                    t.cli_step = "error"
                    t.reasons.append(f"agck recover failed: {e}")
                return
            for t in ts:
                t.cli_step = steps.get(t.run)
        with ThreadPoolExecutor(max_workers=self.cfg.jobs) as ex:
            list(ex.map(one, by_url.items()))

    def resumes(self) -> None:
        cfg = self.cfg
        picks, done = [], set()
        for t in self.trials:
            key = (t.store, t.fault)
            if t.reached and t.recovered != "raised" and key not in done \
                    and sum(1 for p in picks if (p.store, p.fault) == key) < cfg.resume_samples:
                picks.append(t)
                if sum(1 for p in picks if (p.store, p.fault) == key) >= cfg.resume_samples:
                    done.add(key)
        sub = [p for p in picks if p.fault in ("kill", "failpoint", "pgkill")]
        dist = [p for p in picks if p.fault == "dist"]
        if dist:
            _log(cfg, f"resuming {len(dist)} crashed multi-rank runs to the end")
            self._pool(lambda item: self.resume_dist(item[0]), [(p,) for p in dist],
                       workers=max(1, cfg.jobs // cfg.ranks))
        inproc = [p for p in picks if p.fault in ("powerloss", "corrupt")]   # (distpower: checked, not resumed)
        if sub:
            _log(cfg, f"resuming {len(sub)} crashed runs to the end")
            self._pool(lambda item: self.resume_sub(item[0]), [(p,) for p in sub])
        for p in inproc:
            if not self._time_left():
                break
            store = self._open(p.url)
            try:
                p.resume = self.resume_inprocess(store, p.run)
                want = p.recovered or 0
                if p.resume["ok"] and p.resume["from"] != want:
                    p.resume.update(ok=False, why=f"resumed from {p.resume['from']}, recovery said {want}")
            except Exception as e:
                p.resume = {"ok": False, "error": True, "why": f"{type(e).__name__}: {e}"}
            finally:
                store.close()

    def resume_sub(self, t: Trial) -> None:
        d = os.path.join(self.work, "t", f"{t.id}-resume")
        os.makedirs(d)
        p = self._spawn(self._workload_cmd(self._client_url(t), t.run, d), d)
        try:
            p.wait(timeout=600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        if p.returncode != 0:
            t.resume = {"ok": False, "error": True, "why": f"exit {p.returncode}: {self._stderr(d)[-300:]}"}
            return
        with open(os.path.join(d, "out.json")) as f:
            out = json.load(f)
        want = t.recovered if isinstance(t.recovered, int) else 0
        ok = out["final_hash"] == self.ref["final_hash"] and out["resumed_from"] == want
        why = None if ok else (f"final hash {out['final_hash']} (uninterrupted {self.ref['final_hash']}), "
                               f"resumed from {out['resumed_from']}, recovery said {want}")
        t.resume = {"ok": ok, "from": out["resumed_from"], "why": why}

    # -- the whole campaign --------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        t0 = time.monotonic()
        try:
            self.setup()
            if set(cfg.faults) & {"kill", "failpoint", "pgkill", "stale"}:
                self.reference()
            self.kill_trials()
            self.stale_trials()
            self.dist_trials()
            self.pgkill_trials()
            self.powerloss_trials()
            self.corrupt_trials()
            chunkrot.trials(self)
            self.cli_checks()
            self.resumes()
        finally:
            self.cleanup()
        for t in self.trials:
            checker.classify(t)
            if t.fault == "kill" and t.reached:
                t.point = f"after-ack-{t.last_ack}" + ("+in-flight" if t.in_flight else "")
        return report(self, time.monotonic() - t0)


# --- the report ------------------------------------------------------------------------------

def report(c: Campaign, wall: float) -> dict:
    rows = []
    keys = sorted({(t.store, t.fault) for t in c.trials},
                  key=lambda k: (STORES.index(k[0]), FAULTS.index(k[1])))
    for store, fault in keys:
        ts = [t for t in c.trials if (t.store, t.fault) == (store, fault)]
        secs = [t.rec_seconds for t in ts if t.rec_seconds is not None]
        row = {"store": store, "fault": fault, "trials": len(ts),
               "faults_delivered": sum(t.reached for t in ts),
               "crash_points": len({t.point for t in ts if t.reached and t.point}),
               **{o: sum(t.outcome == o for t in ts) for o in OUTCOMES},
               "median_recovery_ms": round(1000 * statistics.median(secs), 2) if secs else None,
               "resumes_checked": sum(t.resume is not None for t in ts),
               "resumes_ok": sum(bool(t.resume and t.resume.get("ok")) for t in ts)}
        rows.append(row)
    totals = {k: sum(r[k] for r in rows) for k in ("trials", "faults_delivered", "ok", "indeterminate", "lost",
                                                    "corrupt", "error", "resumes_checked", "resumes_ok")}
    cfg = c.cfg
    out = {"config": {k: v for k, v in vars(cfg).items() if k != "counts"} | {
               "counts": {str(k): v for k, v in cfg.counts.items()}},
           "rows": rows, "totals": totals, "wall_seconds": round(wall, 1), "notes": c.notes,
           "postgres_kills": getattr(c, "pg_kills", None),
           "failures": [t.as_dict() for t in c.trials if t.outcome in ("lost", "corrupt", "error")],
           "trials": [t.as_dict() for t in c.trials]}
    return out


def markdown(rep: dict) -> str:
    cols = ["store", "fault", "trials", "faults_delivered", "crash_points", "ok", "indeterminate", "lost",
            "corrupt", "error", "median_recovery_ms", "resumes_ok"]
    heads = ["store", "fault", "trials", "faults hit", "distinct points", "ok", "indeterminate", "lost",
             "corrupt", "error", "median recovery (ms)", "resumes ok"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---:" if i > 1 else "---" for i in range(len(cols))) + "|"]
    for r in rep["rows"]:
        cells = []
        for k in cols:
            v = r[k]
            if k == "resumes_ok":
                v = f"{r['resumes_ok']}/{r['resumes_checked']}"
            cells.append("-" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    t = rep["totals"]
    lines.append(f"| **total** | | {t['trials']} | {t['faults_delivered']} | | {t['ok']} | {t['indeterminate']} | "
                 f"{t['lost']} | {t['corrupt']} | {t['error']} | | {t['resumes_ok']}/{t['resumes_checked']} |")
    text = "\n".join(lines)
    text += f"\n\nwall time {rep['wall_seconds']} s"
    if rep.get("postgres_kills") is not None:
        text += f"; Postgres server kills: {rep['postgres_kills']}"
    for n in rep["notes"]:
        text += f"\n\nnote: {n}"
    for f in rep["failures"][:50]:
        text += (f"\n\n**{f['outcome']}** trial {f['id']} ({f['store']}/{f['fault']}, run {f['run']}, "
                 f"point {f['point']!r}): " + "; ".join(f["reasons"]))
    return text


def chart(rep: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = rep["rows"]
    if not rows:
        return False
    labels = [f"{r['store']}\n{r['fault']}" for r in rows]
    colors = {"ok": "#4caf50", "indeterminate": "#90caf9", "lost": "#e53935", "corrupt": "#8e24aa",
              "error": "#ffb300"}
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    bottom = [0] * len(rows)
    for o in OUTCOMES:
        vals = [r[o] for r in rows]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=o, color=colors[o])
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_yscale("symlog")
    ax.set_ylim(0, max(bottom) * 2)   # symlog's automatic top clips the tallest bar
    ax.set_ylabel("trials")
    t = rep["totals"]
    ax.set_title(f"agck crash campaign: {t['trials']} trials, {t['lost']} lost, {t['corrupt']} corrupt")
    ax.legend(loc="upper right", fontsize=8)
    plt.xticks(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(rep: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "crash_report.json"), "md": os.path.join(out_dir, "crash_report.md"),
             "png": os.path.join(out_dir, "crash_report.png")}
    with open(paths["json"], "w") as f:
        json.dump(rep, f, indent=1, default=str)
    with open(paths["md"], "w") as f:
        f.write("# agck crash campaign\n\n" + markdown(rep) + "\n")
    if not rep["config"].get("chart", True) or not chart(rep, paths["png"]):
        paths.pop("png")
    return paths


def exit_code(rep: dict) -> int:
    t = rep["totals"]
    if t["lost"] or t["corrupt"]:
        return 1
    if t["error"]:
        return 2
    return 0
