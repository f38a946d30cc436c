#!/usr/bin/env python3
"""What checkpoint_every costs a running pipeline, and where that cost goes.

A pipeline with ~STATE_MB of float32 state and compute steps of ~STEP_S
seconds (single-threaded matmuls, leaving the second core to the writer; or
--threads N, matmuls on N threads, so that the writer competes for the cores),
checkpointing every EVERY steps to the file store. Cases, alternated each
round (the order rotates): no checkpointing, sync mode, async mode.

Reported per round and as medians:

- the wall-time overhead versus no checkpointing (the same round's run);
- the time the pipeline is blocked per checkpoint versus one host memory copy
  of the state (pinned device-to-host on GPU): the floor for any snapshot that
  lets the pipeline mutate its state right after;
- the CPU seconds (user, system) the writer spends per checkpoint: the writer
  thread, and every thread but the pipeline's (the writer's helpers), against
  plain writes of the same bytes in the same run (buffered write+fsync with
  early writeback, and O_DIRECT+fsync);
- the page cache a checkpoint goes through (pages dirtied, /proc/vmstat) and
  the peak of dirty plus writeback memory;
- the pipeline's step-time inflation while a write is in flight, split into
  time the compute thread ran longer (memory bandwidth, caches, the host) and
  time it waited for a CPU (run-queue wait, /proc/self/task/<tid>/schedstat).

``--json`` keeps every step of every run (the timeline) and every write;
``--plot`` draws the timeline of one round (matplotlib).

After each run, outside its figures, its last checkpoint is read back through a
store object of its own and compared bit for bit with the pipeline's final state,
and every checkpoint of the run must verify (benchio.readback): the first that
does not ends the benchmark, status 1.

    python scripts/bench_snapshot.py [--state-mb 500] [--step-s 1.0] [--steps 30] [--every 10] [--rounds 3]
        [--dir D] [--json F] [--plot F.png] [--device cpu|cuda] [--write buffered|auto] [--writer-nice N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

try:
    import resource
except ImportError:  # pragma: no cover
    resource = None

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

import torch  # noqa: E402

from agck import Snapshotter, durable  # noqa: E402
from agck import snapshot as _snapshot  # noqa: E402

DEVICE = "cpu"
CASES = ("none", "sync", "async")


# --- the pipeline ----------------------------------------------------------------

def make_state(mb: int, device: str = "cpu") -> dict:
    n = mb * (1 << 20) // 4
    sizes = [n // 8] * 8
    return {"layers": [torch.randn(s // 1024, 1024, device=device) for s in sizes], "results": [], "step": 0}


def calibrate(a, step_s: float) -> int:
    """Matmuls of ``a`` (the one compute() does) per step of ``step_s`` seconds."""
    a @ a   # warm-up: the first call initializes the BLAS (cuBLAS on GPU)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    pers = []
    for _ in range(5):   # the median of five batches: one busy moment does not set the step length
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        pers.append((time.perf_counter() - t0) / 20)
    return max(1, int(step_s / statistics.median(pers)))


def compute(state, i, reps):
    a = state["_a"]
    for _ in range(reps):
        a @ a
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    state["layers"][i % len(state["layers"])].mul_(1.0000001)  # the state changes every step
    state["results"].append(i)


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state["layers"])


def memcpy_seconds(state) -> float:
    """One copy of the state to host memory (warm buffers): pinned device-to-host on GPU."""
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


# --- what the kernel says ----------------------------------------------------------

def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def schedstat(tid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting on a run queue) of one thread; zeros where unknown."""
    parts = _read(f"/proc/self/task/{tid}/schedstat").split()
    return (int(parts[0]) / 1e9, int(parts[1]) / 1e9) if len(parts) >= 2 else (0.0, 0.0)


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times() -> dict:
    """System-wide CPU seconds by kind (/proc/stat), all CPUs together."""
    line = _read("/proc/stat").split("\n", 1)[0].split()
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return {k: int(v) / hz for k, v in zip(_STAT_FIELDS, line[1:])} if line else {}


def vmstat() -> dict:
    out = {}
    for line in _read("/proc/vmstat").splitlines():
        k, _, v = line.partition(" ")
        if k in ("nr_dirtied", "nr_written", "pgfault", "pgalloc_normal", "pgfree"):
            out[k] = int(v)
    return out


def meminfo() -> dict:
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in ("Dirty", "Writeback", "Cached", "MemFree"):
            out[k] = int(v.split()[0]) / 1024   # MiB
    return out


def proc_cpu() -> tuple[float, float]:
    if resource is None:
        return time.process_time(), 0.0
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def thread_cpu() -> tuple[float, float]:
    if resource is None or not hasattr(resource, "RUSAGE_THREAD"):
        return time.thread_time(), 0.0
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime


class Sampler:
    """Page-cache figures (/proc/meminfo) every ``period`` seconds on a thread of its own."""

    def __init__(self, period: float = 0.1):
        self.period = period
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _run(self):
        while not self._stop.is_set():
            m = meminfo()
            m["t"] = time.perf_counter()
            self.samples.append(m)
            self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


# --- one run -----------------------------------------------------------------------

def run_case(case, state, args, reps, root) -> dict:
    """One run of ``case``: "none", "sync", "async", or "async-cache" (async with
    every write through the page cache: durable.DIRECT_IO pinned to "never")."""
    if case == "async-cache":
        with benchio.pinned_direct_io("never"):
            return _run_case(case, state, args, reps, root)
    return _run_case(case, state, args, reps, root)


def _run_case(case, state, args, reps, root) -> dict:
    store = os.path.join(root, case)
    shutil.rmtree(store, ignore_errors=True)
    state["results"].clear()
    tid = threading.get_native_id()
    steps: list[dict] = []
    snap = None
    vm0, cpu0, p0, m0 = vmstat(), cpu_times(), proc_cpu(), thread_cpu()
    with Sampler() as sampler:
        t0 = time.perf_counter()
        if case == "none":
            it = iter(range(args.steps))
        else:
            target = open_file_store(store, args.store_kind)
            if args.tiered:     # the file store as a local tier, a SQLite file beside it the durable one
                from agck.stores.tiered import TieredStore
                local = target if not isinstance(target, str) else open_file_store(store, args.store_kind, fresh=True)
                target = TieredStore(local, f"sqlite:///{store}-durable.db")
            snap = Snapshotter(target, "bench", every=args.every, mode=case.split("-")[0], handle_signals=False,
                               resume=False)
            if not hasattr(snap, "write_stats"):
                _record_writes(snap)   # a version without per-write figures: measured from outside
            snap.restore(None)
            it = snap.steps(args.steps)
        prev_end = None
        while True:
            try:
                i = next(it)             # the snapshot of the previous step is taken in here
            except StopIteration:
                break
            b = time.perf_counter()
            r0, w0 = schedstat(tid)
            compute(state, i, reps)
            r1, w1 = schedstat(tid)
            c = time.perf_counter()
            if snap is not None:
                snap.update({"layers": state["layers"], "results": state["results"]})
            # gap_s: from the end of the previous step's compute to this one's start (a snapshot's blocking)
            steps.append({"step": i, "start": b - t0, "compute_s": c - b, "run_s": r1 - r0, "wait_s": w1 - w0,
                          "gap_s": 0.0 if prev_end is None else b - prev_end})
            prev_end = c
        t_close = time.perf_counter()
        if snap is not None:
            snap.close()
        wall = time.perf_counter() - t0
        if snap is not None and target is not store:
            if args.tiered:     # after the wall time: the durable copies are the copier's work, not the pipeline's
                target.flush()
            target.close()
    vm1, cpu1, p1, m1 = vmstat(), cpu_times(), proc_cpu(), thread_cpu()
    if snap is not None:
        if args.tiered:         # the last checkpoint committed durable, verified, as written
            benchio.readback(lambda: open_file_store(f"sqlite:///{store}-durable.db", "default", fresh=True),
                             {("bench", args.steps): {"layers": state["layers"], "results": state["results"]}},
                             runs=["bench"])
        benchio.readback(lambda: open_file_store(store, args.store_kind, fresh=True),
                         {("bench", args.steps): {"layers": state["layers"], "results": state["results"]}},
                         runs=["bench"])
    shutil.rmtree(store, ignore_errors=True)
    for leftover in (f"{store}-durable.db", f"{store}-durable.db-wal", f"{store}-durable.db-shm"):
        if os.path.exists(leftover):
            os.remove(leftover)
    writes = []
    if snap is not None:
        for w in getattr(snap, "write_stats", ()):
            writes.append({"step": w["step"], "start": w["start"] - t0, "end": w["end"] - t0,
                           "seconds": w["end"] - w["start"], "cpu_user_s": w["cpu_user_s"],
                           "cpu_sys_s": w["cpu_sys_s"]})
    prep = getattr(snap, "prepare_stats", None) if snap is not None else None
    if prep:   # staging buffers made ahead by the writer: background work like a write
        writes.append({"step": None, "kind": "prepare", "start": prep["start"] - t0, "end": prep["end"] - t0,
                       "seconds": prep["end"] - prep["start"], "cpu_user_s": prep["cpu_user_s"],
                       "cpu_sys_s": prep["cpu_sys_s"]})
    for s in steps:   # how much of the step's compute overlapped a write (or the preparation) in flight
        lo, hi = s["start"], s["start"] + s["compute_s"]
        s["in_flight"] = sum(max(0.0, min(hi, w["end"]) - max(lo, w["start"])) for w in writes) / max(hi - lo, 1e-9)
    others = (p1[0] - p0[0] - (m1[0] - m0[0]), p1[1] - p0[1] - (m1[1] - m0[1]))
    pages = {k: vm1.get(k, 0) - vm0.get(k, 0) for k in vm0}
    return {
        "case": case, "wall_s": wall, "close_s": wall - (t_close - t0),   # the final flush
        "blocked_s": list(snap.blocked_seconds) if snap else [],
        "steps": steps, "writes": writes,
        "pipeline_cpu_s": [m1[0] - m0[0], m1[1] - m0[1]],
        "other_threads_cpu_s": list(others),      # the writer and its helpers (and the sampler)
        "system_cpu_s": {k: cpu1.get(k, 0) - cpu0.get(k, 0) for k in cpu0},
        "vmstat": pages,
        "page_cache": [{"t": m["t"] - t0, **{k: v for k, v in m.items() if k != "t"}} for m in sampler.samples],
    }


def open_file_store(path: str, kind: str, fresh: bool = False):
    """The file store as --store-kind asks: "whole" (a standalone container per
    checkpoint), "incremental" (chunked), or "default" (whatever open_store does;
    the path itself, for the snapshotter to open, unless ``fresh``: a store object)."""
    from agck import open_store
    if kind == "default":
        return open_store(path) if fresh else path
    try:
        return open_store(path, incremental=kind == "incremental")
    except TypeError:        # a version without incremental stores writes whole files
        if kind == "incremental":
            raise
        return path


def _record_writes(snap) -> None:
    persist = snap._persist
    snap.write_stats = []

    def timed(step, *a, **kw):
        t0, c0 = time.perf_counter(), thread_cpu()
        ref = persist(step, *a, **kw)
        c1 = thread_cpu()
        snap.write_stats.append({"step": step, "start": t0, "end": time.perf_counter(),
                                 "cpu_user_s": c1[0] - c0[0], "cpu_sys_s": c1[1] - c0[1]})
        return ref
    snap._persist = timed


# --- plain writes of the same bytes ------------------------------------------------

def raw_writes(state, root) -> dict:
    """CPU seconds and wall time of plain writes of the state's bytes, from warm,
    page-aligned memory (copied there before the clock starts)."""
    flat = _flat_copy(state)
    path = os.path.join(root, "raw.bin")

    def timed(fn):
        c0, t0 = thread_cpu(), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), thread_cpu()
        os.unlink(path)
        return {"wall_s": t1 - t0, "cpu_user_s": c1[0] - c0[0], "cpu_sys_s": c1[1] - c0[1]}

    return {"buffered": timed(lambda: benchio.raw_write_fsync(path, flat)),
            "direct": timed(lambda: benchio.raw_direct_fsync(path, flat))}


_FLAT: list = []


def _flat_copy(state) -> np.ndarray:
    n = state_bytes(state)
    if not _FLAT or _FLAT[0].size != n:
        import mmap
        _FLAT[:] = [np.frombuffer(mmap.mmap(-1, n), dtype=np.uint8)]
    flat, pos = _FLAT[0], 0
    for t in state["layers"]:
        b = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        flat[pos:pos + b.size] = b
        pos += b.size
    return flat


# --- summaries ---------------------------------------------------------------------

def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_run(run: dict, base: dict, n_ckpt: int) -> dict:
    """Overhead, blocked time, writer CPU, page cache and inflation of one run.

    ``overhead`` is the wall time against the same round's run without
    checkpointing (the target's figure); on a shared machine it carries the
    drift between two runs. ``overhead_parts`` adds up what checkpointing put
    into this run itself: the time before the first step, the pipeline's waits
    at snapshots, the final flush in close(), and the steps computed while a
    write was in flight, each against this run's median step with no write in
    flight (split into time the thread ran longer and time it waited for a CPU)."""
    quiet = [s for s in run["steps"] if s["in_flight"] == 0] or run["steps"]
    own = {k: _med([s[k] for s in quiet]) for k in ("compute_s", "run_s", "wait_s")}
    fl = [s for s in run["steps"] if s["in_flight"] > 0]
    infl = sum(s["compute_s"] - own["compute_s"] for s in fl)
    infl_run = sum(s["run_s"] - own["run_s"] for s in fl)
    infl_wait = sum(s["wait_s"] - own["wait_s"] for s in fl)
    base_compute = _med([s["compute_s"] for s in base["steps"]])
    setup = run["steps"][0]["start"] if run["steps"] else 0.0
    added = setup + sum(s["gap_s"] for s in run["steps"]) + run["close_s"] + infl
    prep = [w for w in run["writes"] if w.get("kind") == "prepare"]
    writes = [w for w in run["writes"] if w.get("kind") != "prepare"]
    k = max(1, n_ckpt)
    dirty = [m.get("Dirty", 0) + m.get("Writeback", 0) for m in run["page_cache"]]
    return {
        "wall_s": run["wall_s"],
        "overhead": run["wall_s"] / base["wall_s"] - 1,
        "overhead_parts": added / max(run["wall_s"] - added, 1e-9),
        "blocked_s": _med(run["blocked_s"]),
        "blocked_first_s": run["blocked_s"][0] if run["blocked_s"] else None,
        "blocked_max_s": max(run["blocked_s"]) if run["blocked_s"] else None,
        "write_s": _med([w["seconds"] for w in writes]),
        "writer_cpu_user_s": _med([w["cpu_user_s"] for w in writes]),
        "writer_cpu_sys_s": _med([w["cpu_sys_s"] for w in writes]),
        "other_threads_cpu_s": [x / k for x in run["other_threads_cpu_s"]],
        "dirtied_mib": run["vmstat"].get("nr_dirtied", 0) * 4096 / (1 << 20) / k,
        "peak_dirty_writeback_mib": max(dirty) if dirty else 0.0,
        "steps_in_flight": len(fl),
        "inflation_s": infl / k,
        "inflation_run_s": infl_run / k,
        "inflation_wait_s": infl_wait / k,
        "inflation_vs_none_s": sum(s["compute_s"] - base_compute for s in fl) / k,
        "close_s": run["close_s"],
        "prepare_s": prep[0]["seconds"] if prep else None,
        "prepare_cpu_s": (prep[0]["cpu_user_s"] + (prep[0]["cpu_sys_s"] or 0)) if prep else None,
    }


def plot(path: str, rnd: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    colors = {"none": "tab:gray", "sync": "tab:red", "async": "tab:blue"}
    for case, run in rnd.items():
        xs = [s["start"] for s in run["steps"]]
        axes[0].plot(xs, [s["compute_s"] * 1e3 for s in run["steps"]], ".-", color=colors[case], label=case)
        axes[1].plot(xs, [s["wait_s"] * 1e3 for s in run["steps"]], ".-", color=colors[case], label=case)
        pc = run["page_cache"]
        axes[2].plot([m["t"] for m in pc], [m.get("Dirty", 0) + m.get("Writeback", 0) for m in pc],
                     color=colors[case], label=case)
        for w in run["writes"]:
            for ax in axes:
                ax.axvspan(w["start"], w["end"], color=colors[case], alpha=0.12,
                           hatch="//" if w.get("kind") == "prepare" else None)
    axes[0].set_ylabel("compute step (ms)")
    axes[1].set_ylabel("run-queue wait\nper step (ms)")
    axes[2].set_ylabel("dirty + writeback\n(MiB)")
    axes[2].set_xlabel("seconds since the run started (shaded: a write in flight; hatched: staging buffers made)")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def conditions(root: str) -> dict:
    fd = os.open(root, os.O_RDONLY)
    try:
        st = os.statvfs(root)
    finally:
        os.close(fd)
    probe = os.path.join(root, ".direct-probe")
    direct = False
    try:
        pfd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            direct = bool(getattr(durable.REAL, "set_direct", lambda fd, on: False)(pfd, True))
        finally:
            os.close(pfd)
            os.unlink(probe)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "loadavg": os.getloadavg(), "fs_block": st.f_bsize,
            "o_direct": direct}


# --- main --------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mb", type=int, default=500)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the stores go (an existing directory)")
    p.add_argument("--json", help="write every round, step and write here")
    p.add_argument("--plot", help="PNG of the timeline of the median round")
    p.add_argument("--device", default="cpu")
    p.add_argument("--write", choices=("auto", "direct", "buffered"), default="auto",
                   help="how large files are written (durable.DIRECT_IO): auto (agck's default: timed per file "
                        "system), direct (always O_DIRECT) or buffered (never), for comparison")
    p.add_argument("--writer-nice", type=int, default=None, help="CPU niceness added to the writer thread")
    p.add_argument("--ab-cache", action="store_true",
                   help="add a case: async with every write through the page cache (DIRECT_IO=never), "
                        "alternated with the others, to compare the two in the same rounds")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads the pipeline computes with (1: the second core is the writer's; "
                        "os.cpu_count(): the pipeline uses every core and the writer competes for them)")
    p.add_argument("--tiered", action="store_true",
                   help="checkpoint through a TieredStore: the file store its local tier, SQLite beside it durable")
    p.add_argument("--store-kind", choices=("whole", "incremental", "default"), default="whole",
                   help="whole: one standalone container per checkpoint (default); incremental: chunked")
    args = p.parse_args()
    prog = os.path.basename(sys.argv[0])

    def fail(msg):   # one line, no traceback, usage error status
        p.exit(2, f"{prog}: error: {msg}\n")

    if args.dir is not None and not os.path.isdir(args.dir):
        fail(f"--dir {args.dir}: no such directory")
    if args.dir is not None and not os.access(args.dir, os.W_OK | os.X_OK):
        fail(f"--dir {args.dir}: not writable")
    if min(args.steps, args.every, args.rounds, args.state_mb) < 1:
        fail("--steps, --every, --rounds and --state-mb must be positive")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device")
    durable.DIRECT_IO = {"auto": "auto", "direct": "always", "buffered": "never"}[args.write]
    if args.writer_nice is not None:
        _snapshot.WRITER_NICE = args.writer_nice
    torch.set_num_threads(max(1, args.threads))
    try:
        root = tempfile.mkdtemp(prefix="agck-bench-snap-", dir=args.dir)
    except OSError as e:
        fail(f"cannot create a directory in {args.dir or tempfile.gettempdir()}: {e.strerror}")
    try:
        run_bench(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_bench(args, root):
    cond = conditions(root)
    state = make_state(args.state_mb, DEVICE)
    n_a = 512 if DEVICE == "cpu" else 4096
    state["_a"] = torch.randn(n_a, n_a, device=DEVICE)
    reps = calibrate(state["_a"], args.step_s)
    nbytes = state_bytes(state)
    n_ckpt = len({s for s in range(args.every, args.steps + 1, args.every)} | {args.steps})
    copies, raws, rounds = [], [], []
    for r in range(args.rounds):
        copies.append(memcpy_seconds(state))
        cases = CASES + (("async-cache",) if args.ab_cache else ())
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        rnd = {}
        for case in order:
            rnd[case] = run_case(case, state, args, reps, root)
        raws.append(raw_writes(state, root))
        rounds.append(rnd)
        s = {c: summarize_run(rnd[c], rnd["none"], n_ckpt) for c in ("sync", "async")}
        print(f"round {r + 1}/{args.rounds} ({' '.join(order)}): none {rnd['none']['wall_s']:.2f} s, "
              f"sync {s['sync']['overhead']:+.1%}, async {s['async']['overhead']:+.1%}", file=sys.stderr, flush=True)
    copy_s = statistics.median(copies)
    summaries = [{c: summarize_run(rnd[c], rnd["none"], n_ckpt) for c in ("sync", "async")} for rnd in rounds]
    cond["loadavg_end"] = os.getloadavg()
    print(benchio.read_back_note(), file=sys.stderr)

    raw_b = _med([x["buffered"]["cpu_user_s"] + x["buffered"]["cpu_sys_s"] for x in raws])
    raw_d = _med([x["direct"]["cpu_user_s"] + x["direct"]["cpu_sys_s"] for x in raws])
    copy_what = "pinned device-to-host copy" if DEVICE == "cuda" else "host memcpy"
    print(f"state {nbytes / 1e6:.0f} MB ({args.state_mb} MiB) on {DEVICE}, {args.steps} steps of ~{args.step_s} s, "
          f"checkpoint every {args.every} ({n_ckpt} per run); one {copy_what} of the state: "
          f"{copy_s * 1e3:.0f} ms (median of rounds: {', '.join(f'{c * 1e3:.0f}' for c in copies)}); "
          f"{args.rounds} alternating rounds; file store: {args.store_kind}; writes: {args.write}; "
          f"pipeline threads: {args.threads} of {os.cpu_count()}, "
          f"O_DIRECT available: {cond['o_direct']}; "
          f"load average {cond['loadavg'][0]:.2f} at start, {cond['loadavg_end'][0]:.2f} at end\n")

    print("| round | none | sync | sync overhead | async | async overhead (wall; parts) | async blocked / ckpt "
          "(first) | blocked / copy | final flush | write / ckpt | writer thread CPU user + sys / ckpt | "
          "all threads but the pipeline's, CPU / ckpt | pages dirtied / ckpt (system-wide) | "
          "inflation in flight / ckpt (ran longer, waited) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r, (rnd, s) in enumerate(zip(rounds, summaries)):
        a, y = s["async"], s["sync"]
        print(f"| {r + 1} | {rnd['none']['wall_s']:.2f} s | {y['wall_s']:.2f} s | {y['overhead']:+.1%} | "
              f"{a['wall_s']:.2f} s | {a['overhead']:+.1%}; {a['overhead_parts']:+.1%} | "
              f"{_ms(a['blocked_s'])} ({_ms(a['blocked_first_s'])}) | {a['blocked_s'] / copy_s:.2f}x | "
              f"{_ms(a['close_s'])} | {_ms(a['write_s'])} | "
              f"{_ms(a['writer_cpu_user_s'])} + {_ms(a['writer_cpu_sys_s'])} | "
              f"{_ms(sum(a['other_threads_cpu_s']))} | {a['dirtied_mib']:.0f} MiB | "
              f"{a['inflation_s'] * 1e3:+.0f} ms ({a['inflation_run_s'] * 1e3:+.0f}, "
              f"{a['inflation_wait_s'] * 1e3:+.0f}) |")

    if args.ab_cache:
        ab = [{c: summarize_run(rnd[c], rnd["none"], n_ckpt) for c in ("async", "async-cache")} for rnd in rounds]
        for c, what in (("async", f"writes {args.write}"), ("async-cache", "every write through the page cache")):
            m = {k: _med([x[c][k] for x in ab]) for k in ("overhead", "overhead_parts", "inflation_s", "close_s",
                                                          "dirtied_mib")}
            cpu = _med([sum(x[c]["other_threads_cpu_s"]) for x in ab])
            per_round = ", ".join(f"{x[c]['overhead_parts']:+.1%}" for x in ab)
            print(f"\nA/B, {c} ({what}): overhead {m['overhead']:+.1%} wall, {m['overhead_parts']:+.1%} inside the run "
                  f"(per round: {per_round}); inflation in "
                  f"flight {m['inflation_s'] * 1e3:+.0f} ms / ckpt; final flush {m['close_s'] * 1e3:.0f} ms; "
                  f"CPU of all threads but the pipeline's {cpu * 1e3:.0f} ms / ckpt; {m['dirtied_mib']:.0f} MiB "
                  f"dirtied / ckpt", end="")
        print()

    med = {c: {k: _med([s[c][k] for s in summaries]) for k in summaries[0][c] if k != "other_threads_cpu_s"}
           for c in ("sync", "async")}
    for c in med:
        med[c]["other_threads_cpu_s"] = _med([sum(s[c]["other_threads_cpu_s"]) for s in summaries])
    a, y = med["async"], med["sync"]
    print(f"\nmedians: sync overhead {y['overhead']:+.1%} (parts {y['overhead_parts']:+.1%}; blocked "
          f"{y['blocked_s'] * 1e3:.0f} ms / ckpt); async overhead {a['overhead']:+.1%} (parts "
          f"{a['overhead_parts']:+.1%}), blocked {a['blocked_s'] * 1e3:.0f} ms / ckpt "
          f"= {a['blocked_s'] / copy_s:.2f}x one {copy_what} ({copy_s * 1e3:.0f} ms)")
    wcpu = a["writer_cpu_user_s"] + (a["writer_cpu_sys_s"] or 0)
    print(f"writer CPU per checkpoint: writer thread {a['writer_cpu_user_s'] * 1e3:.0f} ms user + "
          f"{(a['writer_cpu_sys_s'] or 0) * 1e3:.0f} ms sys; all threads but the pipeline's "
          f"{a['other_threads_cpu_s'] * 1e3:.0f} ms (hashing, and staging buffers made ahead); "
          f"plain writes of the same {nbytes / 1e6:.0f} MB in this run: "
          f"buffered write+fsync {raw_b * 1e3:.0f} ms CPU "
          f"({_med([x['buffered']['wall_s'] for x in raws]) * 1e3:.0f} ms wall), "
          f"O_DIRECT+fsync {raw_d * 1e3:.0f} ms CPU ({_med([x['direct']['wall_s'] for x in raws]) * 1e3:.0f} ms wall); "
          f"writer thread / buffered raw = {wcpu / raw_b:.2f}x" if raw_b else "")
    if a.get("prepare_s") is not None:
        print(f"staging buffers made ahead by the writer (once per run): {a['prepare_s'] * 1e3:.0f} ms, "
              f"{a['prepare_cpu_s'] * 1e3:.0f} ms CPU")
    print(f"page cache per checkpoint: {a['dirtied_mib']:.0f} MiB dirtied (async), {y['dirtied_mib']:.0f} MiB (sync); "
          f"peak dirty+writeback {a['peak_dirty_writeback_mib']:.0f} MiB (async)")
    print(f"pipeline step-time inflation while a write is in flight, per checkpoint: {a['inflation_s'] * 1e3:+.0f} ms "
          f"(ran longer {a['inflation_run_s'] * 1e3:+.0f} ms, waited for a CPU {a['inflation_wait_s'] * 1e3:+.0f} ms, "
          f"against the run's own steps with no write in flight); final flush at close {a['close_s'] * 1e3:.0f} ms")

    limit = 1.1 if DEVICE == "cpu" else 1.2
    # What the pipeline cannot avoid paying: one copy of what changed, per checkpoint (here
    # every tensor changes between two checkpoints, so all of the state), against the
    # run without checkpointing; the target allows 1% on top.
    none_wall = _med([rnd["none"]["wall_s"] for rnd in rounds])
    floor = n_ckpt * copy_s / none_wall
    print(f"\nasync overhead <= one {copy_what} of the changed bytes per checkpoint ({floor:.1%} of the run) + 1%: "
          f"{'PASS' if a['overhead'] <= floor + 0.01 else 'FAIL'} ({a['overhead']:+.1%}, median of {args.rounds} "
          f"rounds, {a['overhead'] - floor:+.1%} above the copy; sync {y['overhead']:+.1%})")
    print(f"async blocked <= {limit}x one {copy_what}: {'PASS' if a['blocked_s'] / copy_s <= limit else 'FAIL'} "
          f"({a['blocked_s'] / copy_s:.2f}x)")

    if args.plot:
        walls = [rnd["async"]["wall_s"] for rnd in rounds]
        mid = sorted(range(len(walls)), key=lambda i: walls[i])[len(walls) // 2]
        plot(args.plot, rounds[mid], f"round {mid + 1} of {args.rounds}: {args.state_mb} MiB state, "
             f"every {args.every} steps, writes {args.write}; async {summaries[mid]['async']['overhead']:+.1%}, "
             f"sync {summaries[mid]['sync']['overhead']:+.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "conditions": cond, "state_bytes": nbytes, "checkpoints_per_run": n_ckpt,
                       "memcpy_s": copy_s, "memcpy_rounds_s": copies, "raw_writes": raws,
                       "medians": med, "round_summaries": summaries, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
