#!/usr/bin/env python3
"""What a long pipeline's checkpoints cost as it runs: incremental versus full.

Two workloads, each run through ``Snapshotter`` (the README's loop form, sync
mode, every EVERY steps) on a fresh file store, once with incremental
checkpoints (the default) and once with ``incremental=False`` (every
checkpoint a full standalone container, as before), alternating:

- ``append``: each step appends one ITEM_KB float32 array to ``state["out"]``
  and a small record to ``state["records"]`` (an embedding or summarization
  pipeline accumulating its results). Reported: the store's size on disk at
  the end against what the pipeline produced, and the checkpoint time per
  block of BLOCK steps (does it grow with the run's length?).
- ``frozen``: a frozen model of MODEL_MB beside a small adapter that changes
  every step (fine-tuning adapters, inference with a fixed model). Reported:
  bytes stored per checkpoint and time per checkpoint.

The physical limit in the same run: a raw write+fsync of what is new at each
checkpoint (the step's appended bytes), and the peer: ``torch.save`` of the
whole state with fsync, which is what a full rewrite costs.

    python scripts/bench_incremental.py [--steps 2000] [--every 10] [--item-kb 64] [--block 500]
        [--model-mb 256] [--frozen-ckpts 10] [--dir D] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

import torch  # noqa: E402

from agck import Snapshotter, open_store  # noqa: E402


def du(path: str) -> int:
    """Bytes the files under ``path`` hold (apparent size)."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


def run_append(root: str, incremental: bool, args) -> dict:
    store = open_store(root, incremental=incremental)
    rng = np.random.default_rng(0)
    width = args.item_kb * 1024 // 4
    state = {"out": [], "records": []}
    # The steps do almost no work, so the wall time of a block of steps is what its
    # checkpoints cost (taken inside the loop, when a step is a multiple of every).
    blocks, t_run = [], time.perf_counter()
    t_block = t_run
    with Snapshotter(store, "append", every=args.every, mode="sync", resume=False) as snap:
        for i in snap.steps(args.steps):
            state["out"].append(rng.random(width, dtype=np.float32))
            state["records"].append({"doc": f"doc-{i}", "score": float(i) / 7, "tokens": i % 513})
            snap.update(state)
            if (i + 1) % args.block == 0:
                now = time.perf_counter()
                blocks.append(round(now - t_block, 3))
                t_block = now
    ckpt_s = time.perf_counter() - t_run
    produced = len(state["out"]) * width * 4
    size = du(root)
    store.close()
    return {"incremental": incremental, "checkpoint_s": round(ckpt_s, 3), "per_block_s": blocks,
            "produced_bytes": produced, "store_bytes": size, "store_over_produced": round(size / produced, 2)}


def run_frozen(root: str, incremental: bool, args) -> dict:
    store = open_store(root, incremental=incremental)
    model = torch.randn(args.model_mb << 18)               # MODEL_MB of float32
    times, sizes = [], []
    for k in range(args.frozen_ckpts):
        adapter = torch.full((1 << 16,), float(k))
        before = du(root)
        t0 = time.perf_counter()
        store.put("frozen", k, {"model": model, "adapter": adapter})
        times.append(time.perf_counter() - t0)
        sizes.append(du(root) - before)
    store.close()
    return {"incremental": incremental, "first_s": round(times[0], 3),
            "later_s_median": round(float(np.median(times[1:])), 4),
            "first_bytes": sizes[0], "later_bytes_median": int(np.median(sizes[1:]))}


def limits(root: str, args) -> dict:
    """Raw write+fsync of one checkpoint's new bytes; torch.save+fsync of a full state."""
    os.makedirs(root, exist_ok=True)
    new = np.random.default_rng(1).random(args.item_kb * 256 * args.every, dtype=np.float32)
    t0 = time.perf_counter()
    for k in range(20):
        benchio.raw_write_fsync(os.path.join(root, f"raw{k}"), memoryview(new).cast("B"))
    raw = (time.perf_counter() - t0) / 20
    full = {"out": [torch.from_numpy(np.random.default_rng(2).random(args.item_kb * 256, dtype=np.float32))
                    for _ in range(args.steps)]}
    t0 = time.perf_counter()
    path = os.path.join(root, "full.pt")
    with open(path, "wb") as f:
        torch.save(full, f)
        f.flush()
        os.fsync(f.fileno())
    return {"raw_new_bytes_s": round(raw, 5), "torch_save_final_state_s": round(time.perf_counter() - t0, 3),
            "final_state_bytes": os.path.getsize(path)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--item-kb", type=int, default=64)
    ap.add_argument("--block", type=int, default=500)
    ap.add_argument("--model-mb", type=int, default=256)
    ap.add_argument("--frozen-ckpts", type=int, default=10)
    ap.add_argument("--dir", help="where to write (default: a temp directory here)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    if args.dir is not None and not os.path.isdir(args.dir):
        print(f"bench_incremental: --dir {args.dir}: no such directory", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="agck-bench-inc-", dir=args.dir or ".")
    out = {"args": vars(args), "append": [], "frozen": []}
    try:
        out["limits"] = limits(os.path.join(work, "limits"), args)
        for incremental in (True, False):
            root = os.path.join(work, f"append-{incremental}")
            out["append"].append(run_append(root, incremental, args))
            shutil.rmtree(root)
        for incremental in (True, False):
            root = os.path.join(work, f"frozen-{incremental}")
            out["frozen"].append(run_frozen(root, incremental, args))
            shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lim = out["limits"]
    print(f"append: {args.steps} steps of {args.item_kb} KiB, checkpoint every {args.every} (sync, file store)")
    print("| checkpoints | store size / produced | checkpoint time per block of "
          f"{args.block} steps (s) | total checkpoint time (s) |")
    print("|---|---:|---|---:|")
    for r in out["append"]:
        name = "incremental" if r["incremental"] else "full (incremental=False)"
        print(f"| {name} | {r['store_over_produced']}x ({r['store_bytes'] / 2**20:.0f} MiB) | "
              f"{', '.join(map(str, r['per_block_s']))} | {r['checkpoint_s']} |")
    n_ckpt = args.steps // args.every
    inc = out["append"][0]
    print(f"- physical limit: raw write+fsync of each checkpoint's new bytes ({args.every * args.item_kb} KiB) "
          f"{lim['raw_new_bytes_s'] * 1000:.1f} ms, x{n_ckpt} checkpoints = {lim['raw_new_bytes_s'] * n_ckpt:.2f} s; "
          f"incremental spent {inc['checkpoint_s']} s ({inc['checkpoint_s'] / (lim['raw_new_bytes_s'] * n_ckpt):.1f}x)")
    print(f"- peer: torch.save+fsync of the final state ({lim['final_state_bytes'] / 2**20:.0f} MiB) "
          f"{lim['torch_save_final_state_s']} s, once; a full rewrite pays about that at every late checkpoint")
    print(f"\nfrozen: a {args.model_mb} MiB frozen model and a 256 KiB adapter, {args.frozen_ckpts} checkpoints")
    print("| checkpoints | first: s, MiB | later (median): s, bytes stored |")
    print("|---|---:|---:|")
    for r in out["frozen"]:
        name = "incremental" if r["incremental"] else "full (incremental=False)"
        print(f"| {name} | {r['first_s']}, {r['first_bytes'] / 2**20:.0f} | "
              f"{r['later_s_median']}, {r['later_bytes_median']:,} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
