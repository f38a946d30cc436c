#!/usr/bin/env python3
"""What checkpoint_every costs a running pipeline.

A pipeline with ~STATE_MB of float32 state and compute steps of ~STEP_S
seconds (single-threaded matmuls, leaving the second core to the writer),
checkpointing every EVERY steps to the file store. Cases, alternated each
round: no checkpointing, sync mode, async mode. Reports the wall-time
overhead versus no checkpointing, and the time the pipeline is blocked per
checkpoint versus one host memory copy of the state (the floor for any
snapshot that lets the pipeline mutate its state right after).

    python scripts/bench_snapshot.py [--state-mb 500] [--step-s 1.0] [--steps 30] [--every 10] [--rounds 2]
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from agck import Snapshotter

DEVICE = "cpu"


def make_state(mb: int, device: str = "cpu") -> dict:
    n = mb * (1 << 20) // 4
    sizes = [n // 8] * 8
    return {"layers": [torch.randn(s // 1024, 1024, device=device) for s in sizes], "results": [], "step": 0}


def calibrate(step_s: float) -> int:
    a = torch.randn(512, 512, device=DEVICE)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 20
    return max(1, int(step_s / per))


def compute(state, i, reps):
    a = state["_a"]
    for _ in range(reps):
        a @ a
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    state["layers"][i % len(state["layers"])].mul_(1.0000001)  # the state changes every step
    state["results"].append(i)


def memcpy_seconds(state) -> float:
    """One copy of the state to host memory: pinned device-to-host on GPU."""
    on_gpu = state["layers"][0].is_cuda
    bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu) for t in state["layers"]]
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for b, t in zip(bufs, state["layers"]):
            b.copy_(t, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


def run_case(case, state, args, reps, root):
    store = os.path.join(root, case)
    shutil.rmtree(store, ignore_errors=True)
    state["results"].clear()
    t0 = time.perf_counter()
    if case == "none":
        for i in range(args.steps):
            compute(state, i, reps)
        return time.perf_counter() - t0, []
    snap = Snapshotter(store, "bench", every=args.every, mode=case, handle_signals=False, resume=False)
    snap.restore(None)
    for i in snap.steps(args.steps):
        compute(state, i, reps)
        snap.update({"layers": state["layers"], "results": state["results"]})
    snap.close()
    wall = time.perf_counter() - t0
    shutil.rmtree(store, ignore_errors=True)
    return wall, snap.blocked_seconds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--state-mb", type=int, default=500)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None)
    p.add_argument("--json")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="agck-bench-snap-", dir=args.dir)
    try:
        state = make_state(args.state_mb, DEVICE)
        state["_a"] = torch.randn(512 if DEVICE == "cpu" else 4096, 512 if DEVICE == "cpu" else 4096, device=DEVICE)
        reps = calibrate(args.step_s)
        copy_s = memcpy_seconds(state)
        walls = {c: [] for c in ("none", "sync", "async")}
        blocked = {c: [] for c in ("sync", "async")}
        for _ in range(args.rounds):
            for case in ("none", "sync", "async"):
                w, b = run_case(case, state, args, reps, root)
                walls[case].append(w)
                if case != "none":
                    blocked[case] += b
        base = statistics.median(walls["none"])
        rows = []
        print(f"state {args.state_mb} MB, {args.steps} steps of ~{args.step_s} s, checkpoint every {args.every}; "
              f"one host memcpy of the state: {copy_s * 1e3:.0f} ms; median of {args.rounds} alternating rounds\n")
        print("| case | wall s | overhead vs none | blocked per checkpoint (median) | blocked / memcpy |")
        print("|---|---|---|---|---|")
        for case in ("none", "sync", "async"):
            w = statistics.median(walls[case])
            b = statistics.median(blocked[case]) if case != "none" else 0.0
            row = {"case": case, "wall_s": w, "overhead": w / base - 1, "blocked_s": b, "blocked_over_memcpy": b / copy_s}
            rows.append(row)
            print(f"| {case} | {w:.2f} | {100 * (w / base - 1):+.1f}% | {b * 1e3:.0f} ms | "
                  f"{b / copy_s:.2f}x |" if case != "none" else f"| none | {w:.2f} | - | - | - |")
        a = rows[2]
        print(f"\nasync overhead <= 5%: {'PASS' if a['overhead'] <= 0.05 else 'FAIL'} ({100 * a['overhead']:+.1f}%)")
        limit = 1.1 if DEVICE == "cpu" else 1.2
        print(f"async blocked <= {limit}x memcpy: {'PASS' if a['blocked_over_memcpy'] <= limit else 'FAIL'} "
              f"({a['blocked_over_memcpy']:.2f}x)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "memcpy_s": copy_s, "rows": rows}, f, indent=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
