"""What the benchmarks share: the plain I/O they compare against (the physical
limits, not agck), and the runner that alternates cases round by round."""

from __future__ import annotations

import gc
import os
import statistics
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
