"""The local tier during a durable-tier outage: its peak size, and the catch-up after.

    python scripts/bench_tier_outage.py [--mib 24] [--every-s 0.5] [--outage-s 60] [--keep-local 2]

A pipeline puts a ``--mib`` MiB checkpoint every ``--every-s`` seconds through a
``TieredStore`` whose local tier is a directory (under /dev/shm where there is one)
and whose durable tier is Postgres reached through a TCP proxy on loopback. After 10 s
the proxy refuses every connection for ``--outage-s`` seconds. The local tier's bytes
are sampled every 0.1 s; printed: its peak during the outage against ``keep_local``
checkpoints (the limit retention keeps), the checkpoints put meanwhile, how long after
the outage the durable tier held the newest step (the catch-up), and that every
durable step reads back verified.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def tree_bytes(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=24)
    p.add_argument("--every-s", type=float, default=0.5)
    p.add_argument("--outage-s", type=float, default=60.0)
    p.add_argument("--keep-local", type=int, default=2)
    p.add_argument("--dsn", default=os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    args = p.parse_args()

    import numpy as np
    from agck.stores import open_store
    from agck.stores.tiered import TieredStore
    from crashtests.faultproxy import FaultProxy

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local = tempfile.mkdtemp(prefix="agck-outage-", dir=base)
    host, port = "127.0.0.1", int(args.dsn.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = FaultProxy(host, port)
    prefix = f"outage_{os.getpid()}"
    dsn = args.dsn.replace(f"{host}:{port}", f"{host}:{proxy.port}")
    open_store(dsn, prefix=prefix, init=True).close()
    store = TieredStore(local, open_store(dsn, prefix=prefix), keep_local=args.keep_local)
    n = args.mib << 18     # fp32 elements
    rng = np.random.default_rng(0)
    peak, samples, stop = [0], [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            b = tree_bytes(local)
            samples.append((time.monotonic(), b))
            stop.wait(0.1)
    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    step, put_times = 0, []
    outage_at, outage_end = start + 10, start + 10 + args.outage_s
    cut = False
    while time.monotonic() < outage_end + 5:
        if not cut and time.monotonic() >= outage_at:
            proxy.cut_for(args.outage_s)
            cut = True
        step += 1
        store.put("run", step, {"w": rng.standard_normal(n, dtype=np.float32), "step": step})
        put_times.append(time.monotonic())
        time.sleep(args.every_s)
    put_in_outage = sum(1 for t in put_times if outage_at <= t <= outage_end)
    newest = step
    caught = None
    while time.monotonic() - outage_end < 120:
        got = store._from_durable(lambda d: d.steps("run", last=1), [])
        if got and got[0] == newest:
            caught = time.monotonic() - outage_end
            break
        time.sleep(0.2)
    stop.set()
    during = [b for t, b in samples if outage_at <= t <= outage_end]
    one = args.mib << 20
    durable = open_store(args.dsn, prefix=prefix)
    verified = all(durable.get("run", s).state["step"] == s for s in durable.steps("run"))
    print(f"| checkpoint | every | outage | keep_local | puts | local tier peak in the outage | "
          f"peak / one checkpoint | durable newest after | durable steps verified |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.mib} MiB | {args.every_s} s | {args.outage_s:.0f} s | {args.keep_local} | {put_in_outage} | "
          f"{max(during) / 2**20:.0f} MiB | {max(during) / one:.2f}x | "
          f"{'%.1f s' % caught if caught is not None else 'not in 120 s'} | {verified} "
          f"({len(durable.steps('run'))} steps) |")
    store.close()
    proxy.close()
    shutil.rmtree(local, ignore_errors=True)
    return 0 if caught is not None and verified and max(during) <= (args.keep_local + 2) * one * 1.1 else 1


if __name__ == "__main__":
    sys.exit(main())
