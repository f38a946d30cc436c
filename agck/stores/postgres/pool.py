"""The connections of a Postgres store: a bounded pool shared by the threads of one process.

A :class:`~agck.stores.postgres.store.PostgresStore` used by many threads at once (an
agent server's conversations, a data loader's workers) gives each operation a
connection of its own, so their round trips and commits overlap instead of
queueing behind one connection. At most ``size`` connections are open; they are
opened when first needed (a store used by one thread holds one), kept open
between operations, and dropped when found broken, so the next operation opens a
fresh one. A thread that needs one while all ``size`` are busy waits up to
``timeout`` seconds, then gets :class:`~agck.errors.StoreConnectionError`.

A thread that already holds a connection of the pool and asks again (a store
method calling another inside its transaction) gets the same one: the pool never
deadlocks on itself, and nested calls see the transaction they run in.

After ``fork()`` the child opens connections of its own: the parent's stay open
and unused in the child (closing one there would end the parent's session on the
shared socket).

psycopg2 (2.9) prints a stray "SystemError ... returned a result with an exception
set" when a server dies mid-COPY: it raises the server's FATAL error, then decodes
the lost connection's message with that exception still set, and PyErr_Print()s
the failure. The error the COPY raises is right; :func:`quiet_stray_copy_errors`
keeps that print, and only it, off the user's terminal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ...errors import StoreConnectionError, StoreError, UsageError

DEFAULT_POOL_SIZE = 4
DEFAULT_POOL_TIMEOUT = 30.0
MAX_POOL_SIZE = 1024


_STRAY = "returned a result with an exception set"
_quiet_lock = threading.Lock()


def is_stray_copy_error(value: BaseException | None) -> bool:
    """psycopg2's doubled error report (see the module's docstring): a SystemError
    caused by a psycopg2 error, about a result returned with an exception set."""
    cause = getattr(value, "__cause__", None)
    return (isinstance(value, SystemError) and _STRAY in str(value) and cause is not None
            and type(cause).__module__.split(".")[0] == "psycopg2")


def quiet_stray_copy_errors() -> None:
    """Route ``sys.excepthook`` (what PyErr_Print calls) past psycopg2's doubled error
    report; every other exception reaches the hook that was there. Idempotent."""
    with _quiet_lock:
        current = sys.excepthook
        if getattr(current, "agck_quiet", False):
            return

        def hook(kind, value, tb, _next=current):
            if not is_stray_copy_error(value):
                _next(kind, value, tb)

        hook.agck_quiet = True
        sys.excepthook = hook


def check_pool_size(value: Any) -> int:
    """A pool size from a keyword or a URL (``agck_pool=N``): an integer 1..1024."""
    try:
        n = int(value, 10) if isinstance(value, str) else value
    except ValueError:
        n = None
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_POOL_SIZE:
        raise UsageError(f"pool size must be an integer from 1 to {MAX_POOL_SIZE}, not {value!r}",
                         hint="e.g. agck_pool=16 in the URL, or PostgresStore(..., pool=16)")
    return n


class ConnectionPool:
    """At most ``size`` connections made by ``connect()``, each used by one thread at a time."""

    def __init__(self, connect: Callable[[], Any], size: int, *, timeout: float = DEFAULT_POOL_TIMEOUT,
                 where: str = "", on_broken: Callable[[], None] | None = None):
        self.size = check_pool_size(size)
        quiet_stray_copy_errors()
        self._connect = connect
        self._on_broken = on_broken     # told when a broken connection is dropped (the server may have changed)
        self._timeout = timeout
        self._where = where
        self._cond = threading.Condition()
        self._idle: list = []
        self._open = 0            # idle + lent + being opened
        self._held = threading.local()
        self._pid = os.getpid()
        self._inherited: list = []
        self._closed = False

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """A connection for this thread until the block ends (the one it already holds, if any)."""
        held = getattr(self._held, "conn", None)
        if held is not None and self._pid == os.getpid():
            yield held
            return
        conn = self._take()
        self._held.conn = conn
        try:
            yield conn
        finally:
            self._held.conn = None
            self._give(conn)

    def holding(self) -> bool:
        """Whether this thread already holds a connection (it is inside a transaction of its own)."""
        return getattr(self._held, "conn", None) is not None and self._pid == os.getpid()

    def _forked(self) -> None:
        """In a child after fork(): none of the parent's connections is this process's."""
        self._inherited += self._idle
        self._idle, self._open, self._pid = [], 0, os.getpid()
        self._held = threading.local()

    def _take(self):
        with self._cond:
            if self._pid != os.getpid():
                self._forked()
            deadline = time.monotonic() + self._timeout
            while True:
                if self._closed:
                    raise StoreError("the store is closed", ref=self._where, hint="open it again")
                while self._idle:
                    conn = self._idle.pop()
                    if not conn.closed:
                        return conn
                    self._open -= 1
                    self._broken()
                if self._open < self.size:
                    self._open += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreConnectionError(
                        f"all {self.size} connections of the store's pool stayed busy for {self._timeout:g} s",
                        ref=self._where, hint="give the store a larger pool (agck_pool=N in the URL, or pool=N)")
                self._cond.wait(left)
        try:
            return self._connect()
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def _give(self, conn) -> None:
        with self._cond:
            if self._pid != os.getpid():     # lent before a fork, returned in the child: the parent's
                return
            if conn.closed or self._closed:
                self._open -= 1
                if conn.closed:
                    self._broken()
                else:
                    conn.close()
            else:
                self._idle.append(conn)
            self._cond.notify()

    def _broken(self) -> None:
        if self._on_broken is not None and not self._closed:
            self._on_broken()

    def close(self) -> None:
        """Close the idle connections; those lent are closed when given back."""
        with self._cond:
            self._closed = True
            if self._pid != os.getpid():
                return
            for conn in self._idle:
                conn.close()
            self._open -= len(self._idle)
            self._idle = []
            self._cond.notify_all()

    def stats(self) -> dict:
        """How many connections are open, and how many of them idle."""
        with self._cond:
            return {"size": self.size, "open": self._open, "idle": len(self._idle)}
