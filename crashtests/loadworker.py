"""The concurrent workload of the ``pgload`` fault kind: one process, many threads, one store.

    python -m crashtests.loadworker URL RUN_PREFIX PROC THREADS STEPS POOL ACKS [threads|asyncio]

Each thread is a conversation: run ``{RUN_PREFIX}-p{PROC}-t{thread}``, steps 0..STEPS-1
put in order through one Postgres store shared by the process's threads (a pool of
POOL connections, fewer than the threads). With ``asyncio`` the conversations are
tasks on one event loop instead, through the store's async methods (``aput_many``,
``aread``: statements awaited on the loop, the loop's own pool of POOL connections). A step's state is made from (run, step)
alone (:func:`state_for`): small messages, and every third step a 256 KiB array the
run's steps share (chunk objects reused across puts) beside a part of its own.
Every fourth step the thread reads back one of its earlier steps and compares it.

A put that fails (the server killed, the connection dropped) is tried again until
it succeeds; one that finds its step already there (its COMMIT had happened, the
answer was lost) reads it back and must find this very state. Only then is the step
acknowledged: one line ``run step`` appended to ACKS. The process exits 0 when every
thread has put every step, 3 when one could not within :data:`GIVE_UP` seconds of
failures, 4 when a read-back or an existing step held another state.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import zlib

import numpy as np

GIVE_UP = 120.0


def state_for(run: str, step: int) -> dict:
    """The state put at (run, step): the same bytes on every call."""
    rng = np.random.default_rng(zlib.crc32(f"{run}/{step}".encode()))
    state = {"run": run, "step": step, "messages": [f"{run} message {step}.{k} " * 8 for k in range(3)],
             "logits": rng.standard_normal(64, dtype=np.float32)}
    if step % 3 == 0:
        base = np.random.default_rng(zlib.crc32(run.encode())).standard_normal(65536, dtype=np.float32)
        state["shared"] = base                                     # the same in every such step of the run
        state["own"] = rng.integers(0, 1 << 30, 20000, dtype=np.int64)
    return state


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


class _Failed(Exception):
    pass


class _Patience:
    """How long to wait after a failure before trying again, for at most GIVE_UP seconds of failures."""

    def __init__(self, what: str):
        self.what, self.deadline = what, None

    def after(self, e: Exception) -> float:
        now = time.monotonic()
        self.deadline = self.deadline or now + GIVE_UP
        if now > self.deadline:
            raise _Failed(f"{self.what}: failing for {GIVE_UP:.0f} s, last: {e}") from None
        return random.uniform(0.02, 0.2)


def _retrying(what: str, fn):
    """``fn()`` until it returns; an agck error (server gone, connection dropped) waits and
    tries again (:class:`_Patience`); a step found there or not there is the caller's."""
    from agck.errors import AgckError, CheckpointExistsError, CheckpointNotFoundError
    patience = _Patience(what)
    while True:
        try:
            return fn()
        except (CheckpointExistsError, CheckpointNotFoundError):
            raise
        except AgckError as e:
            time.sleep(patience.after(e))


def conversation(store, run: str, steps: int, ack) -> None:
    from agck.errors import CheckpointExistsError
    rng = random.Random(run)
    for step in range(steps):
        state = state_for(run, step)
        try:
            _retrying(f"put {run} {step}", lambda: store.put(run, step, state, overwrite=False))
        except CheckpointExistsError:     # an earlier attempt committed; its answer was lost
            back = _retrying(f"read {run} {step}", lambda: store.read(run, step)).state
            if not same(back, state):
                raise SystemExit(f"{run} step {step}: another state is stored there")
        ack(run, step)
        if step % 4 == 3:
            old = rng.randrange(step)
            back = _retrying(f"read {run} {old}", lambda: store.read(run, old)).state
            if not same(back, state_for(run, old)):
                raise SystemExit(f"{run} step {old}: read back a different state")


async def _aretrying(what: str, fn):
    """:func:`_retrying` for a coroutine function ``fn``."""
    import asyncio

    from agck.errors import AgckError, CheckpointExistsError, CheckpointNotFoundError
    patience = _Patience(what)
    while True:
        try:
            return await fn()
        except (CheckpointExistsError, CheckpointNotFoundError):
            raise
        except AgckError as e:
            await asyncio.sleep(patience.after(e))


async def aconversation(store, run: str, steps: int, ack) -> None:
    """:func:`conversation` through the store's async methods."""
    from agck.errors import CheckpointExistsError
    from agck.stores import PutEntry
    rng = random.Random(run)
    for step in range(steps):
        state = state_for(run, step)
        try:
            await _aretrying(f"put {run} {step}",
                             lambda: store.aput_many([PutEntry(run, step, state, overwrite=False)]))
        except CheckpointExistsError:
            back = (await _aretrying(f"read {run} {step}", lambda: store.aread(run, step))).state
            if not same(back, state):
                raise SystemExit(f"{run} step {step}: another state is stored there")
        ack(run, step)
        if step % 4 == 3:
            old = rng.randrange(step)
            back = (await _aretrying(f"read {run} {old}", lambda: store.aread(run, old))).state
            if not same(back, state_for(run, old)):
                raise SystemExit(f"{run} step {old}: read back a different state")


def main(argv: list[str]) -> int:
    url, prefix, proc, threads, steps, pool, acks, *mode = argv
    threads, steps = int(threads), int(steps)
    from agck.stores import open_store
    store = open_store(f"{url}&agck_pool={int(pool)}")
    fd = os.open(acks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def ack(run: str, step: int) -> None:
        os.write(fd, f"{run} {step}\n".encode())     # one write per line: whole lines, whatever the threads do

    failures: list = []

    def body(j: int) -> None:
        try:
            conversation(store, f"{prefix}-p{proc}-t{j}", steps, ack)
        except BaseException as e:     # reported below, by exit code and stderr
            failures.append(e)

    if mode == ["asyncio"]:
        import asyncio

        async def tasks():
            results = await asyncio.gather(*(aconversation(store, f"{prefix}-p{proc}-t{j}", steps, ack)
                                             for j in range(threads)), return_exceptions=True)
            failures.extend(r for r in results if isinstance(r, BaseException))

        asyncio.run(tasks())
    else:
        ts = [threading.Thread(target=body, args=(j,)) for j in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    store.close()
    for e in failures:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
    if any(isinstance(e, SystemExit) for e in failures):
        return 4
    return 3 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
