#!/usr/bin/env python3
"""What a put pays to check the chunks it reuses (``verify_reused``), on each store.

The workload a damaged chunk hurts most: a frozen base of MODEL_MB (a model that
does not train) beside CHANGE_MB that change at every checkpoint. Every put reuses
the base's chunks; the modes differ in what they check of them before relying on
them:

- ``none``: that they exist (the file store trusts what this process made durable
  itself while no collection ran: no stat at all);
- ``size``: their stored size (a stat per chunk, or the stored length in the same query);
- ``sample``: their size, and the bytes of one address bucket in 16 re-read and hashed;
- ``full``: every reused chunk re-read and hashed (BLAKE3).

Each mode has its own store object and run on one store (the base is stored once),
and the puts of the modes alternate round by round. Reported: the median put, its
ratio to ``none``, and in the same run the physical limits: raw write+fsync of the
changed bytes (what any put must do), and BLAKE3 of the base in memory (what ``full``
adds at least). The base's chunks are in the page cache (or the server's buffers),
as on a machine that just wrote them; cold, ``full`` and ``sample`` also pay reading
them from the disk.

After the rounds, each mode's last put is read back through a store object of its
own and compared bit for bit, and every checkpoint of its run must verify
(benchio.readback): the first that does not ends the run, status 1.

    python scripts/bench_verify_reused.py [--model-mb 256] [--change-mb 2] [--repeats 5]
        [--stores file,sqlite,postgres] [--dsn DSN] [--dir D] [--json F]
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

from agck import chunking, open_store  # noqa: E402
from agck.stores.damage import VERIFY_REUSED  # noqa: E402


def _url(kind: str, work: str, dsn: str, prefix: str) -> tuple[str, dict]:
    if kind == "file":
        return os.path.join(work, "store"), {}
    if kind == "sqlite":
        return f"sqlite:///{work}/store.db", {}
    return dsn, {"prefix": prefix, "init": True}


def bench_store(kind: str, args, work: str, base: np.ndarray, log) -> dict:
    prefix = f"bvr_{uuid.uuid4().hex[:8]}"
    url, opts = _url(kind, work, args.dsn, prefix)
    rng = np.random.default_rng(1)
    change = args.change_mb << 20
    stores = {m: open_store(url, **opts, verify_reused=m) for m in VERIFY_REUSED}
    steps = {m: 0 for m in VERIFY_REUSED}
    written = {}      # each mode's last put, to read back

    def put(mode: str):
        steps[mode] += 1
        written[mode] = {"base": base, "changing": rng.random(change // 8)}
        stores[mode].put(mode, steps[mode], written[mode])

    t0 = time.perf_counter()
    for m in VERIFY_REUSED:     # the first put of each run: the base stored once, then found by the others
        put(m)
    log(f"  {kind}: first puts {time.perf_counter() - t0:.1f} s")
    raw_dir = os.path.join(work, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    changed = rng.random(change // 8).tobytes()
    cases = [benchio.Case(m, (lambda m=m: put(m)), nbytes=change) for m in VERIFY_REUSED]
    cases.append(benchio.Case("raw write+fsync of the changed bytes",
                              lambda: benchio.raw_write_fsync(os.path.join(raw_dir, "x"), changed), nbytes=change))
    cases.append(benchio.Case("BLAKE3 of the base", lambda: chunking.address(base.view(np.uint8)), nbytes=base.nbytes))
    benchio.run_rounds(cases, args.repeats, log, warmup=1)
    out = {c.name: c.median for c in cases}
    last = stores["full"].last_put
    out["reused_chunks"] = len(last.addresses) - last.new_chunks if last is not None else None
    for s in stores.values():
        s.close()
    for m in VERIFY_REUSED:
        benchio.readback(lambda m=m: open_store(url, **opts, verify_reused=m), {(m, steps[m]): written[m]}, runs=[m])
    if kind == "postgres":
        import psycopg2
        conn = psycopg2.connect(args.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        cur.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (prefix + "%",))
        for (t,) in cur.fetchall():
            cur.execute(f'DROP TABLE "{t}"')
        conn.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-mb", type=int, default=256)
    ap.add_argument("--change-mb", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stores", default="file,sqlite,postgres")
    ap.add_argument("--dsn", default=os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--dir", help="where to write (default: a temp directory here)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    base = np.random.default_rng(0).standard_normal((args.model_mb << 20) // 4).astype(np.float32)
    results = {}
    for kind in [s.strip() for s in args.stores.split(",") if s.strip()]:
        work = tempfile.mkdtemp(prefix="agck-bvr-", dir=args.dir)
        try:
            log(f"{kind}: base {args.model_mb} MiB, {args.change_mb} MiB changing per put")
            results[kind] = bench_store(kind, args, work, base, log)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nverify_reused: a put of a {args.model_mb} MiB frozen base + {args.change_mb} MiB that changed "
          f"(median of {args.repeats} alternating rounds)\n")
    print("| store | mode | put (ms) | x none | reused chunks checked |")
    print("|---|---|---:|---:|---:|")
    for kind, r in results.items():
        none = r["none"]
        for m in VERIFY_REUSED:
            checked = {"none": "exist", "size": "size", "sample": "exist + 1/16 re-hashed",
                       "full": "all re-hashed"}[m]
            print(f"| {kind} | {m} | {1000 * r[m]:.1f} | {r[m] / none:.2f} | {checked} |")
        print(f"| {kind} | (raw write+fsync of {args.change_mb} MiB) | "
              f"{1000 * r['raw write+fsync of the changed bytes']:.1f} | | |")
        print(f"| {kind} | (BLAKE3 of the {args.model_mb} MiB base) | {1000 * r['BLAKE3 of the base']:.1f} | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    log(benchio.read_back_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
