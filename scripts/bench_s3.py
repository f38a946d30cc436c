#!/usr/bin/env python
"""The object store against the bucket's own speed, in one run, same server, same bytes.

    python scripts/bench_s3.py [--size-mib 1024] [--rounds 5] [--dir /var/tmp] [--endpoint URL]

Starts a private SeaweedFS (``weed mini``, data under --dir) unless --endpoint
names a running S3 server (credentials from the environment). Cases, alternated
round by round:

- **put**: 1 GiB of new content (float32 tensors of 64 MiB) through
  ``S3Store.put`` (chunked: 8 MiB chunks, each looked up and uploaded, 16 at a
  time, then the record), against a raw parallel multipart upload of the same bytes with the
  same client (obstore, 8 MiB parts, 8 in flight);
- **get**: ``S3Store.get`` of that checkpoint (every chunk fetched and its
  BLAKE3 address checked, then the container's checksums) against a raw
  parallel download of the same bytes (ranged GETs of 8 MiB, 16 in flight),
  two passes per round in flipped orders (the first reads after large writes
  are the server's slowest);
- **frozen base**: 1 GiB that does not change and 2 MiB that do, checkpointed
  ten times: bytes uploaded per checkpoint against the state, the requests
  each checkpoint makes, and its time.

Targets (issue: object storage): put and get >= 0.9x raw; a frozen-base
checkpoint uploads <= 5% of the state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402,F401  (puts the checkout on sys.path, before agck is imported)

from crashtests import s3server  # noqa: E402


def _state(total: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n = total // (64 << 20)
    return {f"t{i}": rng.standard_normal((64 << 20) // 4, dtype=np.float32) for i in range(n)}


def raw_put(client, key: str, data: memoryview) -> None:
    client._ob.put(client._store, key, data, use_multipart=True, chunk_size=8 << 20, max_concurrency=8)


def raw_get(client, key: str, size: int, pool: ThreadPoolExecutor) -> np.ndarray:
    out = np.empty(size, np.uint8)
    step = 8 << 20

    def one(lo: int) -> None:
        hi = min(size, lo + step)
        out[lo:hi] = np.frombuffer(client._ob.get_range(client._store, key, start=lo, end=hi), np.uint8)
    list(pool.map(one, range(0, size, step)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the private server keeps its data")
    p.add_argument("--endpoint", default=None, help="a running S3 server instead of a private SeaweedFS")
    p.add_argument("--bucket", default="agck-bench")
    p.add_argument("--frozen-puts", type=int, default=10)
    a = p.parse_args(argv)

    import agck
    from agck.stores.objclient import ObjectClient
    from agck.stores.s3 import S3Store

    server, endpoint = s3server.private_or_given(a.endpoint, a.dir, a.bucket)
    total = a.size_mib << 20
    state = _state(total, 0)
    blob = memoryview(np.concatenate([t.view(np.uint8) for t in state.values()]))
    pool = ThreadPoolExecutor(16)
    rows: dict[str, list[float]] = {"raw put": [], "store put": [], "raw get": [], "store get": []}
    requests = []
    try:
        for r in range(a.rounds):
            url = f"s3://{a.bucket}/bench-{os.getpid()}-{r}?endpoint={endpoint}"
            raw = ObjectClient(url)
            store = S3Store(url)
            cases = ["raw", "store"] if r % 2 == 0 else ["store", "raw"]
            for case in cases:
                t0 = time.perf_counter()
                if case == "raw":
                    raw_put(raw, "raw/blob", blob)
                else:
                    store.put("bench", 1, state)
                rows[f"{case} put"].append(time.perf_counter() - t0)
            requests.append(dict(store.c.requests))
            # two passes of reads, the order flipped in the second: SeaweedFS serves the first
            # reads after a gigabyte of writes slowly, whichever object they are of
            for case in cases + cases[::-1]:
                t0 = time.perf_counter()
                if case == "raw":
                    got = raw_get(raw, "raw/blob", total, pool)
                    assert got.nbytes == total
                else:
                    ck = store.get("bench", 1)
                    assert ck.state["t0"].nbytes == 64 << 20
                rows[f"{case} get"].append(time.perf_counter() - t0)
            del ck, got
            store.close()
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()),
                  file=sys.stderr, flush=True)

        # the frozen base: the same 1 GiB every time, 2 MiB changing
        url = f"s3://{a.bucket}/frozen-{os.getpid()}?endpoint={endpoint}"
        store = S3Store(url)
        frozen = dict(state)
        small = np.zeros((2 << 20) // 4, np.float32)
        per = []
        for i in range(a.frozen_puts + 1):
            small[:] = i
            before = dict(store.c.requests)
            t0 = time.perf_counter()
            store.put("frozen", i, {**frozen, "changing": small})
            took = time.perf_counter() - t0
            after = store.c.requests
            if i:
                up = sum(after.get(k, 0) - before.get(k, 0) for k in ("put_bytes", "multipart_bytes"))
                reqs = {k: after.get(k, 0) - before.get(k, 0) for k in ("put", "multipart", "get", "head", "list",
                                                                         "delete")}
                per.append((up, sum(reqs.values()), reqs, took))
        store.close()
    finally:
        pool.shutdown()
        if server is not None:
            server.close()

    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = total / 1e9
    print(f"\n{a.size_mib} MiB of float32 tensors, {a.rounds} alternating rounds, SeaweedFS on loopback "
          f"(`weed mini`), client obstore; medians\n")
    print("| case | raw (same client) | store | store / raw speed |")
    print("|---|---:|---:|---:|")
    for op in ("put", "get"):
        raw_s, st_s = med[f"raw {op}"], med[f"store {op}"]
        print(f"| {op} | {raw_s:.2f} s ({gb / raw_s:.2f} GB/s) | {st_s:.2f} s ({gb / st_s:.2f} GB/s) | "
              f"{raw_s / st_s:.2f}x |")
    req = requests[-1]
    print(f"\nrequests of one put of new content: {req}")
    ups = [u for u, *_ in per]
    print(f"\nfrozen base: {len(per)} checkpoints of {a.size_mib} MiB + 2 MiB changing: uploaded per checkpoint "
          f"median {statistics.median(ups) / 1e6:.1f} MB = {statistics.median(ups) / total:.2%} of the state; "
          f"requests per checkpoint median {statistics.median(n for _, n, _, _ in per):.0f} "
          f"({per[-1][2]}); time per checkpoint median {statistics.median(t for *_, t in per):.2f} s")
    ok_put = med["raw put"] / med["store put"] >= 0.9
    ok_get = med["raw get"] / med["store get"] >= 0.9
    ok_frozen = statistics.median(ups) / total <= 0.05
    print(f"\nput >= 0.9x raw parallel multipart upload: {'PASS' if ok_put else 'FAIL'} "
          f"({med['raw put'] / med['store put']:.2f}x)")
    print(f"get >= 0.9x raw parallel download: {'PASS' if ok_get else 'FAIL'} "
          f"({med['raw get'] / med['store get']:.2f}x)")
    print(f"frozen base uploads <= 5% of the state per checkpoint: {'PASS' if ok_frozen else 'FAIL'} "
          f"({statistics.median(ups) / total:.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
