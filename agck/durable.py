"""Atomic, durable file writes: the one place that owns fsync and rename.

A checkpoint file is written to a temp file in the same directory, fsync'd,
renamed over its final name, and the directory is fsync'd. A crash at any
instant leaves the old name absent or intact and the new one absent or
complete. All system calls go through an :class:`FileSystem` so the crash
harness can substitute one that forgets unsynced writes (simulated power loss).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import sys
from typing import Iterable

from . import failpoints
from .errors import CheckpointExistsError, DurabilityError

TEMP_MARK = ".tmp."

# Start the disk on each WRITEBACK_EVERY bytes as soon as they are written, so that
# writing the rest overlaps with the disk and the final fsync has little left to do
# (RocksDB's bytes_per_sync). 8 MiB keeps the device busy without a syscall per write.
WRITEBACK_EVERY = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ESPIPE, getattr(errno, "EOPNOTSUPP", -1)}


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    f.restype = ctypes.c_int
    return f


_sync_file_range = _load_sync_file_range()


def temp_name_for(path: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TEMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TEMP_MARK in name


class FileSystem:
    """The system calls durable writes use. Subclassed by the crash harness."""

    def open_new(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)

    def write(self, fd: int, data) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        """Ask the kernel to start writing a range of the file to disk now, without
        waiting for it. A hint for speed, not a durability point: only fsync is.
        Does nothing where the platform or file system lacks sync_file_range(2)."""
        global _sync_file_range
        call = _sync_file_range
        if call is None:
            return
        # Any failure is ignored: this is only a hint, and a real I/O error is still
        # reported by the fsync that follows (without WAIT flags sync_file_range does
        # not consume the file's writeback error). Unsupported: stop asking.
        if call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0 and ctypes.get_errno() in _UNSUPPORTED:
            _sync_file_range = None

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


REAL = FileSystem()


def write_all(fs: FileSystem, fd: int, data) -> int:
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    total = view.nbytes
    while view.nbytes:
        n = fs.write(fd, view)
        view = view[n:]
    return total


def write_atomic(path: str, parts: Iterable, *, overwrite: bool = True, size: int | None = None,
                 fs: FileSystem | None = None) -> None:
    """Write the concatenation of ``parts`` to ``path`` durably.

    ``overwrite=False`` refuses an existing ``path`` (:class:`CheckpointExistsError`)
    without ever replacing it (link(2) never replaces). A failed write or fsync
    raises :class:`DurabilityError`; the temp file is removed and ``path`` is untouched."""
    fs = fs or REAL
    directory = os.path.dirname(path) or "."
    tmp = temp_name_for(path)
    fd = None
    try:
        fd = fs.open_new(tmp)
        failpoints.hit("file.before_write")
        first = True
        written = started = 0
        for part in parts:
            written += write_all(fs, fd, part)
            if first:
                failpoints.hit("file.mid_write")
                first = False
            if written - started >= WRITEBACK_EVERY:
                fs.start_writeback(fd, started, written - started)
                started = written
        failpoints.hit("file.before_fsync")
        fs.fsync(fd)
        failpoints.hit("file.after_fsync")
        fs.close(fd)
        fd = None
        failpoints.hit("file.before_rename")
        if overwrite:
            fs.rename(tmp, path)
        else:
            try:
                fs.link(tmp, path)
            except FileExistsError:
                raise CheckpointExistsError("a checkpoint already exists here", ref=path) from None
            fs.unlink(tmp)
        tmp = None
        failpoints.hit("file.after_rename")
        fs.fsync_dir(directory)
        failpoints.hit("file.after_dir_fsync")
    except OSError as e:
        what = "disk full" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise DurabilityError(f"write failed: {what}", ref=path) from e
    finally:
        if fd is not None:
            try:
                fs.close(fd)
            except OSError:
                pass
        if tmp is not None:
            try:
                fs.unlink(tmp)
            except OSError:
                pass
