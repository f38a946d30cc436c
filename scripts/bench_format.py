#!/usr/bin/env python
"""Benchmark agck's container against the machine's limits and against peers.

    python scripts/bench_format.py [--size-mb 1024] [--repeats 5] [--warmup 1] [--dir DIR]
                                   [--json OUT] [--markdown OUT] [--lib torch|numpy]

One process, one state (a dict of float32 tensors of mixed sizes, ~--size-mb
MiB). Every round runs every case once, in a rotated order, so drift on a
shared machine (other tenants, writeback, thermal) spreads over all cases
instead of landing on one; the table quotes the median of --repeats rounds.

After the rounds, the cases that return new memory (dumps, and its limits:
memcpy, first touch, bytes(view)) also run back to back, as a loop that dumps
state after state would: between rotated calls the kernel has time to hand the
freed output back (to the host, on a ballooned VM), so a rotated dumps pays for
cold memory while a looping one reuses it. Both figures are reported.

Throughput is always the state's payload bytes (sum of tensor nbytes) over
the case's time, so MiB/s figures compare directly across formats.

Reads run with the page cache warm (the file was just written or read), which
is what a training job reloading its own checkpoint sees; cold-cache reads are
disk-bound for every format alike and are not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import msgpack
import numpy as np

from benchio import (Case, aligned_copy, fsync_dir, pinned_direct_io, raw_direct_fsync,  # noqa: E402
                     raw_write_fsync, run_rounds)
import xxhash

# Run from a checkout without installing: scripts/ is sys.path[0], the package is one up.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import agck  # noqa: E402
from agck import durable  # noqa: E402

try:
    import torch
except ImportError:  # numpy-only machines still get the agck and numpy figures
    torch = None
try:
    import safetensors
    import safetensors.torch as st_torch
except ImportError:
    safetensors = st_torch = None

MiB = 1 << 20
ROW = 1024                    # columns of every 2-D tensor: 4 KiB rows of float32
SMALL_MB = 64                 # second size for the load(verify=False) constant-time check
LOOP_CALLS = 5                # back-to-back calls timed per case, after one untimed
NAIVE_MB = 16                 # the tolist+msgpack path is ~1000x slower: time a slice, extrapolate


# --- the state ----------------------------------------------------------------------

def layout(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer-like layout: 8 blocks of 4 matrices + 2 vectors, plus an embedding.

    49 tensors from ~4 KiB to ~8% of the total: enough to see per-tensor overheads
    and big enough that bandwidth dominates."""
    units = 8 + 8 * (3 + 1 + 4 + 4)                     # embedding + per-block matrices, in row units
    unit = max(1, total_bytes // (units * ROW * 4))
    out = [("embed.weight", (8 * unit, ROW))]
    for i in range(8):
        p = f"blocks.{i}."
        out += [(p + "attn.qkv.weight", (3 * unit, ROW)), (p + "attn.qkv.bias", (3 * ROW,)),
                (p + "attn.out.weight", (unit, ROW)),
                (p + "mlp.up.weight", (4 * unit, ROW)), (p + "mlp.down.weight", (4 * unit, ROW)),
                (p + "norm.weight", (ROW,))]
    return out


def build_state(total_bytes: int, lib: str, seed: int = 0) -> dict:
    """Random float32 tensors (random, so no layer below can shortcut zero pages)."""
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in layout(total_bytes):
        a = rng.random(shape, dtype=np.float32)
        state[name] = torch.from_numpy(a) if lib == "torch" else a
    return state


def payload_bytes(state: dict) -> int:
    return sum(v.nbytes for v in state.values())


def as_numpy(state: dict) -> dict:
    return {k: (v.numpy() if torch is not None and isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def as_torch(state: dict) -> dict:
    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in state.items()}


def head_slice(state: dict, nbytes: int) -> dict:
    """The first tensors of ``state`` up to ``nbytes`` (the last one cut by rows)."""
    out, left = {}, nbytes
    for k, v in state.items():
        if left <= 0:
            break
        a = v.numpy() if torch is not None and isinstance(v, torch.Tensor) else v
        if a.nbytes > left:
            rows = max(1, left // (a.nbytes // a.shape[0]))
            a = a[:rows]
        out[k] = torch.from_numpy(np.ascontiguousarray(a)) if torch is not None and isinstance(v, torch.Tensor) else a
        left -= a.nbytes
    return out


# --- the physical limits --------------------------------------------------------------

def raw_read(path: str, buf: bytearray) -> int:
    with open(path, "rb", buffering=0) as f:
        return f.readinto(buf)


def fsync_path(path: str) -> None:
    """For writers that close the file themselves: reopen and fsync it, then its directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def write_with(path: str, dump: Callable[[Any], None]) -> None:
    with open(path, "wb") as f:
        dump(f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def save_pinned(path: str, state, mode: str) -> None:
    """agck.save with durable.DIRECT_IO pinned to ``mode`` ("always" / "never")."""
    with pinned_direct_io(mode):
        agck.save(path, state)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# --- reporting ------------------------------------------------------------------------

def fs_type(path: str) -> str:
    """The filesystem under ``path``, from /proc/mounts (longest matching mount point)."""
    best, kind = "", "?"
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, f"{parts[2]} on {mnt} ({parts[0]})"
    except OSError:
        pass
    return kind


# --- report --------------------------------------------------------------------------

def fmt_s(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 0.1 else f"{t:.3f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="state size in MiB (default 1024)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the table quotes medians (default 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed rounds first (default 1): first calls, and on VMs the host backing "
                    "guest memory on first touch, otherwise land on whichever cases run first")
    ap.add_argument("--dir", default=None, help="where files go (default: the system temp dir); "
                    "use the disk you checkpoint to")
    ap.add_argument("--lib", choices=("torch", "numpy"), default="torch" if torch is not None else "numpy",
                    help="tensor type agck saves (peers use their native type either way)")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    ap.add_argument("--markdown", default=None, help="also write the report as markdown here")
    args = ap.parse_args(argv)
    if args.lib == "torch" and torch is None:
        ap.error("--lib torch needs torch installed")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    workdir = tempfile.mkdtemp(prefix="agck-bench-", dir=args.dir)
    try:
        return _bench(args, workdir, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _bench(args, workdir: str, log) -> int:
    p = lambda name: os.path.join(workdir, name)  # noqa: E731
    t_start = time.perf_counter()

    log(f"building a {args.size_mb} MiB state ({args.lib}) in {workdir} ...")
    state = build_state(args.size_mb * MiB, args.lib)
    small = build_state(SMALL_MB * MiB, args.lib, seed=1)
    np_state = as_numpy(state)
    pt_state = as_torch(state) if torch is not None else None
    nbytes = payload_bytes(state)
    naive_state = head_slice(state, NAIVE_MB * MiB)
    naive_bytes = payload_bytes(naive_state)

    # Fixtures, untimed: the container bytes (what raw write/read/memcpy move), and
    # the files the load cases read. Writing them also warms the page cache.
    container = agck.dumps(state)
    clen = len(container)
    copy_src = np.frombuffer(container, dtype=np.uint8)
    container_aligned = aligned_copy(container) if hasattr(os, "O_DIRECT") else container
    copy_dst = np.empty_like(copy_src)
    copy_dst.fill(0)   # fault the pages in now, not inside the first timed copy
    read_buf = bytearray(clen)
    agck.save(p("fixture.agck"), state)
    agck.save(p("fixture-small.agck"), small)
    small_bytes = payload_bytes(small)
    raw_read(p("fixture.agck"), read_buf)
    if torch is not None:
        write_with(p("fixture.pt"), lambda f: torch.save(pt_state, f))
    if st_torch is not None:
        st_torch.save_file(pt_state, p("fixture.safetensors"))
    for name in ("fixture.pt", "fixture.safetensors"):
        if os.path.exists(p(name)):
            raw_read(p(name), bytearray(os.path.getsize(p(name))))
    log(f"  payload {nbytes / MiB:.1f} MiB in {len(state)} tensors, container {clen / MiB:.1f} MiB "
        f"(setup {time.perf_counter() - t_start:.1f} s)")

    naive_out = msgpack.packb({k: v.tolist() for k, v in naive_state.items()})
    naive_ratio = len(naive_out) / naive_bytes
    del naive_out

    naive_name = f"naive tolist+msgpack ({naive_bytes / MiB:.0f} MiB slice)"

    def naive():
        return msgpack.packb({k: v.tolist() for k, v in naive_state.items()})

    cases = [
        # physical limits
        Case("raw write+fsync", lambda: raw_write_fsync(p("raw.bin"), container),
             lambda: unlink(p("raw.bin")), nbytes),
        Case("raw O_DIRECT write+fsync", lambda: raw_direct_fsync(p("raw-direct.bin"), container_aligned),
             lambda: unlink(p("raw-direct.bin")), nbytes),
        Case("raw read (readinto, warm)", lambda: raw_read(p("fixture.agck"), read_buf), None, nbytes),
        Case("memcpy (np.copyto)", lambda: np.copyto(copy_dst, copy_src), None, nbytes),
        # What any dumps must at least do: copy the bytes into a new bytes object (fresh memory).
        Case("copy into a new bytes (bytes(view))", lambda: bytes(memoryview(container)), None, nbytes),
        Case("xxh3_64 over the bytes", lambda: xxhash.xxh3_64_intdigest(container), None, nbytes),
        # What any case pays to get new memory (a new output buffer, new page-cache pages for
        # a new file): page faults and kernel zeroing; on VMs whose host backs guest memory
        # lazily (virtio balloon, free page reporting) also the host's fault, often the
        # largest term of all.
        Case("first touch of fresh memory (np.ones)", lambda: np.ones(clen, np.uint8), None, nbytes),
        # agck
        Case("agck.save", lambda: agck.save(p("out.agck"), state), lambda: unlink(p("out.agck")), nbytes),
        # the two ways agck.save can write, pinned: what its default chooses between
        Case("agck.save (O_DIRECT)", lambda: save_pinned(p("out-d.agck"), state, "always"),
             lambda: unlink(p("out-d.agck")), nbytes),
        Case("agck.save (page cache)", lambda: save_pinned(p("out-b.agck"), state, "never"),
             lambda: unlink(p("out-b.agck")), nbytes),
        Case("agck.load(verify=True)", lambda: agck.load(p("fixture.agck"), verify=True), None, nbytes),
        Case("agck.load(verify=False)", lambda: agck.load(p("fixture.agck"), verify=False), None, nbytes,
             inner=5),
        Case(f"agck.load(verify=False) {SMALL_MB} MiB", lambda: agck.load(p("fixture-small.agck"), verify=False),
             None, small_bytes, inner=5),
        Case("agck.dumps", lambda: agck.dumps(state), None, nbytes),
        # peers
        Case("np.savez+fsync", lambda: write_with(p("out.npz"), lambda f: np.savez(f, **np_state)),
             lambda: unlink(p("out.npz")), nbytes),
        Case("pickle.dump(p5, numpy)+fsync",
             lambda: write_with(p("out.pkl"), lambda f: pickle.dump(np_state, f, protocol=5)),
             lambda: unlink(p("out.pkl")), nbytes),
        Case(naive_name, naive, None, naive_bytes),
    ]
    if torch is not None:
        cases += [
            Case("torch.save+fsync", lambda: write_with(p("out.pt"), lambda f: torch.save(pt_state, f)),
                 lambda: unlink(p("out.pt")), nbytes),
            Case("torch.load(weights_only)", lambda: torch.load(p("fixture.pt"), weights_only=True), None, nbytes),
            Case("torch.load(weights_only, mmap)",
                 lambda: torch.load(p("fixture.pt"), weights_only=True, mmap=True), None, nbytes, inner=5),
        ]
    if st_torch is not None:
        def st_save():
            st_torch.save_file(pt_state, p("out.safetensors"))
            fsync_path(p("out.safetensors"))
        cases += [
            Case("safetensors save_file+fsync", st_save, lambda: unlink(p("out.safetensors")), nbytes),
            Case("safetensors load_file (lazy mmap)", lambda: st_torch.load_file(p("fixture.safetensors")), None, nbytes),
        ]

    log(f"running {len(cases)} cases x {args.repeats} rounds (+{args.warmup} warm-up), "
        "order rotated each round ...")
    run_rounds(cases, args.repeats, log, args.warmup)
    # The rotation above runs other cases between two dumps, long enough for this
    # kernel to hand the freed output back (to the host, on a ballooned VM), so each
    # rotated dumps gets cold memory. A loop that dumps state after state reuses it:
    # measure that steady state too, back to back, with its own memcpy and first touch.
    loop = [Case(n, f, None, nbytes) for n, f in (
        ("memcpy (np.copyto)", lambda: np.copyto(copy_dst, copy_src)),
        ("first touch of fresh memory (np.ones)", lambda: np.ones(clen, np.uint8)),
        ("copy into a new bytes (bytes(view))", lambda: bytes(memoryview(container))),
        ("agck.dumps", lambda: agck.dumps(state)),
    )]
    log(f"back to back: each of {len(loop)} cases {LOOP_CALLS + 1} times in a row, the first not counted ...")
    for c in loop:
        for i in range(LOOP_CALLS + 1):
            t0 = time.perf_counter()
            result = c.fn()
            t1 = time.perf_counter()
            del result
            if i:
                c.times.append(t1 - t0)
    by = {c.name: c for c in cases}
    med = {c.name: c.median for c in cases}
    loop_med = {c.name: c.median for c in loop}
    mibs = {c.name: c.nbytes / MiB / c.median for c in cases}

    # Ratios are speed ratios (other's time / agck's time): > 1 means agck is faster.
    limit_of = {
        "agck.save": "raw write+fsync",
        "agck.save (O_DIRECT)": "raw O_DIRECT write+fsync",
        "agck.save (page cache)": "raw write+fsync",
        "agck.load(verify=True)": "raw read (readinto, warm)",
        "agck.dumps": "memcpy (np.copyto)",
        "torch.save+fsync": "raw write+fsync",
        "safetensors save_file+fsync": "raw write+fsync",
        "np.savez+fsync": "raw write+fsync",
        "pickle.dump(p5, numpy)+fsync": "raw write+fsync",
        "torch.load(weights_only)": "raw read (readinto, warm)",
    }
    peers_of = {
        "agck.save": ["torch.save+fsync", "safetensors save_file+fsync", "np.savez+fsync",
                      "pickle.dump(p5, numpy)+fsync"],
        "agck.load(verify=True)": ["torch.load(weights_only)"],
        "agck.load(verify=False)": ["torch.load(weights_only, mmap)", "safetensors load_file (lazy mmap)"],
    }

    lines = []
    out = lines.append
    env = (f"Python {platform.python_version()}, numpy {np.__version__}"
           + (f", torch {torch.__version__}" if torch is not None else "")
           + (f", safetensors {safetensors.__version__}" if safetensors is not None else "")
           + f", msgpack {'.'.join(map(str, msgpack.version))}, {os.cpu_count()} CPUs, "
           + f"{platform.machine()} {platform.system()} {platform.release()}")
    out(f"## agck format benchmark: {nbytes / MiB:.0f} MiB of float32 in {len(state)} tensors ({args.lib})")
    out("")
    out(f"`python scripts/bench_format.py --size-mb {args.size_mb} --repeats {args.repeats} "
        f"--warmup {args.warmup}" + (f" --lib {args.lib}" if args.lib != "torch" else "") + "`")
    out("")
    out(f"- {env}")
    out(f"- files in {fs_type(workdir)}")
    out(f"- median of {args.repeats} rounds after {args.warmup} untimed warm-up round(s), cases "
        "alternated round-robin (order rotated each round); MiB/s = payload bytes / median time; cases marked with * are timed "
        f"{by['agck.load(verify=False)'].inner}x per round")
    out("- reads are page-cache warm (the file was just written/read), as when a job reloads its own "
        "checkpoint; writers all fsync file and directory")
    out("- every case that writes a new file or returns a new buffer also pays for fresh memory (page "
        "faults, zeroing); the 'first touch' row is that cost alone"
        + (" (this is a VM with a virtio balloon: the host backs guest memory lazily, which can make "
           "that row, and every writer, slow and noisy)" if os.path.isdir("/sys/bus/virtio/drivers/virtio_balloon")
           else ""))
    out("")
    out("| case | median | min | max | MiB/s | vs limit |")
    out("|---|---:|---:|---:|---:|---:|")
    for c in cases:
        lim = limit_of.get(c.name)
        vs = f"{med[lim] / med[c.name]:.2f}x {lim.split(' (')[0]}" if lim else ""
        star = "*" if c.inner > 1 else ""
        out(f"| {c.name}{star} | {fmt_s(c.median)} | {fmt_s(min(c.times))} | {fmt_s(max(c.times))} | "
            f"{mibs[c.name]:,.0f} | {vs} |")
    out("")
    out(f"Back to back ({LOOP_CALLS} timed calls in a row per case, after one untimed call: a loop "
        "that dumps state after state, reusing the memory the previous output freed):")
    out("")
    out("| case | median | min | max | MiB/s | vs memcpy |")
    out("|---|---:|---:|---:|---:|---:|")
    for c in loop:
        out(f"| {c.name} | {fmt_s(c.median)} | {fmt_s(min(c.times))} | {fmt_s(max(c.times))} | "
            f"{c.nbytes / MiB / c.median:,.0f} | {loop_med['memcpy (np.copyto)'] / c.median:.2f}x |")
    out("")
    out("agck vs peers (speed ratio = peer time / agck time; > 1 means agck is faster):")
    out("")
    out("| agck case | peer | agck | peer | speed ratio |")
    out("|---|---|---:|---:|---:|")
    peer_ratios = {}
    for a, peers in peers_of.items():
        for q in peers:
            if q in med:
                peer_ratios[f"{a} vs {q}"] = med[q] / med[a]
                out(f"| {a} | {q} | {fmt_s(med[a])} | {fmt_s(med[q])} | {med[q] / med[a]:.2f}x |")
    for a in ("agck.dumps", "agck.save"):
        r = mibs[a] / mibs[naive_name]
        peer_ratios[f"{a} vs naive"] = r
        out(f"| {a} | tolist+msgpack (extrapolated) | {mibs[a]:,.0f} MiB/s | {mibs[naive_name]:,.1f} MiB/s "
            f"| {r:,.0f}x |")
    out("")
    out(f"Naive tolist+msgpack output is {naive_ratio:.2f}x the raw tensor bytes "
        f"(agck container: {clen / nbytes:.4f}x).")
    out("")

    # Targets (ENGINEERING.md / the format spec).
    t_save = med["raw write+fsync"] / med["agck.save"]
    t_load = med["raw read (readinto, warm)"] / med["agck.load(verify=True)"]
    nv_full, nv_small = med["agck.load(verify=False)"], med[f"agck.load(verify=False) {SMALL_MB} MiB"]
    t_dumps = med["memcpy (np.copyto)"] / med["agck.dumps"]
    t_naive = mibs["agck.dumps"] / mibs[naive_name]
    targets = []

    def target(ok, text):
        targets.append({"pass": bool(ok), "target": text})
        out(f"- {'PASS' if ok else 'FAIL'}: {text}")

    out("Targets:")
    out("")
    target(t_save >= 1.1, f"save >= 1.1x raw write+fsync: {t_save:.2f}x")
    if "raw O_DIRECT write+fsync" in med:
        fastest = min(med["raw write+fsync"], med["raw O_DIRECT write+fsync"])
        out(f"- (info) save vs the faster plain write of this file system (buffered {fmt_s(med['raw write+fsync'])}, "
            f"O_DIRECT {fmt_s(med['raw O_DIRECT write+fsync'])}): {fastest / med['agck.save']:.2f}x; pinned: "
            f"O_DIRECT {fmt_s(med['agck.save (O_DIRECT)'])}, page cache {fmt_s(med['agck.save (page cache)'])}")
    try:
        choice = durable.DIRECT_CHOICE.state().get(os.stat(workdir).st_dev)
    except OSError:
        choice = None
    if choice:
        out(f"- (info) agck.save's own choice on this file system (durable.DirectChoice, from its timed writes): "
            f"{choice['choice']} (recent medians: O_DIRECT {choice['direct_MBps'] or 0:,.0f} MB/s, "
            f"page cache {choice['buffered_MBps'] or 0:,.0f} MB/s)")
    for q in ("torch.save+fsync", "safetensors save_file+fsync"):
        if q in med:
            target(med["agck.save"] < med[q],
                   f"save faster than {q}: {fmt_s(med['agck.save'])} vs {fmt_s(med[q])} ({med[q] / med['agck.save']:.2f}x)")
    target(t_load >= 0.8, f"load(verify=True) >= 0.8x raw read: {t_load:.2f}x")
    target(nv_full < 0.010 and nv_full <= max(3 * nv_small, nv_small + 0.002),
           f"load(verify=False) constant time: {fmt_s(nv_small)} at {small_bytes / MiB:.0f} MiB, "
           f"{fmt_s(nv_full)} at {nbytes / MiB:.0f} MiB ({nv_full / nv_small:.2f}x; need < 10 ms and <= 3x)")
    t_dumps_loop = loop_med["memcpy (np.copyto)"] / loop_med["agck.dumps"]
    t_naive_loop = (nbytes / loop_med["agck.dumps"]) / (naive_bytes / med[naive_name])
    target(t_dumps_loop >= 0.5, f"dumps >= 0.5x memcpy, back to back: {t_dumps_loop:.2f}x")
    target(t_dumps >= 0.5, f"dumps >= 0.5x memcpy, rotated (cold output memory): {t_dumps:.2f}x")
    t_fresh = med["copy into a new bytes (bytes(view))"] / med["agck.dumps"]
    t_touch = med["first touch of fresh memory (np.ones)"] / med["agck.dumps"]
    out(f"- (info) rotated dumps vs a copy into a new bytes object: {t_fresh:.2f}x; vs only touching "
        f"as much fresh memory: {t_touch:.2f}x")
    target(t_naive_loop >= 100, f"dumps >= 100x the naive tolist+msgpack path, back to back: {t_naive_loop:,.0f}x")
    target(t_naive >= 100, f"dumps >= 100x the naive tolist+msgpack path, rotated: {t_naive:,.0f}x")
    out("")
    out(f"Total run {time.perf_counter() - t_start:.0f} s.")
    report = "\n".join(lines)
    print(report)

    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "size_mb": args.size_mb, "repeats": args.repeats, "lib": args.lib, "env": env,
                "filesystem": fs_type(workdir), "payload_bytes": nbytes, "container_bytes": clen,
                "tensors": len(state), "naive_slice_bytes": naive_bytes, "naive_size_ratio": naive_ratio,
                "cases": {c.name: {"median_s": c.median, "times_s": c.times, "nbytes": c.nbytes,
                                   "mib_s": mibs[c.name], "calls_per_round": c.inner} for c in cases},
                "back_to_back": {c.name: {"median_s": c.median, "times_s": c.times} for c in loop},
                "peer_speed_ratios": peer_ratios, "targets": targets,
            }, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
