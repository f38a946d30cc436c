"""Atomic, durable file writes: the one place that owns fsync and rename.

A checkpoint file is written to a temp file in the same directory, fsync'd,
renamed over its final name, and the directory is fsync'd. A crash at any
instant leaves the old name absent or intact and the new one absent or
complete. All system calls go through an :class:`FileSystem` so the crash
harness can substitute one that forgets unsynced writes (simulated power loss).

Large files may bypass the page cache (O_DIRECT): a buffered write copies every
byte into freshly allocated page-cache pages and leaves the kernel's flusher
threads to write them out, and on a small machine that CPU time is taken from
the program being checkpointed; a direct write goes through a small reusable
aligned buffer instead (or straight from the caller's memory when it happens
to be aligned). Which of the two is faster depends on the file system and the
device (direct writes measured 2.7x faster than buffered on one virtio ext4
disk and 1.6x slower on another), so it is not assumed: :class:`DirectChoice`
times both on each file system a process writes to and keeps the faster
(``DIRECT_IO``, or the ``AGCK_DIRECT_IO`` environment variable, can pin it);
a thread whose writes nobody waits on (:func:`writes_in_background`) saves
CPU instead and writes around the cache. A store that writes files of its own
(chunk files) asks the same question through :func:`direct_write_plan`.
The durability points are the same either way: fsync of the file (O_DIRECT
alone promises nothing about the device cache or the file's metadata), rename,
fsync of the directory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import statistics
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import failpoints, thresholds
from .errors import CheckpointExistsError, DurabilityError, UsageError

TEMP_MARK = ".tmp."

# Start the disk on each WRITEBACK_EVERY bytes as soon as they are written, so that
# writing the rest overlaps with the disk and the final fsync has little left to do
# (RocksDB's bytes_per_sync). 8 MiB keeps the device busy without a syscall per write.
WRITEBACK_EVERY = thresholds.WRITEBACK_EVERY
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

# Direct I/O: files of at least DIRECT_MIN bytes (when the size is known up front)
# are written with O_DIRECT in DIRECT_CHUNK writes. Below that the page cache is
# cheap and the file may well be read back soon.
DIRECT_MIN = thresholds.DIRECT_WRITE
DIRECT_CHUNK = thresholds.DIRECT_SLICE
ALIGNED_RUN_MIN = thresholds.ALIGNED_RUN    # an aligned run this long is written from where it is (a grid chunk of a staged tensor)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DEFAULT_ALIGN = 4096       # when the kernel cannot say (statx STATX_DIOALIGN, Linux 6.1+): safe for 512e and 4Kn
_HASH_SLICE = thresholds.HASH_SLICE     # copy-then-hash granularity: the slice is still in cache when it is hashed
_no_direct_devices: set[int] = set()   # file systems that refused O_DIRECT once: not asked again

# Whether a write of DIRECT_MIN bytes or more whose caller leaves it open
# (direct=None) bypasses the page cache: "auto" (timed, per file system: see
# DirectChoice), "always" or "never". Read from AGCK_DIRECT_IO at import.
DIRECT_IO = os.environ.get("AGCK_DIRECT_IO", "auto").strip().lower() or "auto"
DIRECT_IO_MODES = ("auto", "always", "never")


class DirectChoice:
    """Per file system, whether large durable writes go faster through the page
    cache or around it, learned from the writes themselves.

    Every large write is timed from its first byte to the end of its fsync
    (the rename and the directory's fsync cost the same either way) and kept
    as a throughput sample of its mode. Until each mode has ``WARMUP`` samples
    the writes alternate between them, direct first; from then on a write takes
    the mode with the higher median over the last ``KEEP`` samples of each, and
    one write in ``PROBE_EVERY`` takes the other one, so a choice made while the
    machine was busy, or a device whose behaviour changed, is corrected. The
    cost of probing is bounded: one write in PROBE_EVERY at the slower mode's
    speed."""

    WARMUP = 2
    KEEP = 5
    PROBE_EVERY = 16

    def __init__(self):
        self._lock = threading.Lock()
        self._samples: dict[Any, dict[bool, list[float]]] = {}
        self._writes: dict[Any, int] = {}

    def choose(self, device) -> bool:
        """``device``: what the samples are kept apart by (a file system's st_dev,
        or (st_dev, kind) for writes of another size class)."""
        with self._lock:
            s = self._samples.setdefault(device, {True: [], False: []})
            if len(s[True]) < self.WARMUP or len(s[False]) < self.WARMUP:
                return len(s[True]) <= len(s[False])
            n = self._writes[device] = self._writes.get(device, 0) + 1
            best = statistics.median(s[True]) >= statistics.median(s[False])
            return (not best) if n % self.PROBE_EVERY == 0 else best

    def record(self, device, direct: bool, nbytes: int, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            kept = self._samples.setdefault(device, {True: [], False: []})[direct]
            kept.append(nbytes / seconds)
            del kept[:-self.KEEP]

    def state(self) -> dict[Any, dict[str, Any]]:
        """For each file system written to (its st_dev; (st_dev, "chunk") for chunk
        files): the median MB/s of each mode's recent writes and the mode the next
        non-probe write takes."""
        out = {}
        with self._lock:
            for dev, s in self._samples.items():
                med = {m: (statistics.median(v) / 1e6 if v else None) for m, v in s.items()}
                ready = len(s[True]) >= self.WARMUP and len(s[False]) >= self.WARMUP
                out[dev] = {"direct_MBps": med[True], "buffered_MBps": med[False],
                            "samples": (len(s[True]), len(s[False])),
                            "choice": (("direct" if med[True] >= med[False] else "buffered") if ready
                                       else "learning")}
        return out


DIRECT_CHOICE = DirectChoice()
_THREAD = threading.local()


def in_background() -> bool:
    """Whether the calling thread was marked by :func:`writes_in_background`."""
    return getattr(_THREAD, "background", False)


def writes_in_background(on: bool = True) -> None:
    """Mark the calling thread as one whose writes nobody waits on (a snapshot
    writer): in "auto", its large writes bypass the page cache wherever the file
    system takes O_DIRECT, without timing. Such a write competes with the
    program for CPU, not for time: a buffered write copies every byte into the
    page cache and leaves the flusher threads more work, 6x the CPU of a direct
    write of the same 524 MB in scripts/bench_snapshot.py (195 ms against 31 ms),
    whichever of the two finishes first."""
    _THREAD.background = on


class _StatxTs(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_int64), ("nsec", ctypes.c_uint32), ("_r", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    _fields_ = [("mask", ctypes.c_uint32), ("blksize", ctypes.c_uint32), ("attributes", ctypes.c_uint64),
                ("nlink", ctypes.c_uint32), ("uid", ctypes.c_uint32), ("gid", ctypes.c_uint32),
                ("mode", ctypes.c_uint16), ("_p1", ctypes.c_uint16), ("ino", ctypes.c_uint64),
                ("size", ctypes.c_uint64), ("blocks", ctypes.c_uint64), ("attributes_mask", ctypes.c_uint64),
                ("atime", _StatxTs), ("btime", _StatxTs), ("ctime", _StatxTs), ("mtime", _StatxTs),
                ("rdev_major", ctypes.c_uint32), ("rdev_minor", ctypes.c_uint32),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32), ("mnt_id", ctypes.c_uint64),
                ("dio_mem_align", ctypes.c_uint32), ("dio_offset_align", ctypes.c_uint32),
                ("_spare", ctypes.c_uint64 * 12)]


_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000


def _load_statx():
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    f.restype = ctypes.c_int
    return f


_statx = _load_statx()


def _dio_alignment(fd: int) -> tuple[int, int]:
    """(memory alignment, file offset and length alignment) for O_DIRECT on ``fd``."""
    if _statx is not None:
        st = _Statx()
        if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, ctypes.byref(st)) == 0 \
                and st.mask & _STATX_DIOALIGN and st.dio_offset_align:
            return max(st.dio_mem_align, 1), st.dio_offset_align
    return _DEFAULT_ALIGN, _DEFAULT_ALIGN


class _BouncePool:
    """Page-aligned DIRECT_CHUNK buffers, reused across writes: warm, mapped once,
    small enough to stay in the last-level cache between the copy and the write."""

    def __init__(self):
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            while self._free:
                b = self._free.pop()
                if b.size == DIRECT_CHUNK:
                    return b
        import mmap
        return np.frombuffer(mmap.mmap(-1, DIRECT_CHUNK), dtype=np.uint8)

    def give(self, b: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < 4:
                self._free.append(b)


_BOUNCE = _BouncePool()


def temp_name_for(path: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TEMP_MARK}{os.getpid()}.{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TEMP_MARK in name


def temp_writer_alive(name: str) -> bool:
    """Whether the process that made temp file ``name`` (its pid is in the name,
    :func:`temp_name_for`) still runs on this machine: its write may be in flight."""
    try:
        pid = int(name.split(TEMP_MARK, 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:      # EPERM: another user's process, alive
        return True
    return True


def remove_dead_temps(directory: str) -> list[str]:
    """Remove the temp files in ``directory`` (not below it) whose writer no longer runs:
    writes a crash cut short, never acknowledged and never read. Returns what was
    removed; a file that cannot be removed is left (it is reported by the scans that
    list orphans) and never fails the caller."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if is_temp_name(name) and not temp_writer_alive(name):
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


class FileSystem:
    """The system calls durable writes use. Subclassed by the crash harness."""

    # Whether callers may issue these calls from several threads at once (the real
    # kernel: yes; a simulation that records the order of operations: no).
    concurrent = True

    def open_new(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)

    def open_append(self, path: str) -> int:
        """An append-only log, created if missing (its directory entry is the caller's to fsync)."""
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def write(self, fd: int, data) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def datasync(self, fd: int) -> None:
        """fsync without the metadata a read does not need (times): an append's new size
        is still flushed. A simulation that does not tell the two apart may leave this as is."""
        getattr(os, "fdatasync", os.fsync)(fd)

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

    def set_direct(self, fd: int, on: bool) -> bool:
        """Switch O_DIRECT on or off for an open file. False where the platform or
        the file system does not do direct I/O (the caller then writes buffered).
        Not a durability point either way: only fsync is."""
        if not _O_DIRECT:
            return False
        import fcntl
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
        except OSError:
            return False
        return True

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

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

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


def _bytes_view(data) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _Sink:
    """Writes a stream of pieces to an open file, in order, optionally hashing
    some of them on the way.

    Buffered: each piece is written as it comes (hashed first, a slice at a
    time), and writeback of every WRITEBACK_EVERY bytes is started early.

    Direct: pieces are gathered into an aligned bounce buffer (each slice hashed
    right after it is copied, while it is in cache) and written DIRECT_CHUNK at a
    time. (Writing one buffer on a helper thread while the next fills measured
    slower, not faster: the copy and the device's transfer share the memory
    bus.) A long run of a piece whose memory lines up with the file's blocks is
    written straight from that memory. The last partial block is written with
    O_DIRECT switched off. A sign that the file system will not take these
    direct writes (EINVAL, a short write) switches the rest of the file to
    buffered writes: nothing is lost, since a refused write wrote nothing and a
    short one is resumed where it stopped."""

    def __init__(self, fs: FileSystem, fd: int, direct: bool, mid_point: str | None = "file.mid_write"):
        self.fs, self.fd = fs, fd
        self.mid_point = mid_point    # the fail point hit once, after the first write
        self.written = 0          # bytes handed to write(2) so far
        self.started = 0          # writeback requested up to here (buffered)
        self.direct = False
        self.buf: np.ndarray | None = None      # the bounce buffer
        self.bmv: memoryview | None = None
        self.fill = 0
        self._mid = False
        if direct:
            mem, off = _dio_alignment(fd)
            if DIRECT_CHUNK % off == 0 and mem <= 4096 and fs.set_direct(fd, True):
                self.direct, self.mem_align, self.off_align = True, mem, off
                self.buf = _BOUNCE.take()
                self.bmv = memoryview(self.buf)
            else:
                _remember_no_direct(fd)

    # -- system calls -----------------------------------------------------------
    def _write(self, view: memoryview) -> None:
        while view.nbytes:
            try:
                n = self.fs.write(self.fd, view)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                self._to_buffered(refused=True)
                continue                       # the refused write wrote nothing: again, buffered
            self.written += n
            view = view[n:]
            if view.nbytes and self.direct and n % self.off_align:
                self._to_buffered()            # the rest starts unaligned
        if not self._mid:
            self._mid = True
            if self.mid_point:
                failpoints.hit(self.mid_point)

    def _to_buffered(self, refused: bool = False) -> None:
        self.direct = False
        if not self.fs.set_direct(self.fd, False):
            raise OSError(errno.EIO, "cannot switch O_DIRECT off")
        if refused:
            _remember_no_direct(self.fd)
        self.started = self.written

    def _buffered(self, view: memoryview) -> None:
        for i in range(0, view.nbytes, WRITEBACK_EVERY):
            self._write(view[i:i + WRITEBACK_EVERY])
            if self.written - self.started >= WRITEBACK_EVERY:
                self.fs.start_writeback(self.fd, self.started, self.written - self.started)
                self.started = self.written

    def _flush(self, n: int) -> None:
        """Write the first ``n`` bytes of the bounce buffer; keep the rest at its start."""
        if not n:
            return
        self._write(self.bmv[:n])
        rest = self.fill - n
        if rest:
            self.buf[:rest] = self.buf[n:self.fill]
        self.fill = rest

    def _drain(self) -> None:
        """After a switch to buffered: write what the bounce buffer holds, give it back."""
        if self.fill:
            pending, self.fill = self.bmv[:self.fill], 0
            self._buffered(pending)
        self.release()

    # -- pieces -----------------------------------------------------------------
    def add(self, data, hasher=None) -> None:
        view = _bytes_view(data)
        if not self.direct:
            if self.buf is not None:
                self._drain()
            if hasher is None:
                self._buffered(view)
            else:
                for i in range(0, view.nbytes, _HASH_SLICE):
                    piece = view[i:i + _HASH_SLICE]
                    hasher.update(piece)
                    self._buffered(piece)
            return
        src = np.frombuffer(view, dtype=np.uint8)
        n, i = src.size, 0
        base = src.ctypes.data if n else 0
        while i < n:
            if not self.direct:
                self.add(view[i:], hasher)
                return
            cap = self.buf.size
            top = -self.fill % self.off_align      # bytes that bring the bounce buffer to a block boundary
            run = (n - i - top) // self.off_align * self.off_align
            if run >= ALIGNED_RUN_MIN and (base + i + top) % self.mem_align == 0 and self.fill + top <= cap:
                # A long run already aligned in memory: written from where it is, no copy.
                self._copy(src, i, top, hasher)
                i += top
                self._flush(self.fill)
                end = i + run
                while i < end and self.direct:
                    piece = view[i:min(i + DIRECT_CHUNK, end)]
                    if hasher is not None:
                        hasher.update(piece)
                    self._write(piece)
                    i += piece.nbytes
                continue
            k = min(cap - self.fill, n - i)
            self._copy(src, i, k, hasher)
            i += k
            if self.fill == cap:
                self._flush(cap)

    def _copy(self, src: np.ndarray, i: int, k: int, hasher) -> None:
        f = self.fill
        if hasher is None:
            self.buf[f:f + k] = src[i:i + k]
        else:
            for j in range(0, k, _HASH_SLICE):
                m = min(_HASH_SLICE, k - j)
                self.buf[f + j:f + j + m] = src[i + j:i + j + m]
                hasher.update(self.bmv[f + j:f + j + m])
        self.fill = f + k

    def finish(self) -> None:
        """Write what is still gathered; the last partial block through the page cache."""
        if self.buf is None:
            return
        if self.direct:
            self._flush(self.fill // self.off_align * self.off_align)
            if self.fill:
                self.direct = False
                if not self.fs.set_direct(self.fd, False):
                    raise OSError(errno.EIO, "cannot switch O_DIRECT off to write the last block")
        if self.fill:
            pending, self.fill = self.bmv[:self.fill], 0
            self._write(pending)

    def release(self) -> None:
        if self.buf is not None:
            _BOUNCE.give(self.buf)
            self.buf = self.bmv = None


def _remember_no_direct(fd: int) -> None:
    try:
        _no_direct_devices.add(os.fstat(fd).st_dev)
    except OSError:
        pass


def write_parts(fs: FileSystem, fd: int, parts: Iterable, *, direct: bool = False) -> int:
    """Write ``parts`` to ``fd``, a new file opened by ``fs.open_new``, at its
    current position (0); returns the byte count. No fsync: the caller's.

    ``direct=True``: through O_DIRECT as :func:`write_atomic` does (an aligned
    bounce buffer, the last partial block buffered), falling back to buffered
    writes where the file system refuses. For writers that manage their own temp
    file and rename (a store's chunk files); they still fsync the file and its
    directory: O_DIRECT alone is no durability point."""
    sink = _Sink(fs, fd, direct and bool(_O_DIRECT) and not _known_no_direct(fd), mid_point=None)
    try:
        for part in parts:
            sink.add(part)
        sink.finish()
        return sink.written
    finally:
        sink.release()


def _known_no_direct(fd: int) -> bool:
    if not _no_direct_devices:
        return False
    try:
        return os.fstat(fd).st_dev in _no_direct_devices
    except OSError:
        return False


def _use_direct(direct: bool | None, size: int | None, directory: str, *, minimum: int | None = None,
                kind: str | None = None, background: bool | None = None) -> tuple[bool, Any]:
    """(whether to write ``size`` bytes into ``directory`` with O_DIRECT, the key
    to report the write's time under when DirectChoice made the choice, or None).

    ``minimum``: the smallest size left to the choice (DIRECT_MIN); ``kind``
    keeps the samples of another size class (chunk files) apart; ``background``:
    the write is one nobody waits on (default: the calling thread's mark)."""
    minimum = DIRECT_MIN if minimum is None else minimum
    if not _O_DIRECT or direct is False:
        return False, None
    if direct is None and (size is None or size < minimum or DIRECT_IO == "never"):
        return False, None
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return direct is not None or DIRECT_IO == "always", None
    if device in _no_direct_devices:
        return False, None
    if background is None:
        background = in_background()
    if direct is not None or DIRECT_IO == "always" or (DIRECT_IO == "auto" and background):
        return True, None
    if DIRECT_IO != "auto":
        raise UsageError(f"AGCK_DIRECT_IO (durable.DIRECT_IO) is {DIRECT_IO!r}",
                         hint=f"use one of {', '.join(DIRECT_IO_MODES)}")
    key = device if kind is None else (device, kind)
    return DIRECT_CHOICE.choose(key), key


def direct_write_plan(directory: str, size: int, *, minimum: int, kind: str,
                      background: bool) -> tuple[bool, Any]:
    """For writers that manage their own temp file (a store's chunk files):
    whether to write ``size`` bytes into ``directory`` with O_DIRECT, as
    :func:`write_atomic` decides (DIRECT_IO, DirectChoice under ``kind``, a
    background write always direct), and the key to pass to
    :func:`report_direct_write` with the write's time (None: not timed)."""
    return _use_direct(None, size, directory, minimum=minimum, kind=kind, background=background)


def report_direct_write(fs: FileSystem, key, direct: bool, nbytes: int, seconds: float) -> None:
    """A timed write (first byte to the end of its fsync) planned by
    :func:`direct_write_plan` or :func:`write_atomic`; ignored when ``key`` is
    None, ``fs`` is not the real kernel (a simulation's times say nothing about
    the device), or the file system refused direct I/O meanwhile."""
    if key is None or fs is not REAL:
        return
    device = key[0] if isinstance(key, tuple) else key
    if device not in _no_direct_devices:
        DIRECT_CHOICE.record(key, direct, nbytes, seconds)


def write_atomic(path: str, parts: Iterable, *, overwrite: bool = True, size: int | None = None,
                 fs: FileSystem | None = None, direct: bool | None = None) -> None:
    """Write the concatenation of ``parts`` to ``path`` durably.

    ``overwrite=False`` refuses an existing ``path`` (:class:`CheckpointExistsError`)
    without ever replacing it (link(2) never replaces). A failed write or fsync
    raises :class:`DurabilityError`; the temp file is removed and ``path`` is untouched.

    ``direct``: write with O_DIRECT, bypassing the page cache (None: when ``size``,
    the total, is at least DIRECT_MIN and ``DIRECT_IO`` says so; in "auto", when
    it measured faster on this file system, :class:`DirectChoice`). Falls back to
    buffered writes wherever the file system does not take direct I/O. The
    durability guarantees are the same."""
    _write_atomic(path, ((p, None) for p in parts), overwrite=overwrite, size=size, fs=fs, direct=direct)


def write_atomic_hashed(path: str, pieces: Sequence[tuple[Any, bool]], finish: Callable[[list[int]], bytes],
                        new_hasher: Callable[[], Any], *, overwrite: bool = True, size: int | None = None,
                        fs: FileSystem | None = None, direct: bool | None = None) -> list[int]:
    """:func:`write_atomic` of ``pieces`` followed by ``finish(digests)``, where
    ``digests`` is ``new_hasher()`` fed each piece marked ``True``, in order.

    For formats that end with checksums of their contents: each byte is read from
    memory once, for the copy and the hash together, on the writing thread; no
    second pass, no extra thread. Returns the digests."""
    digests: list[int] = []

    def stream():
        for buf, hashed in pieces:
            if hashed:
                h = new_hasher()
                yield buf, h
                digests.append(h.intdigest())
            else:
                yield buf, None
        yield finish(list(digests)), None

    _write_atomic(path, stream(), overwrite=overwrite, size=size, fs=fs, direct=direct)
    return digests


def _write_atomic(path: str, parts: Iterable, *, overwrite: bool, size: int | None,
                  fs: FileSystem | None, direct: bool | None) -> None:
    fs = fs or REAL
    directory = os.path.dirname(path) or "."
    tmp = temp_name_for(path)
    fd = None
    sink = None
    try:
        fd = fs.open_new(tmp)
        failpoints.hit("file.before_write")
        want_direct, timed = _use_direct(direct, size, directory)
        t0 = time.perf_counter()
        sink = _Sink(fs, fd, want_direct)
        for part, hasher in parts:
            sink.add(part, hasher)
        sink.finish()
        failpoints.hit("file.before_fsync")
        fs.fsync(fd)
        report_direct_write(fs, timed, want_direct, sink.written, time.perf_counter() - t0)
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
                raise CheckpointExistsError.refused(path) from None
            fs.unlink(tmp)
        tmp = None
        failpoints.hit("file.after_rename")
        fs.fsync_dir(directory)
        failpoints.hit("file.after_dir_fsync")
    except OSError as e:
        if isinstance(e, FileNotFoundError) and not os.path.isdir(directory):
            raise DurabilityError(f"directory {directory} does not exist, so nothing was written", ref=path,
                                  hint="create the directory first (os.makedirs), or check the path") from e
        what = "disk full" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise DurabilityError(f"write failed: {what}", ref=path) from e
    finally:
        if sink is not None:
            sink.release()
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


_SYNCED_DIRS: "weakref.WeakKeyDictionary[FileSystem, set]" = weakref.WeakKeyDictionary()   # by make_dir


def make_dir(fs: FileSystem, path: str, parent: str, what: str = "directory") -> None:
    """Create ``path`` (in ``parent``) if missing, and make its entry durable by
    fsync'ing ``parent``, also when it was there already, once per file system
    object: another process may have made it and been killed before its fsync.
    Raises :class:`DurabilityError`."""
    synced = _SYNCED_DIRS.setdefault(fs, set())
    there = os.path.isdir(path)
    if there and path in synced:
        return
    if not there:
        try:
            fs.mkdir(path)
        except FileExistsError:
            pass
        except OSError as e:
            raise DurabilityError(f"cannot create the {what}: {e.strerror}", ref=path) from None
    try:
        fs.fsync_dir(parent)  # the directory's entry must survive too
    except OSError as e:
        raise DurabilityError(f"fsync of {parent} failed: {e.strerror}", ref=parent) from None
    synced.add(path)
