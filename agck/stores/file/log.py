"""The file store's journal logs: one append-only file per run, ``<root>/<run>/journal.agjl``.

Records (:mod:`agck.journalrec`: each framed and checksummed by itself) are appended
in batches, each behind a batch header that carries its checked length: one ``write``
of the batch and one ``fdatasync`` when the caller asks for durability, so a journal
pays one flush per batch, not per record, and the file grows by what the records hold
(no page per record: the page-size floor of one file per entry is what this avoids).

Appends take an exclusive ``flock`` on the file (kept open between appends), so the
processes of one machine that share a run append whole batches one after another. A crash during an append leaves
a torn tail: bytes after the last whole record, never acknowledged (the flush had not
returned): a batch shorter than its header says, or zeros. The next append, under
the lock, finds it (scanning from where this process last saw the log end) and
truncates it before writing, so a torn tail never ends up between records. Bytes
that fail their checks and are not certainly torn (a whole batch whose records fail)
may have been acknowledged: they are never cut off, and every reader reports them
as damaged (FORMAT.md 17). Readers take no lock: a batch being written is, to them,
a torn tail they stop before.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Sequence

from ... import durable, failpoints, journalrec
from ...errors import DurabilityError, StoreConnectionError

LOG_NAME = "journal.agjl"
CLAIMS_NAME = "journal.claims"     # the lock file of shared journals (agck.stores.logclaims)


class FileLogs:
    """The logs of one file store (see the module's docstring)."""

    def __init__(self, fs: durable.FileSystem):
        self.fs = fs
        self._ends: dict[str, int] = {}     # path -> where this process last saw the valid log end
        self._fds: dict[str, int] = {}      # path -> the log, open for appending (kept between appends)
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _fd(self, path: str) -> int:
        if self._pid != os.getpid():     # after fork(): the parent's descriptors and what it saw are its own
            self._fds, self._ends, self._pid = {}, {}, os.getpid()
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = self.fs.open_append(path)
            except OSError as e:
                raise DurabilityError(f"cannot open the journal: {e.strerror}", ref=path) from None
        return fd

    def close(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                for fd in self._fds.values():
                    self.fs.close(fd)
            self._fds = {}

    def append(self, path: str, records: Sequence[bytes], sync: bool) -> tuple[int, int]:
        """Append ``records`` (whole, in order) to the log at ``path``; with ``sync`` they
        are on disk when it returns. Returns where they start and end in the log."""
        data = journalrec.batch(b"".join(records))
        with self._lock:
            fd = self._fd(path)
            return self._append_locked(fd, path, data, sync)

    def _append_locked(self, fd: int, path: str, data: bytes, sync: bool) -> tuple[int, int]:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            known = self._ends.get(path, 0)
            if known != size:
                end = self._valid_end(path, min(known, size))
                if end < size:      # a torn tail: a batch cut short, never acknowledged
                    self.fs.truncate(fd, end)
                    self.fs.fsync(fd)
                size = end
            failpoints.hit("journal.file.before_write")
            view = memoryview(data)
            while view.nbytes:
                n = self.fs.write(fd, view)
                view = view[n:]
            if sync:
                failpoints.hit("journal.file.before_sync")
                self.fs.datasync(fd)
                failpoints.hit("journal.file.after_sync")
            self._ends[path] = size + len(data)
            return size, size + len(data)
        except OSError as e:
            self._ends.pop(path, None)     # the file may hold part of the batch: look again next time
            self._fds.pop(path, None)
            self.fs.close(fd)              # and after a failed fsync, never trust this descriptor again
            raise DurabilityError(f"journal append failed: {e.strerror}", ref=path,
                                  hint="the records of this batch are not acknowledged; write them again") from None
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:     # closed above
                pass

    def _valid_end(self, path: str, start: int) -> int:
        """Where the whole records end, from ``start`` (a record boundary this process saw)."""
        data = self.read(path, start)
        return start + journalrec.scan(data).end

    def read(self, path: str, start: int = 0) -> bytes:
        """The log's bytes from ``start`` (b"" when there is no log)."""
        try:
            if os.stat(path).st_size <= start:    # nothing new: no open, no read
                return b""
            with open(path, "rb") as f:
                f.seek(start)
                return f.read()
        except FileNotFoundError:
            return b""
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                return b""
            raise StoreConnectionError(f"cannot read the journal: {e.strerror}", ref=path) from None
