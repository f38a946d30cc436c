"""Fault kind ``dist``: the workload as a job of ``cfg.ranks`` processes under torch.distributed.

Each job's ranks run the workload with gloo; every rank acknowledges the committed
steps in its own ack log. Four kinds of trial, in turn:

* ``kill-one``  one rank SIGKILLed at a random instant of the run proper;
* ``kill-all``  every rank at once;
* ``failpoint`` one rank killed at a fail point of the collective write (after its
                part; the coordinator before or after the commit record) or of the
                store's write path; the survivors are killed a moment later, as a job
                agent does (:func:`reap`);
* ``stale``     every rank stopped (SIGSTOP) while a second job takes the run over and
                finishes it, then let go (fencing, as the ``stale`` fault).

Contract: :func:`trials` makes one uninterrupted multi-rank reference run (each
rank's per-step hashes and final hash), then runs the trials, ``cfg.jobs //
cfg.ranks`` jobs at a time; none is started once the time limit has passed (they
are skipped, the reference run too). No step may be visible without every part,
and every part of the recovered step must match the reference run's rank
(:func:`crashtests.checker.check_sharded`). :func:`resume` runs a crashed job's
run to the end with a whole job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from . import checker
from .checker import Trial
from .trialkit import PREFIX, STORES, TrialKit, log

KINDS = ("kill-one", "kill-all", "failpoint", "stale")


def spawn(c: TrialKit, url: str, run: str, d: str, mode: str, failpoints: dict | None = None,
          extra: dict | None = None) -> list[subprocess.Popen]:
    """The ranks of one job, each with its own directory (ack log, out.json, stderr)."""
    world = c.cfg.ranks
    os.makedirs(d, exist_ok=True)
    rendezvous = os.path.join(d, "rendezvous")
    procs = []
    for r in range(world):
        dr = os.path.join(d, f"r{r}")
        os.makedirs(dr)
        cmd = c.workload_cmd(url, run, dr, mode, extra=[
            "--world", str(world), "--rank", str(r), "--rendezvous", rendezvous, *(extra or {}).get(r, ())])
        procs.append(c.spawn(cmd, dr, (failpoints or {}).get(r)))
    return procs


def reap(procs: list, grace: float = 3.0, timeout: float = 300.0) -> list[int]:
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


def _outs(c: TrialKit, d: str) -> list[dict]:
    """Every rank's out.json of the job in ``d``."""
    outs = []
    for r in range(c.cfg.ranks):
        with open(os.path.join(d, f"r{r}", "out.json")) as f:
            outs.append(json.load(f))
    return outs


def _acked(c: TrialKit, d: str) -> set:
    """The steps any rank of the job in ``d`` acknowledged."""
    from crashtests.workload import read_acks
    return {s for r in range(c.cfg.ranks) for s in read_acks(os.path.join(d, f"r{r}", "acks"))}


def reference(c: TrialKit) -> None:
    """One uninterrupted job: each rank's per-step hashes and final hash."""
    d = os.path.join(c.work, "dist-reference")
    t0 = time.monotonic()
    world = c.cfg.ranks
    procs = spawn(c, os.path.join(d, "store"), "reference", d, "auto",
                  extra={r: ["--full-hashes", os.path.join(d, f"r{r}", "full.json")] for r in range(world)})
    opened = first_ack = None
    acks = os.path.join(d, "r0", "acks")
    while any(p.poll() is None for p in procs) and time.monotonic() - t0 < 600:
        if opened is None and os.path.exists(acks):
            opened = time.monotonic() - t0
        if first_ack is None and os.path.exists(acks) and os.path.getsize(acks):
            first_ack = time.monotonic() - t0
        time.sleep(0.005)
    codes = reap(procs)
    total = time.monotonic() - t0
    if codes != [0] * world:
        raise RuntimeError(f"the multi-rank reference run failed ({codes}): {c.stderr(os.path.join(d, 'r0'))}")
    full = []
    for r in range(world):
        with open(os.path.join(d, f"r{r}", "full.json")) as f:
            full.append({int(k): v for k, v in json.load(f).items()})
    final = [o["final_hash"] for o in _outs(c, d)]
    c.dist_ref = {"full": full, "final": final, "seconds": total, "first_ack": first_ack or total * 0.7,
                  "run_proper": total - (opened if opened is not None else total * 0.6)}
    log(c.cfg, f"multi-rank reference run ({world} ranks): {total:.1f}s, first ack at "
                f"{c.dist_ref['first_ack']:.1f}s")


def trials(c: TrialKit) -> None:
    from agck.failpoints import POINTS
    cfg = c.cfg
    if not c.starts("dist"):
        return
    reference(c)
    jobs = []
    nputs = max(1, cfg.steps // cfg.every)
    for store in cfg.stores:
        # the collective's own points first, a different one first on each store
        points = [p for p in POINTS if p.startswith("dist.")] + [p for p in POINTS if p.startswith(PREFIX[store])]
        for j in range(cfg.n(store, "dist")):
            kind = KINDS[j % len(KINDS)]
            rank = c.rng.randrange(cfg.ranks)
            spec = None
            if kind == "failpoint":
                point = points[(j // len(KINDS) + STORES.index(store)) % len(points)]
                if point.startswith("dist.") and point != "dist.after_part":
                    rank = 0            # the coordinator's commit
                spec = f"{point}=kill@{c.rng.randint(1, nputs)}"
            t = c.new_trial(store, "dist", "d", c.urls[store])
            jobs.append((t, kind, rank, spec, c.rng.choice(("sync", "async"))))
    if not jobs:
        return
    c.rng.shuffle(jobs)
    jobs_at_once = max(1, cfg.jobs // cfg.ranks)
    log(cfg, f"multi-rank trials: {len(jobs)} jobs of {cfg.ranks} ranks, {jobs_at_once} at a time")
    c.pool(lambda j: trial(c, *j), jobs, workers=jobs_at_once)


def trial(c: TrialKit, t: Trial, kind: str, rank: int, spec: str | None, mode: str) -> None:
    if kind == "stale":
        return stale_trial(c, t, mode)
    d = os.path.join(c.work, "t", str(t.id))
    procs = spawn(c, c.client_url(t), t.run, d, mode, failpoints={rank: spec} if spec else None)
    if kind in ("kill-one", "kill-all"):
        c.wait_started(procs[0], os.path.join(d, "r0"))
        delay = c.rng.uniform(0, 0.9 * c.dist_ref["run_proper"])
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.005)
        victims = [procs[rank]] if kind == "kill-one" else procs
        if all(p.poll() is None for p in victims):
            for p in victims:
                p.send_signal(signal.SIGKILL)
    codes = reap(procs)
    label = f"{kind} rank {rank}" if kind == "kill-one" else kind
    if spec is not None:
        label = f"rank {rank} {spec}"
    if codes == [0] * len(codes):
        t.detail = "finished before the fault"
    elif any(code == -signal.SIGKILL for code in codes):
        t.reached = True
        t.in_flight = spec is not None
        t.point = label
    else:
        t.detail = f"ranks exited {codes}: {c.stderr(os.path.join(d, f'r{rank}'))[-300:]}"
        t.reasons.append(f"the job failed on its own (exit codes {codes})")
        t.recovered = "raised"
    t.acked = sorted(_acked(c, d))
    c.check_store(t, checker.check_sharded, c.dist_ref["full"])


def stale_trial(c: TrialKit, t: Trial, mode: str) -> None:
    """Every rank of a job stopped (SIGSTOP) at a random instant after its first
    acknowledged step; a second job takes the run over (a new epoch) and finishes
    it; then the first is let go. It may acknowledge only steps it committed before
    the takeover (at or before the step the second resumed from)."""
    from crashtests.workload import read_acks
    base = os.path.join(c.work, "t", str(t.id))
    d_old, d_new = os.path.join(base, "old"), os.path.join(base, "new")
    url = c.client_url(t)
    old = spawn(c, url, t.run, d_old, mode)
    new = None
    try:
        deadline = time.monotonic() + 300
        first = os.path.join(d_old, "r0", "acks")
        while all(p.poll() is None for p in old) and time.monotonic() < deadline and not read_acks(first):
            time.sleep(0.005)
        time.sleep(c.rng.uniform(0, c.dist_ref["run_proper"]) / 2)
        if any(p.poll() is not None for p in old):
            reap(old)
            t.detail = "finished before the fault"
            t.acked = sorted(_acked(c, d_old))
            c.check_store(t, checker.check_sharded, c.dist_ref["full"])
            return
        for p in old:
            p.send_signal(signal.SIGSTOP)
        t.reached = True
        before = _acked(c, d_old)
        new = spawn(c, url, t.run, d_new, mode)
        deadline = time.monotonic() + max(10.0, 3 * c.dist_ref["seconds"])
        waited = False
        while any(p.poll() is None for p in new):
            if time.monotonic() > deadline:
                waited = True         # the stopped job holds a commit the takeover waits for
                break
            time.sleep(0.01)
        for p in old:
            p.send_signal(signal.SIGCONT)
        new_codes = reap(new, timeout=300)
        reap(old, timeout=120)
    finally:
        for p in old + (new or []):
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    t.point = "stopped inside a commit" if waited else f"stopped after ack {max(before) if before else None}"
    if new_codes != [0] * len(new_codes):
        t.reasons.append(f"the new job failed (exit codes {new_codes}): "
                         f"{c.stderr(os.path.join(d_new, 'r0'))[-300:]}")
        t.recovered = "raised"
        return
    outs = _outs(c, d_new)
    finals = [o["final_hash"] for o in outs]
    resumed_from = outs[0]["resumed_from"] or 0
    ok = finals == c.dist_ref["final"]
    t.resume = {"ok": ok, "from": resumed_from,
                "why": None if ok else f"final hashes {finals} (uninterrupted {c.dist_ref['final']})"}
    after = _acked(c, d_old)
    t.acked = sorted(after | _acked(c, d_new))
    c.check_store(t, checker.check_sharded, c.dist_ref["full"])
    stale = sorted(k for k in after - before if k > resumed_from)
    if stale:
        t.hash_ok = False
        t.reasons.append(f"the old job committed steps {stale} after the run was taken over "
                         f"(the new one resumed from {resumed_from})")


def resume(c: TrialKit, t: Trial) -> None:
    """Run ``t``'s crashed multi-rank run to the end with a whole job: every rank must
    resume from the step recovery chose and end bit-identical to its reference."""
    d = os.path.join(c.work, "t", f"{t.id}-resume")
    codes = reap(spawn(c, c.client_url(t), t.run, d, "auto"), timeout=600)
    if codes != [0] * len(codes):
        t.resume = {"ok": False, "error": True,
                    "why": f"exit codes {codes}: {c.stderr(os.path.join(d, 'r0'))[-300:]}"}
        return
    outs = _outs(c, d)
    want = t.recovered if isinstance(t.recovered, int) else 0
    finals = [o["final_hash"] for o in outs]
    froms = {o["resumed_from"] for o in outs}
    ok = finals == c.dist_ref["final"] and froms == {want}
    t.resume = {"ok": ok, "from": outs[0]["resumed_from"],
                "why": None if ok else f"final hashes {finals} (uninterrupted {c.dist_ref['final']}), "
                                      f"resumed from {sorted(froms)}, recovery said {want}"}
