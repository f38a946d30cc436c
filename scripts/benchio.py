"""Plain I/O the benchmarks compare against: the physical limits, not agck."""

import os

# Writes in 1 MiB pieces: one giant write(2) is throttled badly on this kernel, and the
# limit we compare against should be the fastest plain way to get the bytes on disk.
WRITE_CHUNK = 1 << 20


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
        while view.nbytes:
            view = view[os.write(fd, view[:WRITE_CHUNK]):]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))
