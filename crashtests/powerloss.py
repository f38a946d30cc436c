"""Fault kinds ``powerloss`` and ``distpower``: the power cut under the file store, on SimFS.

Both replay one plan of checkpoint writes (every step put in turn, a prune at the
fourth, the fifth rewritten as a resumed run does) in-process through a file store
on :class:`crashtests.simfs.SimFS`, which loses power at operation N and then
builds the post-crash tree with the unsynced operations partly applied (one of
:data:`crashtests.simfs.MODES` per trial, in turn):

* ``powerloss``  single-process puts of the pipeline's trees;
* ``distpower``  the parts and commit records of ``cfg.ranks``-rank checkpoints, in
                 the collective's order (every part durable, then the fenced commit
                 record; a rewritten step in a new epoch), in one process.

Contract: :func:`trials` runs ``cfg.n("file", fault)`` trials of each configured
kind (file store only). A dry run counts the plan's file-system operations; trial
i of n cuts the power at about i/n of them. Each post-crash image is recovered
and judged against the in-process trees (``distpower``: every rank's part of the
recovered step, or no step). A trial not started before the time limit is skipped.
"""

from __future__ import annotations

import os
import shutil

from . import checker
from .trialkit import TrialKit, log


def plan(trees: dict) -> list[tuple]:
    steps = sorted(trees)
    out = []
    for j, s in enumerate(steps):
        out.append(("put", s))
        if j == 3:
            out.append(("prune", 2))    # retention: unlink + fsync of the directory
        if j == 4:
            out.append(("put", s))      # a resumed run rewriting a step: rename over a file
    return out


def run_plan(c: TrialKit, sim, store, run: str, steps: list, trees: dict, acked: list) -> None:
    parent = None
    for act, arg in steps:
        if act == "put":
            store.put(run, arg, trees[arg], meta={"snapshot": True}, parent=parent)
            acked.append(arg)
            parent = arg
        else:
            store.prune(run, keep_last=arg)


def run_plan_sharded(c: TrialKit, sim, store, run: str, steps: list, trees: dict, acked: list) -> None:
    """The plan as a job of ``ranks`` ranks would write it (agck.distributed's order,
    one process): every rank's part durable, then the commit record, fenced."""
    from agck import sharded
    ranks = c.cfg.ranks
    epoch = store.begin_epoch(run)
    parent, written = None, set()
    for act, arg in steps:
        if act == "put":
            if arg in written:      # the plan rewrites a step: as a job that resumed does, in a new epoch
                epoch = store.begin_epoch(run)
            written.add(arg)
            refs = []
            for rank in range(ranks):
                nonce = sharded.new_nonce()
                store.parts_store().put(sharded.part_run(run, epoch, rank), arg, rank_tree(trees, arg, rank),
                                        parent=parent, meta=sharded.part_meta(run, arg, epoch, rank, ranks, nonce))
                refs.append(sharded.PartRef(rank, sharded.part_run(run, epoch, rank), nonce))
            commit = sharded.Commit(run=run, step=arg, epoch=epoch, world_size=ranks, parts=refs)
            store.put(run, arg, commit.state(), meta={"snapshot": True}, parent=parent, epoch=epoch)
            acked.append(arg)
            parent = arg
        else:
            store.prune(run, keep_last=arg, epoch=epoch)


def rank_tree(trees: dict, step: int, rank: int) -> dict:
    return {**trees[step], "rank": rank}


def trials(c: TrialKit) -> None:
    from agck.stores.file.store import FileStore
    from crashtests.simfs import MODES, Crash, SimFS
    from crashtests.workload import state_hash
    cfg = c.cfg
    if "file" not in cfg.stores:
        return
    kinds = []
    if "powerloss" in cfg.faults:
        kinds.append(("powerloss", run_plan, lambda store, t: checker.check_library(store, t, c.full)))
    if "distpower" in cfg.faults:
        def check(store, t):
            refs = [{k: state_hash(rank_tree(trees, k, r)) for k in trees} for r in range(cfg.ranks)]
            checker.check_sharded(store, t, refs)
        kinds.append(("distpower", run_plan_sharded, check))
    if not kinds:
        return
    if not c.time_left():
        for fault, _, _ in kinds:
            c.skip_all(fault, ("file",))
        return
    trees = c.trees()
    steps = plan(trees)
    sims = os.path.join(c.work, "pl-sim")
    images = os.path.join(c.work, "pl-images")
    os.makedirs(images, exist_ok=True)
    # an encrypted campaign: one store, one data key. Its key slots are made once (a real store
    # makes them once) and put, already durable, in every simulated disk and in the images,
    # which merge every trial's post-crash tree into one store
    FileStore(images).close()

    def simfs(root: str, **kw) -> SimFS:
        keys = os.path.join(images, ".keys")
        if os.path.isdir(keys):
            shutil.copytree(keys, os.path.join(root, ".keys"))
        return SimFS(root, **kw)
    for fault, run, check in kinds:
        n = cfg.n("file", fault)
        if not c.time_left():
            c.skip_rest("file", fault, n)
            continue
        # a dry run counts the operations a whole plan makes; trial i crashes at about i/n of them
        dry = simfs(os.path.join(sims, f"dry-{fault}"))
        run(c, dry, FileStore(dry.root, fs=dry), "dry", steps, trees, [])
        total = dry.ops
        shutil.rmtree(dry.root)
        log(cfg, f"power-loss simulations ({fault}): {n} (plan of {total} file-system operations)")
        stride = max(1, total // max(1, n))
        for i in range(n):
            if not c.time_left():
                c.skip_rest("file", fault, n - i)
                break
            t = c.new_trial("file", fault, "pl" if fault == "powerloss" else "dpl", images)
            crash_at = min(total, 1 + (i * total) // max(1, n) + c.rng.randrange(stride))
            sim = simfs(os.path.join(sims, str(t.id)), crash_at=crash_at)
            try:
                run(c, sim, FileStore(sim.root, fs=sim), t.run, steps, trees, t.acked)
            except Crash:
                t.reached = True
                t.in_flight = True
            mode = MODES[i % len(MODES)]
            desc = sim.image(images, c.rng, mode)
            t.point = f"op{sim.ops}:{sim.crash_op}/{mode}"
            t.detail = desc
            shutil.rmtree(sim.root)
            store = FileStore(images, create=False)
            try:
                check(store, t)
            finally:
                store.close()
    c.pl_images = images
