"""Plain I/O the benchmarks compare against: the physical limits, not agck."""

import os
import sys

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
