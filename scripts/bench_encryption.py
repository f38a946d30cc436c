#!/usr/bin/env python3
"""Encryption at rest on the file store: put and verified get with a key against the
same without, in one run, and what sealing costs alone.

State: ``--mb`` MiB of float32 tensors (random: incompressible, so compression is off
in both and the difference is the sealing), new content at every put (a fresh store
directory per put, so nothing is shared). Put: ``store.put`` of the state; get: a
verified ``store.get`` by a fresh store object, every chunk opened (its tag checked),
hashed and checksummed. Cases alternate with their order rotated each round; medians
of ``--rounds``. "AES-256-GCM alone" seals and opens the same bytes in 1 MiB objects
on one thread: the floor the encrypted cases add to.

    python scripts/bench_encryption.py [--mb 256] [--rounds 5] [--dir /var/tmp]
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
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    n = a.mb * (1 << 20) // 4
    state = {f"t{i}": torch.rand(n // 16) for i in range(16)}
    key = os.urandom(32)
    base = tempfile.mkdtemp(prefix="agck-bench-enc-", dir=a.dir)
    times: dict[str, list[float]] = {k: [] for k in ("put plain", "put encrypted", "get plain", "get encrypted")}
    try:
        for r in range(a.rounds + 1):          # round 0 warms up, untimed
            order = [None, key] if r % 2 else [key, None]
            for k in order:
                label = "encrypted" if k is not None else "plain"
                root = os.path.join(base, f"{label}-{r}")
                s = open_store(root, key=k, compress="none", min_chunked=0)
                t0 = time.perf_counter()
                s.put("run", 1, state)
                put = time.perf_counter() - t0
                fresh = open_store(root, key=k)
                t0 = time.perf_counter()
                ck = fresh.get("run", 1)
                get = time.perf_counter() - t0
                assert all(torch.equal(ck.state[x], state[x]) for x in state)
                if r:
                    times[f"put {label}"].append(put)
                    times[f"get {label}"].append(get)
                shutil.rmtree(root)
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
    print(f"## Encryption at rest, file store, {a.mb} MiB of float32, medians of {a.rounds} rounds\n")
    print("| case | median s | MB/s | encrypted / plain (speed) |")
    print("|---|---:|---:|---:|")
    for op in ("put", "get"):
        p, e = med[f"{op} plain"], med[f"{op} encrypted"]
        print(f"| {op} plain | {p:.3f} | {mb / p:,.0f} | |")
        print(f"| {op} encrypted | {e:.3f} | {mb / e:,.0f} | {p / e:.2f}x |")
    print(f"| AES-256-GCM seal alone, 1 MiB objects, one thread | {seal_s:.3f} | {mb / seal_s:,.0f} | |")
    print(f"| AES-256-GCM open alone, 1 MiB objects, one thread | {open_s:.3f} | {mb / open_s:,.0f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
