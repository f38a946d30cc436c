#!/usr/bin/env python3
"""The step journal (agck.Journal) on the file store, SQLite and Postgres, against the
floors beneath it, in one run.

- growth: --steps (200,000) steps, each returning a record of about 200 bytes, in
  group commit; the time of every tenth of the run, the last tenth against the first
  (the cost of a step must not grow with the run), results per second, and the bytes
  the journal took on disk against the bytes the steps produced (each result's
  msgpack);
- snapshot: the same --steps steps through checkpoint_every (every --every, 500,
  steps), the records appended to an agck.AppendLog in the state: the last tenth
  against the first, and every byte the store gained (checkpoints, chunks, the log's
  segments; allocated blocks on the file store too) against the bytes produced; and,
  for contrast, --list-steps (20,000) steps holding the records in a plain list;
- sync: --sync-steps (2,000) steps with commit="sync" (each result durable before
  step returns) against the floor, alternated in rounds: the same record bytes
  appended to a file and fdatasync'd per step (file store), one INSERT of them and
  COMMIT per step (SQLite with agck's settings, WAL and synchronous=FULL; Postgres
  with synchronous_commit on).

After each run, what it wrote is read back through a store object of its own
(benchio.readback): every journal result, and a snapshot run's last checkpoint,
bit for bit, and every checkpoint of it must verify; the first that does not
ends the run, status 1.

    python scripts/bench_journal.py [--steps 200000] [--every 500] [--list-steps 20000] [--sync-steps 2000]
                                    [--rounds 3] [--stores file,sqlite,postgres] [--dir /var/tmp]
                                    [--dsn postgresql://...] [--json F] [--only growth,snapshot,sync]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

import msgpack  # noqa: E402

import agck  # noqa: E402
from agck import journalrec  # noqa: E402

DSN = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def result_of(i: int) -> dict:
    return {"doc": i, "summary": f"document {i}: " + "lorem ipsum " * 14, "score": i / 7}


def _open(kind: str, workdir: str, schema: str | None):
    """A new store of ``kind``, and how to open another object on it (the read-back's)."""
    if kind == "file":
        url = os.path.join(workdir, f"file-{time.monotonic_ns()}")
    elif kind == "sqlite":
        url = f"sqlite:///{workdir}/j-{time.monotonic_ns()}.db"
    else:
        url = f"{DSN}{'&' if '?' in DSN else '?'}agck_schema={schema}&agck_prefix=j{time.monotonic_ns()}"
    store = agck.open_store(url, **({"init": True} if kind == "postgres" else {}))
    return store, lambda: agck.open_store(url)


def _results(run: str, steps) -> tuple:
    """What a journal of ``run`` recorded for ``steps``, as benchio.readback takes it (made as it is read)."""
    return (((run, i), result_of(i)) for i in steps), benchio.journal_results("summarize")


def _disk_bytes(kind: str, store, run: str, admin_cur) -> int:
    if kind == "file":
        return os.path.getsize(store.log_ref(run))
    if kind == "sqlite":
        store._db().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return os.path.getsize(store.path)
    admin_cur.execute("SELECT pg_total_relation_size(%s::regclass)", (store.names.log,))
    return int(admin_cur.fetchone()[0])


class _Tally:
    """The time of every tenth of a run, and the bytes its results are (each one's
    msgpack: sampled after the first thousand)."""

    def __init__(self, steps: int):
        self.tenth, self.times, self.produced, self.one = steps // 10, [], 0, 0
        self.t0 = self.start = time.perf_counter()

    def add(self, i: int, result) -> None:
        if i < 1000 or i % 97 == 0:
            self.one = len(msgpack.packb(result))
        self.produced += self.one
        if (i + 1) % self.tenth == 0:
            now = time.perf_counter()
            self.times.append(now - self.t0)
            self.t0 = now

    def done(self) -> tuple[float, list, int]:
        return time.perf_counter() - self.start, self.times, self.produced


def growth(kind: str, steps: int, workdir: str, schema, admin_cur, log) -> dict:
    store, reopen = _open(kind, workdir, schema)
    before = _disk_bytes(kind, store, "grow", admin_cur) if kind == "sqlite" else 0
    tally = _Tally(steps)
    j = agck.Journal(store, "grow", commit="group")
    for i in range(steps):
        tally.add(i, j.step("summarize", result_of, i))
    j.close()
    total, times, produced = tally.done()
    disk = _disk_bytes(kind, store, "grow", admin_cur) - before
    store.close()
    expected, reader = _results("grow", range(steps))
    benchio.readback(reopen, expected, reader=reader)
    out = {"steps": steps, "seconds": total, "per_second": steps / total, "tenths": times,
           "last_over_first": times[-1] / times[0], "produced": produced, "disk": disk, "disk_over_produced":
           disk / produced}
    log(f"  {kind}: {steps} steps in {total:.1f} s ({steps / total:,.0f}/s), last tenth {out['last_over_first']:.2f}x "
        f"the first, {disk / produced:.2f}x the bytes produced on disk")
    return out


def _store_bytes(kind: str, store, admin_cur) -> tuple[int, int]:
    """Everything the store holds: (bytes, bytes allocated on disk)."""
    if kind == "file":
        size = alloc = 0
        for d, _, names in os.walk(store.root):
            for n in names:
                st = os.stat(os.path.join(d, n))
                size += st.st_size
                alloc += st.st_blocks * 512
        return size, alloc
    if kind == "sqlite":
        store._db().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = os.path.getsize(store.path)
        return size, size
    n = store.names
    total = 0
    for t in (n.manifest, n.chunks, n.objects, n.log, n.log_heads):
        admin_cur.execute("SELECT coalesce(pg_total_relation_size(to_regclass(%s)), 0)", (t,))
        total += int(admin_cur.fetchone()[0])
    return total, total


def snapshot(kind: str, steps: int, every: int, workdir: str, schema, admin_cur, log, *, plain_list=False) -> dict:
    """Records accumulated in a checkpoint_every state: an AppendLog (or a plain list)."""
    store, reopen = _open(kind, workdir, schema)
    before, before_alloc = _store_bytes(kind, store, admin_cur)
    state = {"done": 0, "results": [] if plain_list else agck.AppendLog()}
    snap = agck.Snapshotter(store, "grow", every=every)
    state = snap.restore(state)
    tally = _Tally(steps)
    for i in snap.steps(steps):
        r = result_of(i)
        state["results"].append(r)
        state["done"] = i + 1
        tally.add(i, r)
    snap.close()
    total, times, produced = tally.done()
    size, alloc = _store_bytes(kind, store, admin_cur)
    store.close()
    benchio.readback(reopen, {("grow", steps): state}, runs=["grow"])
    disk, disk_alloc = size - before, alloc - before_alloc
    out = {"steps": steps, "every": every, "seconds": total, "per_second": steps / total, "tenths": times,
           "last_over_first": times[-1] / times[0], "produced": produced, "disk": disk, "disk_allocated": disk_alloc,
           "disk_over_produced": disk / produced, "allocated_over_produced": disk_alloc / produced,
           "checkpoints": steps // every}
    what = "a plain list" if plain_list else "an AppendLog"
    log(f"  {kind} ({what}): {steps} steps in {total:.1f} s ({steps / total:,.0f}/s), tenths "
        f"{', '.join(f'{t:.2f}' for t in times)} s: last {out['last_over_first']:.2f}x the first; "
        f"{disk / produced:.2f}x the bytes produced ({disk_alloc / produced:.2f}x allocated)")
    return out


class _Floor:
    """One durable write of a record per step, the plainest way for each store."""

    def __init__(self, kind: str, workdir: str, schema):
        self.kind = kind
        if kind == "file":
            path = os.path.join(workdir, f"floor-{time.monotonic_ns()}.log")
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            benchio.fsync_dir(workdir)
        elif kind == "sqlite":
            self.c = sqlite3.connect(os.path.join(workdir, f"floor-{time.monotonic_ns()}.db"), isolation_level=None)
            self.c.execute("PRAGMA journal_mode = WAL")
            self.c.execute("PRAGMA synchronous = FULL")
            self.c.execute("CREATE TABLE f (run TEXT, seq INTEGER, data BLOB, PRIMARY KEY (run, seq))")
        else:
            import psycopg2
            self.conn = psycopg2.connect(DSN, options=f"-c search_path={schema}")
            self.conn.autocommit = True
            self.cur = self.conn.cursor()
            self.cur.execute("CREATE TABLE IF NOT EXISTS floor_log (run text, seq bigint, data bytea, "
                             "PRIMARY KEY (run, seq))")
        self.n = 0

    def write(self, data: bytes) -> None:
        self.n += 1
        if self.kind == "file":
            os.write(self.fd, data)
            os.fdatasync(self.fd)
        elif self.kind == "sqlite":
            self.c.execute("BEGIN IMMEDIATE")
            self.c.execute("INSERT INTO f VALUES ('r', ?, ?)", (self.n, data))
            self.c.execute("COMMIT")
        else:
            import psycopg2
            self.cur.execute("BEGIN; SET LOCAL synchronous_commit = on; INSERT INTO floor_log VALUES ('r', %s, %s); "
                             "COMMIT", (self.n, psycopg2.Binary(data)))


def sync(kind: str, steps: int, rounds: int, workdir: str, schema, log) -> dict:
    store, reopen = _open(kind, workdir, schema)
    floor = _Floor(kind, workdir, schema)
    rec = journalrec.record("r", "summarize", bytes(16), 0, *journalrec.encode_value(result_of(0)))
    agck_times, floor_times = [], []
    base = 0
    for r in range(rounds + 1):       # the first round warms up
        j = agck.Journal(store, "sync")
        t = time.perf_counter()
        for i in range(base, base + steps):
            j.step("summarize", result_of, i)
        a = (time.perf_counter() - t) / steps
        j.close()
        t = time.perf_counter()
        for i in range(steps):
            floor.write(rec)
        f = (time.perf_counter() - t) / steps
        base += steps
        if r:
            agck_times.append(a)
            floor_times.append(f)
    store.close()
    expected, reader = _results("sync", range(base))
    benchio.readback(reopen, expected, reader=reader)
    a, f = statistics.median(agck_times), statistics.median(floor_times)
    what = {"file": "write + fdatasync", "sqlite": "INSERT + COMMIT", "postgres": "INSERT + COMMIT"}[kind]
    log(f"  {kind}: sync step {a * 1e6:.0f} us, floor ({what} per step) {f * 1e6:.0f} us: {a / f:.2f}x")
    return {"agck_us": a * 1e6, "floor_us": f * 1e6, "ratio": a / f, "floor": what}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--list-steps", type=int, default=20_000)
    p.add_argument("--only", default="growth,snapshot,sync")
    p.add_argument("--sync-steps", type=int, default=2_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stores", default="file,sqlite,postgres")
    p.add_argument("--dir", default=None)
    p.add_argument("--dsn", default=None, help="Postgres DSN (default: $AGCK_TEST_DSN or the local test server)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    global DSN
    DSN = a.dsn or DSN
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    kinds = a.stores.split(",")
    workdir = tempfile.mkdtemp(prefix="agck-bench-journal-", dir=a.dir)
    only = set(a.only.split(","))
    results: dict = {"growth": {}, "snapshot": {}, "snapshot_list": {}, "sync": {}}
    with benchio.scratch_schema(DSN, "bench_journal") as (schema, admin_cur):
        if "growth" in only:
            log(f"growth: {a.steps} steps per store, group commit")
            for k in kinds:
                results["growth"][k] = growth(k, a.steps, workdir, schema, admin_cur, log)
        if "snapshot" in only:
            log(f"snapshot: {a.steps} steps per store through checkpoint_every({a.every}), an AppendLog; "
                f"{a.list_steps} holding a plain list")
            for k in kinds:
                results["snapshot"][k] = snapshot(k, a.steps, a.every, workdir, schema, admin_cur, log)
                if a.list_steps:
                    results["snapshot_list"][k] = snapshot(k, a.list_steps, a.every, workdir, schema, admin_cur,
                                                           log, plain_list=True)
        if "sync" in only:
            log(f"sync: {a.sync_steps} steps per round, {a.rounds} rounds after one warm-up")
            for k in kinds:
                results["sync"][k] = sync(k, a.sync_steps, a.rounds, workdir, schema, log)
    if results["growth"] and results["sync"]:
        print(f"## The step journal: {a.steps:,} steps in group commit, {a.sync_steps:,} in sync commit\n")
        print("| store | results/s (group) | last tenth / first | on disk / produced | sync step | floor "
              "| sync / floor |")
        print("|---|---:|---:|---:|---:|---|---:|")
        for k in kinds:
            g, s = results["growth"][k], results["sync"][k]
            print(f"| {k} | {g['per_second']:,.0f} | {g['last_over_first']:.2f}x | {g['disk_over_produced']:.2f}x | "
                  f"{s['agck_us']:.0f} us | {s['floor']} {s['floor_us']:.0f} us | {s['ratio']:.2f}x |")
    if results["snapshot"]:
        print(f"\n## checkpoint_every({a.every}) with the records in the state: {a.steps:,} steps (AppendLog), "
              f"{a.list_steps:,} (a plain list)\n")
        print("| store | state | steps/s | last tenth / first | store bytes / produced | allocated / produced |")
        print("|---|---|---:|---:|---:|---:|")
        for k in kinds:
            for label, r in (("AppendLog", results["snapshot"][k]), ("list", results["snapshot_list"].get(k))):
                if r:
                    print(f"| {k} | {label} | {r['per_second']:,.0f} | {r['last_over_first']:.2f}x | "
                          f"{r['disk_over_produced']:.2f}x | {r['allocated_over_produced']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    log(benchio.read_back_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
