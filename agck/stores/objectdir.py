"""A file store's chunks: one immutable file per chunk, named by its address.

    <root>/.objects/<first 2 hex digits>/<remaining 62 hex digits>
    <root>/.objects/lock

Writing a chunk: temp file in its directory, write, fsync, rename, and once per
batch fsync of every directory that gained a name (:meth:`Batch.sync`). A
batch's chunks are written by a few threads while the next ones are cut (each
chunk's own order stays write, fsync, rename; the directories are fsync'd after
every rename): file creation and fsync wait on the disk, not on the CPU.
Chunks are never rewritten: the same name always holds the same bytes.

Locking (:mod:`agck.stores.content`, rule 2): a writer holds a shared
``flock`` on ``lock`` from its first "do you have this chunk?" until its
listing is committed; the collector holds it exclusively while it lists the
live chunks and deletes the rest. The kernel drops a killed process's lock, so
a crash never leaves the store locked.

Only the collector deletes chunks, and before it deletes any it writes a new
value into ``<root>/.objects/generation``. A writer that finds the value it
saw when it last made chunks durable knows those chunks are still there,
durable under their names, and skips looking at them again: a checkpoint
that refers to a gigabyte of unchanged chunks costs one read, not a stat per
chunk. Any other value (or none) means look at every chunk again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterable

from .. import durable, failpoints
from ..errors import DurabilityError, StoreError

DIRNAME = ".objects"
_MAX_KNOWN = 1 << 22
WRITERS = 4            # threads writing one batch's chunks
_IN_FLIGHT = 64        # chunks queued to them at most (each a view of the caller's buffer)


class ObjectDir:
    def __init__(self, root: str, fs: durable.FileSystem):
        self.root = root
        self.dir = os.path.join(root, DIRNAME)
        self.fs = fs
        # Chunks known durable under their name: address -> (inode, ctime). Such a
        # chunk, found again as the same file, needs no fsync of its directory (Batch).
        self._durable: dict[bytes, tuple] = {}
        # The collector's generation when _durable was last known complete and true
        # (see the module docstring); None: unknown, look at every chunk.
        self._generation: bytes | None = None
        self._trusted = False      # _durable holds without a stat, for the batch in progress
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor | None:
        """The threads that write chunks, made on first use; None where the file system
        takes one call at a time."""
        if not self.fs.concurrent:
            return None
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="agck-chunks")
            return self._pool

    def path(self, address: bytes) -> str:
        h = address.hex()
        return os.path.join(self.dir, h[:2], h[2:])

    # -- locking ---------------------------------------------------------------
    @contextmanager
    def locked(self, exclusive: bool = False):
        self._ensure_dir(self.dir, self.root)
        try:
            fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise DurabilityError(f"cannot open the chunk lock: {e.strerror}", ref=self.dir) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            gen = self._read_generation()
            if gen is None or gen != self._generation:
                self._durable.clear()
                self._generation = gen
            self._trusted = gen is not None and not exclusive
            try:
                yield
            finally:
                self._trusted = False
        finally:
            os.close(fd)   # releases the lock

    def _generation_path(self) -> str:
        return os.path.join(self.dir, "generation")

    def _read_generation(self) -> bytes | None:
        try:
            with open(self._generation_path(), "rb") as f:
                value = f.read(64)
        except FileNotFoundError:
            return b"0"
        except OSError:
            return None
        return value or None

    def new_generation(self) -> None:
        """Called by the collector (holding the exclusive lock) before it deletes a
        chunk: every writer's knowledge of which chunks exist is void."""
        self._durable.clear()
        self._generation = None
        path = self._generation_path()
        try:
            with open(path + ".tmp", "wb") as f:
                f.write(os.urandom(16).hex().encode())
            os.replace(path + ".tmp", path)
        except OSError as e:
            raise DurabilityError(f"cannot record a garbage collection, so none is done: {e.strerror}",
                                  ref=path) from None

    # -- writing ---------------------------------------------------------------
    def batch(self) -> "Batch":
        """The chunks of one checkpoint: check, add, then :meth:`Batch.sync`."""
        return Batch(self)

    def _known_durable(self, address: bytes, inode: tuple) -> bool:
        return self._durable.get(address) == inode

    def _mark_durable(self, found: dict[bytes, tuple]) -> None:
        if len(self._durable) + len(found) > _MAX_KNOWN:
            self._durable.clear()          # a bound on memory; costs a directory fsync or two later
        self._durable.update(found)

    def _add(self, address: bytes, chunk: memoryview) -> tuple[str, tuple]:
        path = self.path(address)
        d = os.path.dirname(path)
        self._ensure_dir(d, self.dir)
        tmp = durable.temp_name_for(path)
        fd = None
        try:
            fd = self.fs.open_new(tmp)
            durable.write_all(self.fs, fd, chunk)
            failpoints.hit("file.chunk_before_fsync")
            self.fs.fsync(fd)
            self.fs.close(fd)
            fd = None
            self.fs.rename(tmp, path)
            tmp = None
            return d, _identity(path)
        except OSError as e:
            what = "disk full" if e.errno == errno.ENOSPC else e.strerror or str(e)
            raise DurabilityError(f"writing a chunk failed: {what}", ref=path) from e
        finally:
            if fd is not None:
                try:
                    self.fs.close(fd)
                except OSError:
                    pass
            if tmp is not None:
                try:
                    self.fs.unlink(tmp)
                except OSError:
                    pass

    def _ensure_dir(self, d: str, parent: str) -> None:
        durable.make_dir(self.fs, d, parent, "chunk directory")

    # -- reading ---------------------------------------------------------------
    def get(self, address: bytes, size: int):
        """The chunk's bytes, or None if there is no such chunk."""
        try:
            with open(self.path(address), "rb") as f:
                return f.read(size + 1)   # one byte more: a longer file is caught by the caller
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read a chunk: {e.strerror}", ref=self.path(address)) from None

    def read_into(self, address: bytes, view: memoryview) -> int | None:
        """Read the chunk into ``view`` (one copy, from the page cache); returns the
        chunk file's size (the caller checks it is ``len(view)``), or None if there
        is no such chunk. Releases the GIL while reading."""
        path = self.path(address)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read a chunk: {e.strerror}", ref=path) from None
        try:
            size = os.fstat(fd).st_size
            if size != view.nbytes:
                return size
            got = 0
            while got < size:
                k = os.preadv(fd, [view[got:]], got)
                if k == 0:      # shrank since fstat
                    return got
                got += k
            return got
        except OSError as e:
            raise StoreError(f"cannot read a chunk: {e.strerror}", ref=path) from None
        finally:
            os.close(fd)

    # -- collecting ------------------------------------------------------------
    def entries(self) -> Iterable[tuple[str, str]]:
        """(path, name) of every file under the object directory but the lock."""
        try:
            subdirs = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return
        for sub in subdirs:
            d = os.path.join(self.dir, sub)
            if not os.path.isdir(d):
                continue
            for name in sorted(os.listdir(d)):
                yield os.path.join(d, name), sub + name

    def collect(self, live: set[bytes]) -> tuple[int, int]:
        """Delete every chunk not in ``live``, and leftover temp files. The caller
        holds the exclusive lock and computed ``live`` under it. Returns (files, bytes)."""
        files = nbytes = 0
        touched = set()
        self.new_generation()
        for path, name in self.entries():
            base = os.path.basename(path)
            if not durable.is_temp_name(base):
                try:
                    if bytes.fromhex(name) in live:
                        continue
                except ValueError:
                    continue   # not a chunk name: not ours to delete
            try:
                size = os.path.getsize(path)
                self.fs.unlink(path)
                if not durable.is_temp_name(base):
                    self._durable.pop(bytes.fromhex(name), None)
            except FileNotFoundError:
                continue
            files += 1
            nbytes += size
            touched.add(os.path.dirname(path))
        for d in touched:
            self.fs.fsync_dir(d)
        return files, nbytes


def _identity(path: str) -> tuple:
    """Which file a name holds: a file deleted and made again differs in ctime even
    if its inode number is reused."""
    st = os.stat(path)
    return st.st_ino, st.st_ctime_ns


class Batch:
    """One writer's chunks. A chunk found already present counts as well as one
    written: another writer may have renamed it in and not yet fsync'd its
    directory, so :meth:`sync` fsyncs the directory of every chunk the listing
    will rely on, unless this process already made that very file (same inode)
    durable under its name."""

    def __init__(self, objects: ObjectDir):
        self.objects = objects
        self.dirs: set[str] = set()
        self.found: dict[bytes, tuple] = {}
        self._pool = objects.pool()
        self._writing: list = []       # (address, future) of chunks being written

    def has(self, address: bytes) -> bool:
        if self.objects._trusted and address in self.objects._durable:
            return True       # made durable by this process, and no collection since
        path = self.objects.path(address)
        try:
            inode = _identity(path)
        except FileNotFoundError:
            return False
        if not self.objects._known_durable(address, inode):
            self.dirs.add(os.path.dirname(path))
            self.found[address] = inode
        return True

    def add(self, address: bytes, chunk: memoryview) -> None:
        """Write one chunk file (data fsync'd, then renamed into place), now or on a
        writer thread; ``chunk`` must stay unchanged until :meth:`sync` returns."""
        if self._pool is None:
            self._added(address, self.objects._add(address, chunk))
            return
        if len(self._writing) >= _IN_FLIGHT:
            self._wait(len(self._writing) // 2)
        try:
            fut = self._pool.submit(self.objects._add, address, chunk)
        except RuntimeError:     # the interpreter is shutting down (a last snapshot at exit): no new threads
            self._pool = None
            self._added(address, self.objects._add(address, chunk))
            return
        self._writing.append((address, fut))

    def _added(self, address: bytes, written: tuple[str, tuple]) -> None:
        d, inode = written
        self.dirs.add(d)
        self.found[address] = inode

    def _wait(self, n: int | None = None) -> None:
        """Wait for the first ``n`` chunks being written (all by default); the first
        failure is raised once every one of them has ended."""
        done, self._writing = (self._writing, []) if n is None else (self._writing[:n], self._writing[n:])
        error = None
        for address, fut in done:
            try:
                self._added(address, fut.result())
            except BaseException as e:
                error = error or e
        if error is not None:
            self._wait()          # none may still be writing once the put has failed
            raise error

    def sync(self) -> None:
        """Make every chunk checked or added durable under its name."""
        self._wait()
        failpoints.hit("file.chunks_before_dir_fsync")
        dirs = sorted(self.dirs)
        try:
            errors = list(map(self._fsync_dir, dirs) if self._pool is None else self._pool.map(self._fsync_dir, dirs))
        except RuntimeError:     # shutting down, as in add
            errors = list(map(self._fsync_dir, dirs))
        for d, err in zip(dirs, errors):
            if err is not None:
                raise DurabilityError(f"fsync of a chunk directory failed: {err.strerror}", ref=d) from None
        self.objects._mark_durable(self.found)

    def _fsync_dir(self, d: str) -> OSError | None:
        try:
            self.objects.fs.fsync_dir(d)
        except OSError as e:
            return e
        return None
