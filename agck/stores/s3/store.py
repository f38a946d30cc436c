"""A store in an S3-compatible bucket: checkpoints that outlive the machine.

    <prefix>/agck-store                          what this prefix is (written once)
    <prefix>/runs/<run>/log/<seq:020d>           the run's commit records, create-only (log.py)
    <prefix>/runs/<run>/snap/<seq:020d>          the fold of the records up to seq, now and then
    <prefix>/runs/<run>/data/<step:020d>-<token>.agck   a container too large for its record
    <prefix>/runs/<run>/journal/<seq:020d>       the run's step journal, a batch per object (journal.py)
    <prefix>/chunks/<2 hex>/<62 hex>             chunks shared by the checkpoints, by BLAKE3 address
    <prefix>/locks/<w|want|gc>-<ns>-<token>.<host>.<pid>   writers' and the collector's locks
    <prefix>/generation                          changed by whatever deletes or replaces chunks
    <prefix>/quarantine/<64 hex>.<ns>            chunks found damaged
    <prefix>/parts/                              the same layout again: multi-rank parts

The commit: a checkpoint's bytes (its chunks, then its container or listing)
are uploaded first, to keys nothing lists yet; then one record naming them is
created at the run's next sequence number with ``If-None-Match: *``. S3
acknowledges a PUT once the object is durable, so a step is visible exactly
when every byte it needs is. Fencing, overwrite refusals and concurrent
writers all reduce to that one create: it succeeds only for the writer that
saw every record before it (STORAGE.md, "Object stores").

Chunks: a writer holds a *shared lock* (an object of its own under
``locks/``) from the moment it relies on a stored chunk until its record is
created; the collector holds an *exclusive* one while it deletes. Each puts
its lock and then lists the locks, so of two that start together at least
one sees the other (S3's listings are strongly consistent). A lock not
refreshed for ``STALE_AFTER`` seconds (by the server's clock) belongs to a
writer that died, and is ignored.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterable

import xxhash

from ... import checkpoint, chunking, cipher, failpoints, thresholds
from ...args import check_addresses, check_seconds
from ...checkpoint import Checkpoint
from ...errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                      DamagedChunkError, DurabilityError, StoreConnectionError, StoreError, UsageError)
from .. import compression, content, damage, encryption
from . import log as s3log
from ...names import is_run_name
from ..base import CheckpointInfo, Store, check_identity, check_last, check_run, check_step
from .chunks import CATALOG_MARKER, STORE_MARKER, address_of, chunk_key
from .client import ObjectClient, ObjectExists, ObjectInfo
from .journal import JournalLogs

log = logging.getLogger("agck")

MARKER = STORE_MARKER
STALE_AFTER = 600.0        # seconds a lock stands without a refresh (server clock)
REFRESH_EVERY = STALE_AFTER / 4
LOCK_WAIT = 900.0          # how long a writer or collector waits for the other before giving up
LOCK_NOTICE = 5.0          # a wait this long is warned about, naming the lock it waits for
REQUESTS = 16              # requests in flight for one put or read (chunks, records)
# Large tensors are cut every CHUNK_GRID bytes here, not every 1 MiB as on local stores: a
# request costs money and tens of milliseconds on a cloud, a byte of coarser sharing little
# (STORAGE.md, "at scale": 1 MiB chunks make a 10 TB checkpoint 9.5 million PUTs)
CHUNK_GRID = thresholds.OBJECT_GRID
_APPEND_TRIES = 1000       # a commit racing other writers of the same run
KEEP_SNAPSHOTS = 2         # fold snapshots a collection leaves per run (the newest)


def _token() -> str:
    return uuid.uuid4().hex[:16]


class S3Store(JournalLogs, Store):
    """``open_store("s3://bucket/prefix")``: see the module docstring for the layout."""

    def __init__(self, url: str, *, create: bool = True, incremental: bool = True, full_every: int | None = None,
                 min_chunked: int | None = None, verify_reused: str = damage.DEFAULT_VERIFY_REUSED,
                 client: ObjectClient | None = None, stale_after: float | None = None, grace: float = 3600.0,
                 chunk_grid: int = CHUNK_GRID, compress: str = compression.DEFAULT, level: int | None = None,
                 key=None):
        super().__init__()
        given = encryption.given_key(key)     # a bad key argument is refused before any request
        if client is not None and not isinstance(client, ObjectClient):
            raise UsageError(f"client must be an agck.stores.s3.client.ObjectClient, not {type(client).__name__}")
        self._set_policy(incremental, full_every, min_chunked, verify_reused)
        compression.ChunkEncoding(compress, level, local=True)     # the options checked before any request
        try:
            self.large = chunking.grid(chunk_grid)
        except ValueError as e:
            raise UsageError(str(e), hint="chunk_grid=8 << 20 (the default here) or another power of two") from None
        self.chunk_grid = chunk_grid
        self.c = client or ObjectClient(url)
        self.url = self.c.url
        self._set_compression(compress, level, local=self.c.local, what="object store")
        self.stale_after = STALE_AFTER if stale_after is None else check_seconds(stale_after, "stale_after")
        # an unlisted data object younger than this may be a put in flight
        self.grace = check_seconds(grace, "grace", maximum=365 * 86_400.0, zero=True)
        self._states: dict[str, s3log.RunState] = {}
        self._states_lock = threading.Lock()
        self._journal_lock = threading.Lock()
        self._journal_heads: dict[str, int] = {}     # run -> the last journal batch this object saw
        self._known: set[bytes] = set()           # chunks known stored, while the generation holds
        self._generation: bytes | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._in_pool = threading.local()
        self._writer = _token()                   # names this store object's records
        self._open(create)
        self._set_encryption(_KeySlots(self), given, where=self.url)

    def location(self) -> tuple:
        return ("s3", self.c.url.split("?", 1)[0].rstrip("/"), self.c.bucket, self.c.prefix)

    def _runs_to_sample(self):
        return self._run_names()      # each run's records read only when it is looked at

    def _stored_head(self, run: str, step: int) -> bytes | None:
        e = self._state(run).steps.get(step)
        if e is None:
            return None
        try:
            return bytes(memoryview(self._container(run, e, self.ref(run, step), checked=False))[:8])
        except AgckError:
            return None

    def _ckey(self, address: bytes) -> str:
        """A chunk's object key: by its address, or in an encrypted store by its keyed name (FORMAT.md 18.3)."""
        return chunk_key(address if self.sealer is None else self.sealer.name(address))

    def _opened_chunk(self, address: bytes, data):
        """A stored chunk as the store encoded it (opened, in an encrypted store; one
        that does not open stays sealed: 48 bytes too long, judged damaged by its address)."""
        if self._sealed is None or data is None:
            return data
        return self._sealed.opened({self.sealer.name(address): data}, {self.sealer.name(address): address}
                                   ).get(address, data)

    def _open(self, create: bool) -> None:
        marker = self.c.get(MARKER)
        if marker is not None:
            return
        catalog = self.c.head(CATALOG_MARKER) is not None
        if not create and catalog:      # (open_store would refuse it: the hint must not send the user there)
            raise StoreConnectionError("this prefix holds the chunks of a Postgres catalog (agck_objects), not an "
                                       "s3 store", ref=self.url,
                                       hint="open the catalog by its postgresql:// URL (agck ls postgresql://...)")
        if not create:
            raise StoreConnectionError("no agck store at this prefix", ref=self.url,
                                       hint="check the URL; agck.open_store(url) creates a store there")
        if catalog:
            raise UsageError("this prefix holds the chunks of a database catalog (agck_objects), which a store "
                             "here would delete as garbage", ref=self.url, hint="give the s3 store a prefix of its own")
        try:
            self.c.put(MARKER, json.dumps({"agck_store": 1}).encode(), create=True)
        except ObjectExists:
            pass

    def pool(self) -> ThreadPoolExecutor:
        """The threads this store's requests run on (one pool per store object, made when first needed)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(REQUESTS, thread_name_prefix="agck-s3")
            return self._pool

    def _map(self, fn: Callable, items: Iterable) -> list:
        """``fn`` over ``items``, REQUESTS at a time. Called from one of this pool's own
        threads (folding the runs in parallel, each run's records in parallel) it runs
        them there, one after another: a task waiting on tasks queued behind it in the
        same pool would wait for ever."""
        items = list(items)
        if len(items) <= 1 or getattr(self._in_pool, "on", False):
            return [fn(i) for i in items]
        return list(self.pool().map(lambda i: self._pooled(fn, i), items))

    def _pooled(self, fn: Callable, item):
        self._in_pool.on = True
        try:
            return fn(item)
        finally:
            self._in_pool.on = False

    def _open_parts(self, create: bool) -> "S3Store | None":
        sub = self.c.child("parts")
        if not create and sub.get(MARKER) is None:
            return None
        return S3Store(sub.url, client=sub, stale_after=self.stale_after, grace=self.grace,
                       chunk_grid=self.chunk_grid, key=self.sealer and encryption.Inherited(self.sealer), **self._policy())

    # -- keys ------------------------------------------------------------------
    @staticmethod
    def _log_key(run: str, seq: int) -> str:
        return f"runs/{run}/log/{s3log.seq_name(seq)}"

    def ref(self, run: str, step: int) -> str:
        """For people: the run's place in the bucket and the step (not one object's key:
        a checkpoint is a record in the run's log and the objects it names)."""
        return self.c.ref(f"runs/{check_run(run)}") + f"@{check_step(step)}"

    # -- a run's state: its records folded ---------------------------------------
    def _state(self, run: str, *, catch_up: bool = True) -> s3log.RunState:
        with self._states_lock:
            st = self._states.get(run)
        if st is None:
            st = self._load_state(run)
        elif catch_up:
            st = self._catch_up(run, st)
        with self._states_lock:
            old = self._states.get(run)
            if old is None or old.seq <= st.seq:
                self._states[run] = st
        return st

    def _load_state(self, run: str) -> s3log.RunState:
        snaps = sorted((s3log.parse_seq(o.key.rsplit("/", 1)[1]), o.key)
                       for o in self.c.list(f"runs/{run}/snap/"))
        base = s3log.RunState()
        for seq, key in reversed([s for s in snaps if s[0] is not None]):
            data = self.c.get(key)
            if data is None:
                continue
            try:
                base = s3log.RunState.decode(data, self.c.ref(key))
                break
            except CorruptCheckpointError as e:
                log.warning("agck: a damaged snapshot of run %s is skipped: %s", run, e)
        return self._catch_up(run, base)

    def _catch_up(self, run: str, st: s3log.RunState) -> s3log.RunState:
        after = self._log_key(run, st.seq) if st.seq >= 0 else None
        seqs = [s for s in (s3log.parse_seq(o.key.rsplit("/", 1)[1])
                            for o in self.c.list(f"runs/{run}/log/", after=after)) if s is not None and s > st.seq]
        if not seqs:
            return st
        return s3log.fold(st, zip(seqs, self._map(lambda s: self._record(run, s), seqs)))

    def _record(self, run: str, seq: int) -> dict | None:
        key = self._log_key(run, seq)
        data = self.c.get(key)
        if data is None:
            return None
        try:
            return s3log.decode_record(data, self.c.ref(key))
        except CorruptCheckpointError as e:
            log.warning("agck: %s", e)
            return None

    def _append(self, run: str, make: Callable[[s3log.RunState], dict], inline: bytes = b"") -> s3log.RunState:
        """Create ``make(state)`` as the run's next record; ``make`` raises to refuse
        (a stale epoch, an existing step). Returns the state with it folded in."""
        st = self._state(run, catch_up=False)
        for _ in range(_APPEND_TRIES):
            record = dict(make(st), w=self._writer, n=_token())
            seq = st.seq + 1
            key = self._log_key(run, seq)
            try:
                self.c.put(key, s3log.encode_record(record, inline), create=True)
            except ObjectExists:
                if self._is_mine(run, seq, record):    # a retried request whose first try went through
                    break
                st = self._state(run)
                continue
            except DurabilityError:
                if self._is_mine(run, seq, record):
                    break
                raise
            break
        else:
            raise StoreError(f"could not commit to run {run!r}: {_APPEND_TRIES} other commits came first",
                             ref=self.url, hint="too many writers on one run; retry")
        new = st.copy()
        new.apply(seq, record)
        with self._states_lock:
            old = self._states.get(run)
            if old is None or old.seq < new.seq:
                self._states[run] = new
        self._maybe_snapshot(run, new)
        return new

    def _is_mine(self, run: str, seq: int, record: dict) -> bool:
        try:
            found = self._record(run, seq)
        except AgckError:
            return False
        return found is not None and found.get("w") == record["w"] and found.get("n") == record["n"]

    def _maybe_snapshot(self, run: str, st: s3log.RunState) -> None:
        every = s3log.snapshot_every(len(st.steps))
        if st.seq == 0 or st.seq % every:
            return
        try:
            self.c.put(f"runs/{run}/snap/{s3log.seq_name(st.seq)}", st.encode(), create=True)
        except ObjectExists:
            pass
        except AgckError as e:   # a later one will do; opens read a few more records meanwhile
            log.warning("agck: could not write a snapshot of run %s: %s", run, e)

    # -- locks ------------------------------------------------------------------
    @contextmanager
    def _locked(self, exclusive: bool = False):
        """Shared (a writer) or exclusive (the collector). A writer that finds a
        collection running steps back and leaves a ``want-`` marker; a collector
        yields to those, so a collector run in a loop cannot starve the writers. A
        collector keeps its lock while the writers already in flight finish, so
        new ones wait for it."""
        kind = "gc" if exclusive else "w"
        body = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()
        deadline = time.monotonic() + LOCK_WAIT
        delay = 0.02
        want = None
        told = False
        try:
            while True:
                key = f"locks/{kind}-{time.time_ns():020d}-{_token()}.{_holder()}"
                self.c.put(key, body)
                blockers = self._blockers(key, exclusive)
                while exclusive and blockers and all(b.key.startswith("locks/w-") for b in blockers) \
                        and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    blockers = self._blockers(key, exclusive)
                if not blockers:
                    break
                self.c.delete(key)
                if not exclusive and want is None:
                    want = f"locks/want-{time.time_ns():020d}-{_token()}.{_holder()}"
                    self.c.put(want, body)
                if not told and time.monotonic() > deadline - LOCK_WAIT + LOCK_NOTICE:
                    told = True     # a lock of a process on another host counts until it goes stale: say so
                    holder = blockers[0].key.rsplit("/", 1)[-1].split(".", 1)[-1]
                    log.warning("agck: %s waits for the lock %s (held by %s); a lock whose process is gone stops "
                                "counting %.0f s after it was last refreshed (or delete that object)",
                                self.url, blockers[0].key, holder, self.stale_after)
                if time.monotonic() > deadline:
                    raise StoreError(f"the store stayed locked for {LOCK_WAIT:.0f} s by {blockers[0].key}",
                                     ref=self.url, hint="a collection or writer is running; if its process is "
                                     f"gone, its lock stops counting {self.stale_after:.0f} s after it was last "
                                     "refreshed")
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        finally:
            if want is not None:
                self._forget(want)
        held = _Held(self, key, body)
        try:
            yield held
        finally:
            held.release()

    def _forget(self, key: str) -> None:
        try:
            self.c.delete(key)
        except AgckError as e:   # it goes stale on its own
            log.warning("agck: could not remove a lock: %s", e)

    def _blockers(self, mine: str, exclusive: bool) -> list[ObjectInfo]:
        """The locks that keep ``mine`` from being held. A lock counts until it is
        ``stale_after`` old by the server's clock, or at once when it names a process of
        this host that is gone (a writer killed here: restic's rule)."""
        locks = list(self.c.list("locks/"))
        now = max((o.modified for o in locks if o.key == mine), default=time.time())
        live = [o for o in locks if o.key != mine and now - o.modified < self.stale_after and _holder_alive(o.key)]
        if exclusive:
            return [o for o in live if o.key.startswith(("locks/w-", "locks/want-"))
                    or (o.key.startswith("locks/gc-") and o.key < mine)]
        return [o for o in live if o.key.startswith("locks/gc-")]

    def _check_generation(self) -> None:
        gen = self.c.get("generation")
        gen = bytes(gen) if gen is not None else b"0"
        if gen != self._generation:
            self._known.clear()
            self._generation = gen

    def _new_generation(self) -> None:
        """Before a chunk is deleted or replaced: every writer's knowledge of stored chunks is void."""
        self._known.clear()
        self._generation = None
        self.c.put("generation", os.urandom(16).hex().encode())

    # -- writing ------------------------------------------------------------------
    def put(self, run: str, step: int, state: Any, *, meta: Any = None, parent: int | None = None,
            overwrite: bool = True, expect_unchanged: Collection[int] = (), epoch: int | None = None) -> str:
        run = check_run(run)
        step, parent, ref, w, cache = self._prepare_put(run, step, state, meta=meta, parent=parent,
                                                        expect_unchanged=expect_unchanged)
        if cache is None:
            self._commit(run, step, list(checkpoint.stream(w)), w.total_len, parent, overwrite, epoch, ref)
            self.last_put = None
            return ref
        self._refuse_existing(run, step, overwrite, ref)
        with self._locked() as held:
            self._check_generation()
            plan = content.plan_chunks(w, cache, expect_unchanged=expect_unchanged, ref=ref, large=self.large)
            self._send_missing(plan)
            self._known.update(plan.distinct)
            listing = self._seal_listing(run, step, content.listing(w, plan.chunks, run=run, step=step,
                                                                    parent=parent, meta=meta,
                                                                    framed=self.compression.on))
            held.check()
            self._commit(run, step, [listing], w.total_len, parent, overwrite, epoch, ref)
        self._caches.give(run, cache)
        self.last_put = plan.chunks
        return ref

    def _refuse_existing(self, run: str, step: int, overwrite: bool, ref: str) -> None:
        if not overwrite and step in self._state(run).steps:
            raise CheckpointExistsError.refused(ref, step)

    def _send_missing(self, plan: content.Plan) -> None:
        """Upload the plan's chunks the bucket lacks. A chunk this store object does not
        know to be stored is looked up (HEAD) and, if absent, uploaded by the same task,
        so the uploads overlap the lookups; then ``verify_reused`` checks the chunks found
        stored, and a damaged one is quarantined and uploaded afresh."""
        mode, turn = self.verify_reused, self._reread_turn()
        ask = [a for a in plan.distinct if a not in self._known or damage.checks_size(mode)]
        failpoints.hit("s3.before_chunks")
        sent: list[bytes] = []
        half = max(1, len(ask) // 2)
        count = threading.Lock()

        extra = 0 if self.sealer is None else cipher.OVERHEAD

        def settle(a: bytes) -> int | None:
            h = self.c.head(self._ckey(a))
            if h is not None:
                return h.size - extra
            self.c.put(self._ckey(a), self._stored_form(plan, a))
            with count:
                sent.append(a)
                midway = len(sent) == half
            if midway:
                failpoints.hit("s3.mid_chunks")
            return None

        sizes = dict(zip(ask, self._map(settle, ask)))
        stored: dict[bytes, int | None] = {a: None for a in plan.distinct if a not in sizes}
        stored.update({a: n for a, n in sizes.items() if n is not None})
        bad = damage.reused_damage(stored, plan.size, mode, turn, read=self._read_chunks)
        for a, why in bad.items():
            self._set_aside(a, why)
        self._map(lambda a: self.c.put(self._ckey(a), self._stored_form(plan, a)), list(bad))
        plan.count_new(sent + list(bad))

    def _stored_form(self, plan: content.Plan, address: bytes):
        """The bytes to upload for one chunk: as the store compresses them, then seals
        them in an encrypted store (on the uploading thread)."""
        stored = self.compression.encode(address, plan.upload(address), plan.itemsize(address)).stored
        if self.sealer is None:
            return stored
        name = self.sealer.name(address)
        return self.sealer.seal(cipher.Kind.CHUNK, cipher.chunk_context(name), stored)

    def _read_chunks(self, addresses: list[bytes]) -> dict[bytes, Any]:
        got = self._map(lambda a: self._opened_chunk(a, self.c.get(self._ckey(a))), addresses)
        return {a: d for a, d in zip(addresses, got) if d is not None}

    def _commit(self, run: str, step: int, parts: list, length: int, parent: int | None, overwrite: bool,
                epoch: int | None, ref: str) -> None:
        """Upload the container's bytes (``parts``) where no record names them yet, unless
        small enough to go in the record, then create the record."""
        h = xxhash.xxh3_64()
        size = 0
        for p in parts:
            h.update(p)
            size += memoryview(p).nbytes
        record: dict = {"op": "put", "step": step, "size": size, "xxh3": h.intdigest(),
                        "created_at": time.time(), "parent": parent, "length": length, "epoch": epoch}
        inline = b""
        if size <= s3log.INLINE_MAX:
            inline = b"".join(bytes(p) for p in parts)
        else:
            key = f"runs/{run}/data/{step:020d}-{_token()}.agck"
            failpoints.hit("s3.before_data")
            self.c.put(key, parts)
            record["key"] = key

        def make(st: s3log.RunState) -> dict:
            if epoch is not None and st.epoch != epoch:
                raise self._stale(run, epoch, st.epoch, ref)
            if not overwrite and step in st.steps:
                raise CheckpointExistsError.refused(ref, step)
            return record
        failpoints.hit("s3.before_record")
        self._append(run, make, inline)
        failpoints.hit("s3.after_record")

    # -- fencing -----------------------------------------------------------------
    def begin_epoch(self, run: str) -> int:
        run = check_run(run)
        st = self._append(run, lambda st: {"op": "epoch", "epoch": (st.epoch or 0) + 1})
        return st.epoch

    def epoch(self, run: str) -> int | None:
        return self._state(check_run(run)).epoch

    def delete(self, run: str, step: int, *, epoch: int | None = None) -> None:
        run, step = check_run(run), check_step(step)
        ref = self.ref(run, step)

        def make(st: s3log.RunState) -> dict:
            if epoch is not None and st.epoch != epoch:
                raise self._stale(run, epoch, st.epoch, ref)
            if step not in st.steps:
                raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref)
            return {"op": "delete", "steps": [step]}
        self._append(run, make)

    # -- reading -----------------------------------------------------------------
    def _run_names(self) -> list[str]:
        return sorted(n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in self.c.prefixes("runs/"))
                      if is_run_name(n))

    def _folds(self, run: str | None = None) -> dict[str, s3log.RunState]:
        """Each run's state (or ``run``'s alone), caught up once, folded in parallel; runs
        with no step and no epoch too (a data object of theirs can only be an orphan)."""
        names = [check_run(run)] if run is not None else self._run_names()
        return dict(zip(names, self._map(self._state, names)))

    def runs(self) -> list[str]:
        return [n for n, st in self._folds().items() if st.steps or st.epoch is not None]

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        last = check_last(last)
        steps = sorted(self._state(check_run(run)).steps)
        return steps if last is None else steps[-last:]

    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        out = []
        for r in ([check_run(run)] if run is not None else self.runs()):
            st = self._state(r)
            for s in sorted(st.steps):
                e = st.steps[s]
                info = CheckpointInfo(run=r, step=s, ref=self.ref(r, s), size=e.length or e.size,
                                      created_at=e.created_at, parent=e.parent)
                try:
                    head = self._opened_listing(r, s, self._head_bytes(r, e), info.ref)
                    _, m = checkpoint.parse_head(head, ref=info.ref)
                    info.meta = m.get("meta")
                except (AgckError, OSError):
                    pass     # listed without its meta; verify/recover say what is wrong
                out.append(info)
        return out

    def _head_bytes(self, run: str, e: s3log.Entry):
        """The container's first bytes (all of them: they are one object or in the record)."""
        if e.key is None:
            return self._inline(run, e, self.ref(run, e.step))
        data = self.c.get(e.key)
        if data is None:
            raise CheckpointNotFoundError("its data object is gone", ref=self.c.ref(e.key))
        return data

    def _inline(self, run: str, e: s3log.Entry, ref: str) -> memoryview:
        """The container bytes that follow the record which committed ``e`` (read again
        from the bucket each time: what is verified is what is stored)."""
        key = self._log_key(run, e.seq)
        data = self.c.get(key)
        if data is None:
            raise CorruptCheckpointError("the record that committed it is gone", ref=self.c.ref(key), section="log")
        return s3log.record_inline(data, self.c.ref(key))

    def _container(self, run: str, e: s3log.Entry, ref: str, *, checked: bool = True):
        """The stored container of entry ``e``; ``checked``: of the size and XXH3-64 its
        record says (a collector takes it as it is: it keeps what it names whatever its verdict)."""
        where = ref
        if e.key is None:
            data = self._inline(run, e, ref)
            where = self.c.ref(self._log_key(run, e.seq))
        else:
            where = self.c.ref(e.key)
            data = self.c.get(e.key)
            if data is None:
                raise CorruptCheckpointError("its data object is missing from the bucket", ref=where,
                                             section="container")
        if not checked:
            return data
        if len(data) != e.size:
            raise CorruptCheckpointError(f"holds {len(data)} bytes, its record says {e.size}", ref=where,
                                         section="container")
        if xxhash.xxh3_64_intdigest(data) != e.xxh3:
            raise CorruptCheckpointError("its bytes do not match their record's XXH3-64", ref=where,
                                         section="container")
        return data

    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        run, step = check_run(run), check_step(step)
        ref = self.ref(run, step)
        e = self._state(run).steps.get(step)
        if e is None:
            raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref,
                                          hint=f"`agck ls {self.url} --run {run}` lists the steps")
        buf = self._opened_listing(run, step, self._container(run, e, ref), ref)
        try:
            ck = content.decode(buf, self._get_chunk, verify=verify, map_location=map_location, ref=ref,
                                fetch_into=self._get_chunk_into, fetch_threads=REQUESTS,
                                authenticated=self.sealer is not None)
        except DamagedChunkError as err:
            self._damage_found(err)
            raise
        check_identity(ck, run, step, ref)
        return ck

    def _get_chunk(self, address: bytes, size: int):
        return self._opened_chunk(address, self.c.get(self._ckey(address)))

    def _get_chunk_into(self, address: bytes, view: memoryview) -> int | None:
        if self._sealed is None:
            return self.c.get_into(chunk_key(address), view)
        data = self.c.get(self._ckey(address))        # sealed: opened from here into its place
        return None if data is None else self._sealed.found_into({address: data})(address, view)

    # -- shared content ---------------------------------------------------------
    def _listings(self, folds: dict[str, s3log.RunState]) -> list[tuple[str, Callable[[], object]]]:
        """(ref, read its stored container) of every committed checkpoint of ``folds``."""
        return [(self.ref(r, s), lambda r=r, s=s, e=e, ref=self.ref(r, s):
                 self._opened_listing(r, s, self._container(r, e, ref, checked=False), ref))
                for r, st in sorted(folds.items()) for s, e in sorted(st.steps.items())]

    def _orphan_data(self, folds: dict[str, s3log.RunState]) -> list[ObjectInfo]:
        """Data objects of ``folds``' runs that no record names, older than ``grace`` (a put
        that died between its upload and its record; a younger one may be in flight)."""
        now = time.time()
        out = []
        for r, st in sorted(folds.items()):
            named = {e.key for e in st.steps.values() if e.key}
            out += [o for o in self.c.list(f"runs/{r}/data/") if o.key not in named and now - o.modified > self.grace]
        return out

    def _old_snapshots(self, folds: dict[str, s3log.RunState]) -> list[ObjectInfo]:
        """Each run's fold snapshots but the newest ``KEEP_SNAPSHOTS``: a reader starts from
        the newest it can read (an older one, or none, only costs it more records to fold)."""
        def old(run: str) -> list[ObjectInfo]:
            snaps = sorted(((s3log.parse_seq(o.key.rsplit("/", 1)[1]), o) for o in self.c.list(f"runs/{run}/snap/")),
                           key=lambda x: (x[0] is not None, x[0] or 0))
            return [o for seq, o in snaps[:-KEEP_SNAPSHOTS] if seq is not None]
        return [o for found in self._map(old, sorted(folds)) for o in found]

    def collect_garbage(self) -> content.Collected:
        """Delete chunks no committed listing lists, data objects no record names
        (those younger than ``grace`` are spared: a put in flight uploads its data
        object before its record) and each run's older fold snapshots. Holds the
        exclusive lock while it deletes chunks."""
        with self._locked(exclusive=True) as held:
            folds = self._folds()
            live = content.live_chunks(self._listings(folds))
            if not live.complete:
                return live.collected()
            stored = [(a, o) for o in self.c.list("chunks/") if (a := address_of(o.key)) is not None]
            named = live.addresses if self.sealer is None else set(self._sealed.names(live.addresses))
            dead = [(a, o) for a, o in stored if a not in named]
            if dead:
                held.check()
                self._new_generation()
                self._map(lambda item: self.c.delete(item[1].key), dead)
            orphans = self._orphan_data(folds) + self._old_snapshots(folds)
            # a quarantined copy is evidence while a checkpoint that lists its address is broken;
            # once a put wrote the content again (healed), or nothing lists it, it goes
            kept = {a for a, _ in stored} - {a for a, _ in dead}
            for o in self.c.list("quarantine/"):
                a = _quarantined_address(o.key)
                if a is not None and (a not in named or a in kept):
                    orphans.append(o)
            self._map(lambda o: self.c.delete(o.key), orphans)
        return live.collected(len(dead), sum(o.size for _, o in dead))

    # -- damaged chunks ---------------------------------------------------------
    def _set_aside(self, address: bytes, why: str) -> str | None:
        """Copy a damaged chunk's bytes to quarantine/ (the next put of its content
        writes good ones under its name); the generation moves on first."""
        data = self.c.get(self._ckey(address))
        if data is None:
            return None
        self._new_generation()
        stored_as = address if self.sealer is None else self.sealer.name(address)   # no key names an address
        key = f"quarantine/{stored_as.hex()}.{time.time_ns()}"
        self.c.put(key, data)
        self.c.put(key + ".why", why.encode())
        self.c.delete(self._ckey(address))
        return key

    def quarantine(self, addresses) -> dict[bytes, str]:
        addresses = check_addresses(addresses)
        addresses = [bytes(a) for a in addresses]
        with self._locked(exclusive=True):
            found = self._read_chunks(addresses)
            out, bad = damage.judge(addresses, found)
            if any(v != "intact" for v in out.values()):
                # damaged or missing: every writer looks again before relying on these
                # addresses, so the next put holding their content uploads it afresh
                self._new_generation()
            for a, why in bad.items():
                self._set_aside(a, why)
        return out

    def quarantined(self) -> list[damage.QuarantinedChunk]:
        out = []
        objs = {o.key: o for o in self.c.list("quarantine/")}
        for key, o in sorted(objs.items()):
            if key.endswith(".why"):
                continue
            name = key.split("/", 1)[1]
            address, _, ns = name.partition(".")
            why = self.c.get(key + ".why")
            out.append(damage.QuarantinedChunk(address=address, size=o.size,
                                                detected_at=int(ns) / 1e9 if ns.isdigit() else o.modified,
                                                reason=bytes(why).decode(errors="replace") if why is not None else "",
                                                ref=self.c.ref(key)))
        return sorted(out, key=lambda q: q.detected_at)

    def _scrub(self, progress) -> damage.ScrubReport:
        with self._locked():
            listings = [(ref, lambda load=load, ref=ref: content.listed_addresses(load(), verify=True, ref=ref))
                        for ref, load in self._listings(self._folds())]
            chunks = [(a, o) for o in self.c.list("chunks/") if (a := address_of(o.key)) is not None]
            return damage.scrub(self.url, listings, self._prefetched(chunks), progress,
                                name=None if self.sealer is None else self.sealer.name)

    def _prefetched(self, chunks: list[tuple[bytes, ObjectInfo]]):
        """(address, size, ref, read) of each chunk, their bytes fetched REQUESTS at a time
        ahead of the caller (a scrub reads every chunk: one request each)."""
        for i in range(0, len(chunks), REQUESTS * 4):
            batch = chunks[i:i + REQUESTS * 4]
            datas = self._map(lambda item: self.c.get(item[1].key), batch)
            for (a, o), d in zip(batch, datas):
                # no size to judge by: a bucket lists the stored size, which a compressed chunk's is not
                yield a, None, self.c.ref(o.key), (lambda a=a, d=d: self._opened_object(a, d))

    # -- housekeeping -------------------------------------------------------------
    def orphans(self, run: str | None = None) -> list[str]:
        """Data objects no record names, older than ``grace`` (a put that died between
        its upload and its record)."""
        return [self.c.ref(o.key) for o in self._orphan_data(self._folds(run))]

    def clean_orphans(self, run: str | None = None) -> list[str]:
        found = self.orphans(run)
        base = self.c.ref("")
        for ref in found:
            self.c.delete(ref[len(base):])
        return found

    def close(self) -> None:
        super().close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class _Held:
    """A lock this store object holds: refreshed on a timer while held, so a long put
    does not look dead; :meth:`check` refuses to commit when the refreshes failed
    for so long that the collector may have counted it stale."""

    def __init__(self, store: S3Store, key: str, body: bytes):
        self.store, self.key, self.body = store, key, body
        self.refreshed = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="agck-s3-lock", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        every = min(REFRESH_EVERY, self.store.stale_after / 4)
        while not self._stop.wait(every):
            try:
                self.store.c.put(self.key, self.body)
                self.refreshed = time.monotonic()
            except AgckError as e:
                log.warning("agck: could not refresh a lock: %s", e)

    def check(self) -> None:
        if time.monotonic() - self.refreshed > self.store.stale_after / 2:
            raise DurabilityError("this writer's lock was not refreshed in time, so a collector may have deleted "
                                  "chunks it relies on; nothing was committed", ref=self.store.c.ref(self.key),
                                  hint="retry the put")

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self.store._forget(self.key)


def _host() -> str:
    return "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in socket.gethostname())[:64]


def _holder() -> str:
    """Who holds a lock, as its name says it: this host (kept to [A-Za-z0-9-]) and pid
    (asked each time: a forked child is another holder)."""
    return f"{_host()}.{os.getpid()}"


def _holder_alive(key: str) -> bool:
    """False only for a lock named by a process of this host that no longer runs."""
    host, _, pid = key.rsplit("/", 1)[-1].split(".", 1)[-1].rpartition(".")
    if host != _host() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _quarantined_address(key: str) -> bytes | None:
    name = key.rsplit("/", 1)[-1]
    try:
        return bytes.fromhex(name.split(".", 1)[0])
    except ValueError:
        return None




class _KeySlots:
    """An s3 store's key slots (FORMAT.md 18.6): ``keys/<id>.json``, each created only if
    absent (``If-None-Match: *``); nothing secret in them. A removal holds the store's
    exclusive lock from its check to its delete (rule 18.12)."""

    def __init__(self, store: "S3Store"):
        import weakref
        self.store = weakref.proxy(store)
        self.c = store.c

    def load(self) -> "list[dict | encryption.DamagedSlot]":
        out = []
        for o in self.c.list("keys/"):
            name = o.key.rsplit("/", 1)[-1]
            if name.endswith(".json"):
                if o.size > encryption.MAX_SLOT:
                    out.append(encryption.DamagedSlot(name[:-5], self.c.ref(o.key), f"{o.size} bytes, more than a "
                                                      f"key slot's {encryption.MAX_SLOT}"))
                    continue
                data = self.c.get(o.key)
                if data is not None:
                    out.append(encryption.parse_slot(bytes(data), name[:-5], self.c.ref(o.key)))
        return sorted(out, key=lambda x: x["id"] if isinstance(x, dict) else x.id)

    def save(self, slot: dict) -> None:
        try:
            self.c.put(f"keys/{slot['id']}.json", encryption.slot_json(slot).encode(), create=True)
        except ObjectExists:
            raise CheckpointExistsError(f"key slot {slot['id']} exists", ref=self.c.ref("keys/")) from None

    def remove(self, slot_id: str, check) -> None:
        with self.store._locked(exclusive=True):
            check(self.load())
            self.c.delete(f"keys/{slot_id}.json")
