"""Host-loss trials for tiered checkpoints (agck.stores.tiered.TieredStore).

Each trial runs a pipeline through a TieredStore (a local tier in a directory of its
own, a durable tier: SQLite, Postgres or s3) in a process of its own, SIGKILLs it at a
random instant (mid-put, mid-copy to the durable tier, while the durable tier is down),
then loses the host: its local tier is deleted (or, in some trials, damaged in place),
and a replacement host (an empty local tier) restores. Judged against an out-of-band
log the pipeline kept (each step acknowledged local, and each step seen committed in
the durable tier):

- **lost**: a step acknowledged durable that the restore does not reach (it restored
  an older one);
- **corrupt**: the restored state is not the one the pipeline had at that step;
- **not newest**: with the local tier gone, the restored step is not the newest that
  the durable tier holds whole (checked by reading its steps, newest first, verified);
- **resume**: the pipeline resumed from the restored step and run to the end ends in
  exactly the state of a run never interrupted.

    python -m crashtests.hostloss --trials 200 --durable sqlite,postgres,s3 [--seed N]
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
import tempfile
import threading
import time

import numpy as np

RUN = "pipe"
STEPS = 40
WIDTH = 1 << 16            # float64 values of the state's array: 512 KiB


def state_at(step: int, seed: int) -> dict:
    """The pipeline's state after ``step`` steps: each step adds its own draw, so a
    resume that skipped or repeated one ends elsewhere."""
    acc = np.zeros(WIDTH)
    for i in range(1, step + 1):
        acc += np.random.default_rng([seed, i]).standard_normal(WIDTH)
    return {"acc": acc, "step": step}


# -- the pipeline (a process of its own) ----------------------------------------------------

def work(a) -> int:
    from agck.errors import DurabilityError
    from agck.stores import open_store
    from agck.stores.tiered import TieredStore

    durable = open_store(a.durable, **json.loads(a.durable_options))
    if a.down_for > 0:        # the durable tier down for a while: its commits refused
        real, t0 = durable.put, time.monotonic()

        def put(*args, **kw):
            if a.down_at <= time.monotonic() - t0 < a.down_at + a.down_for:
                raise DurabilityError("the durable tier is down (a host-loss trial)")
            return real(*args, **kw)
        durable.put = put
    store = TieredStore(a.local, durable, durable_every=a.durable_every, keep_local=a.keep_local)
    ack = open(a.ack, "a", buffering=1)
    seen = {"durable": store.last_durable_step(RUN) or 0}
    stop = threading.Event()

    def watch():       # what the durable tier holds, as the pipeline's user would see it
        while not stop.is_set():
            d = store.last_durable_step(RUN) or 0
            if d > seen["durable"]:
                seen["durable"] = d
                ack.write(f"durable {d}\n")
            time.sleep(0.01)
    threading.Thread(target=watch, daemon=True).start()
    start, acc = 0, np.zeros(WIDTH)
    if a.resume:
        from agck.recovery import recover_run
        got = recover_run(store, RUN)
        if got.checkpoint is not None:
            start, acc = got.step, np.array(got.checkpoint.state["acc"], dtype=np.float64)
    for i in range(start + 1, a.steps + 1):
        acc = acc + np.random.default_rng([a.seed, i]).standard_normal(WIDTH)
        store.put(RUN, i, {"acc": acc, "step": i})
        ack.write(f"local {i}\n")
        time.sleep(a.pause)
    store.flush(timeout=60)
    stop.set()
    ack.write(f"done {a.steps}\n")
    store.close()
    return 0


# -- the trials -----------------------------------------------------------------------------

def durable_servers(kinds: list[str], who: str):
    """(the kinds that can run here, an s3 URL maker or None, the servers to close): a
    private SeaweedFS where s3 is asked for and can be started."""
    servers, s3_url = [], None
    if "s3" in kinds:
        from crashtests import s3server
        why = s3server.seaweed_available()
        if why is not None:
            kinds = [k for k in kinds if k != "s3"]
            print(f"{who}: no s3 trials ({why})", file=sys.stderr)
        else:
            server = s3server.Seaweed()
            os.environ.update({k: v for k, v in s3server.CREDENTIALS.items() if k not in os.environ})
            server.start()
            server.bucket("agck-hostloss")
            servers.append(server)
            s3_url = lambda name: server.url("agck-hostloss", name)  # noqa: E731
    return kinds, s3_url, servers


def _durable_urls(kinds: list[str], base: str, dsn: str, s3_url) -> dict:
    out = {}
    for k in kinds:
        if k == "sqlite":
            out[k] = (lambda i: (f"sqlite:///{base}/durable-{i}.db", {}))
        elif k == "postgres":
            out[k] = (lambda i: (dsn, {"prefix": f"hl{os.getpid()}_{i}", "init": True}))
        elif k == "s3":
            out[k] = (lambda i: (s3_url(f"hostloss-{os.getpid()}-{i}"), {}))
    return out


def _acked(ack: str) -> int:
    """The newest step the pipeline's log says is acknowledged local."""
    try:
        with open(ack) as f:
            return max([int(x.split()[1]) for x in f.read().split("\n") if x.startswith("local ")] or [0])
    except (OSError, ValueError, IndexError):
        return 0


def _damage_local(local: str, rng: random.Random) -> str:
    files = [os.path.join(r, f) for r, _, fs in os.walk(local) for f in fs if os.path.getsize(os.path.join(r, f))]
    if not files:
        return "nothing to damage"
    victims = rng.sample(files, min(len(files), 3))
    for p in victims:
        with open(p, "r+b") as f:
            n = os.path.getsize(p)
            at = rng.randrange(n)
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
    return f"{len(victims)} local files damaged"


def trial(i: int, kind: str, where, base: str, rng: random.Random, seed: int) -> dict:
    from agck.recovery import recover_run
    from agck.stores import open_store
    from agck.stores.tiered import TieredStore

    url, opts = where(i)
    local = os.path.join(base, f"local-{i}")
    ack = os.path.join(base, f"ack-{i}")
    mode = rng.choice(["delete", "delete", "delete", "damage"])
    down_for = rng.choice([0.0, 0.0, 0.3, 1.0])
    args = ["--local", local, "--durable", url, "--durable-options", json.dumps(opts), "--ack", ack,
            "--seed", str(seed), "--steps", str(STEPS), "--durable-every", str(rng.choice([1, 1, 2, 5])),
            "--keep-local", str(rng.choice([2, 3])), "--pause", "0.005",
            "--down-at", str(rng.uniform(0, 0.4)), "--down-for", str(down_for)]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    p = subprocess.Popen([sys.executable, "-m", "crashtests.hostloss", "work", *args], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # killed once step `at` is acknowledged local, a few milliseconds on: mid-put, mid-copy,
    # mid-prune, while the durable tier is down; a few trials run to the end untouched
    at, t0 = rng.randint(1, STEPS + 3), time.monotonic()
    while p.poll() is None and _acked(ack) < at and time.monotonic() - t0 < 60:
        time.sleep(0.002)
    time.sleep(rng.uniform(0, 0.02))
    delay = time.monotonic() - t0
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    killed = p.returncode == -signal.SIGKILL
    lines = open(ack).read().split("\n") if os.path.exists(ack) else []
    local_acked = max([int(x.split()[1]) for x in lines if x.startswith("local ")] or [0])
    durable_acked = max([int(x.split()[1]) for x in lines if x.startswith("durable ")] or [0])
    row = {"trial": i, "durable": kind, "killed_after_s": round(delay, 2), "killed": killed, "host": mode,
           "down_for": down_for, "local_acked": local_acked, "durable_acked": durable_acked, "verdict": "ok",
           "why": ""}
    if not killed and p.returncode != 0:
        row.update(verdict="error", why=f"the pipeline exited {p.returncode}: {err.decode()[-500:]}")
        return row
    row["host_damage"] = _damage_local(local, rng) if mode == "damage" else shutil.rmtree(local, True) or "deleted"
    durable = open_store(url, **{k: v for k, v in opts.items() if k != "init"})
    newest_whole = 0           # the newest step the durable tier holds whole, verified
    for s in reversed(durable.steps(RUN)):
        try:
            durable.read(RUN, s)
            newest_whole = s
            break
        except Exception:      # a damaged or partial one: walked past, as a restore does
            continue
    store = TieredStore(local, durable, durable_every=1000, keep_local=None)
    try:
        got = recover_run(store, RUN)
        restored = got.step or 0
        row["restored"] = restored
        if restored < durable_acked:
            row.update(verdict="lost", why=f"restored step {restored}, step {durable_acked} was acknowledged durable")
        elif got.checkpoint is not None and not (np.array_equal(got.checkpoint.state["acc"], state_at(restored, seed)["acc"])
                                      and got.checkpoint.state["step"] == restored):
            row.update(verdict="corrupt", why=f"the state restored at step {restored} is not the pipeline's")
        elif mode == "delete" and restored != newest_whole:
            row.update(verdict="not newest", why=f"restored {restored}, the durable tier holds {newest_whole} whole")
    finally:
        store.close()
    if row["verdict"] != "ok":
        return row
    # the replacement host resumes and runs to the end: the state of a run never interrupted
    done = subprocess.run([sys.executable, "-m", "crashtests.hostloss", "work", *args[:-4], "--down-for", "0",
                           "--resume"], env=env, capture_output=True, timeout=300)
    if done.returncode != 0:
        row.update(verdict="error", why=f"the resume exited {done.returncode}: {done.stderr.decode()[-500:]}")
        return row
    final = open_store(url, **{k: v for k, v in opts.items() if k != "init"}).read(RUN, STEPS)
    if not np.array_equal(final.state["acc"], state_at(STEPS, seed)["acc"]):
        row.update(verdict="resume", why="the resumed run ended in another state than an uninterrupted one")
    return row


def run_trials(name: str, trials: int, kinds: list[str], seed: int, trial, line, counts: dict,
               out: str | None = None, quiet: bool = False) -> dict:
    """A host-loss campaign: ``trials`` trials, the durable ``kinds`` in turn, each
    ``trial(i, kind, where, root, rng, seed)`` returning its row (``verdict``, ``why``),
    ``line(row)`` describing it as it ends; the summary counts the verdicts and, for
    each key of ``counts``, the rows its predicate holds for. Written to
    ``out/<name>.json`` when ``out`` is given. Servers and tables are removed after."""
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix=f"agck-{name.replace('_', '-')}-")
    dsn = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    kinds, s3_url, servers = durable_servers(kinds, name)
    where = _durable_urls(kinds, root, dsn, s3_url)
    rows = []
    t0 = time.monotonic()
    try:
        for i in range(trials):
            kind = kinds[i % len(kinds)]
            row = trial(i, kind, where[kind], root, rng, seed * 1000 + i)
            rows.append(row)
            if not quiet:
                print(f"[{time.monotonic() - t0:6.1f}s] trial {i} ({kind}, {line(row)}): {row['verdict']} {row['why']}",
                      file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(root, ignore_errors=True)
        if "postgres" in kinds:
            _drop_prefixes(dsn, f"hl{os.getpid()}_")
    summary = {"seed": seed, "trials": len(rows), "seconds": round(time.monotonic() - t0, 1),
               "verdicts": {v: sum(1 for r in rows if r["verdict"] == v) for v in
                            ("ok", "lost", "corrupt", "not newest", "resume", "error")},
               **{k: sum(1 for r in rows if holds(r)) for k, holds in counts.items()},
               "rows": rows}
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def campaign(trials: int, kinds: list[str], seed: int, out: str | None = None, quiet: bool = False) -> dict:
    return run_trials("hostloss", trials, kinds, seed, trial,
                      lambda r: f"{r['host']}, killed after {r['killed_after_s']} s", {
                          "killed": lambda r: r["killed"],
                          "killed_while_durable_behind": lambda r: r["killed"] and r["durable_acked"] < r["local_acked"],
                          "durable_down_trials": lambda r: r["down_for"] > 0,
                          "damaged_local_tiers": lambda r: r["host"] == "damage"}, out, quiet)


def _drop_prefixes(dsn: str, prefix: str) -> None:
    import psycopg2
    c = psycopg2.connect(dsn)
    c.autocommit = True
    try:
        cur = c.cursor()
        cur.execute("SELECT schemaname, tablename FROM pg_tables WHERE tablename LIKE %s", (prefix + "%",))
        for schema, table in cur.fetchall():
            cur.execute(f'DROP TABLE IF EXISTS "{schema}"."{table}" CASCADE')
    finally:
        c.close()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "work":
        p = argparse.ArgumentParser()
        for name in ("--local", "--durable", "--ack"):
            p.add_argument(name, required=True)
        p.add_argument("--durable-options", default="{}")
        p.add_argument("--seed", type=int, required=True)
        p.add_argument("--steps", type=int, default=STEPS)
        p.add_argument("--durable-every", type=int, default=1)
        p.add_argument("--keep-local", type=int, default=2)
        p.add_argument("--pause", type=float, default=0.0)
        p.add_argument("--down-at", type=float, default=0.0)
        p.add_argument("--down-for", type=float, default=0.0)
        p.add_argument("--resume", action="store_true")
        return work(p.parse_args(argv[1:]))
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
