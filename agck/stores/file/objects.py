"""A file store's chunks: one immutable file per chunk, named by its address.

    <root>/.objects/<first 2 hex digits>/<remaining 62 hex digits>
    <root>/.objects/lock
    <root>/.objects/quarantine/<64 hex digits>.<time ns>.<why>   chunks found damaged

Writing a chunk: temp file in its directory, write, fsync, rename, and once per
batch fsync of every directory that gained a name (:meth:`Batch.sync`). A
batch's chunks are written by a few threads while the next ones are cut (each
chunk's own order stays write, fsync, rename; the directories are fsync'd after
every rename): file creation and fsync wait on the disk, not on the CPU.
Chunks are never rewritten: the same name always holds the same bytes, except
that a chunk found damaged (its bytes no longer match its name) is moved to
``quarantine/`` (:meth:`ObjectDir.quarantine`) or replaced by a put holding its
content (:meth:`Batch.has`), which heals every checkpoint that lists it.

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
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterable

import numpy as np

from ... import chunking, cipher, durable, failpoints, thresholds
from ...errors import (CorruptCheckpointError, DamagedChunkError, DurabilityError, StoreError,
                       UnsupportedVersionError)
from .. import compression, damage

DIRNAME = ".objects"
QUARANTINE = "quarantine"
_MAX_KNOWN = 1 << 22
_PAGE = 4096             # not a threshold: the alignment O_DIRECT writes want
_BUFFER_MIN = 1 << 20    # not a threshold: the least a thread's sealing buffer holds (one chunk)
# each thread's buffer for sealed chunks, kept: a chunk sealed or opened touches no fresh pages
_sealed_reads = threading.local()    # read_into: the sealed file's bytes, opened from here into place
_sealed_writes = threading.local()   # _add: sealed here (page-aligned: an O_DIRECT write takes it as it is)


def _thread_buffer(local: threading.local, n: int, aligned: bool = False) -> memoryview:
    """``n`` bytes of this thread's buffer in ``local`` (grown to the largest asked for)."""
    buf = getattr(local, "buf", None)
    if buf is None or buf.nbytes < n:
        size = max(n, _BUFFER_MIN)
        if aligned:
            raw = np.empty(size + _PAGE, np.uint8)
            start = -raw.ctypes.data % _PAGE
            buf = memoryview(raw[start:start + size])
        else:
            buf = memoryview(bytearray(size))
        local.buf = buf
    return buf[:n]
WRITERS = 4            # threads writing one batch's chunks
# Chunk files this big may bypass the page cache as large files do (durable.DIRECT_IO;
# timed apart from them, as "chunk"): on this VM a buffered 1 MiB chunk file cost
# 3-4 ms of system CPU (fresh page-cache pages) against 0.5 ms written direct.
DIRECT_CHUNK_MIN = thresholds.DIRECT_CHUNK_FILE
_IN_FLIGHT = 64        # chunks queued to them at most (each a view of the caller's buffer)


class ObjectDir:
    DIRNAME = DIRNAME
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
        # an encrypted store's data key (agck.cipher): chunks sealed, each under its keyed name
        self.sealer: cipher.DataKey | None = None

    def pool(self) -> ThreadPoolExecutor | None:
        """The threads that write chunks, made on first use; None where the file system
        takes one call at a time."""
        if not self.fs.concurrent:
            return None
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="agck-chunks")
            return self._pool

    def stored_name(self, address: bytes) -> bytes:
        """What the chunk at ``address`` is stored under: its address, or in an encrypted
        store its keyed name (FORMAT.md 18.3), so no file name tells what content is there."""
        return address if self.sealer is None else self.sealer.name(address)

    def path(self, address: bytes) -> str:
        """The file of the chunk at ``address``."""
        return self._path_of(self.stored_name(address))

    def _path_of(self, name: bytes) -> str:
        h = name.hex()
        return os.path.join(self.dir, h[:2], h[2:])

    def _open(self, data, path: str, address: bytes | None = None, out=None):
        """A stored chunk's bytes as the store wrote them before sealing (FORMAT.md 18.5).
        With ``address``, one that does not open is DamagedChunkError; without, it comes
        back sealed, for a verdict to judge (it matches no address)."""
        if self.sealer is None or data is None:
            return data
        name = bytes.fromhex(os.path.basename(os.path.dirname(path)) + os.path.basename(path))
        try:
            return self.sealer.open(cipher.Kind.CHUNK, cipher.chunk_context(name), data, what="a chunk", out=out)
        except (UnsupportedVersionError, CorruptCheckpointError) as e:
            # a chunk's unknown sealed version is damage, as an unknown frame's is (FORMAT.md 18.5)
            if address is None:
                return data
            raise DamagedChunkError(f"chunk {address.hex()[:16]} {e.reason}", ref=path, damaged=(address,)) from None

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
    def batch(self, verify_reused: str = "none", turn: int = 0,
              encoding: "compression.ChunkEncoding | None" = None) -> "Batch":
        """The chunks of one checkpoint: check, add, then :meth:`Batch.sync`.
        ``verify_reused`` and ``turn``: what is checked of a chunk found present
        (:func:`agck.stores.damage.reread`); ``encoding``: how chunks are stored."""
        return Batch(self, verify_reused, turn, encoding)

    def _known_durable(self, address: bytes, inode: tuple) -> bool:
        return self._durable.get(address) == inode

    def _mark_durable(self, found: dict[bytes, tuple]) -> None:
        if len(self._durable) + len(found) > _MAX_KNOWN:
            self._durable.clear()          # a bound on memory; costs a directory fsync or two later
        self._durable.update(found)

    def _add(self, address: bytes, chunk: memoryview, background: bool = False,
             encoding: "compression.ChunkEncoding | None" = None, itemsize: int | None = None) -> tuple[str, tuple]:
        if encoding is not None:     # compressed (and verified) here, on the writing thread
            chunk = encoding.encode(address, chunk, itemsize).stored
        path = self.path(address)
        if self.sealer is not None:  # then sealed, under its name (FORMAT.md 18.2-18.4)
            name = self.sealer.name(address)
            chunk = self.sealer.seal(cipher.Kind.CHUNK, cipher.chunk_context(name), chunk,
                                     into=_thread_buffer(_sealed_writes, memoryview(chunk).nbytes + cipher.OVERHEAD,
                                                         aligned=True))
        d = os.path.dirname(path)
        self._ensure_dir(d, self.dir)
        tmp = durable.temp_name_for(path)
        fd = None
        try:
            fd = self.fs.open_new(tmp)
            n = memoryview(chunk).nbytes
            direct, timed = durable.direct_write_plan(d, n, minimum=DIRECT_CHUNK_MIN, kind="chunk",
                                                      background=background)
            t0 = time.perf_counter()
            durable.write_parts(self.fs, fd, [chunk], direct=direct)
            failpoints.hit("file.chunk_before_fsync")
            self.fs.fsync(fd)
            durable.report_direct_write(self.fs, timed, direct, n, time.perf_counter() - t0)
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
        path = self.path(address)
        extra = 0 if self.sealer is None else cipher.OVERHEAD
        try:
            with open(path, "rb") as f:
                data = f.read(size + extra + 1)   # one byte more: a longer file is caught by the caller
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read a chunk: {e.strerror}", ref=path) from None
        return self._open(data, path, address)

    def read_into(self, address: bytes, view: memoryview) -> int | None:
        """Read the chunk into ``view`` (one copy, from the page cache); returns the
        chunk file's size (the caller checks it is ``len(view)``), or None if there
        is no such chunk. Releases the GIL while reading."""
        path = self.path(address)
        if self.sealer is not None:     # opened straight into its place (a compressed one: then decoded there)
            want = view.nbytes + cipher.OVERHEAD + 1
            mv = _thread_buffer(_sealed_reads, want)
            try:
                with open(path, "rb", buffering=0) as f:
                    k = 0
                    while k < want and (got := f.readinto(mv[k:])):
                        k += got
            except FileNotFoundError:
                return None
            except OSError as e:
                raise StoreError(f"cannot read a chunk: {e.strerror}", ref=path) from None
            data = mv[:k]
            n = k - cipher.OVERHEAD
            if n <= 0 or n > view.nbytes:    # damage (refused by the tag) or a longer chunk: its length judged
                return len(self._open(data, path, address))
            self._open(data, path, address, out=view[:n])
            return n
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read a chunk: {e.strerror}", ref=path) from None
        try:
            size = os.fstat(fd).st_size
            if size > view.nbytes:
                return size
            # a shorter file is a compressed chunk (FORMAT.md 12.9) or a damaged one: read into
            # the start of view, for the caller to decode and judge
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

    def read_whole(self, address: bytes, size: int | None = None):
        """The chunk file's bytes (opened, in an encrypted store, if they open); None if
        there is none. Never more than a chunk of ``size`` (else of the largest a store
        cuts) can be stored as, plus one byte: a file that long is damaged by its length,
        and a 2 GiB file planted where a 1 MiB chunk belongs is not read whole."""
        return self._read_path(self.path(address), size)

    def _read_path(self, path: str, size: int | None = None):
        limit = _stored_limit(size) + (0 if self.sealer is None else cipher.OVERHEAD)
        try:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
        except (FileNotFoundError, IsADirectoryError):     # a directory where the file should be: no chunk
            return None
        except OSError as e:
            raise StoreError(f"cannot read a chunk: {e.strerror}", ref=path) from None
        return self._open(data, path)

    # -- damaged chunks --------------------------------------------------------
    def quarantine_dir(self) -> str:
        return os.path.join(self.dir, QUARANTINE)

    def _quarantine_path(self, address: bytes, why: str) -> str:
        code = "missing" if why == "missing" else "size" if why.startswith("holds") else "hash"
        return os.path.join(self.quarantine_dir(), f"{self.stored_name(address).hex()}.{time.time_ns()}.{code}")

    def set_aside(self, address: bytes, why: str, *, keep_name: bool) -> str | None:
        """Keep the damaged bytes under ``address``'s name in ``quarantine/``: moved
        there (the name is then free), or with ``keep_name`` linked there (a put is
        about to rename a good copy over the name). Returns the quarantine path,
        None when the chunk was gone (moved) or could not be linked (kept: the put
        replaces it all the same)."""
        src = self.path(address)
        self._ensure_dir(self.quarantine_dir(), self.dir)
        dst = self._quarantine_path(address, why)
        try:
            (os.link if keep_name else self.fs.rename)(src, dst)
        except FileNotFoundError:
            return None
        except OSError as e:
            if keep_name:
                return None
            raise DurabilityError(f"cannot quarantine a damaged chunk: {e.strerror}", ref=src) from None
        return dst

    def quarantine(self, addresses: Iterable[bytes]) -> dict[bytes, str]:
        """Under the exclusive lock (no writer is between finding a chunk and committing a
        listing of it): re-read each chunk; move one whose bytes do not match its address
        to ``quarantine/``, and void every writer's knowledge of what exists, as a
        collection does, so the next put holding its content writes it afresh."""
        out: dict[bytes, str] = {}
        with self.locked(exclusive=True):
            bad = []
            for a in dict.fromkeys(addresses):
                data = self.read_whole(a)
                why = damage.verdict(a, data)
                out[a] = "intact" if why is None else "missing" if data is None else "quarantined"
                if why is not None:
                    bad.append((a, why))
            if not bad:
                return out
            self.new_generation()
            touched = set()
            for a, why in bad:
                if out[a] == "quarantined" and self.set_aside(a, why, keep_name=False) is None:
                    out[a] = "missing"     # gone meanwhile (another process quarantined it)
                touched.add(os.path.dirname(self.path(a)))
            for d in sorted(touched) + [self.quarantine_dir()]:
                try:
                    self.fs.fsync_dir(d)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise DurabilityError(f"fsync after quarantining a chunk failed: {e.strerror}", ref=d) from None
        return out

    def quarantined(self) -> list[damage.QuarantinedChunk]:
        try:
            names = os.listdir(self.quarantine_dir())
        except FileNotFoundError:
            return []
        out = []
        reasons = {"hash": "does not match its address", "size": "wrong size", "missing": "missing"}
        for name in names:
            parts = name.split(".")
            if len(parts) != 3 or len(parts[0]) != 2 * 32 or not parts[1].isdigit():
                continue
            path = os.path.join(self.quarantine_dir(), name)
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            out.append(damage.QuarantinedChunk(address=parts[0], size=size, detected_at=int(parts[1]) / 1e9,
                                                reason=reasons.get(parts[2], parts[2]), ref=path))
        return sorted(out, key=lambda q: (q.detected_at, q.address))

    def stored(self) -> Iterable[tuple[bytes, None, str, object]]:
        """(address, None, path, read) of every chunk file, for a scrub."""
        for path, name in self.entries():
            if durable.is_temp_name(os.path.basename(path)):
                continue
            try:
                address = bytes.fromhex(name)
            except ValueError:
                continue
            if len(address) != 32:
                continue
            # in an encrypted store, "address" is the chunk's name (damage.scrub maps them)
            yield address, None, path, (lambda p=path: self._read_path(p))

    # -- collecting ------------------------------------------------------------
    def entries(self) -> Iterable[tuple[str, str]]:
        """(path, name) of every file under the object directory but the lock and the
        quarantine."""
        try:
            subdirs = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return
        for sub in subdirs:
            d = os.path.join(self.dir, sub)
            if sub == QUARANTINE or not os.path.isdir(d):
                continue
            for name in sorted(os.listdir(d)):
                yield os.path.join(d, name), sub + name

    def collect(self, live: set[bytes]) -> tuple[int, int]:
        """Delete every chunk not in ``live``, and leftover temp files. The caller
        holds the exclusive lock and computed ``live`` under it. Returns (files, bytes).
        A file system that refuses (EACCES, EROFS, EIO) is a DurabilityError naming the
        path: what was deleted before it was no checkpoint's."""
        try:
            return self._collect(live)
        except OSError as e:
            raise DurabilityError(f"collecting garbage failed: {e.strerror or e}", ref=e.filename or self.dir,
                                  hint="fix the store directory's access (or the disk) and collect again; "
                                       "no chunk a checkpoint lists was deleted") from None

    def _collect(self, live: set[bytes]) -> tuple[int, int]:
        files = nbytes = 0
        touched = set()
        self.new_generation()
        names = live if self.sealer is None else {self.sealer.name(a) for a in live}   # what the files are named
        for path, name in self.entries():
            base = os.path.basename(path)
            if not durable.is_temp_name(base):
                try:
                    if bytes.fromhex(name) in names:
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
        for q in self.quarantined():    # kept until healed or listed by no checkpoint
            stored_as = bytes.fromhex(q.address)      # its stored name (an address unless encrypted)
            if stored_as not in names or os.path.exists(self._path_of(stored_as)):
                try:
                    self.fs.unlink(q.ref)
                except FileNotFoundError:
                    continue
                files += 1
                nbytes += q.size
                touched.add(self.quarantine_dir())
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

    def __init__(self, objects: ObjectDir, verify_reused: str = "none", turn: int = 0,
                 encoding: "compression.ChunkEncoding | None" = None):
        self.objects = objects
        self.encoding = encoding if encoding is not None and encoding.on else None
        self.verify_reused, self.turn = verify_reused, turn
        self.healed: list[bytes] = []      # reused chunks found damaged, written afresh by this batch
        self.dirs: set[str] = set()
        self.found: dict[bytes, tuple] = {}
        self._pool = objects.pool()
        self._writing: list = []       # (address, future) of chunks being written
        # a put on a snapshot writer thread: its chunks, written by the pool, are background writes too
        self.background = durable.in_background()

    def has(self, address: bytes, size: int | None = None) -> bool:
        """Whether the store holds the chunk, as far as ``verify_reused`` checks: a
        chunk found damaged (wrong size, or bytes re-read that do not match) is linked
        into the quarantine and reported absent, so the caller adds a good copy,
        renamed over it."""
        mode = self.verify_reused
        reread = damage.reread(address, mode, self.turn)
        if self.objects._trusted and address in self.objects._durable and not reread \
                and not damage.checks_size(mode):
            return True       # made durable by this process, and no collection since
        path = self.objects.path(address)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        inode = (st.st_ino, st.st_ctime_ns)
        why = None
        held = st.st_size - (0 if self.objects.sealer is None else cipher.OVERHEAD)   # the bytes sealed
        if size is not None and damage.checks_size(mode) and held > size:
            why = f"holds {held} bytes, {size} expected"
        elif reread or (size is not None and damage.checks_size(mode) and held < size):
            # a shorter file is compressed or cut short: what it decodes to decides
            why = damage.verdict(address, self.objects.read_whole(address, size), size)
            if why == "missing":
                return False
        if why is not None:
            self.objects.set_aside(address, why, keep_name=True)
            self.healed.append(address)
            return False
        if not self.objects._known_durable(address, inode):
            self.dirs.add(os.path.dirname(path))
            self.found[address] = inode
        return True

    def add(self, address: bytes, chunk: memoryview, itemsize: int | None = None) -> None:
        """Write one chunk file (compressed as the store says, data fsync'd, then renamed
        into place), now or on a writer thread; ``chunk`` must stay unchanged until
        :meth:`sync` returns. ``itemsize``: its float element size, if one."""
        args = (address, chunk, self.background, self.encoding, itemsize)
        if self._pool is None:
            self._added(address, self.objects._add(*args))
            return
        if len(self._writing) >= _IN_FLIGHT:
            self._wait(len(self._writing) // 2)
        try:
            fut = self._pool.submit(self.objects._add, *args)
        except RuntimeError:     # the interpreter is shutting down (a last snapshot at exit): no new threads
            self._pool = None
            self._added(address, self.objects._add(*args))
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


def _stored_limit(size: int | None) -> int:
    """The most bytes a chunk of ``size`` raw bytes (None: of the largest any store cuts,
    chunking.MAX_CHUNK) is stored as: raw, or a frame only where shorter (rule 12.9)."""
    return chunking.MAX_CHUNK if size is None else size

