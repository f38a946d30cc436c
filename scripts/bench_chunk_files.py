#!/usr/bin/env python
"""What a chunk file costs to make durable, through the page cache and around it.

    python scripts/bench_chunk_files.py [--chunks 300] [--chunk-kib 1024] [--rounds 5] [--dir DIR]

The file store keeps each chunk of an incremental checkpoint as a file of its
own (write, fsync, rename). A put of new content makes hundreds of them, on a
pool of writer threads, while the pipeline computes: their CPU is taken from
the pipeline. Cases, alternated round by round (order rotated):

- raw buffered: open, write, fsync, close, per file (the page cache);
- raw O_DIRECT: the same with O_DIRECT, from page-aligned memory;
- the store's chunk writes (``ObjectDir`` batches of random chunks, the chunks
  fsync'd and renamed, their directories fsync'd) with ``durable.DIRECT_IO``
  pinned to "never" and to "always", on one thread.

Reported: wall time and the calling thread's CPU (user + system) per case, as
medians of the rounds; every write of a round is of new content.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402,F401  (puts the checkout on sys.path, before agck is imported)

from agck import chunking, durable  # noqa: E402
from agck.stores.file.objects import ObjectDir  # noqa: E402

try:
    import resource
except ImportError:  # pragma: no cover
    resource = None


def thread_cpu() -> float:
    if resource is not None and hasattr(resource, "RUSAGE_THREAD"):
        r = resource.getrusage(resource.RUSAGE_THREAD)
        return r.ru_utime + r.ru_stime
    return time.thread_time()


def raw_files(d: str, chunks: list, direct: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (getattr(os, "O_DIRECT", 0) if direct else 0)
    for i, c in enumerate(chunks):
        fd = os.open(os.path.join(d, f"c{i}"), flags, 0o644)
        try:
            os.write(fd, c)
            os.fsync(fd)
        finally:
            os.close(fd)
    benchio.fsync_dir(d)


def store_chunks(d: str, chunks: list, addresses: list, mode: str) -> None:
    with benchio.pinned_direct_io(mode):
        objects = ObjectDir(d, durable.REAL)
        os.makedirs(objects.dir, exist_ok=True)
        objects.pool = lambda: None   # written on this thread: its CPU is what is measured
        batch = objects.batch()
        for a, c in zip(addresses, chunks):
            batch.add(a, memoryview(c))
        batch.sync()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=300)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    if args.dir is not None and not os.path.isdir(args.dir):
        p.exit(2, f"--dir {args.dir}: no such directory\n")
    if not hasattr(os, "O_DIRECT"):
        p.exit(2, "this platform has no O_DIRECT\n")
    size = args.chunk_kib << 10
    rng = np.random.default_rng(0)
    cases = {
        "raw buffered write+fsync": lambda d, cs, _: raw_files(d, cs, False),
        "raw O_DIRECT write+fsync": lambda d, cs, _: raw_files(d, cs, True),
        "store chunks, page cache": lambda d, cs, addrs: store_chunks(d, cs, addrs, "never"),
        "store chunks, O_DIRECT": lambda d, cs, addrs: store_chunks(d, cs, addrs, "always"),
    }
    names = list(cases)
    times = {n: [] for n in names}
    cpus = {n: [] for n in names}
    root = tempfile.mkdtemp(prefix="agck-bench-chunks-", dir=args.dir)
    try:
        for r in range(args.rounds + 1):           # the first round warms up, uncounted
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                chunks = [benchio.aligned_copy(rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(args.chunks)]
                addresses = [chunking.address(c) for c in chunks]     # before the clock starts
                d = os.path.join(root, f"r{r}-{names.index(n)}")
                os.mkdir(d)
                c0, t0 = thread_cpu(), time.perf_counter()
                cases[n](d, chunks, addresses)
                t1, c1 = time.perf_counter(), thread_cpu()
                if r:
                    times[n].append(t1 - t0)
                    cpus[n].append(c1 - c0)
                shutil.rmtree(d)
            if r:
                print(f"round {r}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = args.chunks * size / (1 << 20)
    print(f"## {args.chunks} chunk files of {args.chunk_kib} KiB ({mib:.0f} MiB of new content), medians of "
          f"{args.rounds} rounds\n")
    print(f"`python scripts/bench_chunk_files.py --chunks {args.chunks} --chunk-kib {args.chunk_kib} "
          f"--rounds {args.rounds}`\n")
    print("| case | wall | CPU of the writing thread | CPU per MiB |")
    print("|---|---:|---:|---:|")
    for n in names:
        w, c = statistics.median(times[n]), statistics.median(cpus[n])
        print(f"| {n} | {w * 1e3:.0f} ms | {c * 1e3:.0f} ms | {c / mib * 1e3:.2f} ms |")
    pc, dc = statistics.median(cpus["store chunks, page cache"]), statistics.median(cpus["store chunks, O_DIRECT"])
    pw, dw = statistics.median(times["store chunks, page cache"]), statistics.median(times["store chunks, O_DIRECT"])
    print(f"\nstore chunks O_DIRECT against the page cache: {pc / max(dc, 1e-9):.1f}x less CPU, "
          f"{pw / max(dw, 1e-9):.2f}x the speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
