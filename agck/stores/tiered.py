"""Tiered checkpoints: a fast local tier in front of a durable one.

``TieredStore(local, durable)``: a put is acknowledged **local** once it is in the
local tier (a directory on tmpfs or NVMe: any store), and later **durable**, once a
background copier has committed it in the durable tier (any store: s3, Postgres, a
shared file system). The copier never blocks the pipeline; it copies oldest first,
every ``durable_every``-th local checkpoint of a run (and a run's newest when the
store is flushed or closed), retries a durable tier that is down, and after a crash
(this process killed between a local put and its copy) picks up where it stopped:
opened again, the store queues each run's newest local step that the durable tier
lacks. ``last_local_step(run)`` and ``last_durable_step(run)`` say which is which.

Reads take the fastest tier that verifies: the local one, and where its copy is
missing or damaged (a lost or replaced host, rot) the durable one; every copy is
verified by its checksums and chunk addresses before it is used, whatever tier it
came from. ``steps`` is the union of both tiers', so the walk back (``get``,
``agck.recover``, ``checkpoint_every``'s resume) walks across them: a host that lost
its local tier resumes from the newest durable step.

Retention per tier: ``keep_local`` newest local checkpoints per run and at most
``keep_local_bytes`` in the local tier (older ones are pruned from the local tier
once the durable tier holds them or a newer one; a run's newest is always kept);
the durable tier keeps what its own ``prune`` keeps.

Epochs (fencing) are begun in the durable tier, the one every host shares, and the
local tier is brought to the same epoch, so a replacement host with an empty local
tier never reuses an epoch. Multi-rank jobs (:mod:`agck.replicas`) also keep
``replicas`` copies of each rank's part on peers in other hosts; their parts are
copied to the durable tier by each rank's copier, and the commit record only once
every part it binds is there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Collection

from ..checkpoint import Checkpoint
from ..errors import (AgckError, CheckpointNotFoundError, DurabilityError, StaleEpochError, StoreConnectionError,
                      StoreError, UsageError)
from ..names import check_run, check_step
from .base import CheckpointInfo, Store

log = logging.getLogger("agck")

STALL_NOTICE = 10.0     # seconds one copy may take before durable_error says so
OPEN_WAIT = 2.0         # seconds an open waits for the durable tier before going on with the local tier alone
RETRY_FIRST = 0.5       # seconds before a failed durable copy is tried again, doubled each time
RETRY_MOST = 30.0
WAIT_PARTS = 0.2        # seconds between looks for the parts a multi-rank commit record waits on
COMMIT_KEY = "agck.commit"   # agck.sharded.COMMIT_KEY (a floor above): a commit record is copied only with its parts


class NotYet(Exception):
    """A copy that must wait (a commit record for its parts): tried again shortly, no warning."""


@dataclass
class Copy:
    """One copy to the durable tier: (run, step) of the tiers (``parts``: of their parts
    namespaces), fenced by ``epoch`` there; ``ready`` (a multi-rank commit record's)
    raises :class:`NotYet` until the copy may be made, returns False when it never
    need be (a newer step is durable)."""

    run: str
    step: int
    epoch: int | None = None
    parts: bool = False
    ready: Callable[[], bool] | None = None
    awaits: str | None = None     # a rank's part: the run whose commit record makes its step durable


class TieredStore(Store):
    """A local tier in front of a durable one (see the module docstring)."""

    def __init__(self, local: Store | str, durable: Store | str, *, durable_every: int = 1,
                 keep_local: int | None = 2, keep_local_bytes: int | None = None, replicas: int = 1,
                 _view: bool = False, **options):
        super().__init__()
        from . import open_store
        for name, value, least, none_ok in (("durable_every", durable_every, 1, False),
                                            ("keep_local", keep_local, 1, True),
                                            ("keep_local_bytes", keep_local_bytes, 1, True),
                                            ("replicas", replicas, 0, False)):
            if value is None and none_ok:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise UsageError(f"{name} must be an integer of at least {least}{' or None' if none_ok else ''}, "
                                 f"not {value!r}")
        if options and (isinstance(local, Store) or isinstance(durable, Store)):
            # the options would be ignored for a Store object: a key among them would leave it in the clear
            raise UsageError(f"TieredStore's store options ({', '.join(sorted(options))}) apply to tiers given as "
                             "URLs; a tier given as a Store object was opened with its own",
                             hint="pass both tiers as URLs with the options, or open each Store with them")
        self.local = local if isinstance(local, Store) else open_store(local, **options)
        self.durable_every, self.keep_local = durable_every, keep_local
        self.keep_local_bytes, self.replicas = keep_local_bytes, replicas
        self._cond = threading.Condition()
        self._queue: deque[Copy] = deque()                  # oldest first
        self._busy: Copy | None = None
        self._busy_since: float | None = None               # when the copy in progress began
        self._counts: dict[str, int] = {}                   # local puts per run by this object
        self._durable_newest: dict[str, int | None] = {}    # as the copier last saw it
        self._prune: set[str] = set()                       # runs whose local tier may hold too many
        self._failure: str | None = None                    # the durable tier's last error, while it lasts
        self._awaited: dict[str, int] = {}                  # multi-rank run -> newest step flush waits for
        self._unfenced: dict[str, int] = {}                 # run -> an epoch begun in the local tier alone
        self._refused: AgckError | None = None              # why the durable tier can never be used
        self._closing = False
        self.copied = 0
        self._view = _view      # the parts namespaces' reading view: no copier of its own
        self._thread = None
        # the journal and AppendLogs are kept in the durable tier: its compression and its
        # key, once it is open (the local tier's until then)
        self.compression, self.sealer = self.local.compression, self.local.sealer
        self._durable: Store | None = None
        self._opened = threading.Event()     # the first attempt to open the durable tier ended
        if isinstance(durable, Store):
            self._use_durable(durable)
            self._opened.set()
            self.url = f"tiered({self.local.url} -> {durable.url})"
        else:
            self._durable_spec = (durable, options)
            self.url = f"tiered({self.local.url} -> {_shown_url(durable)})"
        if _view:
            return
        self._thread = threading.Thread(target=self._copier, name="agck-durable-copier", daemon=True)
        self._thread.start()
        # a durable tier that is up opens in about a second; one that is down (refused, or a
        # server that does not answer) is opened by the copier once it is back, and the
        # local tier alone serves opening, restoring, putting and reading meanwhile (rule T4)
        self._opened.wait(OPEN_WAIT)
        if self._refused is not None:
            self.close()
            raise self._refused

    def _use_durable(self, durable: Store) -> None:
        """Take ``durable`` as the durable tier: the tiers checked (rule T1, T3), then each
        run's newest local step the durable tier lacks queued (a process killed between a
        local put and its copy left it)."""
        _check_tiers(self.local, durable)
        self.compression, self.sealer = durable.compression, durable.sealer
        if not self._view:
            for run in self.local.runs():
                newest = self.last_local_step(run)
                got = durable.steps(run, last=1)
                durable_newest = got[0] if got else None
                with self._cond:
                    self._durable_newest[run] = durable_newest
                    if newest is not None and newest > (durable_newest if durable_newest is not None else -1) \
                            and (run, newest) not in self.pending:
                        self._queue.append(Copy(run, newest))
        self._durable = durable

    def _open_durable(self) -> bool:
        """On the copier's thread: open the durable tier given by URL, retried while it is
        down; False once the store is closing or the tiers were refused."""
        from . import open_store
        url, options = self._durable_spec
        delay = RETRY_FIRST
        while not self._closing:
            try:
                store = open_store(url, **options)
            except (StoreConnectionError, DurabilityError) as e:     # down: tried again
                delay = self._still_down(e, delay)
                continue
            except AgckError as e:       # refused for good (a wrong key, no such schema)
                self._refused = e
                self._opened.set()
                return False
            try:
                self._use_durable(store)
            except (StoreConnectionError, DurabilityError) as e:     # went down while its runs were read
                store.close()
                delay = self._still_down(e, delay)
                continue
            except Exception as e:
                store.close()
                self._refused = e if isinstance(e, AgckError) else StoreError(
                    f"the durable tier could not be taken: {type(e).__name__}: {e}", ref=self.url)
                self._opened.set()
                return False
            self._failure = None
            self._opened.set()
            return True
        return False

    def _still_down(self, e: AgckError, delay: float) -> float:
        """The durable tier could not be opened: said (``durable_error``), waited for, the
        next wait doubled."""
        self._failure = f"{type(e).__name__}: {e}"
        self._opened.set()
        with self._cond:
            self._cond.wait(delay)
        return min(delay * 2, RETRY_MOST)

    @property
    def durable(self) -> Store:
        """The durable tier; StoreConnectionError while it cannot be opened (the first
        attempt to open it is waited for)."""
        if self._durable is None:
            self._opened.wait()
            if self._refused is not None:
                raise self._refused
            if self._durable is None:
                raise StoreConnectionError(f"the durable tier is not reachable ({self._failure or 'opening'})",
                                           ref=self.url, hint="its copies are made once it is back; the local "
                                                              "tier serves reads and puts meanwhile")
        return self._durable

    def _durable_up(self) -> Store | None:
        """The durable tier where it is open and copies to it are not failing; None while
        it is down (the local tier alone is used: rule T4)."""
        return self._durable if self._durable is not None and self._failure is None else None

    # -- what is where ------------------------------------------------------------------
    def last_local_step(self, run: str) -> int | None:
        """The run's newest step in the local tier (acknowledged local), or None."""
        got = self.local.steps(check_run(run), last=1)
        return got[0] if got else None

    def last_durable_step(self, run: str) -> int | None:
        """The run's newest step committed in the durable tier, or None."""
        got = self.durable.steps(check_run(run), last=1)
        return got[0] if got else None

    @property
    def pending(self) -> list[tuple[str, int]]:
        """(run, step) of the copies not yet committed durable, oldest first (a multi-rank
        run's parts as (part run, step))."""
        with self._cond:
            return [(c.run, c.step) for c in ([self._busy] if self._busy else []) + list(self._queue)]

    @property
    def durable_error(self) -> str | None:
        """Why the last copy to the durable tier failed, while copies are failing; or, while
        one copy has taken more than ``STALL_NOTICE`` seconds, that it has (a stalled
        server holds a request until its read timeout; a large copy takes long too).
        None: copies go through."""
        if self._failure is not None:
            return self._failure
        busy, since = self._busy, self._busy_since
        if busy is not None and since is not None and time.monotonic() - since > STALL_NOTICE:
            return (f"copying step {busy.step} of run {busy.run!r} to the durable tier has taken "
                    f"{time.monotonic() - since:.0f} s so far (a large copy, or a durable tier that does not answer)")
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Queue each run's newest local step not known to be durable, then wait until
        every queued copy is durable (or ``timeout`` seconds pass); True if they are.
        Only the local tier is asked here: a durable tier that is down or stalled delays
        the copier, never this call past its ``timeout``."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or not 0 <= timeout < float("inf")):
            raise UsageError(f"timeout must be a number of seconds >= 0 or None, not {timeout!r}"[:120])
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = []
        for run in self.local.runs():
            newest = self.last_local_step(run)
            durable_newest = self._durable_newest.get(run)      # the copier skips what is durable already
            if newest is not None and newest > (durable_newest if durable_newest is not None else -1):
                wanted.append((run, newest))
        with self._cond:
            for run, step in wanted:
                if (run, step) not in self.pending:
                    self._queue.append(Copy(run, step))
            self._cond.notify_all()
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(1.0 if left is None else min(left, 1.0))
            awaited = dict(self._awaited)
        # a rank's parts are durable, and the step is, once rank 0's copier has copied the
        # commit record that binds them: every rank's flush waits for that (the same answer
        # on every rank)
        for run, step in sorted(awaited.items()):
            while True:
                newest = self._from_durable(lambda d: d.steps(run, last=1), [])
                if newest and newest[0] >= step:
                    with self._cond:
                        if self._awaited.get(run) == step:
                            del self._awaited[run]
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(WAIT_PARTS)
        return True

    # -- writing --------------------------------------------------------------------------
    def put(self, run: str, step: int, state: Any, *, meta: Any = None, parent: int | None = None,
            overwrite: bool = True, expect_unchanged: Collection[int] = (), epoch: int | None = None) -> str:
        """Put in the local tier (acknowledged local when it returns); the copy to the
        durable tier follows in the background, every ``durable_every``-th put of a run."""
        self._check_open()
        ref = self.local.put(run, step, state, meta=meta, parent=parent, overwrite=overwrite,
                             expect_unchanged=expect_unchanged, epoch=epoch)
        step = check_step(step)
        if self._view:
            return ref
        with self._cond:       # the pipeline only queues: the copier copies and prunes
            n = self._counts[run] = self._counts.get(run, 0) + 1
            if n % self.durable_every == 0:
                self._queue.append(Copy(run, step, epoch))
            self._prune.add(run)
            self._cond.notify_all()
        return ref

    def copy_later(self, copy: Copy) -> None:
        """Queue one copy to the durable tier (the multi-rank commit's: a rank's part, a
        commit record that waits for its parts)."""
        with self._cond:
            self._queue.append(copy)
            self._prune.add(copy.run)
            awaited = copy.awaits or (copy.run if copy.ready is not None else None)
            if awaited is not None:
                self._awaited[awaited] = max(self._awaited.get(awaited, copy.step), copy.step)
            self._cond.notify_all()

    def can_confirm_unchanged(self, run: str) -> bool:
        return self.local.can_confirm_unchanged(run)

    def begin_epoch(self, run: str) -> int:
        """A new epoch begun in the durable tier (past any the local tier has seen), and
        the local tier brought to it: a host that lost its local tier never reuses one.
        A local epoch that cannot be read is a damaged local copy: the durable tier's
        epoch (which fences) is taken, and the local copy written anew.

        While the durable tier is down (not open, or its copies failing), the epoch is
        begun in the local tier alone, past every epoch this host has seen, and carried
        to the durable tier before this incarnation's first copy there (rule T4): epochs
        are begun in the durable tier up to it, and if another incarnation got there
        first (a newer epoch), this one's copies are refused as stale, never committed."""
        run = check_run(run)
        durable = self._durable_up()
        if durable is not None:
            try:
                local = self._local_epoch(run) or 0
                epoch = durable.begin_epoch(run)
                while epoch <= local:
                    epoch = durable.begin_epoch(run)
                self.raise_local_epoch(run, epoch)
                with self._cond:
                    self._unfenced.pop(run, None)
                return epoch
            except (StoreConnectionError, DurabilityError) as e:
                log.warning("agck: the durable tier is down (%s): epoch of run %r begun in the local tier", e, run)
        try:
            epoch = self.local.begin_epoch(run)
        except StoreError:       # its epoch damaged: past the newest this store knows of
            epoch = max([self._unfenced.get(run, 0)] + [0]) + 1
            self.local._overwrite_epoch(run, epoch)
        with self._cond:
            self._unfenced[run] = epoch
        return epoch

    def _fence(self, target: Store, run: str, epoch: int) -> None:
        """Carry an epoch begun in the local tier alone to the durable tier (rule T4):
        epochs begun there up to it; StaleEpochError if a newer incarnation is there."""
        now = target.epoch(run) or 0
        while now < epoch:
            now = target.begin_epoch(run)
        if now != epoch:
            raise StaleEpochError(f"epoch {epoch} of run {run!r} was begun in the local tier while the durable "
                                  f"tier was down, and the durable tier is at epoch {now} now: a newer "
                                  "incarnation runs", ref=self.url)
        with self._cond:
            if self._unfenced.get(run) == epoch:
                del self._unfenced[run]

    def _local_epoch(self, run: str) -> int | None:
        """The local tier's epoch of ``run``; None where its copy is damaged (said once)."""
        try:
            return self.local.epoch(run)
        except StoreError as e:
            log.warning("agck: the local tier's epoch of run %r cannot be read (%s): the durable tier's is used",
                        run, e.reason)
            return None

    def raise_local_epoch(self, run: str, epoch: int) -> None:
        """Bring the local tier to ``epoch`` (begun in the durable tier): epochs begun there
        until it is at ``epoch``, or, where its epoch is damaged, written over."""
        try:
            current = self.local.epoch(run) or 0
        except StoreError:
            self.local._overwrite_epoch(run, epoch)
            return
        while current < epoch:
            current = self.local.begin_epoch(run)

    def epoch(self, run: str) -> int | None:
        if run in self._unfenced:
            return self._unfenced[run]
        durable = self._durable_up()
        if durable is None:
            return self._local_epoch(run)
        return durable.epoch(run)

    def delete(self, run: str, step: int, *, epoch: int | None = None) -> None:
        """Delete (run, step) from both tiers (and from the copies not yet made)."""
        step = check_step(step)
        with self._cond:
            self._queue = deque(c for c in self._queue if c.parts or (c.run, c.step) != (run, step))
        found = 0
        for tier in (self.local, self.durable):
            if step in tier.steps(run):
                tier.delete(run, step, epoch=epoch if tier is self.local else None)
                found += 1
        with self._cond:
            self._durable_newest.pop(run, None)
        if not found:
            raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=self.ref(run, step))

    def _retain(self, run: str) -> int:
        """Prune the run's local tier to its ``keep_local`` newest steps, sparing any
        step still to be copied and any newer than the durable tier's newest (then it
        is the only copy of a state that new). Returns how many were deleted."""
        steps = self.local.steps(run)
        if self.keep_local is None or len(steps) <= self.keep_local:
            return 0
        return sum(self._drop(run, s) for s in steps[:-self.keep_local])

    def _drop(self, run: str, step: int) -> bool:
        """Retention's one step: :meth:`drop_local`'s rule, else (and while the durable
        tier cannot be asked) :meth:`_drop_superseded`'s."""
        try:
            if self.drop_local(run, step):
                return True
        except (StoreConnectionError, DurabilityError):
            pass
        return self._drop_superseded(run, step)

    def drop_local(self, run: str, step: int) -> bool:
        """Delete (run, step) from the local tier if the durable tier makes it safe to:
        not waiting to be copied, and not newer than the durable tier's newest. Whether
        it was deleted."""
        durable_newest = self._durable_newest.get(run)
        if durable_newest is None or step > durable_newest:    # another process's copier may have moved it on
            durable_newest = self._durable_newest[run] = self.last_durable_step(run)
        if durable_newest is None or step > durable_newest or (run, step) in self.pending:
            return False
        try:
            self.local.delete(run, step)
            return True
        except CheckpointNotFoundError:
            return False

    def _retain_bytes(self) -> int:
        """Prune the oldest local checkpoints (each run's newest spared, and what
        :meth:`drop_local` spares) while the local tier's listed bytes exceed
        ``keep_local_bytes``. Only the runs this store wrote are pruned: another process
        sharing the local tier has copies queued that this one cannot see (STORAGE.md,
        tiers rule T2); every byte counts toward the limit. Returns how many were deleted."""
        if self.keep_local_bytes is None:
            return 0
        infos = self.local.list()
        with self._cond:
            mine = set(self._counts) | {c.run for c in self._queue}
        total = sum(i.size or 0 for i in infos)
        newest = {}
        for i in infos:
            newest[i.run] = max(newest.get(i.run, i.step), i.step)
        deleted = 0
        for i in sorted(infos, key=lambda i: (i.created_at or 0, i.step)):
            if total <= self.keep_local_bytes:
                break
            if i.run in mine and i.step != newest[i.run] and self._drop(i.run, i.step):
                total -= i.size or 0
                deleted += 1
        return deleted

    # -- the copier -----------------------------------------------------------------------
    def _copier(self) -> None:
        if self._durable is None and not self._open_durable():
            return
        delay = RETRY_FIRST
        while True:
            with self._cond:
                while not self._queue and not self._prune and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return              # the next store opened on these tiers makes what is left
                # retention runs while copies wait too (an outage): the local tier stays
                # within its limits, its newest durable candidates kept (rule T5)
                prune, self._prune = self._prune, set()
                self._busy = self._next_copy() if self._queue else None
                self._busy_since = time.monotonic()
            if prune:
                self._pruned(prune)
            if self._busy is None:
                continue
            job = self._busy
            run, step = job.run, job.step
            gone = waiting = False
            copied = False
            try:
                copied = self._copy(job)
                ok = True
            except NotYet:
                ok, waiting = False, True
            except StaleEpochError as e:    # a newer incarnation began: this one's copies are refused
                ok, gone = False, True
                log.warning("agck: %s was not copied to the durable tier: %s", self.ref(run, step), e)
            except Exception as e:     # the durable tier down, or the local copy gone: said, then retried
                ok = False
                why = f"{type(e).__name__}: {e}"
                if self._failure != why:
                    log.warning("agck: copying %s to the durable tier failed (%s); retrying", self.ref(run, step), why)
                self._failure = why
                source = self._tiers(job)[0]
                try:
                    gone = step not in source.steps(run)     # deleted or pruned meanwhile: nothing to copy
                except Exception:
                    gone = False
                if getattr(e, "verdict", False) and not gone and self._local_damaged(source, run, step):
                    # the local copy is damaged: no retry can copy it (the durable tier keeps what it has)
                    log.warning("agck: %s is damaged in the local tier: not copied", self.ref(run, step))
                    gone = True
            with self._cond:
                self._busy = None
                if ok:
                    self._failure, delay = None, RETRY_FIRST
                    self.copied += copied
                    if copied and not job.parts:    # (not a record left uncopied: no newer durable step)
                        before = self._durable_newest.get(run)
                        self._durable_newest[run] = step if before is None else max(before, step)
                elif not gone:
                    self._queue.appendleft(job)     # oldest first: it stays first
                self._cond.notify_all()
                if waiting and not self._closing:
                    self._cond.wait(WAIT_PARTS)
                elif not ok and not gone and not self._closing:
                    self._cond.wait(delay)
                    delay = min(delay * 2, RETRY_MOST)
            if ok and not job.parts:
                self._pruned({run})

    def _next_copy(self) -> Copy:
        """The next copy to make (under the lock): the oldest queued, or where newer
        plain copies of its run wait behind it, the newest of them: after an outage the
        newest state is made durable first, and the older ones follow unless retention
        drops them meanwhile (rule T5). Multi-rank parts and records keep their order."""
        job = self._queue.popleft()
        if job.parts or job.ready is not None:
            return job
        newer = [c for c in self._queue if not c.parts and c.ready is None and c.run == job.run and c.step > job.step]
        if not newer:
            return job
        pick = max(newer, key=lambda c: c.step)
        self._queue.remove(pick)
        self._queue.appendleft(job)
        return pick

    def _drop_superseded(self, run: str, step: int) -> bool:
        """Delete (run, step) from the local tier, and its queued copy, where a newer step of
        a run this store wrote is durable or queued to be (the newest durable candidate,
        never dropped itself): a backlog left by an outage is not kept past the local
        tier's limits (rule T5). Whether it was deleted."""
        with self._cond:
            if run not in self._counts:
                return False
            busy = self._busy if self._busy is not None and not self._busy.parts else None
            if busy is not None and (busy.run, busy.step) == (run, step):
                return False
            queued = [c.step for c in self._queue if not c.parts and c.run == run]
            if busy is not None and busy.run == run:
                queued.append(busy.step)
            newest_durable = self._durable_newest.get(run)
            superseded_by = max(queued + [newest_durable if newest_durable is not None else -1])
            if step >= superseded_by:
                return False
            self._queue = deque(c for c in self._queue if c.parts or (c.run, c.step) != (run, step))
        try:
            self.local.delete(run, step)
            return True
        except CheckpointNotFoundError:
            return False

    def _tiers(self, job: Copy) -> tuple[Store, Store]:
        """(from, to) for ``job``: the tiers, or their parts namespaces."""
        if job.parts:
            return self.local.parts_store(), self.durable.parts_store()
        return self.local, self.durable

    @staticmethod
    def _local_damaged(source: Store, run: str, step: int) -> bool:
        """Whether the local tier's copy of (run, step) fails verification (not the durable tier's put)."""
        try:
            source.read(run, step, verify=True)
            return False
        except AgckError as e:
            return bool(getattr(e, "verdict", False))

    def _pruned(self, runs: set[str]) -> None:
        """:meth:`_retain` each of ``runs`` and the local tier to its bytes, then collect
        the local tier's garbage if anything was deleted (on the copier's thread: never
        the pipeline's)."""
        try:
            if sum(self._retain(r) for r in sorted(runs)) + self._retain_bytes():
                self.local.collect_garbage()
        except Exception as e:      # pruning is housekeeping: said, and tried again after the next put
            log.warning("agck: pruning the local tier of %s failed: %s", self.local.url, e)

    def _copy(self, job: Copy) -> bool:
        """(run, step) read back from the local tier, verified, and committed durable;
        a multi-rank commit record only once its ``ready`` says every part is there.
        True when the durable tier holds it now; False when it was left uncopied."""
        source, target = self._tiers(job)
        if not job.parts and job.epoch is not None and self._unfenced.get(job.run) == job.epoch:
            self._fence(target, job.run, job.epoch)
        if job.step in target.steps(job.run):
            return True
        if job.ready is not None and not job.ready():
            return False
        ck = source.read(job.run, job.step, verify=True)
        if job.ready is None and not job.parts and isinstance(ck.state, dict) and list(ck.state) == [COMMIT_KEY]:
            # a multi-rank step found by the scan after a crash: its parts are not known
            # to be durable, so its record is not copied (the job's next checkpoint is)
            log.info("agck: %s is a multi-rank commit record: copied by its job, not here", self.ref(job.run, job.step))
            return False
        target.put(job.run, job.step, ck.state, meta=ck.meta, parent=ck.parent, overwrite=True, epoch=job.epoch)
        return True

    # -- reading --------------------------------------------------------------------------
    def _from_durable(self, what: Callable[[Store], Any], default):
        """``what(durable tier)``, or ``default`` while the durable tier is down (said once
        per outage): reads go on with the local tier alone (rule T4)."""
        durable = self._durable_up()
        if durable is None:
            return default
        try:
            return what(durable)
        except (StoreConnectionError, DurabilityError) as e:
            log.warning("agck: the durable tier is down (%s): reading the local tier alone", e)
            return default

    def runs(self) -> list[str]:
        return sorted(set(self.local.runs()) | set(self._from_durable(lambda d: d.runs(), [])))

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        both = sorted(set(self.local.steps(run)) | set(self._from_durable(lambda d: d.steps(run), [])))
        return both[-last:] if last else both

    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        """Every checkpoint of either tier once: the local tier's listing where it has one."""
        seen: dict[tuple[str, int], CheckpointInfo] = {}
        for infos in (self._from_durable(lambda d: d.list(run), []), self.local.list(run)):
            for info in infos:
                seen[(info.run, info.step)] = info
        return [seen[k] for k in sorted(seen)]

    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        """(run, step) from the local tier, else (missing or damaged there) from the
        durable one; a step neither holds whole is the local tier's error."""
        try:
            return self.local.read(run, step, verify=verify, map_location=map_location)
        except AgckError as e:
            if not isinstance(e, CheckpointNotFoundError) and not getattr(e, "verdict", False):
                raise
            if step not in self._from_durable(lambda d: d.steps(run), []):
                raise
            log.warning("agck: %s: the local tier's copy is %s; reading the durable one", self.ref(run, step),
                        "missing" if isinstance(e, CheckpointNotFoundError) else "damaged")
            return self.durable.read(run, step, verify=verify, map_location=map_location)

    def ref(self, run: str, step: int) -> str:
        if self._durable is None:
            return f"{self.local.ref(run, step)} (durable: {self.url}, not open)"
        return f"{self.local.ref(run, step)} (durable: {self._durable.ref(run, step)})"

    # -- journals: in the durable tier (a record is acknowledged once it is there) -------
    def log_append(self, run, records, *, sync: bool = True):
        return self.durable.log_append(run, records, sync=sync)

    def log_read(self, run: str, start: int = 0):
        return self.durable.log_read(run, start)

    def log_ref(self, run: str) -> str:
        if self._durable is None:      # (for messages: the durable tier not open yet)
            return f"{self.url} journal of {run}"
        return self._durable.log_ref(run)

    def log_runs(self) -> list[str]:
        return self.durable.log_runs()

    def log_claims(self, run: str):
        return self.durable.log_claims(run)

    @property
    def log_positions_are_bytes(self) -> bool:     # (the durable tier's journal)
        return self.durable.log_positions_are_bytes

    def _open_parts(self, create: bool):
        """A reading view of both tiers' parts namespaces (a part from the local tier,
        else the durable one); multi-rank jobs write parts through :mod:`agck.replicas`."""
        local, durable = self.local.parts_store(create), self.durable.parts_store(create)
        if local is None or durable is None:
            return local or durable
        return TieredStore(local, durable, keep_local=None, _view=True)

    # -- housekeeping: each tier's own -----------------------------------------------------
    def collect_garbage(self):
        self.local.collect_garbage()
        return self.durable.collect_garbage()

    def _check_open(self) -> None:
        if self._refused is not None:
            raise self._refused
        if self._closing:
            raise UsageError(f"{self.url} is closed: a put now would never be copied to the durable tier",
                             hint="open a new TieredStore on the tiers")

    def close(self) -> None:
        """Stop the copier after the copy in progress (queued copies are made by the
        next store opened on these tiers: it queues what the durable tier lacks), then
        close both tiers. :meth:`flush` first to make every copy now."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if not self._view:      # (a view's tiers are its store's parts namespaces: closed with it)
            self.local.close()
            if self._durable is not None:
                self._durable.close()
        super().close()


def _check_tiers(local: Store, durable: Store) -> None:
    """Two tiers are two places (STORAGE.md, tiers rule T1): the same store given twice
    (a trailing slash, a relative path, ``file://``, another host name for one server)
    would have retention drop the only copy of what it reports durable; one directory
    inside the other is refused too. An encrypted local tier over a plain durable one
    would copy in the clear what it keeps sealed."""
    a, b = local.location(), durable.location()
    if a == b:
        raise UsageError(f"the local and durable tiers are one store ({local.url}): a checkpoint reported durable "
                         "would be the local copy that retention drops",
                         hint="give the durable tier another place (another directory, database prefix, bucket "
                              "prefix)")
    if a[0] == b[0] == "file":
        import os
        inner = [x for x, y in ((a[1], b[1]), (b[1], a[1])) if x.startswith(y.rstrip(os.sep) + os.sep)]
        if inner:
            raise UsageError(f"one tier's directory is inside the other's ({a[1]}, {b[1]})",
                             hint="give the tiers directories side by side")
    if local.sealer is not None and durable.sealer is None:
        raise UsageError(f"the local tier is encrypted and the durable tier ({durable.url}) is not: its copies "
                         "would be in the clear", hint="open the durable tier with a key too")


def _shown_url(url) -> str:
    """A tier's URL for messages, without a password."""
    from .dsn import redact_dsn
    text = str(url)
    return redact_dsn(text) if text.startswith(("postgresql:", "postgres:")) or "=" in text else text

