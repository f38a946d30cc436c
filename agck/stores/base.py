"""The store interface every backend implements, and what they share.

A store keeps checkpoints keyed by (run, step). Durability contract:
``put`` returns only once the checkpoint is durable (file fsync'd, renamed,
directory fsync'd; SQLite commit with synchronous=FULL; Postgres COMMIT with
synchronous_commit=on). In-flight checkpoints are present or absent, never
half-present. Putting an existing (run, step) replaces it atomically
(``overwrite=False`` refuses instead): a resumed run must be able to rewrite
a step whose old checkpoint failed verification.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import numbers
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Collection, Iterable, Sequence

from typing import ClassVar, Protocol

from .. import checkpoint, cipher, format, thresholds
from ..args import check_addresses, check_callable
from ..checkpoint import Checkpoint
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StaleEpochError, UsageError
from ..names import MAX_STEP, check_run, check_step
from . import compression, encryption
from .content import WriteCache, WriteCaches, cannot_confirm
from .damage import DEFAULT_VERIFY_REUSED, QuarantinedChunk, ScrubReport, check_verify_reused

log = logging.getLogger("agck")

@dataclass
class CheckpointInfo:
    """One checkpoint as listed: no payload read."""

    run: str
    step: int
    ref: str                      # where it lives, for humans: a path or a table row
    size: int | None = None       # bytes of the container
    created_at: float | None = None
    parent: int | None = None
    meta: Any = None
    checksum: str | None = None   # xxh3-64 of the whole container, hex, where the store records one

    def as_dict(self) -> dict:
        """The listing row as JSON-able values (``agck ls --json``)."""
        return asdict(self)


@dataclass(frozen=True)
class PutEntry:
    """One checkpoint of :meth:`Store.put_many`: the arguments of :meth:`Store.put`."""

    run: str
    step: int
    state: Any
    meta: Any = None
    parent: int | None = None
    overwrite: bool = True


# An incremental store writes a container smaller than this standalone: splitting it
# would cost more writes (chunks, then a listing) than sharing its content could save.
MIN_CHUNKED = thresholds.MIN_CHUNKED


class Policies(Protocol):
    """What is decided above the store floor, over the store interface: which
    checkpoint of a run is the newest that verifies, and what retention deletes.
    :mod:`agck.recovery` implements it; agck's public face installs it as
    :attr:`Store.policies` on import, so a store never imports the policies that
    judge it."""

    def newest(self, store: "Store", run: str, *, map_location=None) -> Checkpoint: ...

    def prune(self, store: "Store", run: str, *, keep_last, keep_every, before, epoch,
              drop_unverified) -> list[int]: ...


def check_last(last: Any) -> int | None:
    """``steps(run, last=...)``: None (every step) or a positive integer."""
    if last is None:
        return None
    if isinstance(last, numbers.Integral) and not isinstance(last, bool) and last > 0:
        return min(int(last), MAX_STEP)        # more than a run can hold is every step
    raise UsageError(f"last must be a positive integer or None, not {last!r}")


class Store(ABC):
    """Backend interface. Implementations must be safe to share between threads."""

    url: str
    policies: ClassVar[Policies | None] = None   # installed by agck (agck.recovery.POLICIES)

    incremental = False
    full_every: int | None = None
    _min_chunked: int | None = None     # as given; None: the default, which depends on compression
    verify_reused = DEFAULT_VERIFY_REUSED
    log_positions_are_bytes = False     # journal logs: byte offsets, else numbers of batches (log_read)
    native_async = False     # whether the a* methods run on the event loop (else on a worker thread each)

    def __init__(self):
        self._lock = threading.RLock()
        self._caches = WriteCaches()   # what the last put of each run found, for incremental puts
        self._parts: Store | None = None
        self._turns = itertools.count()   # the sample of reused chunks each put re-reads (damage.reread)
        self.compression = compression.ChunkEncoding("none", local=True)   # a store's __init__ sets its own
        self.sealer: cipher.DataKey | None = None     # an encrypted store's data key (_set_encryption)
        self._slots: encryption.SlotFiles | None = None
        self._sealed: encryption.SealedObjects | None = None     # the object table's edge, where rows hold chunks

    @property
    def where(self) -> str:
        """Where the store's data is, for errors: its URL, and for a store that shares
        its database with others (a table prefix, a schema), which tables are its."""
        return self.url

    def _set_compression(self, compress: str, level: int | None, *, local: bool, what: str = "store") -> None:
        """``compress`` ("auto", "zstd", "none") and ``level`` (zstd's; default 1): how the
        chunks of chunked puts are stored (:mod:`agck.stores.compression`); ``local``:
        whether the store is on this machine (what "auto" decides by)."""
        self.compression = compression.ChunkEncoding(compress, level, local=local, what=what)

    @property
    def min_chunked(self) -> int:
        """A container of fewer bytes is written standalone: as given, else
        ``MIN_CHUNKED`` (64 KiB), or ``MIN_CHUNKED_COMPRESSED`` (4 KiB) where the store
        compresses (agck/thresholds.py)."""
        if self._min_chunked is not None:
            return self._min_chunked
        return thresholds.MIN_CHUNKED_COMPRESSED if self.compression.on else MIN_CHUNKED

    def _set_policy(self, incremental, full_every, min_chunked=None,
                    verify_reused=DEFAULT_VERIFY_REUSED) -> None:
        """``incremental``: keep checkpoints as chunk listings sharing content.
        ``full_every=K``: the first put of each run by this store object, and
        every K-th after it, is a standalone container all the same, so damage
        to one shared chunk can reach at most the checkpoints since the last
        standalone one (README, "Incremental checkpoints"). ``min_chunked``: a
        container of fewer bytes is written standalone (0: every one is chunked; None,
        the default: 64 KiB, or 4 KiB where the store compresses).
        ``verify_reused``: what a chunked put checks of the chunks it reuses before
        relying on them: ``"none"`` (that they exist), ``"size"`` (their stored size),
        ``"sample"`` (the default: that they exist, and the bytes of one address bucket
        in 16, a different one each put) or ``"full"`` (every reused chunk's size and bytes); a
        damaged one is quarantined and written afresh by that put (README, "Damaged chunks")."""
        if not isinstance(incremental, bool):
            raise UsageError(f"incremental must be True or False, not {incremental!r}")
        if full_every is not None and (not isinstance(full_every, numbers.Integral) or isinstance(full_every, bool)
                                       or full_every < 1):
            raise UsageError(f"full_every must be a positive integer or None, not {full_every!r}")
        if min_chunked is not None and (not isinstance(min_chunked, numbers.Integral)
                                        or isinstance(min_chunked, bool) or min_chunked < 0):
            raise UsageError(f"min_chunked must be a byte count >= 0 or None, not {min_chunked!r}")
        self.incremental = incremental
        self.full_every = None if full_every is None else int(full_every)
        self._min_chunked = None if min_chunked is None else int(min_chunked)
        self.verify_reused = check_verify_reused(verify_reused)

    def _set_encryption(self, slots: "encryption.SlotFiles", given, *, where: str) -> None:
        """Open the store's data key from ``slots`` with the ``given`` user key
        (:func:`encryption.data_key`); an encrypted store writes every checkpoint as a
        sealed listing and sealed chunks: nothing, of any size, in the clear."""
        self._slots = slots
        self.sealer = encryption.data_key(slots, given, sealed_found=self._sealed_found, where=where)
        if self.sealer is not None:
            self._sealed = encryption.SealedObjects(self.sealer)
            if not self.incremental or self.full_every is not None:
                raise UsageError("an encrypted store writes every checkpoint as chunks: incremental=False and "
                                 "full_every are not available", ref=where)
            self._min_chunked = 0

    def location(self) -> tuple:
        """Where the store's data is, resolved (a real path; a server's identity, database,
        schema and prefix; a bucket and prefix): two stores with equal locations are one
        store however they were spelled (STORAGE.md, tiers rule T1)."""
        return ("url", self.url)

    def _overwrite_epoch(self, run: str, epoch: int) -> None:
        """Set the run's epoch whatever the store holds (a tier's damaged local copy)."""
        raise UsageError(f"{type(self).__name__} cannot replace a run's epoch", ref=self.url)

    def _stored_head(self, run: str, step: int) -> bytes | None:
        """The first bytes (at least 8) of (run, step)'s container or listing as stored
        (sealed or not), or None: what :meth:`_sealed_found` judges by."""
        return None

    def _runs_to_sample(self) -> Iterable[str]:
        """The runs :meth:`_sealed_found` looks at, in order (a store whose ``runs()``
        reads every run's state gives its names, read one at a time)."""
        return self.runs()

    def _sealed_found(self) -> bool | None:
        """Whether what the store holds is sealed (FORMAT.md rule 18.9), for a store with
        no key slots: the stored container of the newest step of the first run that has
        one, else the first record that holds a value in the first journal log. None: the
        store holds neither (empty, or chunks left by a put that never committed)."""
        for run in self._runs_to_sample():
            for step in self.steps(run, last=1):
                head = self._stored_head(run, step)
                if head:
                    return bytes(head[:4]) == cipher.MAGIC
        try:
            log_runs = self.log_runs()
        except UsageError:      # a store that keeps no journal
            return None
        from .. import journalrec
        for run in log_runs:
            sealed = journalrec.first_value_sealed(self.log_read(run)[0])
            if sealed is not None:
                return sealed
        return None

    def _before_write(self) -> None:
        """Before anything is written: an empty store opened with a key becomes encrypted
        now, by its first slot (FORMAT.md rule 18.11), so that an open that only reads writes nothing."""
        if self.sealer is not None:
            encryption.commit_first_slot(self.sealer)

    def _refuse_sealed_log(self, ref: str, records) -> None:
        """An encrypted store appends only records whose values are sealed (FORMAT.md 18.8):
        what agck's journal and AppendLogs write there; anything else would be in the clear."""
        self._before_write()
        if self.sealer is not None:
            from .. import journalrec
            i = journalrec.unsealed(records)
            if i is not None:
                raise UsageError(f"record {i} of the batch is not a journal record with a sealed value: an "
                                 "encrypted store keeps nothing in the clear", ref=ref,
                                 hint="append through agck.Journal or an AppendLog, which seal what they write")

    def _seal_listing(self, run: str, step: int, listing: bytes) -> bytes:
        """A listing as an encrypted store keeps it: sealed to its run and step (FORMAT.md 18.4)."""
        if self.sealer is None:
            return listing
        return bytes(self.sealer.seal(cipher.Kind.CONTAINER, cipher.container_context(run, step), listing))

    def _opened_listing(self, run: str, step: int, buf, ref: str):
        """A stored container as it was before sealing (in an encrypted store); one that
        does not open is a verdict on that checkpoint (CorruptCheckpointError)."""
        if self.sealer is None:
            return buf
        try:
            return self.sealer.open(cipher.Kind.CONTAINER, cipher.container_context(run, step), buf,
                                    what="the checkpoint's sealed container")
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(e.reason, ref=ref, section="sealed") from None

    def _opened_object(self, name: bytes, data):
        """A stored object as scrub judges it: opened, in an encrypted store that keeps
        chunks in rows (one that does not open stays sealed and matches nothing)."""
        if self._sealed is None or data is None:
            return data
        name = bytes(name)
        return self._sealed.opened({name: data}, {name: name}, quiet=True).get(name, data)

    def key_slots(self) -> list[dict]:
        """The store's intact key slots (FORMAT.md 18.6; nothing secret in them); [] when not
        encrypted (or not yet: an empty store opened with a key until its first write)."""
        return encryption.split_slots(self._slots.load())[0] if self._slots is not None else []

    def damaged_key_slots(self) -> "list[encryption.DamagedSlot]":
        """The store's key slots that cannot be read (each with its id, where and why)."""
        return encryption.split_slots(self._slots.load())[1] if self._slots is not None else []

    def add_key(self, key) -> dict:
        """Wrap the store's data key under one more user key (a passphrase, 32 raw bytes,
        a callable): a new key slot, returned. No data is rewritten."""
        return encryption.add_key(self._slots, self.sealer, key, self.where)

    def remove_key(self, slot_id: str) -> None:
        """Remove a key slot: its key opens the store no more. The last slot stays."""
        encryption.remove_key(self._slots, self.sealer, slot_id, self.where)

    def _policy(self) -> dict:
        """The options that make another store of this backend write as this one does."""
        return {"incremental": self.incremental, "full_every": self.full_every, "min_chunked": self._min_chunked,
                "verify_reused": self.verify_reused, "compress": self.compression.requested,
                "level": self.compression.level}

    def _reread_turn(self) -> int:
        """Which share of its reused chunks this put re-reads (``verify_reused="sample"``)."""
        return next(self._turns)

    def _write_cache(self, run: str, expect_unchanged: Collection[int] = (), ref: str | None = None
                     ) -> WriteCache | None:
        """The run's write cache for a chunked put (give it back with
        ``self._caches.give`` once the put succeeded), or None: write this one standalone.
        A standalone put cannot confirm ``expect_unchanged`` tensors: refused, before
        anything counts as a put."""
        if expect_unchanged and not self.can_confirm_unchanged(run):
            raise cannot_confirm(ref)
        if not self.incremental:
            return None
        cache = self._caches.take(run)
        standalone = self.full_every is not None and cache.puts % self.full_every == 0
        cache.puts += 1
        if standalone:
            self._caches.give(run, cache)
            return None
        return cache

    def _encode(self, run: str, step: int, state: Any, *, meta: Any, parent: int | None,
                expect_unchanged: Collection[int], ref: str) -> tuple[format.ContainerWriter, WriteCache | None]:
        """Encode a put (with the run's encoding memo where it is chunked) and say how
        it is written: with the cache to split it with, or None: standalone (not
        incremental, a ``full_every`` put, or smaller than ``min_chunked`` and not
        confirming ``expect_unchanged`` tensors; the cache is then given back)."""
        self._before_write()
        cache = self._write_cache(run, expect_unchanged, ref)
        w = checkpoint.encode(state, run=run, step=step, parent=parent, meta=meta,
                              memo=cache.encoding if cache else None)
        if cache is not None and w.total_len < self.min_chunked and not expect_unchanged:
            self._caches.give(run, cache)
            cache = None
        return w, cache

    def _prepare_put(self, run: str, step: int, state: Any, *, meta: Any, parent: int | None,
                     expect_unchanged: Collection[int]) -> tuple[int, int | None, str, format.ContainerWriter,
                                                                   WriteCache | None]:
        """A put's arguments checked and its container encoded: (step, parent, ref, the
        writer, the write cache to split it with or None: standalone)."""
        step = check_step(step)
        if parent is not None:
            parent = check_step(parent, "parent")
        ref = self.ref(run, step)
        w, cache = self._encode(run, step, state, meta=meta, parent=parent, expect_unchanged=expect_unchanged,
                                ref=ref)
        return step, parent, ref, w, cache

    # -- writing ---------------------------------------------------------------
    @abstractmethod
    def put(self, run: str, step: int, state: Any, *, meta: Any = None, parent: int | None = None,
            overwrite: bool = True, expect_unchanged: Collection[int] = (), epoch: int | None = None) -> str:
        """Write a checkpoint durably; returns its ref.

        ``epoch``: the writer's incarnation (:meth:`begin_epoch`); the put commits only
        while it is the run's newest, checked in the commit itself, else
        :class:`StaleEpochError`.

        ``expect_unchanged``: memory addresses (``data_ptr()``) of tensors in
        ``state`` that the caller did not copy because they have not changed since
        the run's last put through this store object (see
        :meth:`can_confirm_unchanged`). Their bytes are confirmed against that put's
        while they are split (one XXH3 pass, which the split makes anyway); if any
        differs, :class:`ContentChangedError` is raised and nothing is written."""

    def put_many(self, entries: Sequence[PutEntry]) -> list[str]:
        """Write several checkpoints durably, in order; returns their refs.

        The SQL stores write them in one transaction (one commit): after a crash
        either all of them are there or none is. Other stores put them one by one:
        after a crash the ones there are a prefix of ``entries``, each whole. Either
        way an entry may refer to the entries before it. An entry with
        ``overwrite=False`` whose (run, step) holds a checkpoint raises
        :class:`CheckpointExistsError` with its ref; nothing is written then, except,
        on a store that puts one by one, the entries before it."""
        entries = check_entries(entries)
        return [self.put(e.run, e.step, e.state, meta=e.meta, parent=e.parent, overwrite=e.overwrite)
                for e in entries]

    # -- multi-rank parts -------------------------------------------------------
    def parts_store(self, create: bool = True) -> "Store | None":
        """The store that holds the per-rank parts of multi-rank checkpoints
        (:mod:`agck.sharded`): the same backend and location in a namespace of its
        own, so parts never appear among the runs. With ``create=False``, None when
        no part was ever written here."""
        with self._lock:
            if self._parts is None:
                self._parts = self._open_parts(create)
            return self._parts

    def _open_parts(self, create: bool) -> "Store | None":
        raise UsageError(f"{type(self).__name__} cannot hold multi-rank checkpoints", ref=self.url)

    # -- fencing -----------------------------------------------------------------
    @abstractmethod
    def begin_epoch(self, run: str) -> int:
        """Begin a new incarnation of ``run`` and return its epoch (1, 2, ...), made
        durable before it is returned. From then on a put given an older epoch is
        refused with :class:`StaleEpochError` and commits nothing, so a writer left
        over from an earlier incarnation (a job that kept running after the run was
        restarted elsewhere) can never commit over this one. Puts given no epoch are
        not fenced."""

    @abstractmethod
    def epoch(self, run: str) -> int | None:
        """The epoch of ``run``'s newest incarnation, None if none began."""

    @staticmethod
    def _stale(run: str, epoch: int, current: int | None, ref: str) -> StaleEpochError:
        return StaleEpochError(f"run {run!r} is at epoch {current}, this writer's epoch is {epoch}: a newer "
                               "incarnation of the run began", ref=ref)

    def can_confirm_unchanged(self, run: str) -> bool:
        """Whether the next put of ``run`` can confirm ``expect_unchanged`` tensors:
        it will be chunked, and this store object holds the run's last checkpoint
        as it split it."""
        if not self.incremental:
            return False
        cache = self._caches.peek(run)
        if cache is None or not cache.split:
            return False
        return self.full_every is None or cache.puts % self.full_every != 0

    @abstractmethod
    def delete(self, run: str, step: int, *, epoch: int | None = None) -> None:
        """Remove one checkpoint (CheckpointNotFoundError if absent). ``epoch``: fenced
        like a put, so a writer of an older incarnation cannot delete what the
        newer one relies on (StaleEpochError, nothing deleted)."""

    # -- reading ---------------------------------------------------------------
    @abstractmethod
    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        """Checkpoints ordered by (run, step), without reading payloads."""

    @abstractmethod
    def runs(self) -> list[str]:
        """Run names, sorted."""

    @abstractmethod
    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        """The run's steps, ascending; the cheapest listing the backend has.
        ``last``: only the newest ``last`` of them (the SQL stores read no more rows)."""

    @abstractmethod
    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        """Load exactly (run, step). Raises CorruptCheckpointError (with ``ref``)
        on anything that fails verification, CheckpointNotFoundError if absent.
        ``verify`` may be a :class:`agck.chunking.CheckedChunks` shared by several
        reads: each chunk is then checked against its address once for all."""

    # -- awaitable forms: on Postgres its own (postgres/aio.py), here the method on a worker thread --
    async def aput_many(self, entries: Sequence[PutEntry]) -> list[str]:
        """:meth:`put_many`, awaited."""
        return await asyncio.to_thread(self.put_many, check_entries(entries))

    async def aread(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        """:meth:`read`, awaited."""
        return await asyncio.to_thread(self.read, run, step, verify=verify, map_location=map_location)

    async def aread_newest(self, run: str, *, verify: bool = True, map_location=None) -> Checkpoint | None:
        """:meth:`read_newest`, awaited."""
        return await asyncio.to_thread(self.read_newest, run, verify=verify, map_location=map_location)

    async def asteps(self, run: str, *, last: int | None = None) -> list[int]:
        """:meth:`steps`, awaited."""
        return await asyncio.to_thread(self.steps, run, last=last)

    def read_newest(self, run: str, *, verify: bool = True, map_location=None) -> Checkpoint | None:
        """The checkpoint at the run's newest step, read and verified as :meth:`read`
        reads it (a damaged one raises; :meth:`get` walks back past it instead), or
        None when the run has no step. One round trip on Postgres; elsewhere
        :meth:`steps` then :meth:`read`, again if the step was deleted in between."""
        check_run(run)
        tries = 0
        while True:
            last = self.steps(run, last=1)
            if not last:
                return None
            try:
                return self.read(run, last[0], verify=verify, map_location=map_location)
            except CheckpointNotFoundError:
                tries += 1
                if tries == 8:     # deleted under it again and again: say so
                    raise

    # -- journal logs (agck.journal) -----------------------------------------------
    def log_append(self, run: str, records: Sequence[bytes], *, sync: bool = True) -> tuple[int, int] | None:
        """Append journal records (:mod:`agck.journalrec`, each framed and checksummed by
        itself) to the run's log, whole and in order, after every record appended
        before; with ``sync`` they are durable when it returns. Returns the positions
        (as :meth:`log_read` takes them) where they start and end, where the store
        knows them without another round trip (else None)."""
        raise UsageError(f"{type(self).__name__} keeps no step journal yet", ref=self.url,
                         hint="use a file, SQLite, Postgres or s3:// store for agck.Journal")

    def log_read(self, run: str, start: int = 0) -> tuple[bytes, int]:
        """The records appended to the run's log from position ``start`` (0: the
        beginning), as bytes, and the position to read on from. Positions are byte
        offsets where :attr:`log_positions_are_bytes` (a log that can end in a torn
        tail, read again from its start), else numbers of whole appended batches."""
        raise UsageError(f"{type(self).__name__} keeps no step journal yet", ref=self.url,
                         hint="use a file, SQLite, Postgres or s3:// store for agck.Journal")

    def log_ref(self, run: str) -> str:
        """Where the run's journal log is, for humans."""
        return f"{self.url} journal of {run}"

    def log_runs(self) -> list[str]:
        """The runs that have a journal log, sorted."""
        return []

    def log_claims(self, run: str):
        """Claims on the run's journal steps, for the processes that share the run
        (:class:`agck.stores.logclaims.LogClaims`): each held until released or until
        its holder dies."""
        raise UsageError(f"{type(self).__name__} cannot share a journal between processes", ref=self.url,
                         hint="use a file, SQLite or Postgres store for Journal(..., shared=True)")

    @abstractmethod
    def ref(self, run: str, step: int) -> str:
        """A human-readable location of (run, step)."""

    def get(self, run: str, step: int | None = None, *, verify: bool = True, map_location=None) -> Checkpoint:
        """(run, step), or with ``step=None`` the newest checkpoint of ``run`` that
        verifies (:func:`agck.recovery.recover_run`, strict)."""
        check_run(run)
        if step is not None:
            return self.read(run, check_step(step), verify=verify, map_location=map_location)
        return self._policies().newest(self, run, map_location=map_location)

    def _policies(self) -> Policies:
        if self.policies is None:
            raise UsageError("no recovery policies are installed", ref=self.url, hint="import agck")
        return self.policies

    # -- housekeeping ----------------------------------------------------------
    def orphans(self, run: str | None = None) -> list[str]:
        """Leftovers of interrupted writes (temp files, incomplete rows)."""
        return []

    def clean_orphans(self, run: str | None = None) -> list[str]:
        """Remove what :meth:`orphans` lists; returns what was removed."""
        return []

    def prune(self, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
              before: int | None = None, epoch: int | None = None, drop_unverified: bool = False) -> list[int]:
        """Delete old checkpoints of ``run``; returns the deleted steps.

        Keeps the newest ``keep_last``, every step divisible by ``keep_every``,
        and all steps >= ``before`` (when given, only steps below it are
        candidates). Never deletes the newest checkpoint that verifies, nor any
        newer one (a verdict of damage deletes nothing by itself;
        ``drop_unverified=True`` deletes those newer ones, each logged with its
        reason), and deletes nothing when it cannot find one (see
        :func:`agck.recovery.prune`); then collects the garbage and the parts of
        pruned multi-rank steps."""
        return self._policies().prune(self, run, keep_last=keep_last, keep_every=keep_every, before=before,
                                      epoch=epoch, drop_unverified=drop_unverified)

    # -- damaged chunks ----------------------------------------------------------
    def quarantine(self, addresses) -> dict[bytes, str]:
        """Take chunks found damaged out of use. Each address is re-read under the
        collector's lock (no writer is between relying on it and committing): a chunk
        whose stored bytes are indeed damaged is moved out of the object table, kept
        for inspection (:meth:`quarantined`); a missing one is recorded as such. In
        both cases every writer looks again before relying on that address, so the
        next put holding its content writes it afresh, healing every checkpoint that
        lists it. Returns each address's verdict: ``quarantined``, ``missing`` or
        ``intact`` (its stored bytes match: a misread, left in place). Stores that
        share no content between checkpoints have nothing to quarantine."""
        addresses = check_addresses(addresses)
        return {}

    def quarantined(self) -> list[QuarantinedChunk]:
        """The chunks quarantined in this store, oldest first."""
        return []

    def scrub(self, *, quarantine: bool = True, progress=None) -> ScrubReport:
        """Re-hash every stored chunk (restic's ``check --read-data``, ZFS's scrub),
        read every chunk listing, and report each chunk that is damaged or missing
        with the checkpoints it breaks; with ``quarantine`` (the default) quarantine
        them (:meth:`quarantine`). Standalone containers hold no shared chunks:
        ``agck verify`` checks them. ``progress(nbytes)`` is called per chunk."""
        rep = self._scrub(check_callable(progress, "progress"))
        bad = rep.damaged + rep.missing
        if quarantine and bad:
            verdicts = self.quarantine([bytes.fromhex(d.address) for d in bad])
            held = {q.address for q in self.quarantined()} if rep.missing else set()
            for d in bad:
                d.quarantined = verdicts.get(bytes.fromhex(d.address))
                if d.quarantined == "missing" and d.address in held:
                    d.quarantined = "quarantined earlier"
        parts = self.parts_store(create=False)
        if parts is not None:      # the chunks of multi-rank parts, kept in a namespace of their own
            rep.absorb(parts.scrub(quarantine=quarantine, progress=progress))
        return rep

    def _scrub(self, progress) -> ScrubReport:
        return ScrubReport(url=self.url)

    def _damage_found(self, e) -> None:
        """A read found chunks damaged or missing (:class:`agck.errors.DamagedChunkError`):
        quarantine them before the error reaches the caller. A failure to quarantine
        is logged, never raised in place of the damage itself."""
        addresses = list(dict.fromkeys(e.damaged + e.missing))
        if not addresses:
            return
        try:
            verdicts = self.quarantine(addresses)
        except Exception as q:   # the damage is the error to report; quarantine is best effort here
            log.warning("agck: could not quarantine %d damaged chunk(s) of %s: %s", len(addresses), self.url, q)
            return
        n = sum(1 for v in verdicts.values() if v == "quarantined")
        if e.missing and not n:
            held = {q.address for q in self.quarantined()}
            n = sum(1 for a in e.missing if a.hex() in held)
        if n:
            e.reason += (f"; {n} damaged chunk(s) quarantined: the next put holding their content writes it "
                         "afresh, which heals this checkpoint")

    def collect_garbage(self):
        """Delete stored content that no checkpoint refers to any more (chunks of
        deleted checkpoints, leftovers of interrupted writes). Stores that share no
        content between checkpoints have none; returns what was collected, or None."""
        return None

    def close(self) -> None:
        """Release what the store holds (its parts namespace included); stores that
        hold more override this and call it."""
        parts, self._parts = self._parts, None
        if parts is not None:
            parts.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def check_records(records: Any) -> list:
    """The records of a log_append: a list of bytes-like objects."""
    if isinstance(records, (str, bytes, bytearray, memoryview)) or not hasattr(records, "__iter__"):
        raise UsageError(f"log_append: records must be a list of bytes, not {type(records).__name__}")
    out = list(records)
    for i, r in enumerate(out):
        if not isinstance(r, (bytes, bytearray, memoryview)):
            raise UsageError(f"log_append: record {i} is a {type(r).__name__}, not bytes")
    return out


def check_position(start: Any) -> int:
    """Where a log_read starts: an int >= 0."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise UsageError(f"log_read: start must be an int >= 0, not {start!r}"[:200])
    return start


def check_entries(entries: Sequence[PutEntry]) -> list[PutEntry]:
    """``entries`` of a put_many as a list, their names checked, no (run, step) twice."""
    if isinstance(entries, (str, bytes, PutEntry)) or not hasattr(entries, "__iter__"):
        raise UsageError(f"put_many: entries must be a list of agck.stores.PutEntry, not {type(entries).__name__}")
    out, seen = [], set()
    for i, e in enumerate(entries):
        if not isinstance(e, PutEntry):
            raise UsageError(f"put_many: entry {i} is a {type(e).__name__}, not an agck.stores.PutEntry")
        key = (check_run(e.run), check_step(e.step))
        if e.parent is not None:
            check_step(e.parent, "parent")
        if key in seen:
            raise UsageError(f"put_many: run {e.run!r} step {e.step} appears twice")
        seen.add(key)
        out.append(e)
    return out


def iter_hashed(parts: Iterable, hasher) -> Iterable:
    """Pass ``parts`` through, feeding each to ``hasher`` (whole-container checksum)."""
    for p in parts:
        hasher.update(p)
        yield p


def check_identity(ck: Checkpoint, run: str, step: int, ref: str) -> None:
    """A container must say it is (run, step), rule 10.20: catches a file or row
    swapped in from another run or step, which its own checksums cannot."""
    if ck.run != run or ck.step != step:
        raise CorruptCheckpointError(
            f"holds run {ck.run!r} step {ck.step}, expected run {run!r} step {step}: "
            "a checkpoint from elsewhere was put in its place", ref=ref, section="metadata")
