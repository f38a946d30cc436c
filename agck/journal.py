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
processes write at once (a pool of workers over one corpus): a step is run once per
key between them. Before running a step, a shared journal claims its key
(:meth:`Store.log_claims`: a byte-range lock on the file store and SQLite, an
advisory lock on Postgres) and reads the log's new records; a process that finds the
key claimed waits for the holder's result to be durable and returns it. A claim dies
with its holder, so a killed worker's step is run by the next one that calls it
(its result was never acknowledged). The threads of one journal run a key once too.
On Postgres the claims live on a connection of their own: if it fails, the steps
running under them may run a second time elsewhere (both results are recorded;
every reader takes the first).

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
(:mod:`agck.stores.file.log`: one ``write`` and one ``fdatasync`` per batch); SQLite
and Postgres a table of records per run (``{prefix}_log``: one transaction per
batch); an object store an object per batch, created at the run's next number
(:mod:`agck.stores.s3.journal`: one PUT per batch; not ``shared``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import journalrec
from .errors import AgckError, EncodeError, UsageError
from .names import check_run
from .stores import Store, open_store

log = logging.getLogger("agck.journal")

COMMITS = ("sync", "group")
_MAX_MS = 86_400_000          # a day: the longest a group commit waits (a larger wait overflows the clock)
# FORMAT.md 17.9: a damaged batch header alone; its records verify and are read
FRAMING_FATE = "a batch header only: the records after it verify and are read, nothing is lost"
_OPEN: "weakref.WeakValueDictionary[str, Journal]" = weakref.WeakValueDictionary()   # unshared journals, by log
_OPEN_LOCK = threading.Lock()


def _unregister(j: "Journal") -> None:
    with _OPEN_LOCK:
        if _OPEN.get(j.ref) is j:
            del _OPEN[j.ref]


class Journal:
    """The step journal of ``run`` on ``store`` (a Store or a store URL; see the module's docstring)."""

    def __init__(self, store: Store | str, run: str, *, commit: str = "sync", every: int = 256, ms: float = 50.0,
                 shared: bool = False, **open_options):
        if commit not in COMMITS:
            raise UsageError(f"commit must be one of {COMMITS}, not {commit!r}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise UsageError(f"every must be a positive integer, not {every!r}")
        if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not 0 < ms <= _MAX_MS:
            raise UsageError(f"ms must be a number of milliseconds in (0, {_MAX_MS:,}] (a day), not {ms!r}")
        self.run = check_run(run)
        if isinstance(store, Store):
            self.store, self._own = store, False
        else:
            self.store, self._own = open_store(store, **open_options), True
        self.commit, self.every, self.ms = commit, every, float(ms)
        self.shared = bool(shared)
        self.ref = self.store.log_ref(self.run)
        # values are compressed where the store compresses its chunks (agck.stores.compression)
        self._compress_level = self.store.compression.active_level
        # an encrypted store's data key: values sealed, input fingerprints keyed (FORMAT.md 18.8)
        self._sealer = self.store.sealer
        self.damaged: list[str] = []      # what was found damaged and run again, for humans
        # the index: (name, key) -> the value's (enc, payload), plain tuples that the cyclic
        # collector stops tracking (an index of objects made every full collection walk them
        # all: the last tenth of 200,000 steps cost 1.4x the first)
        self._results: dict[tuple[str, bytes], tuple[str, bytes]] = {}
        self._items: dict[tuple[str, bytes], dict[int, tuple[str, bytes]]] = {}
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
        self._busy: dict[tuple[str, bytes], int] = {}   # keys a thread of this journal runs now -> that thread
        self._idle = threading.Condition(self._lock)    # notified when one ends
        self._held: list[bytes] = []      # claims of pending records, released by their flush
        self._claims = self.store.log_claims(self.run) if self.shared else None
        if not self.shared:
            self._register()
        self._catch_up()

    # -- the index of what the log holds ------------------------------------------------
    def _catch_up(self) -> None:
        """Read what was appended to the log since this journal last looked."""
        data, end = self.store.log_read(self.run, self._pos)
        found = journalrec.scan(data, tears=self.store.log_positions_are_bytes)
        for _, e in found.entries:
            key = (e.name, e.key)
            if e.kind == "r":
                self._results.setdefault(key, (e.enc, e.payload))      # the first recorded result is the result
            elif e.kind == "i":
                self._items.setdefault(key, {}).setdefault(e.index, (e.enc, e.payload))
            elif e.kind == "e":
                self._ends.setdefault(key, e.index)
            # "s": a segment of an AppendLog (agck.applog), not a step. The first of a key decides: rule 17.4
        for off, why in found.damaged:
            where = f"{self.ref}, byte {off} of the records after position {self._pos}: {why}"
            if journalrec.framing_only(found, off):
                self._report(where, FRAMING_FATE)
            elif not journalrec.healed(found, data, off):
                self._report(where)
        if found.end == len(data):
            self._pos = end
        elif self.store.log_positions_are_bytes:
            self._pos += found.end      # a torn tail is read again next time (its writer may still be at it)
        else:      # batches are whole once committed: a record cut short in one is damage
            self._report(f"{self.ref}: the records after position {self._pos} end in a record cut short")
            self._pos = end

    def _report(self, what: str, fate: str = "its step runs again") -> None:
        self.damaged.append(what)
        log.warning("journal %s: damaged, %s: %s", self.run, fate, what)

    def _value(self, name: str, stored: tuple[str, bytes], kind: str, key: tuple[str, bytes],
               index: int) -> tuple[bool, Any]:
        try:
            return True, journalrec.decode_value(journalrec.Entry(kind, key[0], key[1], index, *stored), ref=self.ref,
                                                 sealer=self._sealer)
        except Exception as err:      # a value the codec refuses to rebuild: damaged
            if isinstance(err, AgckError) and not err.verdict:
                raise
            why = err
        self._report(f"step {name!r}: its recorded value does not decode ({why})")
        return False, None

    # -- steps ---------------------------------------------------------------------------
    def step(self, name: str, fn: Callable, *args, **kwargs) -> Any:
        """``fn(*args, **kwargs)``, run once per (name, inputs): a result recorded before
        (by this process or another, before a crash or not) is returned instead.

        When ``fn`` raises, nothing is recorded and the exception reaches the caller as
        it is; the next call with the same inputs runs ``fn`` again (a failure is not a
        result). A result that cannot be stored (EncodeError) is not recorded either."""
        self._check(name)
        if inspect.isgeneratorfunction(fn):
            raise UsageError(f"step {name!r}: {fn.__qualname__} is a generator function",
                             hint="journal.stream(name, fn, ...) records its items")
        key = (name, self._fingerprint(args, kwargs))
        with self._lock:
            got = self._begin(key)
        if got is not _MISSING:
            return got
        claim = _Claim(None)
        try:
            if self._claims is not None:
                self._claim(key, claim)
                with self._lock:
                    got = self._lookup(key)       # recorded by another process before the claim was ours
                if got is not _MISSING:
                    return got
            result = fn(*args, **kwargs)
            enc, payload = self._encode(result, name)
            with self._lock:
                self._append(journalrec.record("r", name, key[1], 0, enc, payload, sealer=self._sealer), claim)
                self._results.setdefault(key, (enc, payload))
                self._end(key)
                key = None
            return result
        finally:
            if key is not None:
                self._unclaim(key, claim)

    def _lookup(self, key) -> Any:
        """The recorded result of ``key`` in this journal's index, or _MISSING (a damaged
        one is reported and forgotten: the step runs again)."""
        e = self._results.get(key)
        if e is None:
            return _MISSING
        ok, value = self._value(key[0], e, "r", key, 0)
        if ok:
            return value
        del self._results[key]
        return _MISSING

    # A key runs in one thread of a journal at a time (``_busy``), and in a shared journal
    # in one process at a time (its claim, Store.log_claims). The claim passes to the
    # step's record when that is appended (_append) and is released once the record is
    # durable; a step that raises, or finds a result recorded, releases it on the way out.
    def _begin(self, key) -> Any:
        """(Under ``_lock``.) The recorded result of ``key``; else, once no other thread
        of this journal runs it, _MISSING with ``key`` marked as running here."""
        while True:
            got = self._lookup(key)
            if got is not _MISSING or not self._running(key):
                break
            self._idle.wait()
        if got is _MISSING:
            self._busy[key] = threading.get_ident()
        return got

    def _running(self, key) -> bool:
        """(Under ``_lock``.) Whether another thread runs ``key`` now; a UsageError when this
        one does (a step that calls itself with the same inputs would wait for itself forever)."""
        owner = self._busy.get(key)
        if owner is not None and owner == threading.get_ident():
            raise UsageError(f"step {key[0]!r} is called again with the same inputs while it runs, in the same "
                             "thread: it would wait for its own result forever", ref=self.ref,
                             hint="a step may call other steps, or itself with other inputs; finish (or close) "
                                  "a stream before starting it again")
        return owner is not None

    def _end(self, key) -> None:
        """(Under ``_lock``.) ``key`` no longer runs here."""
        self._busy.pop(key, None)
        self._idle.notify_all()

    def _claim(self, key, claim: "_Claim") -> None:
        """Take this process's claim on ``key`` (waiting while another process holds it),
        then read what the log gained meanwhile."""
        token = key[0].encode("utf-8", "surrogatepass") + b"\0" + key[1]
        if not self._claims.claim(token, wait=False):
            # another process runs it: wait for its result holding no claim meanwhile (a claim of this
            # journal kept until its batch's flush could be what that process waits for)
            self.flush()
            self._claims.claim(token, wait=True)
        claim.token = token
        with self._lock:
            self._catch_up()

    def _unclaim(self, key, claim: "_Claim") -> None:
        """A call on ``key`` ends without appending its record (it raised, or found one)."""
        try:
            if claim.token is not None and not claim.passed:
                self._claims.release([claim.token])
        finally:
            with self._lock:
                self._end(key)

    def stream(self, name: str, fn: Callable[..., Iterator], *args, **kwargs) -> Iterator:
        """The items of ``fn(*args, **kwargs)`` (a generator), each recorded as it comes.
        A stream recorded to its end is replayed without running ``fn``. One a crash cut
        short is replayed as far as it was recorded; then ``fn`` runs again from its
        start and its first items, as many as were replayed, are dropped (so the caller
        sees each index once: ``fn`` should yield the same items again)."""
        self._check(name)
        key = (name, self._fingerprint(args, kwargs))
        with self._lock:
            self._running(key)        # refused at once in the thread that runs it (it would replay itself)
            if self.shared:
                self._catch_up()
        n = yield from self._replay(key, 0)
        if n == self._ends.get(key):
            return
        with self._lock:
            while self._running(key):     # another thread of this journal runs it
                self._idle.wait()
            self._busy[key] = threading.get_ident()
        claim = _Claim(None)
        try:
            if self._claims is not None:
                self._claim(key, claim)
            n = yield from self._replay(key, n)      # what was recorded while this call waited for the key
            if n == self._ends.get(key):
                return
            items = fn(*args, **kwargs)
            try:
                items = iter(items)
            except TypeError:
                raise UsageError(f"stream {name!r}: its function returned {type(items).__name__}, not an iterable "
                                 "of items", ref=self.ref, hint="make it a generator (yield each item)") from None
            for i, value in enumerate(items):
                if i < n:
                    continue
                stored = self._encode(value, f"{name}[{i}]")
                with self._lock:
                    self._append(journalrec.record("i", name, key[1], i, *stored, sealer=self._sealer))
                    self._items.setdefault(key, {}).setdefault(i, stored)
                yield value
                n = i + 1
            with self._lock:
                self._append(journalrec.record("e", name, key[1], n, "t", b"\xc0"), claim)
                self._ends.setdefault(key, n)
        finally:
            self._unclaim(key, claim)

    def _replay(self, key, n: int):
        """Yield the recorded items of stream ``key`` from index ``n`` while they are there
        and decode (never past its end); returns the index after the last one yielded."""
        while True:
            with self._lock:
                e = self._items.get(key, {}).get(n)
                end = self._ends.get(key)
            if e is None or (end is not None and n >= end):
                return n
            ok, value = self._value(f"{key[0]}[{n}]", e, "i", key, n)
            if not ok:
                with self._lock:
                    self._items[key].pop(n, None)
                return n
            yield value
            n += 1

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

    def _append(self, rec: bytes, claim: "_Claim | None" = None) -> None:
        """Record ``rec`` (under ``_lock``); ``claim``, the key's claim, passes to the
        record: released once it is durable, or at once if the append fails."""
        self._raise_error()
        if claim is not None and claim.token is not None:
            claim.passed = True
        else:
            claim = None
        self._recorded += 1
        if self.commit == "sync" or self._closed:     # closed: no flush would come for it
            try:
                self._appended(self.store.log_append(self.run, [rec], sync=True))
            except BaseException:
                self._recorded -= 1
                raise
            finally:
                if claim is not None:
                    self._claims.release([claim.token])
            self._durable = self._recorded
            return
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(rec)
        if claim is not None:
            self._held.append(claim.token)
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
        if self._held:     # their results are durable: the processes waiting for them read them now
            held, self._held = self._held, []
            self._claims.release(held)

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
        """Flush what is pending, stop the flusher, close the store if this journal opened it.
        A step still running in another thread appends its record synchronously when it
        returns (or raises the store's error): its result is never left unwritten."""
        try:
            with self._lock:
                if not self._closed:
                    self._closed = True
                    self._flush_locked()
        finally:
            self._closed = True
            _unregister(self)
            self._wake.set()
            if self._flusher is not None and self._flusher is not threading.current_thread():
                self._flusher.join()
            if self._claims is not None:
                self._claims.close()
            if self._own:
                self.store.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------
    def _register(self) -> None:
        """One unshared journal of a run in this process at a time: two would each run
        every step the other runs, and interleave their records (shared=True coordinates
        them, across processes too)."""
        with _OPEN_LOCK:
            other = _OPEN.get(self.ref)
            if other is not None and not other._closed:
                raise UsageError(f"run {self.run!r} already has an open journal in this process", ref=self.ref,
                                 hint="use that journal (it is thread-safe), close it first, or open both with "
                                      "shared=True")
            _OPEN[self.ref] = self

    def _check(self, name: Any) -> None:
        if not isinstance(name, str) or not name:
            raise UsageError(f"a step's name must be a non-empty str, not {name!r}")
        if self._closed:
            raise UsageError("the journal is closed", ref=self.ref)

    def _fingerprint(self, args: tuple, kwargs: dict) -> bytes:
        """The key of a step's inputs (FORMAT.md 17); keyed in an encrypted store (18.8)."""
        fp = journalrec.fingerprint(args, kwargs)
        return fp if self._sealer is None else self._sealer.journal_key(fp)

    def _encode(self, value: Any, what: str) -> tuple[str, bytes]:
        try:
            return journalrec.encode_value(value, "result", level=self._compress_level)
        except EncodeError as e:
            raise EncodeError(f"step {what!r}: {e.reason}", ref=self.ref,
                              hint="return plain data, arrays or tensors (nothing is pickled)") from None

    def __repr__(self) -> str:
        return f"<Journal {self.run} on {self.store.url} ({self.commit})>"


_MISSING = object()


class _Claim:
    """A step's claim on its key while it runs (``token`` None: not shared), and whether
    it passed to the step's record."""
    __slots__ = ("token", "passed")

    def __init__(self, token: bytes | None):
        self.token, self.passed = token, False


def inspect_journal(store: Store, run: str, *, decode: bool = True) -> dict:
    """What the run's journal holds, every record verified, for ``agck journal``:
    its results and streams (complete or cut short), the segments of AppendLogs
    snapshotted in the run, the records found damaged (and
    where), whether it ends in a torn tail, and its size. Without ``decode`` only
    the records' checksums are checked (``agck ls``), not whether each value rebuilds."""
    data, _ = store.log_read(check_run(run))
    found = journalrec.scan(data, tears=store.log_positions_are_bytes)
    results, items, ends = set(), {}, {}
    segments: dict[str, int] = {}      # AppendLog name -> its segments (agck.applog)
    undecodable = []
    for off, e in found.entries:
        key = (e.name, e.key)
        if e.kind == "r":
            results.add(key)
        elif e.kind == "i":
            items.setdefault(key, set()).add(e.index)
        elif e.kind == "e":
            ends.setdefault(key, e.index)
        else:
            segments[e.name] = segments.get(e.name, 0) + 1
        if e.kind != "e" and decode:
            try:
                value = journalrec.decode_value(e, ref=store.log_ref(run), sealer=store.sealer)
            except Exception as err:     # its check held but its value does not rebuild: damaged
                if isinstance(err, AgckError) and not err.verdict:
                    raise
                undecodable.append({"at": off, "reason": f"step {e.name!r}: its value does not decode ({err})"})
                continue
            if e.kind == "s" and not isinstance(value, list):      # FORMAT.md 17.9: a segment holds a list
                undecodable.append({"at": off, "reason": f"AppendLog {e.name!r}: a segment whose value is a "
                                                         f"{type(value).__name__}, not a list of items"})
    names: dict[str, int] = {}
    for name, _ in results:
        names[name] = names.get(name, 0) + 1
    damaged, healed = [], []
    for off, why in found.damaged:
        if journalrec.framing_only(found, off):
            damaged.append({"at": off, "reason": why, "kind": "batch"})
            continue
        who = journalrec.identity_at(data, off)
        (healed if journalrec.healed(found, data, off) else damaged).append(
            {"at": off, "reason": why, "kind": who[0] if who else None})
    damaged += undecodable
    return {"run": run, "ref": store.log_ref(run), "bytes": len(data), "records": len(found.entries),
            "results": len(results), "steps": dict(sorted(names.items())),
            "streams": len(set(items) | set(ends)), "streams_complete": len(ends),
            "log_segments": dict(sorted(segments.items())),
            "damaged": sorted(damaged, key=lambda d: d["at"]), "healed": healed, "torn_tail": found.torn}
