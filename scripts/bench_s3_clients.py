#!/usr/bin/env python
"""Which S3 client the object store is built on: obstore against boto3, same server, same bytes.

    python scripts/bench_s3_clients.py [--size-mib 512] [--rounds 3] [--dir /var/tmp] [--endpoint URL]

A private SeaweedFS (``weed mini``) unless --endpoint is given. Cases, the two
clients alternated round by round, the order flipping each round:

- large upload: ``--size-mib`` in one object, multipart, 8 MiB parts, 8 in flight
  (obstore ``put(use_multipart=True)``; boto3 ``upload_fileobj`` with the same
  TransferConfig);
- large download: the same object, 8 MiB ranges, 16 in flight (obstore
  ``get_range`` on a pool; boto3 ``download_fileobj``);
- small puts: 200 objects of 10 KB, one after another (a record, a small
  checkpoint): the latency of one request;
- create-only: whether ``If-None-Match: *`` is refused on an existing key
  (obstore ``mode="create"``; boto3 ``put_object(IfNoneMatch="*")``).

Reported: medians, and the CPU the process spent (the client's cost beside a
pipeline, which shares the cores).
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402,F401  (puts the checkout on sys.path)

from crashtests import s3server  # noqa: E402

PART = 8 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--bucket", default="agck-clients")
    a = p.parse_args(argv)

    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    import obstore
    from obstore.store import S3Store

    server, endpoint = s3server.private_or_given(a.endpoint, a.dir, a.bucket)
    ob = S3Store(a.bucket, config={"endpoint": endpoint, "region": "us-east-1"}, client_options={"allow_http": True})
    bc = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      config=Config(max_pool_connections=32, retries={"max_attempts": 5, "mode": "standard"}))
    tc = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=8)
    tc_get = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=16)
    size = a.size_mib << 20
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    view = memoryview(data)
    small = os.urandom(10_000)
    pool = ThreadPoolExecutor(16)
    rows: dict[str, list[tuple[float, float]]] = {}

    def timed(name, fn):
        c0, t0 = _cpu(), time.perf_counter()
        fn()
        rows.setdefault(name, []).append((time.perf_counter() - t0, _cpu() - c0))

    def ob_get():
        out = np.empty(size, np.uint8)

        def one(lo):
            hi = min(size, lo + PART)
            out[lo:hi] = np.frombuffer(obstore.get_range(ob, "big-ob", start=lo, end=hi), np.uint8)
        list(pool.map(one, range(0, size, PART)))

    def bc_get():
        buf = io.BytesIO()
        bc.download_fileobj(a.bucket, "big-bc", buf, Config=tc_get)

    try:
        for r in range(a.rounds):
            order = ["obstore", "boto3"] if r % 2 == 0 else ["boto3", "obstore"]
            for client in order:
                if client == "obstore":
                    timed("obstore upload", lambda: obstore.put(ob, "big-ob", view, use_multipart=True,
                                                                chunk_size=PART, max_concurrency=8))
                    timed("obstore download", ob_get)
                    timed("obstore 200 small puts", lambda: [obstore.put(ob, f"s/{i}", small) for i in range(200)])
                else:
                    timed("boto3 upload", lambda: bc.upload_fileobj(io.BytesIO(view), a.bucket, "big-bc", Config=tc))
                    timed("boto3 download", bc_get)
                    timed("boto3 200 small puts", lambda: [bc.put_object(Bucket=a.bucket, Key=f"s/{i}", Body=small)
                                                           for i in range(200)])
            print(f"round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
        refused = {}
        try:
            obstore.put(ob, "s/0", small, mode="create")
            refused["obstore"] = False
        except Exception:   # AlreadyExistsError or PreconditionError
            refused["obstore"] = True
        try:
            bc.put_object(Bucket=a.bucket, Key="s/0", Body=small, IfNoneMatch="*")
            refused["boto3"] = False
        except bc.exceptions.ClientError:
            refused["boto3"] = True
    finally:
        pool.shutdown()
        if server is not None:
            server.close()

    print(f"\n{a.size_mib} MiB object, {a.rounds} alternating rounds, SeaweedFS on loopback; medians\n")
    print("| case | obstore | boto3 | obstore speed / boto3 |")
    print("|---|---:|---:|---:|")
    for case in ("upload", "download", "200 small puts"):
        o, b = rows[f"obstore {case}"], rows[f"boto3 {case}"]
        ot, oc = statistics.median(x for x, _ in o), statistics.median(c for _, c in o)
        bt, bcpu = statistics.median(x for x, _ in b), statistics.median(c for _, c in b)
        print(f"| {case} | {ot:.2f} s (CPU {oc:.2f} s) | {bt:.2f} s (CPU {bcpu:.2f} s) | {bt / ot:.2f}x |")
    print(f"\ncreate-only put refused on an existing key: obstore {refused['obstore']}, boto3 {refused['boto3']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
