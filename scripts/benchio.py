"""What the benchmarks share: the plain I/O they compare against (the physical
limits, not agck), the runner that alternates cases round by round, and the
read-back every benchmark that writes through a store ends with."""

from __future__ import annotations

import gc
import os
import statistics
import struct
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

# Run from a checkout without installing: scripts/ is sys.path[0], the package is one up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from agck.durable import REAL as _FS  # noqa: E402  (only its sync_file_range(2) wrapper is used)

# Writes in 1 MiB pieces: one giant write(2) is throttled badly on this kernel, and the
# limit we compare against should be the fastest plain way to get the bytes on disk.
# So it also starts writeback of every 8 MiB as soon as it is written (sync_file_range,
# where the platform has it): the disk then works while the rest is written.
WRITE_CHUNK = 1 << 20
WRITEBACK_EVERY = 8 << 20


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_fsync(path: str, data) -> None:
    """What any durable writer must at least do: write the bytes, fsync the file and its directory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data).cast("B")
        written = started = 0
        while view.nbytes:
            n = os.write(fd, view[:WRITE_CHUNK])
            view = view[n:]
            written += n
            if written - started >= WRITEBACK_EVERY:
                _FS.start_writeback(fd, started, written - started)  # start the disk, don't wait
                started = written
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def raw_direct_fsync(path: str, data, chunk: int = 8 << 20) -> None:
    """O_DIRECT writes straight from ``data`` (page-aligned memory: see
    :func:`aligned_copy`), then fsync of the file and its directory: the floor for
    a durable write that skips the page cache. The last partial block is written
    buffered."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        view = memoryview(data).cast("B")
        n_aligned = view.nbytes // 4096 * 4096
        for i in range(0, n_aligned, chunk):
            os.write(fd, view[i:min(i + chunk, n_aligned)])
        if n_aligned < view.nbytes:
            import fcntl
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            os.write(fd, view[n_aligned:])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


@contextmanager
def pinned_direct_io(mode: str):
    """agck's durable writes with ``durable.DIRECT_IO`` pinned to ``mode``
    ("always", "never" or "auto") for the duration, then as they were."""
    from agck import durable
    was, durable.DIRECT_IO = durable.DIRECT_IO, mode
    try:
        yield
    finally:
        durable.DIRECT_IO = was


def aligned_copy(data):
    """``data``'s bytes in fresh page-aligned memory (an anonymous mapping), as
    O_DIRECT writes from the caller's memory need."""
    import mmap
    view = memoryview(data).cast("B")
    out = memoryview(mmap.mmap(-1, max(1, view.nbytes)))[:view.nbytes]
    out[:] = view
    return out


@dataclass
class Case:
    name: str
    fn: Callable[[], Any]            # the timed part; its result is dropped after the clock stops
    after: Callable[[], None] | None = None   # untimed cleanup (delete the file it wrote)
    nbytes: int = 0                  # bytes the MiB/s figure is computed over
    times: list = field(default_factory=list)
    inner: int = 1                   # calls per round, for cases too fast to time once

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def run_rounds(cases: list[Case], repeats: int, log, warmup: int = 0,
               quiesce: Callable[[], None] | None = None) -> None:
    """Every round runs every case once (``inner`` timed calls), in an order rotated
    each round, so drift on a shared machine spreads over all cases. ``quiesce``
    runs untimed before each case (e.g. flush the previous case's dirty pages)."""
    for r in range(-warmup, repeats):
        t_round = time.perf_counter()
        k = r % len(cases)
        for c in cases[k:] + cases[:k]:
            if quiesce:
                quiesce()
            for _ in range(c.inner):
                gc.collect()
                t0 = time.perf_counter()
                result = c.fn()
                t1 = time.perf_counter()
                del result
                if r >= 0:
                    c.times.append(t1 - t0)
            if c.after:
                c.after()
        what = f"round {r + 1}/{repeats}" if r >= 0 else "warm-up round (not counted)"
        log(f"  {what}: {time.perf_counter() - t_round:.1f} s")


@contextmanager
def scratch_schema(dsn: str, prefix: str):
    """A Postgres schema of this run's own (``{prefix}_<random>``), dropped after: yields
    (schema name, an autocommit psycopg2 cursor on the server)."""
    import secrets

    import psycopg2
    schema = f"{prefix}_{secrets.token_hex(3)}"
    admin = psycopg2.connect(dsn)
    admin.autocommit = True
    cur = admin.cursor()
    cur.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema, cur
    finally:
        cur.execute(f"DROP SCHEMA {schema} CASCADE")
        admin.close()


# --- read-back ---------------------------------------------------------------------------
# A benchmark that writes through a store reads back what it wrote, untimed, and fails
# when it is not that: a fast put that stored the wrong bytes is no result.

_read_back = [0]     # values compared so far in this process (read_back_note)


def readback(open_fresh: Callable[[], Any], expected, *, reader: Callable | None = None, runs: Any = ()) -> int:
    """Read back what a benchmark wrote, outside any timed part, through a store object
    of its own: ``open_fresh()`` opens one (``agck.open_store`` of the writer's URL and
    options; never the writer, whose caches could answer for the store). ``expected``
    maps (run, step) to what was written there (a dict, or pairs made as they are
    read: a long journal's results need not all be held); ``reader(store)`` gives the
    ``read(run, step)`` that reads it back (default :func:`read_checkpoint`;
    :func:`journal_results` for a journal's). ``runs``: runs whose every checkpoint must
    verify too (agck.recovery.verify_store), for what was written beside the values the
    caller still knows (a snapshotter's earlier steps); None: every run of the store.

    The first value that is not bit for bit what was written, cannot be read, or does
    not verify prints one line naming the store, run and step, and exits with status 1.
    Returns how many values it compared."""
    from agck.recovery import verify_store
    store = open_fresh()
    n = 0
    try:
        where = store.where
        read = (reader or read_checkpoint)(store)
        for (run, step), want in (expected.items() if hasattr(expected, "items") else expected):
            try:
                got = read(run, step)
            except Exception as e:   # missing, damaged, undecodable: what was written did not come back
                _read_back_failed(where, run, step, f"{type(e).__name__}: {e}")
            diff = difference(want, got)
            if diff is not None:
                _read_back_failed(where, run, step, f"not what was written: {diff}")
            n += 1
        for run in (store.runs() if runs is None else runs):
            for rj in verify_store(store, run).rejected:
                _read_back_failed(where, rj.run, rj.step, f"does not verify: {rj.reason}")
    finally:
        store.close()
    _read_back[0] += n
    return n


def read_back_note() -> str:
    return (f"read back {_read_back[0]} written values through fresh store objects: bit-exact, verified"
            if _read_back[0] else "nothing read back")


def _read_back_failed(where: str, run, step, why: str):
    print(f"read-back FAILED: store {where}, run {run!r}, step {step}: {why}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def read_checkpoint(store) -> Callable[[str, int], Any]:
    """The default reader of :func:`readback`: (run, step) read with every checksum
    verified. A snapshotter's checkpoint reads as the state it captured (its AppendLogs
    rebuilt from the run's log, every record checked; its RNG states left out, which
    the caller does not know), a multi-rank step as {rank: its part's state}."""
    from agck import applog, sharded

    def read(run: str, step: int):
        ck = store.read(run, step, verify=True)
        commit = sharded.as_commit(ck)
        if commit is not None:     # each part read and verified once, bound to this record
            return {p.rank: sharded.read_part(store, commit, p.rank).state for p in commit.parts}
        tree = ck.state
        if isinstance(ck.meta, dict) and ck.meta.get("snapshot") is True and isinstance(tree, dict) \
                and "state" in tree:
            if tree.get("step") != step:
                raise ValueError(f"the snapshot at step {step} says it is of step {tree.get('step')!r}")
            applog.resolve(store, run, tree, ck.ref)
            return tree["state"]
        return tree
    return read


def journal_results(name: str) -> Callable:
    """A reader for :func:`readback` of a journal: (run, i) reads the result the run's
    journal recorded for step ``name`` called with the one input ``i``, through an
    ``agck.Journal`` opened on the fresh store (every record checked when it opens). A
    result not recorded, or a record found damaged, fails."""
    def reader(store):
        from agck import Journal
        journals: dict = {}

        def read(run: str, i):
            j = journals.get(run)
            if j is None:
                j = journals[run] = Journal(store, run)
            got = j.step(name, _not_recorded, i)
            if j.damaged:
                raise ValueError(f"the journal found damaged records: {j.damaged[0]}")
            return got
        return read
    return reader


def langgraph_values(store) -> Callable[[str, Any], Any]:
    """A reader for :func:`readback` of what agck's LangGraph checkpointer wrote: (thread
    id, checkpoint id, or None: the thread's newest) reads that checkpoint's channel
    values through an ``AgckSaver`` on the fresh store (a damaged entry raises)."""
    from agck.integrations.langgraph import AgckSaver
    saver = AgckSaver(store)

    def read(thread_id: str, checkpoint_id):
        conf = {"thread_id": thread_id, "checkpoint_ns": ""}
        if checkpoint_id is not None:
            conf["checkpoint_id"] = checkpoint_id
        found = saver.get_tuple({"configurable": conf})
        if found is None:
            raise LookupError("no such checkpoint")
        return found.checkpoint["channel_values"]
    return read


def _bytes_differ(at: str, first: int, nbytes: int) -> str:
    return f"{at}: the bytes differ, first at byte {first} of {nbytes}"


def _not_recorded(*_):
    raise LookupError("no result recorded for this step")


def difference(want: Any, got: Any, at: str = "state") -> str | None:
    """Where ``got`` is not bit for bit ``want``, said in a few words; None where it is.
    Tensors and arrays: dtype, shape and bytes; dicts, lists, tuples and AppendLogs:
    item by item; floats: their bits; anything else: its type and ==."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(want, torch.Tensor):     # nn.Parameter too
        if not isinstance(got, torch.Tensor):
            return f"{at} is a {type(got).__name__}, not a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{at} is {got.dtype} {tuple(got.shape)}, not {want.dtype} {tuple(want.shape)}"
        w, g = (t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in (want, got))
        return None if torch.equal(w, g) else _bytes_differ(at, int((w != g).nonzero()[0]), w.numel())
    if np is not None and isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray):
            return f"{at} is a {type(got).__name__}, not an array"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{at} is {got.dtype} {got.shape}, not {want.dtype} {want.shape}"
        w, g = (np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (want, got))
        return None if np.array_equal(w, g) else _bytes_differ(at, int(np.flatnonzero(w != g)[0]), w.size)
    if type(got) is not type(want):
        return f"{at} is a {type(got).__name__}, not a {type(want).__name__}"
    if isinstance(want, dict):
        if got.keys() != want.keys():
            return (f"{at}: keys missing {', '.join(sorted(map(repr, want.keys() - got.keys()))) or '-'}, "
                    f"keys never written {', '.join(sorted(map(repr, got.keys() - want.keys()))) or '-'}")
        return next((d for k in want if (d := difference(want[k], got[k], f"{at}[{k!r}]")) is not None), None)
    if isinstance(want, (list, tuple)) or getattr(type(want), "_agck_log", False):    # an AppendLog
        if len(got) != len(want):
            return f"{at} has {len(got)} items, not {len(want)}"
        return next((d for i, (w, g) in enumerate(zip(want, got))
                     if (d := difference(w, g, f"{at}[{i}]")) is not None), None)
    if isinstance(want, float):
        return None if struct.pack("<d", want) == struct.pack("<d", got) else f"{at} is {got!r}, not {want!r}"
    return None if got == want else f"{at} is {got!r:.80}, not {want!r:.80}"
