"""Run a function in N real processes joined by a torch.distributed gloo group.

    codes = launch("tests.test_distributed:save_loop", world=2, args=(url, out_dir))

Each rank is a fresh interpreter (spawn), so ``AGCK_FAILPOINTS`` and the like can
be given to one rank only (``env={1: {...}}``) and take effect when it first
imports agck. The function is named as ``"module:function"`` and called as
``fn(rank, world, *args)``; the exit codes come back by rank (``-9``: SIGKILL).
Nothing here imports agck or torch in the parent.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import tempfile
import time


def _rank_main(target: str, rank: int, world: int, rendezvous: str, args: tuple, env: dict) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def launch(target: str, world: int, args: tuple = (), *, env: dict[int, dict] | None = None,
           timeout: float = 120.0, kill_rest_after: float = 20.0) -> list[int]:
    """Run ``target`` on ``world`` ranks; returns their exit codes.

    Once a rank has failed (a signal or a non-zero exit) the others are given
    ``kill_rest_after`` seconds to end (they may be blocked in a collective with the
    dead rank until gloo notices), then SIGKILLed, as torchrun's agent does to a
    failed job. A run past ``timeout`` kills every rank and raises TimeoutError."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="agck-rdzv-") as d:
        rendezvous = os.path.join(d, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(target, r, world, rendezvous, args, (env or {}).get(r, {})),
                             daemon=False) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        died_at = None
        try:
            while any(p.exitcode is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"{target} on {world} ranks did not finish in {timeout:.0f} s")
                if died_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    died_at = now
                if died_at is not None and now - died_at > kill_rest_after:
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join()
        return [p.exitcode for p in procs]
