"""What every fault kind's trials run on: the campaign's configuration, its servers and
stores, the workload subprocess, the reference run, the checks of a trial's store.

Contract. :class:`TrialKit` owns what the fault kinds share: the private Postgres
cluster and the stores' URLs (:meth:`TrialKit.setup`, :meth:`TrialKit.cleanup`),
spawning the workload subprocess, the reference run every subprocess trial is
compared with, the in-process pipeline trees, checking a trial's store, the
CLI cross-check and the in-process resume. Each fault module has ``trials(c)``, ``c``
a TrialKit (in a campaign, a :class:`crashtests.campaign.Campaign`), which runs
that kind's trials (a no-op when the kind is not configured): it creates each trial
with :meth:`TrialKit.new_trial`, and records every trial it does not start because
the time limit has passed as skipped (``starts``, ``skip``, ``skip_rest``,
``skip_all``; :meth:`TrialKit.pool` does it for the queued trials it does not
start); a harness failure is recorded on its trial as an error, never dropped.
The fault modules import this module, never :mod:`crashtests.campaign`, which
imports them all.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from agck.stores import compression

from . import checker, pgcluster, s3server
from .checker import FAULTS, STORES, Trial
from .trialstores import TrialStores
from .workload import PROFILES

__all__ = ["STORES", "FAULTS", "PREFIX", "PG_STORES", "PROFILES", "Config", "TrialKit", "log"]

# each store's fail points; "pgs3" is a Postgres store whose chunks are in the object store (agck_objects)
PREFIX = {"file": ("file.",), "sqlite": ("sqlite.",), "postgres": ("pg.",), "s3": ("s3.",), "pgs3": ("pg.", "pgobj.")}
PG_STORES = ("postgres", "pgs3")    # stores whose workloads hold a Postgres connection
S3_BUCKET = "agck-crash"
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
    profile: str = "small"              # the workload's state size (crashtests.workload.PROFILES)
    compress: str | None = None         # every store's compress option (AGCK_COMPRESS); None: their default
    encrypt: bool = False               # every store encrypted, under a random key (AGCK_KEY_FILE; file store)

    def n(self, store: str, fault: str) -> int:
        return self.counts.get((store, fault), self.counts.get(fault, self.trials))


_T0 = time.monotonic()


def log(cfg: Config, msg: str) -> None:
    if not cfg.quiet:
        print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class TrialKit:
    def __init__(self, cfg: Config, first_id: int = 0):
        if cfg.profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, not {cfg.profile!r}")
        self.cfg = cfg
        # every store the campaign and its processes open compresses as asked (their default otherwise)
        if cfg.compress is None:
            os.environ.pop(compression.ENV, None)
        else:
            os.environ[compression.ENV] = cfg.compress
        self.rng = random.Random(cfg.seed)
        self.trials: list[Trial] = []
        self.work = tempfile.mkdtemp(prefix="agck-crash-")
        os.environ.pop("AGCK_KEY", None)
        if cfg.encrypt:      # a raw key in a file: every store the campaign and its processes open uses it
            path = os.path.join(self.work, "key")
            with open(path, "w") as f:
                f.write(os.urandom(32).hex())
            os.environ["AGCK_KEY_FILE"] = path
        else:
            os.environ.pop("AGCK_KEY_FILE", None)
        self.notes: list[str] = []
        self.cluster: pgcluster.PgCluster | None = None
        self.urls: dict[str, str] = {}        # store -> URL the subprocess trials use
        self.ref: dict = {}
        self.est: dict[str, float] = {}       # store -> estimated workload duration (s)
        self.lock = threading.Lock()
        self.last_id = first_id               # trial ids go on from an earlier campaign's
        self.t0 = time.monotonic()
        self.pg_skipped: str | None = None
        self.s3: s3server.Seaweed | None = None
        self.s3_kills = 0
        self.proxy = None                     # the fault proxy of the netcut trials
        self.pair = None                      # the primary and standby of the failover trials
        self.power = None                     # the cluster of the dbpower trials, its server under the shim
        self.own = TrialStores(self)          # the large profile's stores of one trial each

    # -- trials and the time limit ---------------------------------------------------------
    def new_trial(self, store: str, fault: str, run_prefix: str, url: str) -> Trial:
        with self.lock:
            self.last_id += 1
            t = Trial(id=self.last_id, store=store, fault=fault, run=f"{run_prefix}{self.last_id}", url=url,
                      profile=self.cfg.profile)
            self.trials.append(t)
        return t

    def time_left(self) -> bool:
        return time.monotonic() - self.t0 < self.cfg.time_limit

    def skip(self, t: Trial) -> None:
        """``t`` will not start: the time limit has passed. Not judged, and no error."""
        t.skipped = True
        t.reasons.append(f"not started: campaign time limit ({self.cfg.time_limit:g} s)")

    def skip_rest(self, store: str, fault: str, n: int) -> None:
        """Record ``n`` trials of (store, fault) that will not start: the time limit has passed."""
        for _ in range(n):
            self.skip(self.new_trial(store, fault, "skipped", ""))

    def skip_all(self, fault: str, stores: tuple | None = None) -> None:
        """Record every trial of ``fault`` (on ``stores``, default all) as skipped: none will start."""
        for store in stores or self.cfg.stores:
            self.skip_rest(store, fault, self.cfg.n(store, fault))

    def starts(self, fault: str) -> bool:
        """Whether ``fault``'s trials are to start: not when it is not configured, nor once the
        time limit has passed (every trial of it is then recorded as skipped)."""
        if fault not in self.cfg.faults:
            return False
        if not self.time_left():
            self.skip_all(fault)
            return False
        return True

    def pool(self, fn, items, workers: int | None = None, *, trials: bool = True) -> None:
        """``fn(item)`` for every item, ``workers`` (default ``cfg.jobs``) at a time; ``item[0]``
        is a Trial. An item not started before the time limit is left: its trial skipped (with
        ``trials``; a resume is left unchecked). A harness failure is reported on its trial."""
        def guarded(item):
            if not self.time_left():
                if trials:
                    self.skip(item[0])
                return
            try:
                fn(item)
            except Exception as e:  # a harness failure is reported on its trial, never dropped
                item[0].reasons.append(f"harness error: {type(e).__name__}: {e}")
                item[0].recovered = "raised"
        with ThreadPoolExecutor(max_workers=workers or self.cfg.jobs) as ex:
            list(ex.map(guarded, items))

    # -- setup -------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if set(PG_STORES) & set(cfg.stores):
            reason = pgcluster.available()
            if reason:
                self.pg_skipped = reason
                self.notes.append(f"{', '.join(s for s in cfg.stores if s in PG_STORES)} skipped: {reason}")
                cfg.stores = tuple(s for s in cfg.stores if s not in PG_STORES)
            else:
                log(cfg, "starting a private Postgres cluster")
                self.cluster = pgcluster.PgCluster().start()
                # commit_delay (max 100 ms) holds each COMMIT between its WAL insert and the flush:
                # a window in which the server can be killed mid-commit on purpose.
                self.cluster.create_db("crash", {"commit_delay": 100000, "commit_siblings": 0})
                self.cluster.create_db("corrupt")
                from agck.stores.postgres.store import PostgresStore
                for db in ("crash", "corrupt"):
                    PostgresStore(self.cluster.dsn(db), init=True).close()
                self.urls["postgres"] = self.cluster.dsn("crash")
        if {"s3", "pgs3"} & set(cfg.stores):
            reason = s3server.seaweed_available()
            try:
                import obstore  # noqa: F401
            except ImportError:
                reason = reason or "obstore not installed"
            if reason:
                self.notes.append(f"{', '.join(s for s in cfg.stores if s in ('s3', 'pgs3'))} skipped: {reason}")
                cfg.stores = tuple(s for s in cfg.stores if s not in ("s3", "pgs3"))
            else:
                log(cfg, "starting a private SeaweedFS server")
                for k, v in s3server.CREDENTIALS.items():     # the workloads inherit them
                    os.environ.setdefault(k, v)
                self.s3 = s3server.Seaweed(self.work).start()
                self.s3.bucket(S3_BUCKET)
                self.urls["s3"] = self.s3_url("kill")
        if "pgs3" in cfg.stores:
            self.urls["pgs3"] = self.catalog_url("crash", "cat", "kill-catalog")
            from agck.stores import open_store
            open_store(self.urls["pgs3"], init=True).close()      # its tables, bound to its object prefix
        self.urls["file"] = os.path.join(self.work, "kill-file")
        self.urls["sqlite"] = f"sqlite:///{self.work}/kill.db"

    def trial_url(self, store: str) -> str:
        """Where a subprocess trial on ``store`` writes: the store's shared one, or with the
        large profile an empty one of its own (:mod:`crashtests.trialstores`)."""
        return self.urls[store] if self.cfg.profile == "small" else self.own.url(store)

    def s3_url(self, prefix: str) -> str:
        return self.s3.url(S3_BUCKET, prefix)

    def catalog_url(self, db: str, prefix: str, objects: str) -> str:
        """A Postgres store of the private cluster (tables ``prefix``) whose chunks are in the
        object store under ``objects``, as one URL (agck_prefix, agck_objects)."""
        return (self.cluster.dsn(db) + f"&agck_prefix={prefix}&agck_objects="
                + urllib.parse.quote(self.s3_url(objects), safe=":/"))

    def cleanup(self) -> None:
        kills = None
        if self.pair is not None:          # kept until now: the CLI cross-check reads their stores
            kills = sum(node.kills for node in self.pair.nodes)
            self.pair.destroy()
            self.pair = None
        if self.power is not None:
            kills = (kills or 0) + self.power.kills
            self.power.destroy()
            self.power = None
        if self.s3 is not None:
            self.s3.close()
            self.s3 = None
        if kills is not None:
            self.pg_kills = kills
        if self.cluster is not None:
            self.pg_kills = self.cluster.kills + (kills or 0)
            self.cluster.destroy()
            self.cluster = None
        if not self.cfg.keep:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- the workload subprocess --------------------------------------------------------
    def workload_cmd(self, url: str, run: str, d: str, mode: str = "auto", extra=()) -> list[str]:
        c = self.cfg
        return [sys.executable, "-m", "crashtests.workload", "--store", url, "--run", run,
                "--steps", str(c.steps), "--every", str(c.every), "--device", c.device, "--mode", mode,
                "--profile", c.profile,
                "--step-sleep", str(c.step_sleep), "--ack-log", os.path.join(d, "acks"),
                "--out", os.path.join(d, "out.json"), *extra]

    def env(self, failpoints: str | None = None) -> dict:
        env = dict(os.environ)
        env.pop("AGCK_FAILPOINTS", None)
        if failpoints:
            env["AGCK_FAILPOINTS"] = failpoints
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS, for bit-exact resume
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        return env

    def spawn(self, cmd, d: str, failpoints: str | None = None) -> subprocess.Popen:
        err = open(os.path.join(d, "stderr"), "wb")
        try:
            return subprocess.Popen(cmd, cwd=REPO, env=self.env(failpoints), stdout=subprocess.DEVNULL,
                                    stderr=err, stdin=subprocess.DEVNULL)
        finally:
            err.close()

    @staticmethod
    def finish(p: subprocess.Popen, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``p`` to exit, else kill it; whether it hung."""
        try:
            p.wait(timeout=timeout)
            return False
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            return True

    @staticmethod
    def crashed(t: Trial, p: subprocess.Popen, failpoint: bool) -> None:
        """A crashed workload's end: killed if it still runs, and whether the trial's fault
        was reached (a fail point's kill is the process's SIGKILL)."""
        if p.poll() is None:
            p.kill()
            p.wait()
        if failpoint:
            t.reached = p.returncode == -9
        if not t.reached:
            t.detail = f"finished before the fault (exit {p.returncode})"

    def reference(self) -> None:
        """One uninterrupted run: per-step hashes, final hash, and how long the phases take."""
        d = os.path.join(self.work, "reference")
        os.makedirs(d)
        cmd = self.workload_cmd(os.path.join(d, "store"), "reference", d, extra=[
            "--hashes", os.path.join(d, "hashes.json"), "--full-hashes", os.path.join(d, "full.json")])
        t0 = time.monotonic()
        p = self.spawn(cmd, d)
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
            raise RuntimeError(f"the reference run failed ({p.returncode}): {self.stderr(d)}")
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
            extra = 0.12 * (self.cfg.steps // self.cfg.every) if s in PG_STORES else 0.0
            self.est[s] = (total - opened + extra) * slow
        log(self.cfg, f"reference run: {total:.1f}s (imports done at {opened:.1f}s, first ack at "
                       f"{self.ref['first_ack']:.1f}s), final hash {out['final_hash']}")

    def wait_started(self, p: subprocess.Popen, d: str, timeout: float = 300) -> float:
        """Wait until the workload has imported torch and opened its ack log (the run proper starts);
        returns when that was, on the monotonic clock."""
        acks = os.path.join(d, "acks")
        deadline = time.monotonic() + timeout
        while p.poll() is None and time.monotonic() < deadline and not os.path.exists(acks):
            time.sleep(0.005)
        return time.monotonic()

    def kill_delay(self, store: str) -> float:
        """A random instant of the run proper (restore, steps, checkpoints, close)."""
        return self.rng.uniform(0, 0.9 * self.est[store])

    def stderr(self, d: str) -> str:
        try:
            with open(os.path.join(d, "stderr"), "rb") as f:
                return f.read()[-1500:].decode("utf-8", "replace")
        except OSError:
            return ""

    def open(self, url: str):
        from agck.stores import open_store
        if url.startswith(("postgres", "sqlite:")):
            return open_store(url)
        return open_store(url, create=True)

    def check(self, t: Trial, d: str) -> None:
        from crashtests.workload import read_acks
        t.acked = read_acks(os.path.join(d, "acks"))
        self.check_store(t, checker.check_library, self.ref["full"])

    def check_store(self, t: Trial, check, ref) -> None:
        """``check(store, t, ref)`` on ``t``'s store, opened for it and closed after; on
        Postgres, only once the trial's workload backends are gone (their transactions settled)."""
        if t.store in PG_STORES:
            self._wait_backend_gone(t)
        store = self.open(t.url)
        try:
            check(store, t, ref)
        finally:
            store.close()

    def client_url(self, t: Trial) -> str:
        """The workload's URL: for Postgres, tagged with the run so that its backend can be found."""
        return f"{t.url}&application_name={t.run}" if t.store in PG_STORES else t.url

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

    # -- server kills: trials one after another on one shared server -----------------------------
    def revive_cluster(self) -> None:
        """Restart the private Postgres server if it is not running (after a harness failure)."""
        if self.cluster.proc is None or self.cluster.proc.poll() is not None:
            self.cluster.restart()

    def server_kill_trials(self, store: str, fault: str, prefix: str, what: str, trial, revive) -> None:
        """``cfg.n(store, fault)`` trials of ``trial(c, t, i)``, one at a time (they share the
        server); ``revive()`` brings the server back after a harness failure."""
        n = self.cfg.n(store, fault)
        log(self.cfg, f"{what} kills: {n}")
        for i in range(n):
            t = self.new_trial(store, fault, prefix, "")
            if not self.time_left():
                self.skip(t)
                continue
            try:
                t.url = self.trial_url(store)
                trial(self, t, i)
            except Exception as e:
                t.reasons.append(f"harness error: {type(e).__name__}: {e}")
                t.recovered = "raised"
                revive()

    def recheck_older(self, t: Trial, faults: tuple) -> None:
        """After a server kill in trial ``t``: every earlier trial of ``faults`` on the same
        server must still recover to the step it recovered to before (else it is corrupt);
        of the large profile's, those whose stores are still there."""
        by_url: dict[str, list[Trial]] = {}
        for old in self.trials:
            if old is not t and old.store == t.store and old.fault in faults and old.url \
                    and not old.skipped and not self.own.gone(old.url):
                by_url.setdefault(old.url, []).append(old)
        for url, olds in by_url.items():
            store = self.open(url)
            try:
                checker.recheck(store, olds, self.ref["full"], f"server kill in trial {t.id}")
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
        state = build_state(cfg.steps, "cpu", profile=cfg.profile)
        trees, full, prev = {}, {}, {}
        for i in range(cfg.steps):
            state = run_step(state, i)
            k = i + 1
            if k % cfg.every == 0 or k == cfg.steps:
                tree = {"state": capture(state), "step": k, "rng": rng_state()}
                full[k] = state_hash(tree)
                trees[k] = checkpoint.loads(checkpoint.dumps(tree)).state   # a private copy
                big = trees[k]["state"].get("large", {})
                for name, x in big.items():    # the large profile's unchanged tensors: one copy for all steps
                    if name in prev and torch.equal(prev[name], x):
                        big[name] = prev[name]
                prev = big
        self._final_cpu = state_hash(state)
        if self.ref and self.cfg.device == "cpu":
            for k, h in full.items():
                if self.ref["full"].get(k) != h:
                    self.notes.append(f"in-process step {k} hash {h} differs from the reference run's "
                                      f"{self.ref['full'].get(k)}")
        self._trees, self.full = trees, full
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

        state = build_state(cfg.steps, "cpu", profile=cfg.profile)
        for i in range(cfg.steps):
            state = step(state, i)
        start = step.snapshotter.start_step
        step.close()
        h = state_hash(state)
        ok = h == self._final_cpu
        return {"ok": ok, "from": start, "why": None if ok else f"final hash {h}, uninterrupted {self._final_cpu}"}

    # -- CLI cross-check -----------------------------------------------------------------------
    def cli_checks(self) -> None:
        by_url: dict[str, list[Trial]] = {}
        for t in self.trials:
            # (a journal trial's run holds no checkpoints: its journal is judged by its own module;
            # a failover trial that resumed its pipeline has run on to the end since it was judged;
            # a large trial whose store was dropped was checked before)
            if t.recovered != "raised" and not t.skipped and t.fault != "journal" and t.cli_step == "unchecked" \
                    and not (t.fault == "failover" and t.resume is not None):
                by_url.setdefault(t.url, []).append(t)
        if not by_url:
            return
        log(self.cfg, f"CLI cross-check: `agck recover STORE --json` on {len(by_url)} stores")
        urls = list(by_url)
        n = max(1, self.cfg.jobs)
        with ThreadPoolExecutor(max_workers=n) as ex:   # one interpreter per worker, each a share of the stores
            list(ex.map(lambda share: self.cli_check({url: by_url[url] for url in share}),
                        [urls[i::n] for i in range(n)]))

    @staticmethod
    def cli_check(by_url: dict) -> None:
        """`agck recover STORE --json` on the stores of ``by_url`` ({url: its trials}), in one
        interpreter: each trial's ``cli_step`` is what the CLI recovered of its run."""
        urls = list(by_url)
        if not urls:
            return
        try:
            found = checker.cli_recover_many(urls)
        except Exception as e:
            found = {url: e for url in urls}
        for url in urls:
            steps = found[url]
            for t in by_url[url]:
                if isinstance(steps, Exception):
                    t.cli_step = "error"
                    t.reasons.append(f"agck recover failed: {steps}")
                elif t.load is not None:    # many runs: each must recover to its last step
                    short = {r: steps.get(r) for r in t.load["runs"] if steps.get(r) != t.load["last"]}
                    t.cli_step = t.recovered if not short else None
                    if short:
                        t.reasons.append(f"the CLI recovered {dict(list(short.items())[:3])}, "
                                         f"not step {t.load['last']}")
                else:
                    t.cli_step = steps.get(t.run)
