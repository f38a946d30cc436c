#!/usr/bin/env python3
"""Compressed chunks in the stores: bytes stored, put and get time, with compression
off (``compress="none"``) and on (``compress="zstd"``), on every backend, in one run.

Contents, made here (``scripts/bench_compress.py``'s): an MLP of 10.5M parameters
trained 200 AdamW steps, its weights as bf16 (21 MB) and as fp32 (42 MB), its AdamW
state (84 MB), and a LangGraph-like conversation of 100 turns (a Python dict of
messages, 0.2 MB). Each is put as its own checkpoint, chunked (``min_chunked=0``),
into a store namespace of its own (a fresh directory, database file, table prefix or
bucket prefix per repeat: chunks are shared store-wide, so a second put of the same
bytes would write nothing).

Bytes stored are counted from the storage itself, not from agck's accounting: the
chunk files' sizes (file), ``sum(length(data))`` of the objects table (SQLite,
Postgres), the sizes of the chunk objects a bucket lists (s3: the bytes uploaded).
Put: ``store.put`` on a store object that has not seen the content. Get: a verified
``store.get`` on a fresh store object (every chunk hashed, every blob checksummed).
Medians of ``--repeats``. Stores: a directory and a SQLite file under ``--dir``,
the Postgres server at ``AGCK_TEST_DSN`` (a schema of its own, dropped at the end), a
SeaweedFS server started here (skipped without ``weed``).

    python scripts/bench_store_compression.py [--repeats 3] [--dir /var/tmp] [--stores file,sqlite,postgres,s3]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import agck  # noqa: E402
from agck.stores import open_store  # noqa: E402
from bench_compress import conversation, trained_mlp  # noqa: E402

DSN = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
MODES = ("none", "zstd")


def contents(steps: int, log) -> dict:
    bf16, fp32, adam = trained_mlp(steps, log)

    def tensors(parts, dtype):
        return {f"p{i}": torch.frombuffer(bytearray(p), dtype=dtype) for i, p in enumerate(parts)}

    return {"weights bf16": tensors(bf16, torch.bfloat16), "weights fp32": tensors(fp32, torch.float32),
            "AdamW state fp32": tensors(adam, torch.float32),
            "conversation (100 turns)": json.loads(conversation(100))}


def raw_size(state) -> int:
    return agck.checkpoint.encode(state).total_len


class Backend:
    """A fresh store namespace per call of :meth:`fresh`, and how to count its bytes."""

    def __init__(self, kind: str, base: str):
        self.kind, self.base = kind, base
        self.server = None
        self.schema = None
        if kind == "s3":
            from crashtests import s3server
            why = s3server.seaweed_available()
            if why is not None:
                raise RuntimeError(f"no SeaweedFS: {why}")
            os.environ.update({k: v for k, v in s3server.CREDENTIALS.items() if k not in os.environ})
            self.server = s3server.Seaweed().start()
            self.server.bucket("bench")
        if kind == "postgres":
            import psycopg2
            self.schema = f"agck_bench_{secrets.token_hex(3)}"
            self.conn = psycopg2.connect(DSN)
            self.conn.autocommit = True
            self.conn.cursor().execute(f"CREATE SCHEMA {self.schema}")

    def fresh(self) -> tuple[str, dict]:
        tag = secrets.token_hex(4)
        if self.kind == "file":
            return os.path.join(self.base, f"file-{tag}"), {}
        if self.kind == "sqlite":
            return f"sqlite:///{self.base}/sqlite-{tag}.db", {}
        if self.kind == "postgres":
            return DSN, {"prefix": f"b{tag}", "schema": self.schema, "init": True}
        return self.server.url("bench", f"p{tag}"), {}

    def stored_bytes(self, store) -> int:
        if self.kind == "file":
            root = os.path.join(store.root, ".objects")
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
                       if "quarantine" not in d and f not in ("lock", "generation"))
        if self.kind == "sqlite":
            import sqlite3
            with sqlite3.connect(store.path) as c:
                return c.execute(f"SELECT coalesce(sum(length(data)), 0) FROM {store.prefix}_objects").fetchone()[0]
        if self.kind == "postgres":
            cur = self.conn.cursor()
            cur.execute(f"SELECT coalesce(sum(octet_length(data)), 0) FROM {self.schema}.{store.prefix}_objects")
            return int(cur.fetchone()[0])
        return sum(o.size for o in store.c.list("chunks/"))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.schema is not None:
            self.conn.cursor().execute(f"DROP SCHEMA {self.schema} CASCADE")
            self.conn.close()


def equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def measure(backend: Backend, mode: str, name: str, state, repeats: int) -> dict:
    puts, gets, stored = [], [], []
    for _ in range(repeats):
        url, opts = backend.fresh()
        store = open_store(url, compress=mode, min_chunked=0, **opts)
        t0 = time.perf_counter()
        store.put("bench", 1, state)
        puts.append(time.perf_counter() - t0)
        stored.append(backend.stored_bytes(store))
        fresh = open_store(url, **{k: v for k, v in opts.items() if k != "init"})
        t0 = time.perf_counter()
        ck = fresh.get("bench", 1)
        gets.append(time.perf_counter() - t0)
        assert equal(ck.state, state), f"{backend.kind} {mode} {name}: read back differs"
        if backend.kind in ("file", "sqlite"):
            shutil.rmtree(url, ignore_errors=True) if backend.kind == "file" else os.unlink(store.path)
    return {"put_s": statistics.median(puts), "get_s": statistics.median(gets), "stored": statistics.median(stored)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--stores", default="file,sqlite,postgres,s3")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    data = contents(args.steps, log)
    base = tempfile.mkdtemp(prefix="agck-bench-compress-", dir=args.dir)
    rows = []
    try:
        for kind in args.stores.split(","):
            try:
                backend = Backend(kind, base)
            except Exception as e:   # a store this machine cannot run: said, not hidden
                log(f"{kind}: skipped ({e})")
                continue
            try:
                for name, state in data.items():
                    raw = raw_size(state)
                    got = {mode: measure(backend, mode, name, state, args.repeats) for mode in MODES}
                    off, on = got["none"], got["zstd"]
                    row = {"store": kind, "content": name, "raw_bytes": raw,
                           "stored_off": off["stored"], "stored_on": on["stored"],
                           "ratio": off["stored"] / on["stored"],
                           "put_off_s": off["put_s"], "put_on_s": on["put_s"],
                           "get_off_s": off["get_s"], "get_on_s": on["get_s"]}
                    rows.append(row)
                    log(f"{kind:8} {name:26} ratio {row['ratio']:.3f}  put {off['put_s']:.3f}/{on['put_s']:.3f} s  "
                        f"get {off['get_s']:.3f}/{on['get_s']:.3f} s")
            finally:
                backend.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("| store | content | raw MB | stored off MB | stored on MB | ratio | put off s | put on s | "
          "get off s | get on s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['store']} | {r['content']} | {r['raw_bytes'] / 1e6:.1f} | {r['stored_off'] / 1e6:.2f} | "
              f"{r['stored_on'] / 1e6:.2f} | {r['ratio']:.3f} | {r['put_off_s']:.3f} | {r['put_on_s']:.3f} | "
              f"{r['get_off_s']:.3f} | {r['get_on_s']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
