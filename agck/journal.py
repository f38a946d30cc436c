"""A step journal: what a pipeline step produced is recorded once and read back after
a crash, instead of running the step again.

::

    j = agck.Journal("ckpts/", "embed-corpus")
    for doc in docs:
        vec = j.step("embed", embed, doc)            # runs embed(doc) once; after a crash, reads it back

The key of a step is the run, its name and a fingerprint of its inputs
(:func:`agck.journalrec.fingerprint`: plain data by value, arrays and tensors by
content), so a call with other inputs runs again. A result is anything agck's codec
stores (plain data, tuples, sets, numpy arrays, torch tensors, nested); anything
else is refused by name at the call (:class:`agck.EncodeError`), never pickled.

A journal reads its run's log when it opens. ``shared=True`` is for runs several
processes write at once (a pool of workers over one corpus): before running a step
it looks for a result another process recorded since (one read of the log's new
records per step). Two processes that start the same step at the same moment may
both run it; each journal then returns the result it recorded or found first.

A generator function is a streamed step (:meth:`Journal.stream`): each item is
recorded as it comes and replayed in order.

Durability (``commit``):

- ``"sync"`` (the default): a result is durable before ``step`` returns (one flush
  per step: one ``fdatasync`` of the run's log on the file store);
- ``"group"``: results are batched and made durable every ``every`` results or
  ``ms`` milliseconds, whichever comes first, and by :meth:`Journal.flush` and
  :meth:`Journal.close`. ``step`` returns before its result is durable: after a
  crash the steps whose results were not yet flushed run again.
  :attr:`Journal.last_durable` says how many of this journal's results are on disk.

Every record is checksummed. A damaged one is never returned: it is reported
(:attr:`Journal.damaged`, and a warning) and its step runs again.

Where the records go: a file store keeps one append-only log per run
(:mod:`agck.stores.filelog`: one ``write`` and one ``fdatasync`` per batch); SQLite
and Postgres a table of records per run (``{prefix}_log``: one transaction per
batch). Object stores keep no journal yet.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import journalrec
from .errors import AgckError, EncodeError, UsageError
from .names import check_run
from .stores import Store, open_store

log = logging.getLogger("agck.journal")

COMMITS = ("sync", "group")


class Journal:
    """The step journal of ``run`` on ``store`` (a Store or a store URL; see the module's docstring)."""

    def __init__(self, store: Store | str, run: str, *, commit: str = "sync", every: int = 256, ms: float = 50.0,
                 shared: bool = False, **open_options):
        if commit not in COMMITS:
            raise UsageError(f"commit must be one of {COMMITS}, not {commit!r}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise UsageError(f"every must be a positive integer, not {every!r}")
        if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not ms > 0:
            raise UsageError(f"ms must be a positive number of milliseconds, not {ms!r}")
        self.run = check_run(run)
        if isinstance(store, Store):
            self.store, self._own = store, False
        else:
            self.store, self._own = open_store(store, **open_options), True
        self.commit, self.every, self.ms = commit, every, float(ms)
        self.shared = bool(shared)
        self.ref = self.store.log_ref(self.run)
        self.damaged: list[str] = []      # what was found damaged and run again, for humans
        self._results: dict[tuple[str, bytes], journalrec.Entry] = {}
        self._items: dict[tuple[str, bytes], dict[int, journalrec.Entry]] = {}
        self._ends: dict[tuple[str, bytes], int] = {}
        self._pos = 0
        self._lock = threading.RLock()
        self._pending: list[bytes] = []
        self._pending_since = 0.0
        self._recorded = 0       # results and items this journal recorded
        self._durable = 0        # of which are on disk
        self._error: BaseException | None = None
        self._closed = False
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        self._catch_up()

    # -- the index of what the log holds ------------------------------------------------
    def _catch_up(self) -> None:
        """Read what was appended to the log since this journal last looked."""
        data, end = self.store.log_read(self.run, self._pos)
        found = journalrec.scan(data)
        for off, why in found.damaged:
            self._report(f"{self.ref}, byte {off} of the records after position {self._pos}: {why}")
        for _, e in found.entries:
            key = (e.name, e.key)
            if e.kind == "r":
                self._results.setdefault(key, e)      # the first recorded result is the result
            elif e.kind == "i":
                self._items.setdefault(key, {}).setdefault(e.index, e)
            else:
                self._ends.setdefault(key, e.index)
        self._pos += found.end      # a torn tail is read again next time (its writer may still be at it)

    def _report(self, what: str) -> None:
        self.damaged.append(what)
        log.warning("journal %s: damaged, its step runs again: %s", self.run, what)

    def _value(self, e: journalrec.Entry) -> tuple[bool, Any]:
        try:
            return True, journalrec.decode_value(e, ref=self.ref)
        except Exception as err:      # a value the codec refuses to rebuild: damaged
            if isinstance(err, AgckError) and not err.verdict:
                raise
            why = err
        self._report(f"step {e.name!r}: its recorded value does not decode ({why})")
        return False, None

    # -- steps ---------------------------------------------------------------------------
    def step(self, name: str, fn: Callable, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, run once per (name, inputs): a result recorded before
        (by this process or another, before a crash or not) is returned instead."""
        self._check(name)
        if inspect.isgeneratorfunction(fn):
            raise UsageError(f"step {name!r}: {fn.__qualname__} is a generator function",
                             hint="journal.stream(name, fn, ...) records its items")
        key = (name, journalrec.fingerprint(args, kwargs))
        with self._lock:
            got = self._recorded_result(key)
            if got is not _MISSING:
                return got
        result = fn(*args, **kwargs)
        enc, payload = self._encode(result, name)
        with self._lock:
            if key in self._results:      # another thread of this journal recorded it meanwhile
                ok, value = self._value(self._results[key])
                if ok:
                    return value
            e = journalrec.Entry("r", name, key[1], 0, enc, payload)
            self._append(journalrec.record(*_fields(e)))
            self._results[key] = e
        return result

    def _recorded_result(self, key) -> Any:
        for look in (False, self.shared):     # shared: what other processes recorded since, too
            if look:
                self._catch_up()
            e = self._results.get(key)
            if e is not None:
                ok, value = self._value(e)
                if ok:
                    return value
                del self._results[key]     # damaged: run the step again
                return _MISSING
        return _MISSING

    def stream(self, name: str, fn: Callable[..., Iterator], *args, **kwargs) -> Iterator:
        """The items of ``fn(*args, **kwargs)`` (a generator), each recorded as it comes.
        A stream recorded to its end is replayed without running ``fn``. One a crash cut
        short is replayed as far as it was recorded; then ``fn`` runs again from its
        start and its first items, as many as were replayed, are dropped (so the caller
        sees each index once: ``fn`` should yield the same items again)."""
        self._check(name)
        key = (name, journalrec.fingerprint(args, kwargs))
        with self._lock:
            if self.shared:
                self._catch_up()
            items = dict(self._items.get(key, {}))
            end = self._ends.get(key)
        n = 0
        while n in items and (end is None or n < end):
            ok, value = self._value(items[n])
            if not ok:
                break
            yield value
            n += 1
        if end is not None and n == end:
            return
        for i, value in enumerate(fn(*args, **kwargs)):
            if i < n:
                continue
            e = journalrec.Entry("i", name, key[1], i, *self._encode(value, f"{name}[{i}]"))
            with self._lock:
                self._append(journalrec.record(*_fields(e)))
                self._items.setdefault(key, {}).setdefault(i, e)
            yield value
            n = i + 1
        with self._lock:
            self._append(journalrec.record("e", name, key[1], n, "t", b"\xc0"))
            self._ends.setdefault(key, n)

    def __call__(self, fn: Callable | None = None, *, name: str | None = None):
        """A decorator: ``@journal`` or ``@journal(name="embed")`` makes every call of the
        function a step (a generator function: a streamed step), named by ``name`` or
        the function's qualified name."""
        def wrap(f: Callable) -> Callable:
            step_name = name or f"{f.__module__}.{f.__qualname__}"
            if inspect.isgeneratorfunction(f):
                @functools.wraps(f)
                def streamed(*args, **kwargs):
                    return self.stream(step_name, f, *args, **kwargs)
                return streamed

            @functools.wraps(f)
            def journaled(*args, **kwargs):
                return self.step(step_name, f, *args, **kwargs)
            return journaled
        return wrap(fn) if fn is not None else wrap

    # -- durability ------------------------------------------------------------------------
    @property
    def recorded(self) -> int:
        """How many results and stream items this journal has recorded."""
        return self._recorded

    @property
    def last_durable(self) -> int:
        """How many of them are on disk: never more than are (``"sync"``: all)."""
        return self._durable

    def _append(self, rec: bytes) -> None:
        self._raise_error()
        self._recorded += 1
        if self.commit == "sync":
            self._appended(self.store.log_append(self.run, [rec], sync=True))
            self._durable = self._recorded
            return
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(rec)
        if len(self._pending) >= self.every:
            self._flush_locked()
        elif self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_on_time, name=f"agck-journal-{self.run}",
                                             daemon=True)
            self._flusher.start()

    def _appended(self, where: tuple[int, int] | None) -> None:
        """Records of this journal, already in its index, went to ``where``: when they
        follow what it has read, it reads on after them instead of reading them back
        (where the store does not say, they are read back by the next look)."""
        if where is not None and where[0] == self._pos:
            self._pos = where[1]

    def flush(self) -> int:
        """Make every result recorded so far durable; returns :attr:`last_durable`."""
        with self._lock:
            self._raise_error()
            self._flush_locked()
            return self._durable

    def _flush_locked(self) -> None:
        if not self._pending:
            return
        batch, count = self._pending, self._recorded
        self._pending = []
        try:
            self._appended(self.store.log_append(self.run, batch, sync=True))
        except BaseException:
            self._pending = batch + self._pending     # not acknowledged: kept, tried again by the next flush
            raise
        self._durable = count

    def _flush_on_time(self) -> None:
        while not self._closed:
            self._wake.wait(self.ms / 1000)
            with self._lock:
                if self._closed:
                    return
                if self._pending and time.monotonic() - self._pending_since >= self.ms / 1000:
                    try:
                        self._flush_locked()
                    except BaseException as e:   # raised by the next call on the journal
                        self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        """Flush what is pending, stop the flusher, close the store if this journal opened it."""
        try:
            with self._lock:
                if not self._closed:
                    self._flush_locked()
        finally:
            self._closed = True
            self._wake.set()
            if self._flusher is not None and self._flusher is not threading.current_thread():
                self._flusher.join()
            if self._own:
                self.store.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------
    def _check(self, name: Any) -> None:
        if not isinstance(name, str) or not name:
            raise UsageError(f"a step's name must be a non-empty str, not {name!r}")
        if self._closed:
            raise UsageError("the journal is closed", ref=self.ref)

    def _encode(self, value: Any, what: str) -> tuple[str, bytes]:
        try:
            return journalrec.encode_value(value, "result")
        except EncodeError as e:
            raise EncodeError(f"step {what!r}: {e.reason}", ref=self.ref,
                              hint="return plain data, arrays or tensors (nothing is pickled)") from None

    def __repr__(self) -> str:
        return f"<Journal {self.run} on {self.store.url} ({self.commit})>"


_MISSING = object()


def _fields(e: journalrec.Entry) -> tuple:
    return e.kind, e.name, e.key, e.index, e.enc, e.payload


def inspect_journal(store: Store, run: str) -> dict:
    """What the run's journal holds, every record verified, for ``agck journal``:
    its results and streams (complete or cut short), the records found damaged (and
    where), whether it ends in a torn tail, and its size."""
    data, _ = store.log_read(check_run(run))
    found = journalrec.scan(data)
    results, items, ends = set(), {}, {}
    undecodable = []
    for off, e in found.entries:
        key = (e.name, e.key)
        if e.kind == "r":
            results.add(key)
        elif e.kind == "i":
            items.setdefault(key, set()).add(e.index)
        else:
            ends.setdefault(key, e.index)
        if e.kind != "e":
            try:
                journalrec.decode_value(e, ref=store.log_ref(run))
            except Exception as err:     # its check held but its value does not rebuild: damaged
                if isinstance(err, AgckError) and not err.verdict:
                    raise
                undecodable.append({"at": off, "reason": f"step {e.name!r}: its value does not decode ({err})"})
    names: dict[str, int] = {}
    for name, _ in results:
        names[name] = names.get(name, 0) + 1
    damaged = [{"at": off, "reason": why} for off, why in found.damaged] + undecodable
    return {"run": run, "ref": store.log_ref(run), "bytes": len(data), "records": len(found.entries),
            "results": len(results), "steps": dict(sorted(names.items())),
            "streams": len(set(items) | set(ends)), "streams_complete": len(ends),
            "damaged": sorted(damaged, key=lambda d: d["at"]), "torn_tail": found.torn}
