#!/usr/bin/env python3
"""Multi-rank checkpoints: agck's collective save and restore against each rank
writing alone, and against torch.distributed.checkpoint's own file storage.

For each world size (``--ranks``), one launch of N gloo ranks on this machine runs
every case of every round; cases alternate, their order rotating each round, after
one untimed warm-up round. Each rank holds ``--mb-per-rank`` MiB of float32 state
(16 tensors, random once, different per rank, under per-rank keys so that DCP
does not take them for replicated tensors and write them once). The file store
is ``agck.open_store(dir)``. Every case starts on a barrier; its time is the
slowest rank's, from the barrier to its return. Before each case, ``sync(2)``
flushes the previous case's dirty pages, so no case pays for another's writeback.
Ranks run torch with one intra-op thread unless OMP_NUM_THREADS is set, as
torchrun does for several ranks on one machine.

Saves (ratio: to "agck.save alone", the floor):

- agck collective save, whole files: ``ShardedRun.write`` to a store opened with
  ``incremental=False`` (each part a standalone container, fsync'd; then the
  commit record from rank 0); a fresh step each round.
- agck collective save, incremental store (the default ``open_store``), the
  content refilled with new random values before each round, so every chunk is
  new and written: the cost of chunking and content addressing on top of the
  write, not a dedup hit.
- agck.save alone: every rank ``agck.save(path, state)`` of its state to its own
  standalone file (fsync'd), all at once, so the disk is shared as in a
  collective save.
- DCP FileSystemWriter: ``dcp.save`` with its defaults (one file per rank,
  ``sync_files=True``: it fsyncs its files).
- agck.dcp save, when ``agck.dcp`` imports: ``dcp.save`` through
  ``agck.dcp.StorageWriter`` on the whole-file store, one writer per rank made
  once, ``checkpoint_id=step`` per save (its documented use).

Commit overhead, for the saves through agck: each rank's part put
(``parts_store().put``) and rank 0's commit put are wrapped to note when they end
(``time.monotonic()``, one clock for every process on Linux); the overhead is
from the slowest rank's part being durable to ``write`` returning on the last
rank: the all-gather of outcomes, the commit record's put and the broadcast.

Loads, into this rank's state (ratio: to "DCP FileSystemReader load"); the
checkpoints read were written in the same run, so the page cache is warm:

- agck find: ``ShardedRun.find()``, the newest committed step, this rank's part
  read and every checksum verified, all ranks agreeing; whole-file store (a
  zero-copy mapping) and incremental store. "+ copy" rows add copying the
  tensors into the preallocated state, which the DCP loads do.
- DCP FileSystemReader load: ``dcp.load`` into preallocated tensors of the same
  shapes (no checksums).
- agck.dcp load, when ``agck.dcp`` imports: ``dcp.load`` through
  ``agck.dcp.StorageReader`` (verifies every checksum).

Tables of medians per world size; ``--json`` keeps every rank's timings of
every round. The data directories are removed at the end.

Every checkpoint written through agck is read back, outside the clock, through
store objects of their own (benchio.readback): a collective save's step found by
every rank on a fresh store, each rank's part compared bit for bit with its state,
an agck.dcp save loaded through a fresh store, before each is deleted; the load
fixtures once, after they are written. A rank whose read-back fails exits with
status 1, and the benchmark with it.

    python scripts/bench_distributed.py [--ranks 2,4] [--mb-per-rank 256] [--rounds 5] [--dir /var/tmp]
        [--json F]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

MiB = 1 << 20
N_TENSORS = 16

SAVE_WHOLE = "agck collective save (whole files)"
SAVE_INC = "agck collective save (incremental, new content)"
ALONE = "agck.save alone (every rank at once)"
DCP_FS_SAVE = "DCP FileSystemWriter save"
AGCK_DCP_SAVE = "agck.dcp save (whole files)"
FIND_WHOLE = "agck find (whole files)"
FIND_INC = "agck find (incremental)"
DCP_FS_LOAD = "DCP FileSystemReader load"
AGCK_DCP_LOAD = "agck.dcp load (whole files)"
SAVES = (SAVE_WHOLE, SAVE_INC, ALONE, DCP_FS_SAVE, AGCK_DCP_SAVE)
LOADS = (FIND_WHOLE, FIND_INC, DCP_FS_LOAD, AGCK_DCP_LOAD)
COPY = " + copy"     # the row of a find case that also copies into the preallocated state


def agck_dcp_error() -> str | None:
    """Why agck.dcp cannot be benchmarked here, None when it imports."""
    try:
        import agck.dcp  # noqa: F401
    except Exception as e:   # being written elsewhere: any failure only drops its cases
        return f"{type(e).__name__}: {e}"
    return None


# --- what each rank runs -----------------------------------------------------------------

def make_state(rank: int, mb: int, seed: int) -> dict:
    import torch
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    n = mb * MiB // 4 // N_TENSORS
    return {f"rank{rank}.layer{i:02d}": torch.rand(n // 1024, 1024, generator=gen) for i in range(N_TENSORS)}


def rank_main(rank: int, world: int, cfg: dict, root: str, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import agck
    from agck import sharded
    from agck.distributed import Group, ShardedRun

    with_agck_dcp = cfg["agck_dcp"]
    if with_agck_dcp:
        import agck.dcp

    def log(msg):
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does for several ranks a machine: more intra-op threads than cores
        # make each tensor copy many times slower (DCP's loads copy, so do the "+ copy" rows).
        torch.set_num_threads(1)
    g = Group()
    t_setup = time.monotonic()
    state = make_state(rank, cfg["mb"], seed=1)
    fresh = make_state(rank, cfg["mb"], seed=2)    # the incremental case's content, new each round
    target = {k: torch.empty_like(v) for k, v in state.items()}   # where loads land
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    whole = agck.open_store(os.path.join(root, "whole"), incremental=False)
    inc = agck.open_store(os.path.join(root, "inc"))
    stores = {"whole": whole, "inc": inc}
    # What the read-backs read through: another store object on each, opened as the writer was.
    reopen = {"whole": lambda: agck.open_store(os.path.join(root, "whole"), incremental=False),
              "inc": lambda: agck.open_store(os.path.join(root, "inc"))}
    alone_dir = os.path.join(root, "alone")
    fsw_root = os.path.join(root, "dcp-fs")
    os.makedirs(alone_dir, exist_ok=True)
    os.makedirs(fsw_root, exist_ok=True)

    runs = {}
    for key, store, run in (("save_whole", whole, "save"), ("save_inc", inc, "save"),
                            ("load_whole", whole, "load"), ("load_inc", inc, "load")):
        sr = ShardedRun(store, run, g)
        runs[key] = (sr, sr.begin_epoch())

    # When each part put and the commit put end: the instants the commit overhead is taken between.
    marks: dict = {}

    def wrap(store, what: str):
        put = store.put

        def timed_put(*a, **kw):
            marks[what + "_start"] = time.monotonic()
            try:
                return put(*a, **kw)
            finally:
                marks[what + "_end"] = time.monotonic()
        store.put = timed_put

    for store in (whole, inc):
        wrap(store.parts_store(), "part")
        wrap(store, "commit")

    # Fixtures the loads read: step 0 of run "load" (both stores), a DCP checkpoint on disk.
    for key in ("load_whole", "load_inc"):
        sr, epoch = runs[key]
        sr.write(0, state, meta=None, parent=None, epoch=epoch)
    fs_fixture = os.path.join(fsw_root, "load")
    dcp.save(state, storage_writer=FileSystemWriter(fs_fixture))
    writer = None
    if with_agck_dcp:
        dcp.save(state, storage_writer=agck.dcp.StorageWriter(whole, "dcpload", 0))
        writer = agck.dcp.StorageWriter(whole, "dcp")

    def committed_part(store):
        """benchio.readback's reader of a collective save: the run's newest step that every
        rank can restore from ``store`` (each rank's part read and verified), this rank's part."""
        def read(run: str, step: int):
            commit, part, rejected, _ = ShardedRun(store, run, g).find()
            if commit is None or commit.step != step:
                raise ValueError(f"the newest step every rank can restore is {commit and commit.step}, "
                                 f"rejected: {[(r.step, r.reason) for r in rejected]}")
            return part.state
        return read

    def dcp_loaded(store):
        """benchio.readback's reader of an agck.dcp save: dcp.load through ``store`` into zeroed tensors."""
        def read(run: str, step: int):
            for t in target.values():
                t.zero_()
            dcp.load(target, storage_reader=agck.dcp.StorageReader(store, run, step))
            return target
        return read

    # Every load must give back this rank's state; checked once, untimed (agck's through
    # store objects of their own).
    for name in ("whole", "inc"):
        benchio.readback(reopen[name], {("load", 0): state}, reader=committed_part)
    if with_agck_dcp:
        benchio.readback(reopen["whole"], {("dcpload", 0): state}, reader=dcp_loaded)
    loaders = [lambda: dcp.load(target, storage_reader=FileSystemReader(fs_fixture))]
    if with_agck_dcp:
        loaders.append(lambda: dcp.load(target, storage_reader=agck.dcp.StorageReader(whole, "dcpload", 0)))
    for t in target.values():
        t.zero_()
    loaders[0]()
    assert all(torch.equal(target[k], v) for k, v in state.items())
    log(f"  {world} ranks: setup {time.monotonic() - t_setup:.1f} s")

    steps = itertools.count(1)
    last: dict = {}
    records: dict[str, list] = {}

    def case(name: str, op, after=None):
        recs = records.setdefault(name, [])

        def fn():
            marks.clear()
            g.barrier()
            t0 = time.monotonic()
            extra = op() or {}
            t1 = time.monotonic()
            recs.append({"t0": t0, "t1": t1, **marks, **extra})
        return benchio.Case(name, fn, after, nbytes)

    def drop(name: str, run: str, step: int, content: dict, reader=committed_part) -> None:
        """Every rank reads the step back (its part, through a store object of its own),
        then rank 0 deletes the step's commit record and every rank's part."""
        benchio.readback(reopen[name], {(run, step): content}, reader=reader)
        store = stores[name]
        g.barrier()
        if rank == 0:
            commit = sharded.as_commit(store.read(run, step))
            store.delete(run, step)
            sharded.delete_parts(store, commit)
            if store.incremental:
                store.parts_store().collect_garbage()
                store.collect_garbage()
        g.barrier()

    def collective_save(key: str, content: dict):
        sr, epoch = runs[key]

        def op():
            last[key] = step = next(steps)
            sr.write(step, content, meta=None, parent=None, epoch=epoch)
        return op

    def refill():
        for t in fresh.values():
            t.uniform_()

    def alone():
        agck.save(os.path.join(alone_dir, f"rank{rank}.agck"), state)

    def fsw_save():
        last["fsw"] = path = os.path.join(fsw_root, f"step{next(steps)}")
        dcp.save(state, storage_writer=FileSystemWriter(path))

    def fsw_after():
        g.barrier()
        if rank == 0:
            shutil.rmtree(last["fsw"])
        g.barrier()

    def agck_dcp_save():
        last["dcp"] = step = next(steps)
        dcp.save(state, storage_writer=writer, checkpoint_id=step)

    def find(key: str):
        sr = runs[key][0]

        def op():
            commit, part, _, _ = sr.find()
            found = time.monotonic()
            for k, t in target.items():
                t.copy_(part.state[k])
            return {"found": found, "step": commit.step}
        return op

    cases = [
        case(SAVE_WHOLE, collective_save("save_whole", state),
             lambda: drop("whole", "save", last["save_whole"], state)),
        case(SAVE_INC, collective_save("save_inc", fresh),
             lambda: (drop("inc", "save", last["save_inc"], fresh), refill())),
        case(ALONE, alone, lambda: os.unlink(os.path.join(alone_dir, f"rank{rank}.agck"))),
        case(DCP_FS_SAVE, fsw_save, fsw_after),
        case(FIND_WHOLE, find("load_whole")),
        case(FIND_INC, find("load_inc")),
        case(DCP_FS_LOAD, loaders[0]),
    ]
    if with_agck_dcp:
        cases += [case(AGCK_DCP_SAVE, agck_dcp_save, lambda: drop("whole", "dcp", last["dcp"], state, dcp_loaded)),
                  case(AGCK_DCP_LOAD, loaders[1])]

    def quiesce():
        g.barrier()
        if rank == 0:
            os.sync()
        g.barrier()

    # run_rounds collects before every case: with torch and DCP loaded a full collection
    # takes a quarter second here, so what setup made is put out of its reach.
    gc.collect()
    gc.freeze()
    log(f"  {world} ranks: {len(cases)} cases x {cfg['rounds']} rounds (+1 warm-up), order rotated each round, "
        "sync before each case")
    benchio.run_rounds(cases, cfg["rounds"], lambda m: log(f"  {world} ranks:{m}"), warmup=1, quiesce=quiesce)

    # The warm-up round's records go first; every rank's go to rank 0.
    mine = {name: recs[1:] for name, recs in records.items()}
    gathered = g.all_gather(mine)
    if rank == 0:
        result = {"world": world, "bytes_per_rank": nbytes, "torch_threads": torch.get_num_threads(),
                  "by_rank": gathered}
        with open(out, "w") as f:
            json.dump(result, f)
    g.barrier()
    log(f"  {world} ranks: rank 0 {benchio.read_back_note()}")
    for store in (whole, inc):
        store.close()


# --- summaries ---------------------------------------------------------------------------

def rounds_of(res: dict, name: str) -> list[dict]:
    """Per round, the case's figures across ranks."""
    by_rank = [r[name] for r in res["by_rank"] if name in r]
    if len(by_rank) != res["world"]:
        return []
    out = []
    for recs in zip(*by_rank):
        row = {"seconds": max(r["t1"] - r["t0"] for r in recs),       # the slowest rank, barrier to return
               "span_s": max(r["t1"] for r in recs) - min(r["t0"] for r in recs)}
        if all("part_end" in r for r in recs):
            last_part = max(r["part_end"] for r in recs)
            row["part_put_s"] = max(r["part_end"] - r["t0"] for r in recs)
            row["commit_overhead_s"] = max(r["t1"] for r in recs) - last_part
            c = recs[0]
            if "commit_start" in c:
                row["gather_s"] = c["commit_start"] - last_part   # all-gather of outcomes (and DCP's own steps)
                row["commit_put_s"] = c["commit_end"] - c["commit_start"]
                row["broadcast_s"] = max(r["t1"] for r in recs) - c["commit_end"]
        if all("found" in r for r in recs):
            row["found_s"] = max(r["found"] - r["t0"] for r in recs)
        out.append(row)
    return out


def summarize(res: dict) -> dict:
    total = res["bytes_per_rank"] * res["world"]
    rows = {}
    for name in SAVES + LOADS:
        rs = rounds_of(res, name)
        if not rs:
            continue
        if "found_s" in rs[0]:
            rows[name] = {"times": [r["found_s"] for r in rs], "rounds": rs}
            rows[name + COPY] = {"times": [r["seconds"] for r in rs], "rounds": rs}
        else:
            rows[name] = {"times": [r["seconds"] for r in rs], "rounds": rs}
    for name, row in rows.items():
        row["median_s"] = statistics.median(row["times"])
        row["gb_s"] = total / row["median_s"] / 1e9
        base = ALONE if name in SAVES else DCP_FS_LOAD
        if base in rows:
            row["ratio"] = row["median_s"] / statistics.median(rows[base]["times"])
        for k in ("commit_overhead_s", "part_put_s", "gather_s", "commit_put_s", "broadcast_s"):
            if k in row["rounds"][0] and not name.endswith(COPY):
                row[k] = statistics.median(r[k] for r in row["rounds"])
    return {"world": res["world"], "total_bytes": total, "rows": rows}


def _ms(x) -> str:
    return "" if x is None else f"{x * 1e3:.1f}"


def table(summary: dict) -> str:
    rows = summary["rows"]
    lines = [f"### {summary['world']} ranks, {summary['total_bytes'] / MiB:.0f} MiB in all",
             "",
             "| case | median s | GB/s | ratio | slowest part put s | commit overhead ms "
             "| gather / commit put / broadcast ms |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, row in rows.items():
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        part = f"{row['part_put_s']:.3f}" if "part_put_s" in row else ""
        split = " / ".join(_ms(row.get(k)) for k in ("gather_s", "commit_put_s", "broadcast_s")) \
            if "commit_put_s" in row else ""
        lines.append(f"| {name} | {row['median_s']:.3f} | {row['gb_s']:.2f} | {ratio} | {part} "
                     f"| {_ms(row.get('commit_overhead_s'))} | {split} |")
    lines.append("")
    lines.append("Ratios: saves to \"agck.save alone\", loads to \"DCP FileSystemReader load\". Loads read what "
                 "this run wrote: warm page cache.")
    goals = []
    if SAVE_WHOLE in rows and ALONE in rows:
        r = rows[SAVE_WHOLE]
        goals.append(f"collective save within 1.1x of agck.save alone: {r['ratio']:.2f}x "
                     f"({'met' if r['ratio'] <= 1.1 else 'NOT met'})")
        goals.append(f"commit adds at most 10 ms over the slowest part: {r['commit_overhead_s'] * 1e3:.1f} ms "
                     f"({'met' if r['commit_overhead_s'] <= 0.010 else 'NOT met'})")
    if SAVE_WHOLE in rows and DCP_FS_SAVE in rows:
        a, d = rows[SAVE_WHOLE]["median_s"], rows[DCP_FS_SAVE]["median_s"]
        goals.append(f"collective save faster than DCP FileSystemWriter: {a:.3f} s vs {d:.3f} s "
                     f"({'met' if a < d else 'NOT met'})")
    if FIND_WHOLE in rows and DCP_FS_LOAD in rows:
        for name in (FIND_WHOLE, FIND_WHOLE + COPY):
            r = rows[name]["ratio"]
            goals.append(f"{name} within 1.1x of DCP FileSystemReader: {r:.2f}x ({'met' if r <= 1.1 else 'NOT met'})")
    if goals:
        lines.append("")
        lines += [f"- {x}" for x in goals]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    ap.add_argument("--mb-per-rank", type=int, default=256, help="state per rank in MiB (default 256)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; tables quote medians (default 5)")
    ap.add_argument("--dir", default="/var/tmp", help="where the data goes (default /var/tmp)")
    ap.add_argument("--json", default=None, help="also write every round's figures as JSON here")
    args = ap.parse_args(argv)
    worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not worlds or min(worlds) < 1 or args.mb_per_rank < 1 or args.rounds < 1:
        ap.error("--ranks, --mb-per-rank and --rounds must be positive")

    from crashtests.ranks import launch

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    no_dcp = agck_dcp_error()
    if no_dcp:
        log(f"agck.dcp does not import ({no_dcp}): its cases are skipped")
    cfg = {"mb": args.mb_per_rank, "rounds": args.rounds, "agck_dcp": no_dcp is None}
    workdir = tempfile.mkdtemp(prefix="agck-bench-dist-", dir=args.dir)
    t_start = time.monotonic()
    results, summaries, walls = [], [], {}
    try:
        for world in worlds:
            root = os.path.join(workdir, f"w{world}")
            out = os.path.join(workdir, f"result-w{world}.json")
            # A generous bound: every byte of every case at 20 MB/s, three times over.
            cases = 9 * (args.rounds + 1) + 6
            timeout = max(600.0, 3 * cases * world * args.mb_per_rank * MiB / 20e6)
            log(f"{world} ranks, {args.mb_per_rank} MiB each, in {root} ...")
            t0 = time.monotonic()
            codes = launch("bench_distributed:rank_main", world, (cfg, root, out), timeout=timeout)
            walls[world] = time.monotonic() - t0
            if any(codes):
                log(f"{world} ranks failed: exit codes {codes}")
                return 1
            with open(out) as f:
                res = json.load(f)
            shutil.rmtree(root, ignore_errors=True)
            results.append(res)
            summaries.append(summarize(res))
            log(f"  {world} ranks: {walls[world]:.1f} s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"## Multi-rank checkpoints: {args.mb_per_rank} MiB of float32 per rank, file store in {args.dir}, "
          f"medians of {args.rounds} rounds")
    print()
    print(f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"slowest rank from a barrier to its return; sync(2) before each case; "
          f"DCP FileSystemWriter with its defaults (sync_files=True: fsync'd)")
    if no_dcp:
        print(f"\nagck.dcp cases skipped: it does not import ({no_dcp})")
    for s in summaries:
        print()
        print(table(s))
    print(f"\ntotal {time.monotonic() - t_start:.1f} s (" +
          ", ".join(f"{w} ranks {t:.1f} s" for w, t in walls.items()) + ")")

    if args.json:
        doc = {"args": vars(args), "host": platform.node(), "cpus": os.cpu_count(),
               "agck_dcp": no_dcp or "included",
               "worlds": [{"world": r["world"], "bytes_per_rank": r["bytes_per_rank"],
                           "torch_threads": r["torch_threads"], "wall_s": walls[r["world"]],
                           "rows": s["rows"],
                           "by_rank": r["by_rank"]} for r, s in zip(results, summaries)]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
