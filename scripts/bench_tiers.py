"""Tiered multi-rank checkpoints: the stall of a local checkpoint, and restore after one
host is lost, from peers against the durable tier alone (throttled and not).

    python scripts/bench_tiers.py [--mib-per-rank 64] [--rate-mbs 100] [--rounds 3] [--dir /var/tmp]

4 gloo ranks in 2 "hosts" (ranks 0-1, 2-3), each host a local directory; the durable
tier a private SeaweedFS (s3), each host reaching it through its own TCP proxy, which
in the throttled case is a token bucket of ``--rate-mbs`` per direction (a host's link
to a cloud object store).

1. **checkpoint**: the job runs ``--steps`` steps of ``--mib-per-rank`` MiB of fp32 per
   rank through ``agck.Snapshotter(mode="async")``, a checkpoint every step (replicated
   to the other host, copied durable in the background). The stall of each
   checkpointing step (the time the pipeline spends in the Snapshotter between two
   steps) is set against one in-memory copy of the rank's state (``torch.clone``), median.
2. **restore after losing host 1** (its directory deleted), three ways, ``--rounds``
   each, every rank's ``Snapshotter.restore`` timed from a barrier, the slowest rank's:
   - *peers*: tiered as written: ranks 0-1 read their host's tier, ranks 2-3 get their
     parts from host 0's replicas over torch.distributed (gloo, loopback);
   - *durable, throttled*: every rank restores from the durable tier alone (no local
     tier, no replicas), each host's ranks through its throttled proxy;
   - *durable, unthrottled*: the same through an unthrottled proxy.
   The ratio durable-throttled / peers is the speed-up the tiers give.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WORLD = 4
RUN = "bench"


def _host(rank: int) -> str:
    return "host0" if rank < 2 else "host1"


def rank_main(a) -> int:
    import torch
    import torch.distributed as dist

    import agck

    dist.init_process_group("gloo", init_method=f"file://{a.rdzv}", rank=a.rank, world_size=WORLD)
    durable = agck.open_store(a.durables.split(",")[a.rank // 2])
    if a.mode == "durable":        # the durable tier alone
        store = durable
    else:
        store = agck.TieredStore(os.path.join(a.base, _host(a.rank)), durable, keep_local=2, replicas=1)
    n = a.mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(a.rank)
    state = {"w": torch.randn(n, generator=g)}
    out = {"rank": a.rank}
    if a.phase == "write":
        snap = agck.Snapshotter(store, RUN, every=1, mode="async", resume=False)
        state = snap.restore(state)
        stalls, copies = [], []
        last = None
        for i in snap.steps(a.steps):
            now = time.perf_counter()
            if last is not None:
                stalls.append(now - last)
            state["w"].add_(1.0)
            t = time.perf_counter()
            copy = state["w"].clone()
            copies.append(time.perf_counter() - t)
            del copy
            time.sleep(a.step_s)
            last = time.perf_counter()
        snap.close()
        if a.mode != "durable":
            store.flush(timeout=600)
        out.update(stall=statistics.median(stalls), copy=statistics.median(copies))
    else:
        dist.barrier()
        prof = None
        if os.environ.get("BENCH_PROFILE") == str(a.rank):
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t = time.perf_counter()
        snap = agck.Snapshotter(store, RUN, every=1, mode="sync")
        state = snap.restore(state)
        dist.barrier()
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{a.report}.prof.{a.mode}")
        out.update(restore=time.perf_counter() - t, step=snap.start_step,
                   source=getattr(getattr(snap._target, "sharded", None), "restored_from", None))
        snap.close()
    store.close()
    with open(f"{a.report}.{a.rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    return 0


def job(base: str, phase: str, mode: str, durables: list[str], a) -> list[dict]:
    rdzv = os.path.join(base, f"rdzv-{time.monotonic_ns()}")
    report = os.path.join(base, "report")
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "rank", "--rank", str(r), "--rdzv", rdzv,
                               "--base", base, "--durables", ",".join(durables), "--phase", phase, "--mode", mode,
                               "--report", report, "--mib", str(a.mib_per_rank), "--steps", str(a.steps),
                               "--step-s", str(a.step_s)], env=env, stderr=subprocess.PIPE) for r in range(WORLD)]
    errs = [p.communicate(timeout=1800)[1] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} of {phase}/{mode} exited {p.returncode}: {errs[r].decode()[-2000:]}")
    return [json.load(open(f"{report}.{r}")) for r in range(WORLD)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib-per-rank", type=int, default=64)
    p.add_argument("--rate-mbs", type=float, default=100.0, help="the throttled durable link per host, MB/s")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--step-s", type=float, default=1.0, help="the pipeline's own time per step")
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    from urllib.parse import urlsplit

    from crashtests import s3server
    from crashtests.faultproxy import FaultProxy

    base = tempfile.mkdtemp(prefix="agck-bench-tiers-", dir=a.dir)
    server, endpoint = s3server.private_or_given(None, base, "tiers")
    port = urlsplit(endpoint).port
    plain = [FaultProxy("127.0.0.1", port) for _ in range(2)]
    slow = [FaultProxy("127.0.0.1", port, rate=a.rate_mbs * 1e6) for _ in range(2)]

    def urls(proxies, prefix):
        return [f"s3://tiers/{prefix}?endpoint={px.endpoint}" for px in proxies]
    results: dict = {"mib_per_rank": a.mib_per_rank, "rate_mbs_per_host": a.rate_mbs, "world": WORLD, "hosts": 2}
    try:
        # 1. the tiered job writes (through the unthrottled links: the copy is not what is timed)
        wrote = job(base, "write", "tiered", urls(plain, "tiered"), a)
        results["stall_ms"] = [round(w["stall"] * 1e3, 1) for w in wrote]
        results["copy_ms"] = [round(w["copy"] * 1e3, 1) for w in wrote]
        results["stall_over_copy"] = round(max(w["stall"] / w["copy"] for w in wrote), 2)
        # the same states written to the durable tier alone, for its restores
        job(base, "write", "durable", urls(plain, "alone"), a)
        times: dict[str, list] = {"peers": [], "durable throttled": [], "durable unthrottled": []}
        sources = {}
        for _ in range(a.rounds):
            shutil.rmtree(os.path.join(base, "host1"), ignore_errors=True)        # host 1 lost
            got = job(base, "restore", "tiered", urls(slow, "tiered"), a)
            times["peers"].append(max(g["restore"] for g in got))
            sources["peers"] = [g["source"] for g in got]
            for name, proxies in (("durable throttled", slow), ("durable unthrottled", plain)):
                got = job(base, "restore", "durable", urls(proxies, "alone"), a)
                times[name].append(max(g["restore"] for g in got))
        results["restore_s"] = {k: [round(x, 3) for x in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        results["restore_median_s"] = {k: round(v, 3) for k, v in med.items()}
        results["peers_sources"] = sources["peers"]
        results["throttled_over_peers"] = round(med["durable throttled"] / med["peers"], 2)
        results["unthrottled_over_peers"] = round(med["durable unthrottled"] / med["peers"], 2)
    finally:
        for px in plain + slow:
            px.close()
        if server is not None:
            server.close()
        if not os.environ.get("BENCH_PROFILE"):
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        q = argparse.ArgumentParser()
        for name in ("--rdzv", "--base", "--durables", "--phase", "--mode", "--report"):
            q.add_argument(name, required=True)
        q.add_argument("--rank", type=int, required=True)
        q.add_argument("--mib", type=int, required=True)
        q.add_argument("--steps", type=int, required=True)
        q.add_argument("--step-s", type=float, required=True)
        sys.exit(rank_main(q.parse_args(sys.argv[2:])))
    sys.exit(main())
