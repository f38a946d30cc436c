#!/usr/bin/env python3
"""Encryption at rest: put and verified get with a key against the same without, in one
run, on each store asked for (the file store, SQLite, Postgres), and what sealing costs alone.

State: ``--mb`` MiB of float32 tensors (random: incompressible, so compression is off
in both and the difference is the sealing), new content at every put (a fresh store
directory per put, so nothing is shared). Put: ``store.put`` of the state; get: a
verified ``store.get`` by a fresh store object, every chunk opened (its tag checked),
hashed and checksummed. Cases alternate with their order rotated each round; medians
of ``--rounds``. "AES-256-GCM alone" seals and opens the same bytes in 1 MiB objects
on one thread: the floor the encrypted cases add to.

    python scripts/bench_encryption.py [--mb 256] [--rounds 5] [--dir /var/tmp] [--stores file,sqlite,postgres]

Postgres: ``--dsn`` (default ``$AGCK_TEST_DSN``, else the local test server), a schema
of its own per case, dropped after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from agck import cipher  # noqa: E402
from agck.stores import open_store  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--stores", default="file")
    ap.add_argument("--dsn", default=os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    a = ap.parse_args(argv)
    stores = a.stores.split(",")
    torch.manual_seed(0)
    n = a.mb * (1 << 20) // 4
    state = {f"t{i}": torch.rand(n // 16) for i in range(16)}
    key = os.urandom(32)
    base = tempfile.mkdtemp(prefix="agck-bench-enc-", dir=a.dir)
    times: dict[str, list[float]] = {f"{op} {kind} {label}": [] for kind in stores for op in ("put", "get")
                                     for label in ("plain", "encrypted")}
    try:
        for r in range(a.rounds + 1):          # round 0 warms up, untimed
            order = [None, key] if r % 2 else [key, None]
            for kind in stores:
                for k in order:
                    label = "encrypted" if k is not None else "plain"
                    url, opts, done = _place(kind, base, f"{label}-{r}", a.dsn)
                    s = open_store(url, key=k, compress="none", min_chunked=0, **opts)
                    t0 = time.perf_counter()
                    s.put("run", 1, state)
                    put = time.perf_counter() - t0
                    s.close()
                    fresh = open_store(url, key=k, **{o: v for o, v in opts.items() if o != "init"})
                    t0 = time.perf_counter()
                    ck = fresh.get("run", 1)
                    get = time.perf_counter() - t0
                    fresh.close()
                    assert all(torch.equal(ck.state[x], state[x]) for x in state)
                    del ck
                    if r:
                        times[f"put {kind} {label}"].append(put)
                        times[f"get {kind} {label}"].append(get)
                    done()
        d = cipher.DataKey.new()
        blob = os.urandom(1 << 20)
        total = a.mb
        t0 = time.perf_counter()
        sealed = [d.seal(cipher.Kind.CHUNK, b"c", blob) for _ in range(total)]
        seal_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for x in sealed:
            d.open(cipher.Kind.CHUNK, b"c", x)
        open_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = a.mb * (1 << 20) / 1e6
    print(f"## Encryption at rest, {a.mb} MiB of float32, medians of {a.rounds} rounds\n")
    print("| store | case | median s | MB/s | encrypted / plain (speed) |")
    print("|---|---|---:|---:|---:|")
    for kind in stores:
        for op in ("put", "get"):
            p, e = med[f"{op} {kind} plain"], med[f"{op} {kind} encrypted"]
            print(f"| {kind} | {op} plain | {p:.3f} | {mb / p:,.0f} | |")
            print(f"| {kind} | {op} encrypted | {e:.3f} | {mb / e:,.0f} | {p / e:.2f}x |")
    print(f"| - | AES-256-GCM seal alone, 1 MiB objects, one thread | {seal_s:.3f} | {mb / seal_s:,.0f} | |")
    print(f"| - | AES-256-GCM open alone, 1 MiB objects, one thread | {open_s:.3f} | {mb / open_s:,.0f} | |")
    return 0


def _place(kind: str, base: str, name: str, dsn: str):
    """(url, options, cleanup) of a new, empty store of ``kind``."""
    if kind == "file":
        root = os.path.join(base, name)
        return root, {}, lambda: shutil.rmtree(root)
    if kind == "sqlite":
        path = os.path.join(base, name + ".db")
        return "sqlite:///" + path, {}, lambda: [os.remove(p) for p in (path, path + "-wal", path + "-shm")
                                                if os.path.exists(p)]
    if kind == "postgres":
        import psycopg2
        schema = "bench_enc_" + name.replace("-", "_")

        def sql(text):
            c = psycopg2.connect(dsn)
            c.autocommit = True
            try:
                c.cursor().execute(text)
            finally:
                c.close()
        sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}")
        return dsn, {"schema": schema, "init": True}, lambda: sql(f"DROP SCHEMA {schema} CASCADE")
    raise SystemExit(f"--stores: unknown store {kind!r} (file, sqlite, postgres)")


if __name__ == "__main__":
    sys.exit(main())
