#!/usr/bin/env python3
"""What a long pipeline's checkpoints cost as it runs: incremental versus full.

Every workload runs through ``Snapshotter`` (the README's loop form) on a fresh
store, once with incremental checkpoints (the default) and once with
``incremental=False`` (every checkpoint a full standalone container, as
before), alternating, on the file store and on Postgres:

- ``arrays``: each step appends one ITEM_KB float32 array to ``state["out"]``
  (an embedding pipeline accumulating its results); sync mode, every EVERY.
- ``records``: each step appends one Python record of about 200 bytes (a dict
  with a string, an int and a list of floats); sync mode, every EVERY.
- ``frozen``: a MODEL_MB frozen base beside a 16 MiB part and its AdamW state
  that change every step; async mode, every EVERY.

Reported per run: the checkpoint time per window of WINDOW steps (the steps do
almost nothing, so a window's wall time is what its checkpoints cost) and the
last window over the first; bytes written over the run against the bytes the
pipeline produced (file store: the bytes this process sent to the disk,
/proc/self/io write_bytes; Postgres: the WAL the server wrote plus nothing
else, since table pages follow the WAL); of them the listings' bytes
(metadata), and the bytes of the new chunks the checkpoints added (what the
store itself counted, before pages, file-system metadata or WAL records are
added to it); for ``frozen`` the bytes each later checkpoint adds to the store
against the state's size, and the time ``checkpoint_every`` blocked the
pipeline. Then ``store.get`` and recovery of the last checkpoint, incremental
against full.

The physical limit in the same run: raw write+fsync of one checkpoint's new
bytes.

Before each store is dropped, its last checkpoint is read back through a store
object of its own and compared bit for bit with the pipeline's final state, and
every checkpoint of the run must verify (benchio.readback): the first that does
not ends the run, status 1.

    python scripts/bench_incremental.py [--steps 2000] [--every 10] [--window 500]
        [--record-steps 2000] [--model-mb 1024] [--frozen-steps 60]
        [--stores file,postgres] [--dsn DSN] [--dir D] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

import torch  # noqa: E402

from agck import Snapshotter, open_store, recover  # noqa: E402


def _proc_written() -> int:
    """Bytes this process caused to be written to storage so far (Linux)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Target:
    """A fresh store of one kind, and how to count what it wrote."""

    def __init__(self, kind: str, work: str, dsn: str):
        self.kind, self.work, self.dsn = kind, work, dsn
        self.prefix = None

    def open(self, incremental: bool, name: str):
        self.incremental = incremental
        if self.kind == "file":
            self.url = os.path.join(self.work, f"{name}-{incremental}")
            self.opts = {}
            return open_store(self.url, incremental=incremental)
        self.url = self.dsn
        self.prefix = f"bench_{uuid.uuid4().hex[:8]}"
        self.opts = {"prefix": self.prefix}
        return open_store(self.url, incremental=incremental, init=True, **self.opts)

    def reopen(self):
        """Another store object on the store opened last, opened as it was: the read-back's."""
        return open_store(self.url, incremental=self.incremental, **self.opts)

    def written(self) -> int:
        if self.kind == "file":
            return _proc_written()
        import psycopg2
        with psycopg2.connect(self.dsn) as c, c.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn() - '0/0'")
            return int(cur.fetchone()[0])

    def drop(self, store) -> None:
        store.close()
        if self.kind == "file":
            shutil.rmtree(self.url, ignore_errors=True)
            return
        import psycopg2
        with psycopg2.connect(self.dsn) as c, c.cursor() as cur:
            cur.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (self.prefix + "\\_%",))
            for (t,) in cur.fetchall():
                cur.execute(f'DROP TABLE IF EXISTS "{t}" CASCADE')


def _listing_bytes(store) -> int:
    lp = getattr(store, "last_put", None)
    return 0 if lp is None else 37 * len(lp.addresses) + 200   # per chunk a 32-byte address and its size


def run_growth(target: Target, incremental: bool, kind: str, args) -> dict:
    store = target.open(incremental, kind)
    rng = np.random.default_rng(0)
    width = args.item_kb * 1024 // 4
    steps = args.steps if kind == "arrays" else args.record_steps
    state: dict = {"out": []}
    produced = listings = chunk_bytes = 0
    windows: list[float] = []
    written0 = target.written()
    t_run = t_window = time.perf_counter()
    with Snapshotter(store, kind, every=args.every, mode="sync", resume=False) as snap:
        for i in snap.steps(steps):
            if kind == "arrays":
                state["out"].append(rng.random(width, dtype=np.float32))
                produced += width * 4
            else:
                rec = {"doc": f"document {i:08d} of the corpus, summarized", "tokens": i * 7 % 4099,
                       "scores": [round(float(x), 6) for x in rng.random(12)]}
                state["out"].append(rec)
                produced += 200
            snap.update(state)
            if (i + 1) % args.every == 0:
                listings += _listing_bytes(store)
                lp = getattr(store, "last_put", None)
                chunk_bytes += 0 if lp is None else lp.new_bytes
            if (i + 1) % args.window == 0:
                now = time.perf_counter()
                windows.append(round(now - t_window, 3))
                t_window = now
    total_s = time.perf_counter() - t_run
    written = target.written() - written0
    get_s, rec_s = _read_times(store, kind)
    benchio.readback(target.reopen, {(kind, steps): state}, runs=[kind])
    target.drop(store)
    return {"store": target.kind, "incremental": incremental, "steps": steps, "checkpoint_s": round(total_s, 3),
            "windows_s": windows, "last_over_first": round(windows[-1] / windows[0], 2) if windows else None,
            "produced": produced, "written": written, "listings": listings,
            "written_over_produced": round(written / produced, 2),
            "chunk_bytes": chunk_bytes if incremental else None,
            "chunks_over_produced": round(chunk_bytes / produced, 2) if incremental else None,
            "get_s": get_s, "recover_s": rec_s}


def _read_times(store, run: str, repeats: int = 3) -> tuple[float, float]:
    last = store.steps(run)[-1]
    best_get = best_rec = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.get(run, last)
        best_get = min(best_get, time.perf_counter() - t0)
        t0 = time.perf_counter()
        recover(store, run)
        best_rec = min(best_rec, time.perf_counter() - t0)
    return round(best_get, 4), round(best_rec, 4)


def run_frozen(target: Target, incremental: bool, args) -> dict:
    store = target.open(incremental, "frozen")
    torch.manual_seed(0)
    base = torch.randn(args.model_mb << 18)                  # frozen, MODEL_MB of float32
    part = torch.nn.Parameter(torch.randn(4 << 20))          # 16 MiB that changes every step
    opt = torch.optim.AdamW([part], lr=1e-3)
    state_bytes = base.nbytes + 3 * part.nbytes
    added: list[int] = []
    written0 = target.written()
    sizes = []
    with Snapshotter(store, "frozen", every=args.every, mode="async", resume=False) as snap:
        for i in snap.steps(args.frozen_steps):
            part.grad = torch.randn_like(part)      # AdamW's two moments change everywhere too
            opt.step()
            snap.update({"base": base, "part": part, "opt": opt.state_dict()})
            if (i + 1) % args.every == 0:
                sizes.append(target.written())
        blocked = list(snap.blocked_seconds)
    sizes.append(target.written())      # after close: the last write is done
    # async: what is written between two checkpoint boundaries is (about) one checkpoint
    added = [b - a for a, b in zip(sizes[1:], sizes[2:])]
    get_s, rec_s = _read_times(store, "frozen")
    written = target.written() - written0
    benchio.readback(target.reopen, {("frozen", args.frozen_steps): {"base": base, "part": part,
                                                                     "opt": opt.state_dict()}}, runs=["frozen"])
    target.drop(store)
    return {"store": target.kind, "incremental": incremental, "state_bytes": state_bytes,
            "later_written_median": int(np.median(added)) if added else None,
            "later_over_state": round(float(np.median(added)) / state_bytes, 4) if added else None,
            "blocked_median_s": round(float(np.median(blocked)), 4) if blocked else None,
            "blocked_max_s": round(max(blocked), 4) if blocked else None,
            "written": written, "get_s": get_s, "recover_s": rec_s}


def limits(root: str, args) -> dict:
    """Raw write+fsync of one checkpoint's new bytes (the arrays workload), and what
    the disk is sent for the smallest durable file: one record's worth of bytes
    written, fsync'd, and its directory fsync'd (the floor of a store that keeps
    each new piece of content as a file)."""
    os.makedirs(root, exist_ok=True)
    new = np.random.default_rng(1).random(args.item_kb * 256 * args.every, dtype=np.float32)
    t0 = time.perf_counter()
    for k in range(20):
        benchio.raw_write_fsync(os.path.join(root, f"raw{k}"), memoryview(new).cast("B"))
    raw_s = (time.perf_counter() - t0) / 20
    small = os.urandom(200 * args.every)
    w0 = _proc_written()
    for k in range(50):
        benchio.raw_write_fsync(os.path.join(root, f"small{k}"), small)
    return {"raw_new_bytes_s": round(raw_s, 5), "small_file_bytes": (_proc_written() - w0) // 50,
            "small_file_payload": len(small)}


def _mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--record-steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--item-kb", type=int, default=64)
    ap.add_argument("--window", type=int, default=500)
    ap.add_argument("--model-mb", type=int, default=1024)
    ap.add_argument("--frozen-steps", type=int, default=60)
    ap.add_argument("--stores", default="file,postgres")
    ap.add_argument("--workloads", default="arrays,records,frozen")
    ap.add_argument("--dsn", default=os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--dir", help="where to write (default: a temp directory here)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    if args.dir is not None and not os.path.isdir(args.dir):
        print(f"bench_incremental: --dir {args.dir}: no such directory", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="agck-bench-inc-", dir=args.dir or ".")
    kinds = [k for k in args.stores.split(",") if k]
    workloads = [w for w in args.workloads.split(",") if w]
    out: dict = {"args": vars(args), "growth": [], "frozen": []}
    try:
        out["limits"] = limits(os.path.join(work, "limits"), args)
        for kind in kinds:
            target = Target(kind, work, args.dsn)
            for workload in ("arrays", "records"):
                if workload in workloads:
                    for incremental in (True, False):      # alternating, same store kind, same run
                        r = run_growth(target, incremental, workload, args)
                        r["workload"] = workload
                        out["growth"].append(r)
                        print(json.dumps(r), file=sys.stderr, flush=True)
            if "frozen" in workloads:
                for incremental in (True, False):
                    r = run_frozen(target, incremental, args)
                    out["frozen"].append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(out, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(benchio.read_back_note(), file=sys.stderr)
    return 0


def report(out: dict, args) -> None:
    lim = out["limits"]
    print(f"growth: {args.steps} steps appending {args.item_kb} KiB arrays, {args.record_steps} steps appending "
          f"~200-byte records; every {args.every}, sync")
    print(f"| workload | store | checkpoints | time per {args.window} steps (s) | last / first | total (s) | "
          "written / produced (MiB) | of it listings (MiB) | new chunks / produced | get / recover last (ms) |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in out["growth"]:
        name = "incremental" if r["incremental"] else "full"
        print(f"| {r['workload']} | {r['store']} | {name} | {', '.join(map(str, r['windows_s']))} | "
              f"{r['last_over_first']} | {r['checkpoint_s']} | {_mib(r['written'])} / {_mib(r['produced'])} "
              f"= {r['written_over_produced']}x | {_mib(r['listings'])} | "
              + (f"{r['chunks_over_produced']}x | " if r["incremental"] else "- | ")
              + f"{r['get_s'] * 1000:.1f} / {r['recover_s'] * 1000:.1f} |")
    print(f"- physical limit: raw write+fsync of one checkpoint's new arrays ({args.every * args.item_kb} KiB) "
          f"{lim['raw_new_bytes_s'] * 1000:.1f} ms")
    print(f"- one durable file of one checkpoint's new records ({lim['small_file_payload']} bytes: write, fsync, "
          f"fsync of its directory) sends the disk {lim['small_file_bytes']:,} bytes "
          f"({lim['small_file_bytes'] / lim['small_file_payload']:.1f}x): the floor per new file of the file store")
    if out["frozen"]:
        print(f"\nfrozen: {args.model_mb} MiB frozen base + 16 MiB part + its AdamW state, {args.frozen_steps} steps, "
              f"every {args.every}, async")
        print("| store | checkpoints | later written, median (MiB; of state) | "
              "blocked median / max (ms) | get / recover last (ms) |")
        print("|---|---|---:|---:|---:|")
        for r in out["frozen"]:
            name = "incremental" if r["incremental"] else "full"
            print(f"| {r['store']} | {name} | {_mib(r['later_written_median'])} "
                  f"({r['later_over_state']:.1%}) | {r['blocked_median_s'] * 1000:.0f} / "
                  f"{r['blocked_max_s'] * 1000:.0f} | {r['get_s'] * 1000:.0f} / {r['recover_s'] * 1000:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
