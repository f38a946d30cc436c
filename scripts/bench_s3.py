#!/usr/bin/env python
"""The object store against the bucket's own speed, in one run, same server, same bytes.

    python scripts/bench_s3.py [--size-mib 1024] [--rounds 5] [--dir /var/tmp] [--endpoint URL]
                               [--first-get-mib 256] [--first-get-only] [--unpopulated-read-buffer]

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
  are the server's slowest); and once more with ``verify=False``, to show what
  checking every byte costs;
- **catalog**, when Postgres answers at --dsn (default ``AGCK_TEST_DSN``): the
  same put and get through a Postgres store whose chunks go to the bucket
  (``agck_objects``: chunks uploaded, then one transaction of their rows and the
  listing), and through a plain Postgres store (every byte through COPY and the
  WAL), in the same rounds;
- **frozen base**: 1 GiB that does not change and 2 MiB that do, checkpointed
  ten times: bytes uploaded per checkpoint against the state, the requests
  each checkpoint makes, and its time;
- **a few KB changed**: 64 MiB of frozen tensors and 256 small values of 4 KiB,
  one of which changes per checkpoint: the requests each checkpoint makes;
- **first get after put**: what a user sees who reads back what was just written:
  --first-get-mib MiB (default 256) put through a new ``S3Store``, then read
  through that same object (the first get, then a second), then opened afresh
  and read (``open_store`` + ``get``, timed together), against the same bytes
  uploaded raw and downloaded raw right after (the first download, then a
  second), on a new prefix each round, the two orders alternating.
  ``--first-get-only`` runs this case alone; ``--unpopulated-read-buffer`` adds
  the store's reads once more with the output buffer left unpopulated (numpy's
  allocation, its pages faulted in by the threads that write the chunks into it,
  as the raw download's are) instead of ``agck.memory.new_buffer``'s pages put in
  place before the first chunk is asked for;
- **ranks**: --ranks processes (default 4) each writing its part of --rank-mib
  MiB (default 256) at once (``sharded.put_part`` into the store's parts, then
  the commit record), against the same processes each uploading the same bytes
  raw (parallel multipart); the time is from the start shared by all to the
  last one's end, and the commit for the store.

Targets (issue: object storage): put and get >= 0.9x raw; a frozen-base
checkpoint uploads <= 5% of the state; 4 ranks >= 0.9x four raw uploads; the
catalog's put at the object store's speed, not the WAL's.

Every checkpoint put through a store is read back, outside the clock, through a
store object of its own and compared bit for bit with what was put, every rank's
part of a multi-rank step too (benchio.readback): the first that differs or does
not verify ends the run, status 1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

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


def _unpopulated(size: int) -> np.ndarray:
    """A get's output buffer without its pages put in place first: each is faulted in
    by the thread that writes a chunk into it, while other chunks are in flight."""
    return np.empty(size, np.uint8)


def first_get_round(bucket: str, endpoint: str, tag: str, state: dict, blob: memoryview, pool: ThreadPoolExecutor,
                    cases: list[str], rows: dict[str, list[float]]) -> None:
    """One round of the first-get case: each of ``cases`` ("raw", "store", "store unpopulated")
    on a prefix of its own, in the order given; times appended to ``rows``."""
    from agck import memory, open_store
    from agck.stores.s3.client import ObjectClient
    from agck.stores.s3.store import S3Store
    size = blob.nbytes
    for case in cases:
        url = f"s3://{bucket}/first-{tag}-{case.replace(' ', '-')}?endpoint={endpoint}"
        if case == "raw":
            raw = ObjectClient(url)
            raw_put(raw, "raw/blob", blob)
            for label in ("first get", "get again"):
                t0 = time.perf_counter()
                got = raw_get(raw, "raw/blob", size, pool)
                rows[f"raw {label}"].append(time.perf_counter() - t0)
                del got
            continue
        populated = memory.new_buffer
        if case == "store unpopulated":
            memory.new_buffer = _unpopulated
        try:
            with S3Store(url) as store:
                store.put("first", 1, state)
                for label in ("first get", "get again"):
                    t0 = time.perf_counter()
                    ck = store.get("first", 1)
                    rows[f"{case} {label}"].append(time.perf_counter() - t0)
                    del ck
            t0 = time.perf_counter()
            with open_store(url) as fresh:
                ck = fresh.get("first", 1)
                rows[f"{case} fresh object"].append(time.perf_counter() - t0)
            del ck
        finally:
            memory.new_buffer = populated
        benchio.readback(lambda url=url: open_store(url), {("first", 1): state})


def first_get_table(mib: int, rounds: int, rows: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    spread = {k: f"{min(v):.2f}-{max(v):.2f}" for k, v in rows.items() if v}
    raw_first = med["raw first get"]
    print(f"\nfirst get after put, {mib} MiB, {rounds} rounds (a new prefix each, raw and store alternating); "
          f"medians (min-max); the raw column is the raw download right after the raw upload, then again\n")
    print("| case | raw (same client) | first get, same object | get again, same object | "
          "fresh object (open + get) | first get / raw first |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in ("store", "store unpopulated"):
        if f"{case} first get" not in med:
            continue
        name = "store" if case == "store" else "store, output buffer not populated first"
        print(f"| {name} | {raw_first:.2f} s ({spread['raw first get']}); again {med['raw get again']:.2f} s | "
              + " | ".join(f"{med[f'{case} {k}']:.2f} s ({spread[f'{case} {k}']})"
                           for k in ("first get", "get again", "fresh object"))
              + f" | {raw_first / med[f'{case} first get']:.2f}x |")


def _rank(rank: int, world: int, url: str, case: str, mib: int, epoch: int, barrier, out) -> None:
    """One rank: its part of new content put into the store's parts (or the same bytes
    uploaded raw), started with the others; reports (start, end, nonce)."""
    from agck import sharded
    from agck.stores.s3.client import ObjectClient
    from agck.stores.s3.store import S3Store
    state = _state(mib << 20, 100 + rank)
    blob = memoryview(np.concatenate([t.view(np.uint8) for t in state.values()]))
    raw = ObjectClient(url)
    parts = S3Store(url).parts_store()
    nonce = sharded.new_nonce()
    barrier.wait()
    t0 = time.monotonic()
    if case == "raw":
        raw_put(raw, f"raw/rank-{rank}", blob)
    else:
        sharded.put_part(parts, "bench", 1, epoch, rank, world, nonce, state)
    out.put((rank, t0, time.monotonic(), nonce))


def ranks_case(url: str, case: str, world: int, mib: int) -> float:
    """Seconds from the ranks' shared start to the last one's end (and the commit); the
    store's step is then read back, every rank's part."""
    from agck import open_store, sharded
    from agck.stores.s3.store import S3Store
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    epoch = 0
    if case == "store":
        with S3Store(url) as store:
            epoch = store.begin_epoch("bench")
    procs = [ctx.Process(target=_rank, args=(r, world, url, case, mib, epoch, barrier, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    took = max(e for _, _, e, _ in got) - min(s for _, s, _, _ in got)
    if case == "store":
        t0 = time.monotonic()
        with S3Store(url) as store:
            sharded.commit_step(store, "bench", 1, epoch, [n for *_, n in got])
        took += time.monotonic() - t0
        benchio.readback(lambda: open_store(url), {("bench", 1): {r: _state(mib << 20, 100 + r) for r in range(world)}})
    return took


def _postgres(dsn: str | None):
    if not dsn:
        return None
    try:
        import psycopg2
        psycopg2.connect(dsn, connect_timeout=3).close()
    except Exception as e:  # noqa: BLE001 - reported: the catalog rows are left out
        print(f"no Postgres at {dsn} ({str(e).strip().splitlines()[0]}): catalog cases left out", file=sys.stderr)
        return None
    return dsn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the private server keeps its data")
    p.add_argument("--endpoint", default=None, help="a running S3 server instead of a private SeaweedFS")
    p.add_argument("--bucket", default="agck-bench")
    p.add_argument("--frozen-puts", type=int, default=10)
    p.add_argument("--dsn", default=os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"),
                   help="Postgres for the catalog cases ('' leaves them out)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rank-mib", type=int, default=256)
    p.add_argument("--first-get-mib", type=int, default=256, help="the first-get case's size (0 leaves it out)")
    p.add_argument("--first-get-only", action="store_true", help="run the first-get case alone")
    p.add_argument("--unpopulated-read-buffer", action="store_true",
                   help="the first-get case's store reads once more into a buffer not populated first")
    a = p.parse_args(argv)
    if a.first_get_only and a.first_get_mib <= 0:
        p.error("--first-get-only needs --first-get-mib above 0")
    dsn = _postgres(a.dsn)

    from agck import open_store
    from agck.stores.s3.client import ObjectClient
    from agck.stores.s3.store import S3Store

    server, endpoint = s3server.private_or_given(a.endpoint, a.dir, a.bucket)
    pool = ThreadPoolExecutor(16)
    first_cases = ["raw", "store"] + (["store unpopulated"] if a.unpopulated_read_buffer else [])
    first_rows: dict[str, list[float]] = {f"{c} {k}": [] for c in first_cases for k in
                                          ("first get", "get again") + (() if c == "raw" else ("fresh object",))}
    first_state = _state(a.first_get_mib << 20, 1) if a.first_get_mib > 0 else None

    def first_round(r: int) -> None:
        if first_state is None:
            return
        blob = memoryview(np.concatenate([t.view(np.uint8) for t in first_state.values()]))
        order = first_cases[r % len(first_cases):] + first_cases[:r % len(first_cases)]
        first_get_round(a.bucket, endpoint, f"{os.getpid()}-{r}", first_state, blob, pool, order, first_rows)
        print(f"round {r + 1}/{a.rounds}, first get after put: "
              + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in first_rows.items()), file=sys.stderr, flush=True)

    if a.first_get_only:
        try:
            for r in range(a.rounds):
                first_round(r)
        finally:
            pool.shutdown()
            if server is not None:
                server.close()
        first_get_table(a.first_get_mib, a.rounds, first_rows)
        print(benchio.read_back_note(), file=sys.stderr)
        return 0
    total = a.size_mib << 20
    state = _state(total, 0)
    blob = memoryview(np.concatenate([t.view(np.uint8) for t in state.values()]))
    kinds = ["raw", "store"] + (["catalog", "pg"] if dsn else [])
    rows: dict[str, list[float]] = {f"{k} {op}": [] for op in ("put", "get") for k in kinds}
    rows.update({"raw ranks": [], "store ranks": [], "store get unverified": []})
    requests = []
    try:
        from agck.stores.postgres.store import PostgresStore
    except ImportError:
        PostgresStore = None
    try:
        for r in range(a.rounds):
            first_round(r)      # first: before this round's gigabyte of writes slows the server's reads
            url = f"s3://{a.bucket}/bench-{os.getpid()}-{r}?endpoint={endpoint}"
            raw = ObjectClient(url)
            stores = {"store": S3Store(url)}
            reopen = {"store": lambda url=url: open_store(url)}    # the read-back's store objects
            if dsn:
                prefix = f"bench{os.getpid()}_{r}"
                objects = f"s3://{a.bucket}/catalog-{os.getpid()}-{r}?endpoint={endpoint}"
                stores["catalog"] = PostgresStore(dsn, prefix=prefix + "c", init=True, objects=objects)
                stores["pg"] = PostgresStore(dsn, prefix=prefix + "p", init=True)
                reopen["catalog"] = lambda p=prefix + "c", o=objects: open_store(dsn, prefix=p, objects=o)
                reopen["pg"] = lambda p=prefix + "p": open_store(dsn, prefix=p)
            cases = kinds[r % len(kinds):] + kinds[:r % len(kinds)]     # the order rotates round by round
            for case in cases:
                t0 = time.perf_counter()
                if case == "raw":
                    raw_put(raw, "raw/blob", blob)
                else:
                    stores[case].put("bench", 1, state)
                rows[f"{case} put"].append(time.perf_counter() - t0)
            requests.append(dict(stores["store"].c.requests))
            # two passes of reads, the order flipped in the second: SeaweedFS serves the first
            # reads after a gigabyte of writes slowly, whichever object they are of
            for case in cases + cases[::-1]:
                t0 = time.perf_counter()
                if case == "raw":
                    got = raw_get(raw, "raw/blob", total, pool)
                    assert got.nbytes == total
                else:
                    ck = stores[case].get("bench", 1)
                    assert ck.state["t0"].nbytes == 64 << 20
                rows[f"{case} get"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()      # the same read without checking a byte: what verifying costs
            ck = stores["store"].get("bench", 1, verify=False)
            rows["store get unverified"].append(time.perf_counter() - t0)
            del ck, got
            for open_fresh in reopen.values():
                benchio.readback(open_fresh, {("bench", 1): state})
            for case in ("store", "raw") if r % 2 else ("raw", "store"):
                rows[f"{case} ranks"].append(ranks_case(f"s3://{a.bucket}/ranks-{os.getpid()}-{r}"
                                                        f"?endpoint={endpoint}", case, a.ranks, a.rank_mib))
            for k, st in stores.items():
                if k in ("catalog", "pg"):
                    n = st.names
                    st._query(f"DROP TABLE IF EXISTS {n.manifest}, {n.chunks}, {n.objects}, {n.gc}, {n.doomed}, "
                              f"{n.version} CASCADE; SELECT 1")
                st.close()
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()),
                  file=sys.stderr, flush=True)

        # the frozen base: the same 1 GiB every time, 2 MiB changing
        url = f"s3://{a.bucket}/frozen-{os.getpid()}?endpoint={endpoint}"
        store = S3Store(url)
        frozen = dict(state)
        small = np.zeros((2 << 20) // 4, np.float32)
        per = []
        written = {}     # what each checkpoint holds, to read back
        for i in range(a.frozen_puts + 1):
            small[:] = i
            written[("frozen", i)] = {**frozen, "changing": small.copy()}
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
        benchio.readback(lambda: open_store(url), written)

        # a few KB changed: 64 MiB frozen, 256 small values of 4 KiB, one of them changing
        small_state = {**{f"t{i}": state[f"t{i}"] for i in range(1)},
                       **{f"s{i}": np.full(1024, i, np.float32) for i in range(256)}}
        few = {}
        few_url = f"s3://{a.bucket}/few-{os.getpid()}?endpoint={endpoint}"
        few_catalog = {"prefix": f"bench{os.getpid()}_few",
                       "objects": f"s3://{a.bucket}/few-cat-{os.getpid()}?endpoint={endpoint}"}
        targets = {"store": S3Store(few_url)}
        reopen = {"store": lambda: open_store(few_url)}
        if dsn:
            targets["catalog"] = PostgresStore(dsn, init=True, **few_catalog)
            reopen["catalog"] = lambda: open_store(dsn, **few_catalog)
        for k, st in targets.items():
            client = st.c if k == "store" else st._objects.c
            counts = []
            written = {}
            for i in range(a.frozen_puts + 1):
                small_state[f"s{i % 256}"] = np.full(1024, 1000 + i, np.float32)
                written[("few", i)] = dict(small_state)      # its values are replaced, never changed
                before = dict(client.requests)
                st.put("few", i, small_state)
                if i:
                    counts.append({q: client.requests.get(q, 0) - before.get(q, 0)
                                   for q in ("put", "multipart", "get", "head", "list", "delete")})
            few[k] = counts
            benchio.readback(reopen[k], written)
            if k == "catalog":
                n = st.names
                st._query(f"DROP TABLE IF EXISTS {n.manifest}, {n.chunks}, {n.objects}, {n.gc}, {n.doomed}, "
                          f"{n.version} CASCADE; SELECT 1")
            st.close()
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
    raw_s, st_s = med["raw get"], med["store get unverified"]
    print(f"| get, verify=False (no BLAKE3, no XXH3) | {raw_s:.2f} s | {st_s:.2f} s ({gb / st_s:.2f} GB/s) | "
          f"{raw_s / st_s:.2f}x |")
    rgb = a.ranks * (a.rank_mib << 20) / 1e9
    raw_s, st_s = med["raw ranks"], med["store ranks"]
    print(f"| {a.ranks} ranks' parts at once, {a.rank_mib} MiB each | {raw_s:.2f} s ({rgb / raw_s:.2f} GB/s) | "
          f"{st_s:.2f} s ({rgb / st_s:.2f} GB/s) | {raw_s / st_s:.2f}x |")
    if dsn:
        print("\nPostgres catalog, chunks in the bucket (agck_objects), against a plain Postgres store "
              "(every byte through COPY and the WAL), same run:\n")
        print("| case | raw upload/download | catalog + bucket | plain Postgres | catalog / raw | catalog / Postgres |")
        print("|---|---:|---:|---:|---:|---:|")
        for op in ("put", "get"):
            raw_s, cat_s, pg_s = med[f"raw {op}"], med[f"catalog {op}"], med[f"pg {op}"]
            print(f"| {op} | {raw_s:.2f} s | {cat_s:.2f} s ({gb / cat_s:.2f} GB/s) | {pg_s:.2f} s "
                  f"({gb / pg_s:.2f} GB/s) | {raw_s / cat_s:.2f}x | {pg_s / cat_s:.2f}x |")
    for k, counts in few.items():
        tot = [sum(c.values()) for c in counts]
        print(f"\na few KB changed ({k}): requests per checkpoint median {statistics.median(tot):.0f} "
              f"(max {max(tot)}; last {counts[-1]})")
    req = requests[-1]
    print(f"\nrequests of one put of new content: {req}")
    ups = [u for u, *_ in per]
    print(f"\nfrozen base: {len(per)} checkpoints of {a.size_mib} MiB + 2 MiB changing: uploaded per checkpoint "
          f"median {statistics.median(ups) / 1e6:.1f} MB = {statistics.median(ups) / total:.2%} of the state; "
          f"requests per checkpoint median {statistics.median(n for _, n, _, _ in per):.0f} "
          f"({per[-1][2]}); time per checkpoint median {statistics.median(t for *_, t in per):.2f} s")
    if first_state is not None:
        first_get_table(a.first_get_mib, a.rounds, first_rows)
    ok_put = med["raw put"] / med["store put"] >= 0.9
    ok_get = med["raw get"] / med["store get"] >= 0.9
    ok_frozen = statistics.median(ups) / total <= 0.05
    print(f"\nput >= 0.9x raw parallel multipart upload: {'PASS' if ok_put else 'FAIL'} "
          f"({med['raw put'] / med['store put']:.2f}x)")
    print(f"get >= 0.9x raw parallel download: {'PASS' if ok_get else 'FAIL'} "
          f"({med['raw get'] / med['store get']:.2f}x)")
    print(f"frozen base uploads <= 5% of the state per checkpoint: {'PASS' if ok_frozen else 'FAIL'} "
          f"({statistics.median(ups) / total:.2%})")
    ratio = med["raw ranks"] / med["store ranks"]
    print(f"{a.ranks} ranks >= 0.9x {a.ranks} raw parallel uploads: {'PASS' if ratio >= 0.9 else 'FAIL'} "
          f"({ratio:.2f}x)")
    if dsn:
        cat, pg = med["raw put"] / med["catalog put"], med["pg put"] / med["catalog put"]
        print(f"catalog put at the object store's speed (>= 0.9x raw), not the WAL's: "
              f"{'PASS' if cat >= 0.9 else 'FAIL'} ({cat:.2f}x raw, {pg:.2f}x the plain Postgres store)")
    print(benchio.read_back_note(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
