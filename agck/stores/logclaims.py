"""Claims on journal steps: the lock a process holds on a step's key while it runs the
step, so that the processes sharing a run (``Journal(..., shared=True)``) run each
step once between them. A claim is released once the step's result is durable; a
process that waits for it then reads the result instead of running the step.

A claim dies with its holder: a process killed while it runs a step leaves nothing
that blocks the others; the next to claim the key runs the step again (its result
was never acknowledged).

- :class:`FileClaims` (file store, SQLite): a byte-range lock (``fcntl`` ``F_SETLK``)
  on one byte of a lock file, the byte chosen by the key's hash; the kernel drops a
  process's locks when it exits. Such locks belong to the process, not to a
  descriptor or a thread, and closing any descriptor of the file drops them all: so
  a process opens each lock file once (:func:`_lock_file`) and keeps, beside the
  kernel's locks, its own table of which keys its threads hold.
- Postgres: session advisory locks (:mod:`agck.stores.postgres.log`); the server drops them
  when the holder's connection ends.

Two keys whose hashes agree share a lock: one then waits for the other for no
reason, nothing worse.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from abc import ABC, abstractmethod

import xxhash

from ..errors import StoreConnectionError

# offsets below 2**62: positive in any off_t, and a collision between two live keys
# of one run is as likely as in a 62-bit hash
_OFFSET_BITS = 62


def claim_number(scope: str, key: bytes) -> int:
    """The 62-bit number that stands for ``key`` of ``scope`` (a run) in a lock table."""
    return xxhash.xxh3_64_intdigest(scope.encode() + b"\0" + key) >> (64 - _OFFSET_BITS)


class LogClaims(ABC):
    """The claims one journal holds on its run's steps (see the module's docstring)."""

    @abstractmethod
    def claim(self, key: bytes, *, wait: bool) -> bool:
        """Take the claim on ``key``; with ``wait``, block until its holder releases it.
        Returns whether it is held (always, with ``wait``)."""

    @abstractmethod
    def release(self, keys) -> None:
        """Release the claims on ``keys`` (each held by this object)."""

    def close(self) -> None:
        """Release every claim still held."""


class _LockFile:
    """One process's descriptor of a lock file, and which of its bytes its threads hold."""

    def __init__(self, path: str):
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreConnectionError(f"cannot open the journal's claims: {e.strerror}", ref=path) from None
        self.path = path
        self.users = 0
        self.held: set[int] = set()
        self.cond = threading.Condition()

    def lock(self, offset: int, wait: bool) -> bool:
        with self.cond:
            while offset in self.held:          # a thread of this process holds it: the kernel would not say
                if not wait:
                    return False
                self.cond.wait()
            self.held.add(offset)
        try:
            while True:
                try:
                    fcntl.lockf(self.fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB), 1, offset)
                    return True
                except OSError as e:
                    if e.errno in (errno.EAGAIN, errno.EACCES) and not wait:
                        self._forget(offset)
                        return False
                    if e.errno != errno.EDEADLK:
                        raise
                    # the kernel sees a cycle between processes, counting every thread of each as
                    # one: the other holder releases once its results are durable, so wait and retry
                    time.sleep(0.005)
        except OSError as e:
            self._forget(offset)
            raise StoreConnectionError(f"cannot claim a journal step: {e.strerror}", ref=self.path) from None
        except BaseException:
            self._forget(offset)
            raise

    def unlock(self, offset: int) -> None:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, offset)
        finally:
            self._forget(offset)

    def _forget(self, offset: int) -> None:
        with self.cond:
            self.held.discard(offset)
            self.cond.notify_all()


_files: dict[str, _LockFile] = {}
_files_lock = threading.Lock()
_files_pid = os.getpid()


def _lock_file(path: str, delta: int) -> _LockFile:
    """The process's one descriptor of ``path``, counted by its users (``delta`` +1 to
    take it, -1 to give it back: closed with its last user)."""
    global _files, _files_pid
    with _files_lock:
        if _files_pid != os.getpid():     # after fork(): the kernel's locks stayed with the parent
            _files, _files_pid = {}, os.getpid()
        f = _files.get(path)
        if f is None:
            if delta < 0:
                raise KeyError(path)
            f = _files[path] = _LockFile(path)
        f.users += delta
        if f.users <= 0:
            del _files[path]
            os.close(f.fd)
        return f


class FileClaims(LogClaims):
    """Claims on the steps of ``scope`` (a run) as byte-range locks on ``path``."""

    def __init__(self, path: str, scope: str):
        self.scope = scope
        self._path = os.path.abspath(path)
        self._file = _lock_file(self._path, +1)
        self._pid = os.getpid()
        self._mine: set[int] = set()
        self._closed = False

    def claim(self, key: bytes, *, wait: bool) -> bool:
        offset = claim_number(self.scope, key)
        got = self._file.lock(offset, wait)
        if got:
            self._mine.add(offset)
        return got

    def release(self, keys) -> None:
        for key in keys:
            offset = claim_number(self.scope, key)
            if offset in self._mine:
                self._mine.discard(offset)
                self._file.unlock(offset)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pid != os.getpid():
            return
        for offset in list(self._mine):
            self._file.unlock(offset)
        self._mine.clear()
        _lock_file(self._path, -1)
