"""Host-loss trials for multi-rank jobs over tiers (agck.replicas): 4 ranks, 2 hosts.

Each trial runs a job of 4 gloo ranks, in processes of their own, checkpointing every
step through a TieredStore per rank: ranks 0-1 are host A (one local directory),
ranks 2-3 host B (another), each part replicated on the other host, a shared durable
tier (SQLite, Postgres or s3) written in the background. At a random instant host B
dies: its ranks are SIGKILLed (at a random moment, or at a fail point: after their
part, after the replicas, after the local commit), host A's ranks are killed a moment
later as a job's agent does, and host B's local tier is deleted. In some trials host
A's replicas of host B's parts are damaged too, and in some the durable tier is down
for a while before the kill. Then the job restarts with a replacement host B (an empty
local tier) and runs to the end. Judged against an out-of-band log (each step
acknowledged local, each step seen durable):

- **lost**: the restored step is older than one acknowledged durable;
- **not newest**: the restored step is not the newest step that the surviving tiers
  (host A's local tier, the durable tier) hold whole for every rank, checked before the
  restart by reading every part verified;
- **corrupt**: a rank's restored state is not the one it had at that step;
- **resume**: a rank's state at the end is not that of a job never interrupted.

    python -m crashtests.hostloss_ranks --trials 200 --durable sqlite,postgres,s3 [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from crashtests.hostloss import run_trials

RUN = "job"
STEPS = 24
WORLD = 4
WIDTH = 1 << 15          # float64 values per rank: 256 KiB
HOST_B = (2, 3)
POINTS = ("dist.after_part", "tier.after_replicas", "tier.after_local_commit")


def expected(step: int, seed: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s array checkpointed at ``step``: after the iterations 0..step-1."""
    acc = np.zeros(WIDTH)
    for i in range(step):
        acc += np.random.default_rng([seed, rank, i]).standard_normal(WIDTH)
    return acc


def host_dir(base: str, rank: int) -> str:
    return os.path.join(base, "hostA" if rank not in HOST_B else "hostB")


# -- one rank (a process of its own) ---------------------------------------------------------

def rank_work(a) -> int:
    import torch
    import torch.distributed as dist

    import agck
    from agck.errors import DurabilityError
    from agck.stores import open_store

    dist.init_process_group("gloo", init_method=f"file://{a.rdzv}", rank=a.rank, world_size=WORLD)
    durable = open_store(a.durable, **json.loads(a.durable_options))
    if a.down_for > 0:          # the durable tier down for a while: its commits refused
        t0 = time.monotonic()

        def refusing(put):
            def wrapped(*args, **kw):
                if a.down_at <= time.monotonic() - t0 < a.down_at + a.down_for:
                    raise DurabilityError("the durable tier is down (a host-loss trial)")
                return put(*args, **kw)
            return wrapped
        durable.put = refusing(durable.put)
        parts = durable.parts_store()
        parts.put = refusing(parts.put)
    store = agck.TieredStore(host_dir(a.base, a.rank), durable, durable_every=a.durable_every,
                             keep_local=a.keep_local, replicas=1)
    snap = agck.Snapshotter(store, RUN, every=1, mode="sync")
    state = snap.restore({"acc": torch.zeros(WIDTH, dtype=torch.float64), "step": 0})
    start = snap.start_step or 0
    source = snap._target.sharded.restored_from
    report = {"rank": a.rank, "started": start, "source": source,
              "rejected": [[r.step, r.reason] for r in (snap.recovery.rejected if snap.recovery else [])],
              "restored_ok": bool(np.array_equal(state["acc"].numpy(), expected(start, a.seed, a.rank))
                                  and state["step"] == max(start - 1, 0))}
    ack = open(a.ack, "a", buffering=1) if a.rank == 0 else None
    stop = threading.Event()
    if ack is not None:
        def watch():        # what the durable tier holds, as the job's user would see it
            seen = 0
            while not stop.is_set():
                d = store.last_durable_step(RUN) or 0
                if d > seen:
                    seen = d
                    ack.write(f"durable {d}\n")
                time.sleep(0.02)
        threading.Thread(target=watch, daemon=True).start()
    for i in snap.steps(a.steps):
        if ack is not None and snap.last_durable_step:
            ack.write(f"local {snap.last_durable_step}\n")
        state["acc"] += torch.from_numpy(np.random.default_rng([a.seed, a.rank, i]).standard_normal(WIDTH))
        state["step"] = i
        time.sleep(a.pause)
    snap.close()
    if ack is not None:
        ack.write(f"local {snap.last_durable_step}\n")
    store.flush(timeout=60)
    stop.set()
    report["final_ok"] = bool(np.array_equal(state["acc"].numpy(), expected(a.steps, a.seed, a.rank)))
    with open(f"{a.report}.{a.rank}", "w") as f:
        json.dump(report, f)
    store.close()
    dist.destroy_process_group()
    return 0


# -- what the surviving tiers hold ---------------------------------------------------------

def newest_whole(base: str, durable) -> int:
    """The newest step whose commit record and every rank's part are whole in host A's
    local tier or the durable tier (host B is gone): read and verified here."""
    from agck import sharded
    from agck.errors import AgckError
    from agck.stores import open_store

    local = open_store(host_dir(base, 0))
    tiers = [local, durable]
    steps = sorted(set(local.steps(RUN)) | set(durable.steps(RUN)))
    for s in reversed(steps):
        commits = []
        for t in tiers:
            try:
                commits.append(sharded.as_commit(t.read(RUN, s)))
            except AgckError:
                continue
        if not commits:
            continue
        commit = max(commits, key=lambda c: c.epoch)
        whole = True
        for r in range(WORLD):
            ok = False
            for t in tiers:
                parts = t.parts_store(create=False)
                if parts is None:
                    continue
                try:
                    sharded.read_part(t, commit, r, parts=parts)
                    ok = True
                    break
                except AgckError:
                    continue
            whole = whole and ok
        if whole:
            local.close()
            return s
    local.close()
    return 0


def _damage_replicas(base: str, rng: random.Random) -> int:
    """Flip a byte in each file of host A's replicas of host B's parts (their listings)."""
    parts = os.path.join(host_dir(base, 0), ".parts")
    n = 0
    for name in os.listdir(parts) if os.path.isdir(parts) else []:
        if not any(name.endswith(f".r{r}") for r in HOST_B):
            continue
        for root, _, files in os.walk(os.path.join(parts, name)):
            for f in files:
                p = os.path.join(root, f)
                size = os.path.getsize(p)
                if size == 0 or f.startswith("."):
                    continue
                with open(p, "r+b") as fh:
                    at = rng.randrange(size)
                    fh.seek(at)
                    b = fh.read(1)
                    fh.seek(at)
                    fh.write(bytes([b[0] ^ 0xFF]))
                n += 1
    return n


# -- the trials ------------------------------------------------------------------------------

def _start(base: str, args: list[str], env_for) -> list[subprocess.Popen]:
    rdzv = os.path.join(base, f"rdzv-{time.monotonic_ns()}")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    env.pop("AGCK_FAILPOINTS", None)
    return [subprocess.Popen([sys.executable, "-m", "crashtests.hostloss_ranks", "rank", "--rank", str(r),
                              "--rdzv", rdzv, *args], env={**env, **env_for(r)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(WORLD)]


def _acked(ack: str, kind: str) -> int:
    try:
        with open(ack) as f:
            return max([int(x.split()[1]) for x in f.read().split("\n") if x.startswith(kind + " ")] or [0])
    except (OSError, ValueError, IndexError):
        return 0


def trial(i: int, kind: str, where, root: str, rng: random.Random, seed: int) -> dict:
    from agck.stores import open_store

    url, opts = where(i)
    base = os.path.join(root, f"t{i}")
    os.makedirs(base)
    ack, report = os.path.join(base, "ack"), os.path.join(base, "report")
    down_for = rng.choice([0.0, 0.0, 0.0, 0.5, 1.5])
    damage = rng.random() < 0.25
    how = rng.choice(["time", "time", "point"])
    point = rng.choice(POINTS) if how == "point" else None
    if os.environ.get("HOSTLOSS_FORCE"):      # reproducing one kind of trial: point,down_for,damage
        f = os.environ["HOSTLOSS_FORCE"].split(",")
        point, down_for, damage = f[0] or None, float(f[1]), f[2] == "1"
    args = ["--base", base, "--durable", url, "--durable-options", json.dumps(opts), "--ack", ack,
            "--report", report, "--seed", str(seed), "--steps", str(STEPS),
            "--durable-every", str(rng.choice([1, 1, 2, 4])), "--keep-local", str(rng.choice([2, 3])),
            "--pause", "0.01"]
    at = rng.randint(1, STEPS - 2)
    env_for = (lambda r: {"AGCK_FAILPOINTS": f"{point}=kill@{at}"} if r in HOST_B else {}) if point else \
        (lambda r: {})
    procs = _start(base, args + ["--down-at", str(rng.uniform(0, 1.0)), "--down-for", str(down_for)], env_for)
    t0 = time.monotonic()
    if point is None:       # host B killed once step `at` is acknowledged, a moment on
        while all(p.poll() is None for p in procs) and _acked(ack, "local") < at and time.monotonic() - t0 < 120:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.05))
        for r in HOST_B:
            if procs[r].poll() is None:
                procs[r].send_signal(signal.SIGKILL)
    else:                   # host B's ranks kill themselves at the fail point
        while all(procs[r].poll() is None for r in HOST_B) and time.monotonic() - t0 < 120:
            time.sleep(0.002)
        for r in HOST_B:
            if procs[r].poll() is None:
                procs[r].send_signal(signal.SIGKILL)
    time.sleep(rng.uniform(0, 0.5))      # host A's ranks go on a moment (copies, collectives), then the agent kills them
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    errs = [p.communicate(timeout=60)[1] for p in procs]
    codes = [p.returncode for p in procs]
    row = {"trial": i, "durable": kind, "kill": point or "time", "killed_after_s": round(time.monotonic() - t0, 2),
           "codes": codes, "down_for": down_for, "damaged_replicas": 0, "verdict": "ok", "why": "",
           "local_acked": _acked(ack, "local"), "durable_acked": _acked(ack, "durable")}
    def failed(r: int) -> bool:
        # host A's ranks may fail first in a collective with the dead host: an exception
        # (exit 1), or gloo aborting at exit after one ("terminate called...": SIGABRT)
        return codes[r] not in (0, -signal.SIGKILL) and not (r not in HOST_B and codes[r] in (1, -signal.SIGABRT)
                                                             and any(w in errs[r] for w in (
                                                                 b"gloo", b"c10d", b"Connection reset",
                                                                 b"Connection closed")))
    if any(failed(r) for r in range(WORLD)):
        bad = next(r for r in range(WORLD) if failed(r))
        row.update(verdict="error", why=f"rank {bad} exited {codes[bad]}: {errs[bad].decode()[-600:]}")
        return row
    shutil.rmtree(host_dir(base, 2), ignore_errors=True)            # host B lost
    if damage:
        row["damaged_replicas"] = _damage_replicas(base, rng)
    durable = open_store(url, **{k: v for k, v in opts.items() if k != "init"})
    try:
        whole = newest_whole(base, durable)
    finally:
        durable.close()
    row["newest_whole"] = whole
    procs = _start(base, args, lambda r: {})     # (the durable tier up, no fail points)
    errs = [p.communicate(timeout=300)[1] for p in procs]
    if any(p.returncode != 0 for p in procs):
        bad = next(r for r, p in enumerate(procs) if p.returncode != 0)
        row.update(verdict="error", why=f"the restarted rank {bad} exited {procs[bad].returncode}: "
                                        f"{errs[bad].decode()[-600:]}")
        return row
    reports = [json.load(open(f"{report}.{r}")) for r in range(WORLD)]
    restored = reports[0]["started"]
    row.update(restored=restored, sources=[x["source"] for x in reports])
    if any(x["started"] != restored for x in reports):
        row.update(verdict="error", why=f"the ranks restored different steps: {[x['started'] for x in reports]}")
    elif restored < row["durable_acked"]:
        row.update(verdict="lost", why=f"restored step {restored}, step {row['durable_acked']} was acknowledged durable")
    elif restored != whole:
        row.update(verdict="not newest", why=f"restored {restored}, the surviving tiers hold {whole} whole; "
                                             f"why not {whole}: {[w for s, w in reports[0]['rejected'] if s == whole]}")
    elif not all(x["restored_ok"] for x in reports):
        row.update(verdict="corrupt", why=f"ranks {[x['rank'] for x in reports if not x['restored_ok']]} restored "
                                          f"another state than theirs at step {restored}")
    elif not all(x["final_ok"] for x in reports):
        row.update(verdict="resume", why="a rank ended in another state than an uninterrupted job's")
    if row["verdict"] == "ok":
        shutil.rmtree(base, ignore_errors=True)
    return row


def campaign(trials: int, kinds: list[str], seed: int, out: str | None = None, quiet: bool = False) -> dict:
    return run_trials("hostloss_ranks", trials, kinds, seed, trial, lambda r: (
        f"kill {r['kill']}, down {r['down_for']}, damaged {r['damaged_replicas']}; local {r['local_acked']} "
        f"durable {r['durable_acked']} -> {r.get('restored')} from {r.get('sources')}"), {
        "restored_from_peers": lambda r: "peer" in (r.get("sources") or []),
        "restored_from_durable": lambda r: "durable" in (r.get("sources") or []),
        "killed_at_fail_points": lambda r: r["kill"] != "time",
        "durable_behind_at_kill": lambda r: r["durable_acked"] < r["local_acked"],
        "durable_down_trials": lambda r: r["down_for"] > 0,
        "damaged_replica_trials": lambda r: r["damaged_replicas"]}, out, quiet)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rank":
        p = argparse.ArgumentParser()
        for name in ("--base", "--durable", "--ack", "--report", "--rdzv"):
            p.add_argument(name, required=True)
        p.add_argument("--rank", type=int, required=True)
        p.add_argument("--durable-options", default="{}")
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--steps", type=int, default=STEPS)
        p.add_argument("--durable-every", type=int, default=1)
        p.add_argument("--keep-local", type=int, default=2)
        p.add_argument("--pause", type=float, default=0.0)
        p.add_argument("--down-at", type=float, default=0.0)
        p.add_argument("--down-for", type=float, default=0.0)
        return rank_work(p.parse_args(argv[1:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--durable", default="sqlite,postgres,s3")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.randrange(1 << 20)
    s = campaign(a.trials, a.durable.split(","), seed, a.out)
    print(json.dumps({k: v for k, v in s.items() if k != "rows"}, indent=1))
    bad = sum(n for v, n in s["verdicts"].items() if v != "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
