"""Fresh memory for large outputs, and filling it at memory speed.

A new gigabyte costs more to fault in than to fill: 4 KiB at a time, each page
a trap and a zeroing, and on a virtual machine often a trip to the host too.
Two things bring a fill back near memcpy speed:

- Transparent huge pages: 512x fewer faults. They are asked for (madvise) only
  when the kernel holds free 2 MiB blocks for the whole request, read from
  /proc/buddyinfo, because otherwise the fault would stall in direct memory
  compaction, for seconds, which is far worse than small pages.
- More than one core: pieces of the copy (with their page faults) and the
  checksums of different blobs run on a few threads; numpy's copy, xxhash and
  madvise all release the GIL.

No I/O and no format knowledge: the caller says what goes where and what to
hash. The Linux-specific parts fall back to plain allocation elsewhere.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from . import thresholds

MAX_THREADS = 4                # memory bandwidth is saturated well before this on common machines
PARALLEL_MIN = thresholds.PARALLEL_FILL        # below this a fill is over before the threads have started
POPULATE_MIN = thresholds.POPULATE_MIN         # below this malloc's recycled pages are as good
_TASK = thresholds.FILL_TASK                # bytes per task: about a hundred tasks per GiB, each ~1 ms
_SLICE = thresholds.COPY_HASH_SLICE             # copy-then-hash granularity: fits in L2 between the two

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23      # Linux 5.14+; older kernels answer EINVAL and pages fault in on use
_THP_DIR = "/sys/kernel/mm/transparent_hugepage"


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _huge_page_size() -> int:
    """The PMD huge page size, or 0 when the kernel will not give huge pages on madvise."""
    if _LIBC is None or "[never]" in _read(f"{_THP_DIR}/enabled"):
        return 0
    text = _read(f"{_THP_DIR}/hpage_pmd_size").strip()
    return int(text) if text.isdigit() else 0


_HUGE = _huge_page_size()


def huge_pages_free() -> int:
    """Bytes the kernel holds free in blocks of at least one huge page (all zones)."""
    if not _HUGE:
        return 0
    order = (_HUGE // mmap.PAGESIZE).bit_length() - 1
    free = 0
    for line in _read("/proc/buddyinfo").splitlines():
        # "Node 0, zone   Normal   9811 5478 ..." : free blocks of order 0, 1, 2, ...
        counts = line.split()[4:]
        for k, n in enumerate(counts):
            if k >= order and n.isdigit():
                free += int(n) << k
    return free * mmap.PAGESIZE


def huge_pages_ready(size: int) -> bool:
    """Can ``size`` bytes come from free huge pages, without compacting memory?"""
    # A margin over the request so the allocator's watermarks and other tenants
    # do not push the last faults into compaction.
    return bool(_HUGE) and size >= 2 * _HUGE and huge_pages_free() >= size + size // 4 + (64 << 20)  # not a threshold: headroom


def advise_huge(addr: int, size: int) -> bool:
    """Ask for huge pages over the aligned interior of [addr, addr+size), if the
    kernel can hand them out without compacting memory. Returns whether it asked."""
    if not huge_pages_ready(size):
        return False
    start = (addr + _HUGE - 1) & ~(_HUGE - 1)
    end = (addr + size) & ~(_HUGE - 1)
    return end > start and _LIBC.madvise(start, end - start, _MADV_HUGEPAGE) == 0


def new_buffer(size: int) -> np.ndarray:
    """A writable uint8 array of ``size`` bytes, its pages already in place.

    An anonymous mapping, huge pages when they are free, populated by the kernel
    in one call made through ctypes, which releases the GIL: a caller can
    prepare it on another thread while data is on its way."""
    if size >= POPULATE_MIN and _LIBC is not None:
        buf = _populated_mapping(size)
        if buf is not None:
            return buf
    return np.empty(size, dtype=np.uint8)


def _populated_mapping(size: int) -> np.ndarray | None:
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    huge = huge_pages_ready(size)
    if not huge:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    # With huge pages, over-allocate by one so the buffer starts on a huge-page boundary.
    span = size + (_HUGE if huge else 0)
    base = _LIBC.mmap(None, span, prot, flags, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        return None
    addr = base
    if huge:
        addr = (base + _HUGE - 1) & ~(_HUGE - 1)
        _LIBC.madvise(addr, size, _MADV_HUGEPAGE)
        # On kernels before 5.14 this is EINVAL and the pages fault in as they are written.
        _LIBC.madvise(addr, size, _MADV_POPULATE_WRITE)
    raw = (ctypes.c_ubyte * size).from_address(addr)
    # Unmapped once no array refers to it; never at interpreter exit, where a daemon
    # thread or an atexit handler may still read it (the OS reclaims it at exit).
    weakref.finalize(raw, _LIBC.munmap, base, span).atexit = False
    return np.frombuffer(raw, dtype=np.uint8)


def _bytes_api():
    if sys.implementation.name != "cpython":
        return None
    try:
        f = ctypes.pythonapi.PyBytes_FromStringAndSize
    except AttributeError:
        return None
    f.restype = ctypes.py_object
    f.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    return f


_NEW_BYTES = _bytes_api()


def new_bytes(size: int) -> tuple[bytes, np.ndarray] | None:
    """An uninitialised ``bytes`` of ``size`` and a writable uint8 view of it.

    Fill the view completely before the bytes object is shared: this is how C
    code builds a bytes object (``PyBytes_FromStringAndSize(NULL, n)``) and
    saves the copy that ``bytes(buffer)`` would make. None where CPython's API
    is not available."""
    if _NEW_BYTES is None:
        return None
    out = _NEW_BYTES(None, size)
    addr = np.frombuffer(out, dtype=np.uint8).ctypes.data
    if size >= PARALLEL_MIN:
        advise_huge(addr, size)
    raw = (ctypes.c_ubyte * size).from_address(addr)
    raw._owner = out          # the view keeps the bytes object, and so its memory, alive
    return out, np.frombuffer(raw, dtype=np.uint8)


def run_tasks(tasks: Sequence[Callable[[], Any]], workers: int) -> None:
    """Run independent tasks on a pool of ``workers`` threads; exceptions propagate.

    A pool cannot be started once the interpreter is shutting down (an atexit
    handler flushing a last snapshot, a daemon thread), so whatever cannot be
    scheduled runs on the calling thread instead."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agck") as pool:
        futures = []
        for k, task in enumerate(tasks):
            try:
                futures.append(pool.submit(task))
            except RuntimeError:             # "cannot schedule new futures after interpreter shutdown"
                for rest in tasks[k:]:
                    rest()
                break
        for fut in futures:
            fut.result()


def threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def fill(dest: np.ndarray, pieces: Sequence[tuple[int, memoryview, bool]],
         new_hasher: Callable[[], Any]) -> list[int]:
    """Copy each ``(offset, buffer, hashed)`` of ``pieces`` into ``dest`` at its
    offset; return the digest (``new_hasher()`` fed the buffer) of each piece
    marked ``hashed``, in order.

    A hashed piece is hashed from its source a cache-sized slice at a time, right
    after the slice is copied, so the data crosses the memory bus once. Large fills
    run as tasks of a few MiB on up to MAX_THREADS threads, the longest first; a
    piece too big for that to balance is copied in slices by any thread and hashed
    separately from its source in one sequential pass."""
    total = sum(b.nbytes for _, b, _ in pieces)
    hashed = [k for k, (_, _, h) in enumerate(pieces) if h]
    digests: dict[int, int] = {}
    workers = threads()
    if workers == 1 or total < PARALLEL_MIN:
        for k, (off, b, h) in enumerate(pieces):
            _copy(dest, off, b, new_hasher, digests, k if h else None)
        return [digests[k] for k in hashed]

    too_big = total // (2 * workers)
    ops: list[tuple[int, Callable[[], None]]] = []   # (bytes, operation)
    for k, (off, b, h) in enumerate(pieces):
        if h and b.nbytes <= too_big:     # copied and hashed by one thread, in one pass
            ops.append((b.nbytes, partial(_copy, dest, off, b, new_hasher, digests, k)))
            continue
        if h:
            ops.append((b.nbytes, partial(_hash_only, b, new_hasher, digests, k)))
        for i in range(0, b.nbytes, _TASK):
            piece = b[i:i + _TASK]
            ops.append((piece.nbytes, partial(_copy, dest, off + i, piece, new_hasher, digests, None)))
    # Group small operations (in address order) into tasks of about _TASK bytes.
    tasks: list[tuple[int, list]] = []
    group, size = [], 0
    for n, op in ops:
        if n >= _TASK:
            tasks.append((n, [op]))
            continue
        group.append(op)
        size += n
        if size >= _TASK:
            tasks.append((size, group))
            group, size = [], 0
    if group:
        tasks.append((size, group))
    tasks.sort(key=lambda t: -t[0])
    run_tasks([partial(_run_all, group) for _, group in tasks], workers)
    return [digests[k] for k in hashed]


def digests(buffers: Sequence[memoryview], digest: Callable[[memoryview], int]) -> list[int]:
    """``[digest(b) for b in buffers]``, on up to MAX_THREADS threads when the
    buffers are large (several blobs hash at once; one blob is one sequential pass)."""
    total = sum(b.nbytes for b in buffers)
    workers = threads()
    if workers == 1 or total < PARALLEL_MIN or len(buffers) < 2:
        return [digest(b) for b in buffers]
    out = [0] * len(buffers)

    def run(indices):
        for i in indices:
            out[i] = digest(buffers[i])

    tasks, group, size = [], [], 0
    for i in sorted(range(len(buffers)), key=lambda i: -buffers[i].nbytes):
        group.append(i)
        size += buffers[i].nbytes
        if size >= _TASK:
            tasks.append(group)
            group, size = [], 0
    if group:
        tasks.append(group)
    run_tasks([partial(run, t) for t in tasks], workers)
    return out


def _run_all(ops) -> None:
    for op in ops:
        op()


def _copy(dest: np.ndarray, off: int, b: memoryview, new_hasher, digests: dict, key: int | None) -> None:
    src = np.frombuffer(b, dtype=np.uint8)
    if key is None:
        dest[off:off + src.size] = src
        return
    h = new_hasher()
    for i in range(0, src.size, _SLICE):
        s = src[i:i + _SLICE]
        dest[off + i:off + i + s.size] = s
        h.update(s)          # the slice the copy just read is still in cache
    digests[key] = h.intdigest()


def _hash_only(b: memoryview, new_hasher, digests: dict, key: int) -> None:
    h = new_hasher()
    h.update(b)
    digests[key] = h.intdigest()
