"""The embedded default store: a directory of AGCK files::

    <root>/<run>/<step:012d>.agck     one container per checkpoint
    <root>/.objects/                  chunks shared by the checkpoints (objects.py)
    <root>/<run>/.epoch, .lock        the run's newest epoch, and the lock its commits take (fencing)
    <root>/.parts/                    a file store of its own: the parts of multi-rank
                                      checkpoints (FORMAT.md section 13)

By default (``incremental=True``) a checkpoint's file is a chunked container
(FORMAT.md, version 1.1) listing the chunks of its content, and only chunks
the store does not hold yet are written (:mod:`agck.stores.content`): a
checkpoint costs what changed since the earlier ones. A container under
``min_chunked`` bytes (64 KiB) is written standalone all the same. With
``incremental=False`` each file is a standalone 1.0 container, read
(mmap'd and zero-copy when ``verify=False``: a read that verifies reads the
bytes, so that a disk's I/O error is an error, not a SIGBUS). Either way a file is written by :mod:`agck.durable` (temp
file, fsync, rename, fsync of the directory), after every chunk it lists is
durable; a new run directory is made durable by fsync'ing the root after
mkdir. Temp files left by a crash are listed by :meth:`orphans`; chunks no
checkpoint lists any more are deleted by :meth:`collect_garbage`.
Other files (another spelling of a step's name, notes, other tools' files) are ignored.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
import re
import shlex
from contextlib import contextmanager
from typing import Any, Callable, Collection, Sequence

from ... import checkpoint, cipher, durable, format
from ...args import check_addresses
from ...checkpoint import Checkpoint
from ...errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                      DamagedChunkError, DurabilityError, FormatError, StoreConnectionError, StoreError)
from ...names import MAX_STEP, is_run_name
from .. import compression, content, damage, encryption
from ..base import (CheckpointInfo, Store, check_identity,
                   check_last, check_position, check_records, check_run, check_step)
from .log import CLAIMS_NAME, LOG_NAME, FileLogs
from ..logclaims import FileClaims
from .keys import KeySlots
from .objects import ObjectDir

SUFFIX = ".agck"
_STEP_DIGITS = 12
_RUN_DIR_TRIES = 3      # a put's attempts when deletes keep removing its (emptied) run directory
_STEP_NAME_RE = re.compile(r"[0-9]{12,19}\.agck", re.ASCII)


def step_filename(step: int) -> str:
    return f"{step:0{_STEP_DIGITS}d}{SUFFIX}"


def parse_step_filename(name: str) -> int | None:
    """The step a file holds, for the canonical name only (``step_filename``): another
    spelling of a step (``1.agck``, other digits) would list one checkpoint twice."""
    if not _STEP_NAME_RE.fullmatch(name):
        return None
    step = int(name[: -len(SUFFIX)])
    return step if step <= MAX_STEP and step_filename(step) == name else None


class FileStore(Store):
    """Checkpoints as AGCK files under ``root`` (the layout is in this module's docstring);
    safe to share between threads and processes on one machine.

    ``create=False`` opens only an existing store. ``fs`` is the file system the writes go
    through (:class:`agck.durable.FileSystem`; the crash tests give a simulated one).
    ``incremental``, ``full_every``, ``min_chunked`` and ``verify_reused`` choose how
    checkpoints share chunks, as on every store (README, "Incremental checkpoints");
    ``compress`` and ``level`` how their chunks are stored (:mod:`agck.stores.compression`)."""

    log_positions_are_bytes = True     # one append-only file per run, which can end in a torn tail

    def __init__(self, root: str | os.PathLike, *, create: bool = True, fs: durable.FileSystem | None = None,
                 incremental: bool = True, full_every: int | None = None, min_chunked: int | None = None,
                 verify_reused: str = damage.DEFAULT_VERIFY_REUSED, compress: str = compression.DEFAULT,
                 level: int | None = None, key=None):
        super().__init__()
        self._set_policy(incremental, full_every, min_chunked, verify_reused)
        self._set_compression(compress, level, local=True, what="directory")
        given = encryption.given_key(key)     # a bad key argument is refused before anything is made
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.fs = fs or durable.REAL
        self.objects = ObjectDir(self.root, self.fs)
        self._logs = FileLogs(self.fs)
        self._logs_durable: set[str] = set()
        self._log_paths: dict[str, str] = {}
        if not os.path.isdir(self.root):
            if not create:
                raise StoreConnectionError("no such store directory", ref=self.root,
                                           hint="check the path; agck.open_store(path) creates a store there")
            try:
                # the store's own directory through self.fs, so that a simulated file system
                # (the crash harness) sees it made and made durable (a parts namespace is one)
                os.makedirs(os.path.dirname(self.root), exist_ok=True)
                try:
                    self.fs.mkdir(self.root)
                except FileExistsError:     # another process (a rank) made it first, or a file is there
                    pass
                self.fs.fsync_dir(os.path.dirname(self.root))
            except OSError as e:
                raise StoreConnectionError(f"cannot create the store directory: {e.strerror}", ref=self.root) from None
            if not os.path.isdir(self.root):
                raise StoreConnectionError("not a checkpoint directory: a file is in the way", ref=self.root,
                                           hint="pass a directory path")
        self._set_encryption(KeySlots(self.root, self.fs), given, where=self.root)
        self.objects.sealer = self.sealer

    # -- journal logs (agck.journal; stores/file/log.py) ---------------------------
    def log_ref(self, run: str) -> str:
        path = self._log_paths.get(run)
        if path is None:
            path = self._log_paths[run] = os.path.join(self._run_dir(run), LOG_NAME)
        return path

    def log_append(self, run: str, records: Sequence[bytes], *, sync: bool = True) -> tuple[int, int]:
        """Append journal records to the run's log (see :meth:`Store.log_append`)."""
        records = check_records(records)
        self._refuse_sealed_log(self.log_ref(run), records)
        path = self.log_ref(run)
        if path in self._logs_durable:     # its directory made, its entry durable: append
            return self._logs.append(path, records, sync)
        d = os.path.dirname(path)
        durable.make_dir(self.fs, d, self.root, "run directory")
        where = self._logs.append(path, records, sync)
        if sync:     # the log's own entry in the run directory, once
            try:
                self.fs.fsync_dir(d)
            except OSError as e:
                raise DurabilityError(f"fsync of the run directory failed: {e.strerror}", ref=d) from None
            self._logs_durable.add(path)
        return where

    def log_runs(self) -> list[str]:
        return [r for r in self.runs() if os.path.isfile(os.path.join(self.root, r, LOG_NAME))]

    def log_claims(self, run: str) -> FileClaims:
        d = self._run_dir(run)
        durable.make_dir(self.fs, d, self.root, "run directory")
        return FileClaims(os.path.join(d, CLAIMS_NAME), run)

    def log_read(self, run: str, start: int = 0) -> tuple[bytes, int]:
        """The run's log from ``start`` and where it was read to (see :meth:`Store.log_read`)."""
        start = check_position(start)
        data = self._logs.read(self.log_ref(run), start)
        return data, start + len(data)

    def close(self) -> None:
        super().close()
        self._logs.close()

    def _open_parts(self, create: bool) -> "FileStore | None":
        path = os.path.join(self.root, ".parts")   # not a run name: never listed as a run
        if not create and not os.path.isdir(path):
            return None
        return FileStore(path, fs=self.fs, key=self.sealer and encryption.Inherited(self.sealer), **self._policy())

    def location(self) -> tuple:
        return ("file", os.path.realpath(self.root))

    def _overwrite_epoch(self, run: str, epoch: int) -> None:
        """Set the run's epoch file to ``epoch`` whatever it holds: only for a tier's local
        copy of an epoch begun in its durable tier (the durable tier fences)."""
        path = os.path.join(self._run_dir(run), ".epoch")

        def write() -> None:
            with self._run_locked(run, exclusive=True):
                durable.write_atomic(path, [b"%d\n" % epoch], fs=self.fs)
        self._in_run_dir(path, write)

    def _stored_head(self, run: str, step: int) -> bytes | None:
        try:
            with open(self.path(run, step), "rb") as f:
                return f.read(8)
        except OSError:
            return None

    def _run_dir(self, run: str) -> str:
        return os.path.join(self.root, check_run(run))

    def path(self, run: str, step: int) -> str:
        """The file that holds (or would hold) ``run``'s checkpoint at ``step``."""
        return os.path.join(self._run_dir(run), step_filename(check_step(step)))

    def ref(self, run: str, step: int) -> str:
        return self.path(run, step)

    # -- writing ---------------------------------------------------------------
    def put(self, run: str, step: int, state: Any, *, meta: Any = None, parent: int | None = None,
            overwrite: bool = True, expect_unchanged: Collection[int] = (), epoch: int | None = None) -> str:
        step, parent, path, w, cache = self._prepare_put(run, step, state, meta=meta, parent=parent,
                                                         expect_unchanged=expect_unchanged)
        if cache is None:
            self._write_step(run, step, epoch, path, lambda: checkpoint.stream(w), overwrite, w.total_len)
            self.last_put = None
            return path
        if not overwrite and os.path.exists(path):   # before writing chunks; link(2) below still decides
            raise CheckpointExistsError.refused(path, step)
        with self.objects.locked():   # no chunk we rely on can be collected until the listing is durable
            batch = self.objects.batch(self.verify_reused, self._reread_turn(), self.compression)
            chunks = content.store_chunks(w, batch.has, batch.add, cache, expect_unchanged=expect_unchanged,
                                          ref=path)
            batch.sync()
            listing = content.listing(w, chunks, run=run, step=step, parent=parent, meta=meta,
                                      framed=self.compression.on)
            if self.sealer is not None:    # sealed to its run and step (FORMAT.md 18.4)
                listing = self.sealer.seal(cipher.Kind.CONTAINER, cipher.container_context(run, step), listing)
            self._write_step(run, step, epoch, path, lambda: [listing], overwrite, len(listing))
        self._caches.give(run, cache)
        self.last_put = chunks
        return path

    def _write_step(self, run: str, step: int, epoch: int | None, path: str, parts: Callable[[], Any],
                    overwrite: bool, size: int) -> None:
        """Write ``parts()`` as the step's file, fenced, with its run directory in place."""
        def write():
            with self._fenced(run, epoch, path):
                try:
                    durable.write_atomic(path, parts(), overwrite=overwrite, size=size, fs=self.fs)
                except CheckpointExistsError:
                    raise CheckpointExistsError.refused(path, step) from None
        self._in_run_dir(path, write)

    # -- fencing: <run>/.epoch, under a flock on <run>/.lock --------------------
    def begin_epoch(self, run: str) -> int:
        path = os.path.join(self._run_dir(run), ".epoch")

        def write() -> int:
            with self._run_locked(run, exclusive=True):
                epoch = (self._read_epoch(run) or 0) + 1
                durable.write_atomic(path, [b"%d\n" % epoch], fs=self.fs)
            return epoch
        return self._in_run_dir(path, write)

    def epoch(self, run: str) -> int | None:
        return self._read_epoch(check_run(run))

    def _read_epoch(self, run: str) -> int | None:
        path = os.path.join(self._run_dir(run), ".epoch")
        try:
            with open(path, "rb") as f:
                text = f.read(64)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read the run's epoch: {e.strerror}", ref=path) from None
        if not re.fullmatch(rb"[1-9][0-9]{0,18}\n", text):
            raise StoreError(f"the run's epoch file holds {text[:20]!r}, not a number", ref=path,
                             hint="another tool wrote it; begin a new epoch (Snapshotter does) to replace it")
        return int(text)

    @contextmanager
    def _run_locked(self, run: str, exclusive: bool):
        d = self._run_dir(run)
        try:
            fd = os.open(os.path.join(d, ".lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise DurabilityError(f"cannot open the run's lock: {e.strerror}", ref=d) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)   # releases the lock

    @contextmanager
    def _fenced(self, run: str, epoch: int | None, path: str):
        """Commit (the rename of ``path`` into place) only while ``epoch`` is the run's
        newest: the check and the rename happen under the run's lock, which
        :meth:`begin_epoch` takes exclusively. (flock: on a local file system.)"""
        if epoch is None:
            yield
            return
        with self._run_locked(run, exclusive=False):
            current = self._read_epoch(run)
            if current != epoch:
                raise self._stale(run, epoch, current, path)
            yield

    def _ensure_run_dir(self, d: str) -> None:
        durable.make_dir(self.fs, d, self.root, "run directory")

    def _in_run_dir(self, path: str, write: Callable[[], Any]) -> Any:
        """``write()`` (which makes a file in ``path``'s run directory), with the directory
        in place: a delete of the run's last checkpoint (another thread's, another
        process's) removes the directory, and may do so between this one making sure
        it is there and writing into it."""
        d = os.path.dirname(path)
        for attempt in range(_RUN_DIR_TRIES):
            self._ensure_run_dir(d)
            try:
                return write()
            except DurabilityError as e:
                gone = isinstance(e.__cause__, FileNotFoundError) and not os.path.isdir(d)
                if not gone or attempt == _RUN_DIR_TRIES - 1:
                    raise

    def _drop_run_dir_if_empty(self, d: str) -> None:
        """Remove a run directory its last checkpoint has left, so that runs() (and a
        LangGraph thread's per-checkpoint runs) do not accumulate empty ones. A file
        there (a fenced run's lock, a put's temp file) keeps it. Not made durable:
        one a crash brings back is empty, and lists no steps."""
        try:
            self.fs.rmdir(d)
        except OSError:
            pass

    def delete(self, run: str, step: int, *, epoch: int | None = None) -> None:
        step = check_step(step)
        path = self.path(run, step)
        with self._fenced(run, epoch, path):
            try:
                self.fs.unlink(path)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=path) from None
            except OSError as e:
                raise DurabilityError(f"cannot delete the checkpoint: {e.strerror}", ref=path,
                                      hint="check the directory's permissions and the storage") from None
            try:
                self.fs.fsync_dir(os.path.dirname(path))
            except FileNotFoundError:
                pass     # another delete removed the emptied run directory: the entry went with it
            except OSError as e:
                raise DurabilityError(f"deleted, but fsync of its directory failed: {e.strerror}", ref=path,
                                      hint="the deletion may not survive a crash; check the storage") from None
        self._drop_run_dir_if_empty(os.path.dirname(path))

    # -- reading ---------------------------------------------------------------
    def runs(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except OSError as e:
            raise StoreConnectionError(f"cannot list the store: {e.strerror}", ref=self.root) from None
        return sorted(n for n in names if is_run_name(n) and os.path.isdir(os.path.join(self.root, n)))

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        last = check_last(last)
        try:
            names = os.listdir(self._run_dir(run))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StoreConnectionError(f"cannot list run {run!r}: {e.strerror}", ref=self._run_dir(run)) from None
        steps = sorted(s for s in map(parse_step_filename, names) if s is not None)
        return steps if last is None else steps[-last:]

    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        out = []
        for r in ([check_run(run)] if run is not None else self.runs()):
            for s in self.steps(r):
                path = self.path(r, s)
                info = CheckpointInfo(run=r, step=s, ref=path)
                try:
                    info.size = os.path.getsize(path)
                    if self.sealer is None:
                        h, m = checkpoint.read_head(path)
                    else:
                        h, m = checkpoint.parse_head(self._opened_listing(r, s, checkpoint.read_file(path), path), ref=path)
                    if format.is_chunked(h) and type(m.get("length")) is int:
                        info.size = m["length"]   # the checkpoint's size, not its listing's
                    info.created_at = h.created_at_ns / 1e9
                    info.parent = m.get("parent")
                    info.meta = m.get("meta")
                except (AgckError, OSError):
                    pass  # listed without details; verify/recover say what is wrong
                out.append(info)
        return out

    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        step = check_step(step)
        path = self.path(run, step)
        for attempt in range(2):
            try:
                before = os.stat(path)
            except FileNotFoundError:
                if attempt:
                    break
                raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=path, hint=f"`agck ls "
                                              f"{shlex.quote(self.root)} --run {run}` lists the steps") from None
            # a read that judges the bytes (verify) reads them: a disk's I/O error is then an
            # error the walk back can judge, where a mapped page would kill the process (SIGBUS)
            buf = checkpoint.read_file(path, mmap=verify is False and self.sealer is None)
            try:
                buf = self._opened_listing(run, step, buf, path)
                ck = content.decode(buf, self.objects.get, verify=verify, map_location=map_location, ref=path,
                                    fetch_into=self.objects.read_into, authenticated=self.sealer is not None)
            except CorruptCheckpointError as e:
                # A listing deleted (a prune) or replaced while read, and its chunks collected
                # meanwhile, is gone or changed, not damaged: read again what is there now
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    break
                if (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino) or attempt:
                    if isinstance(e, DamagedChunkError):
                        self._damage_found(e)
                    raise
                continue
            check_identity(ck, run, step, path)
            return ck
        raise CheckpointNotFoundError(f"no checkpoint at step {step} (deleted while it was read)", ref=path)

    # -- shared content --------------------------------------------------------
    def collect_garbage(self) -> content.Collected:
        """Delete the chunks no checkpoint lists (and writers' leftovers). Holds the
        chunk lock exclusively, so it waits for writers in progress and they wait for
        it. Every chunk a listing names is kept, whatever the listing's verdict; a
        checkpoint nothing can be read from (an I/O error, bytes that do not parse),
        or one of a newer format, stops the collection before anything is deleted
        (:func:`content.live_chunks`). A store that never held a chunk has nothing to
        collect and is left as it is."""
        if not os.path.isdir(self.objects.dir):
            return content.Collected(listings=0, live_chunks=0, deleted_chunks=0, deleted_bytes=0)
        with self.objects.locked(exclusive=True):
            keys = [(r, s) for r in self.runs() for s in self.steps(r)]
            live = content.live_chunks([(self.path(r, s), partial(self._stored_listing, r, s)) for r, s in keys])
            if not live.complete:
                return live.collected()
            files, nbytes = self.objects.collect(live.addresses)
        return live.collected(files, nbytes)

    # -- damaged chunks --------------------------------------------------------
    def quarantine(self, addresses) -> dict[bytes, str]:
        addresses = check_addresses(addresses)
        if not os.path.isdir(self.objects.dir):
            return {bytes(a): "missing" for a in addresses}
        return self.objects.quarantine(bytes(a) for a in addresses)

    def quarantined(self) -> list[damage.QuarantinedChunk]:
        return self.objects.quarantined()

    def _scrub(self, progress) -> damage.ScrubReport:
        """Under the writers' shared lock: no collection removes a chunk meanwhile, so
        a chunk a listing lists and the scrub does not find is missing."""
        if not os.path.isdir(self.objects.dir):
            return damage.ScrubReport(url=self.url)

        def listed(run, step):
            buf = self._stored_listing(run, step)
            return None if buf is None else content.listed_addresses(buf, verify=True, ref=self.path(run, step))

        with self.objects.locked():
            listings = [(self.path(r, s), partial(listed, r, s)) for r in self.runs() for s in self.steps(r)]
            return damage.scrub(self.url, listings, self.objects.stored(), progress,
                                name=None if self.sealer is None else self.sealer.name)

    # -- encryption (agck.cipher) ----------------------------------------------
    def _stored_listing(self, run: str, step: int):
        """What a collector or scrub reads of a checkpoint file (:func:`_read_listing`), opened."""
        path = self.path(run, step)
        if self.sealer is None:
            return _read_listing(path)
        try:
            buf = checkpoint.read_file(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"cannot read a checkpoint, so no chunk is collected: {e.strerror}", ref=path) from None
        return self._opened_listing(run, step, buf, path)

    # -- housekeeping ----------------------------------------------------------
    def orphans(self, run: str | None = None) -> list[str]:
        dirs = [self.root] + [self._run_dir(r) for r in ([run] if run is not None else self.runs())]
        out = []
        for d in dirs:
            try:
                names = os.listdir(d)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as e:
                raise StoreConnectionError(f"cannot list a run directory: {e.strerror}", ref=d,
                                           hint="fix the directory's access (or the disk)") from None
            # a temp file whose writer still runs is a put in flight, not a leftover
            out += [os.path.join(d, n) for n in sorted(names)
                    if durable.is_temp_name(n) and not durable.temp_writer_alive(n)]
        return out

    def clean_orphans(self, run: str | None = None) -> list[str]:
        removed = []
        try:
            for p in self.orphans(run):
                try:
                    self.fs.unlink(p)
                    removed.append(p)
                except FileNotFoundError:
                    pass
            for d in {os.path.dirname(p) for p in removed}:
                self.fs.fsync_dir(d)
        except OSError as e:       # EACCES, EROFS, EIO: said with the path, and what was removed before it
            done = f" ({len(removed)} removed before it)" if removed else ""
            raise DurabilityError(f"cannot remove a leftover of an interrupted write: {e.strerror or e}{done}",
                                  ref=e.filename or self.root,
                                  hint="fix the file's access (or the disk) and clean again; a leftover is "
                                       "never a checkpoint, so it may also be removed by hand") from None
        return removed


def locate(path: str) -> tuple[str, str, int] | None:
    """(store root, run, step) when the file at ``path`` is a chunked checkpoint of a
    file store (its content is then read through that store: ``FileStore(root).read(run,
    step)``); None for anything else (a standalone container, another file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(format.HEADER_SIZE)
        h = None if head[:4] == cipher.MAGIC else format.parse_header(head, ref=path)   # sealed: a store's
    except (OSError, AgckError):
        return None
    run_dir = os.path.dirname(os.path.abspath(path))
    root, step = os.path.dirname(run_dir), parse_step_filename(os.path.basename(path))
    if (h is not None and not format.is_chunked(h)) or step is None or not os.path.isdir(os.path.join(root, ObjectDir.DIRNAME)):
        return None
    return root, os.path.basename(run_dir), step




def _read_listing(path: str):
    """The stored bytes of a checkpoint file that may be a chunk listing, for the
    collector (:func:`content.live_chunks`): the whole file when its header says it
    is one, or when its header is damaged (the header and the metadata it claims, as
    far as the file goes); None for a standalone container or a file deleted
    meanwhile. StoreError if it cannot be read here."""
    try:
        with open(path, "rb") as f:
            head = f.read(format.HEADER_SIZE)
            try:
                h = format.parse_header(head, ref=path)
            except (CorruptCheckpointError, FormatError):
                return head + f.read(min(format.claimed_meta_len(head), format.MAX_META_LEN))
            if not format.is_chunked(h):
                return None
            return head + f.read(h.total_len - len(head) + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(f"cannot read a checkpoint, so no chunk is collected: {e.strerror}", ref=path,
                         hint="fix the file's access and collect again") from None
