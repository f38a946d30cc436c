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

Retention per tier: ``keep_local`` newest local checkpoints per run (older ones are
pruned from the local tier once the durable tier holds them or a newer one);
the durable tier keeps what its own ``prune`` keeps.

Not yet: replicas of a rank's part on peers (the multi-rank commit over tiers);
``parts_store`` refuses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Collection

from ..checkpoint import Checkpoint
from ..errors import AgckError, CheckpointNotFoundError, CorruptCheckpointError, UsageError
from ..names import check_run, check_step
from .base import CheckpointInfo, Store

log = logging.getLogger("agck")

RETRY_FIRST = 0.5       # seconds before a failed durable copy is tried again, doubled each time
RETRY_MOST = 30.0


class TieredStore(Store):
    """A local tier in front of a durable one (see the module docstring)."""

    def __init__(self, local: Store | str, durable: Store | str, *, durable_every: int = 1,
                 keep_local: int | None = 2, **options):
        super().__init__()
        from . import open_store
        if not isinstance(durable_every, int) or isinstance(durable_every, bool) or durable_every < 1:
            raise UsageError(f"durable_every must be a positive integer, not {durable_every!r}")
        if keep_local is not None and (not isinstance(keep_local, int) or isinstance(keep_local, bool)
                                       or keep_local < 1):
            raise UsageError(f"keep_local must be a positive integer or None, not {keep_local!r}")
        self.local = local if isinstance(local, Store) else open_store(local, **options)
        self.durable = durable if isinstance(durable, Store) else open_store(durable, **options)
        self.url = f"tiered({self.local.url} -> {self.durable.url})"
        self.durable_every, self.keep_local = durable_every, keep_local
        # the journal and AppendLogs are kept in the durable tier: its compression and its key
        self.compression, self.sealer = self.durable.compression, self.durable.sealer
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, int]] = deque()      # (run, step) to copy, oldest first
        self._busy: tuple[str, int] | None = None
        self._counts: dict[str, int] = {}                   # local puts per run by this object
        self._durable_newest: dict[str, int | None] = {}    # as the copier last saw it
        self._prune: set[str] = set()                       # runs whose local tier may hold too many
        self._failure: str | None = None                    # the durable tier's last error, while it lasts
        self._closing = False
        self.copied = 0
        for run in self.local.runs():       # after a crash: each run's newest step the durable tier lacks
            newest, durable_newest = self.last_local_step(run), self.last_durable_step(run)
            self._durable_newest[run] = durable_newest
            if newest is not None and newest > (durable_newest if durable_newest is not None else -1):
                self._queue.append((run, newest))
        self._thread = threading.Thread(target=self._copier, name="agck-durable-copier", daemon=True)
        self._thread.start()

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
        """(run, step) of the copies not yet committed durable, oldest first."""
        with self._cond:
            return ([self._busy] if self._busy else []) + list(self._queue)

    @property
    def durable_error(self) -> str | None:
        """Why the last copy to the durable tier failed, while copies are failing (None: they are not)."""
        return self._failure

    def flush(self, timeout: float | None = None) -> bool:
        """Queue each run's newest local step the durable tier lacks, then wait until
        every queued copy is durable (or ``timeout`` seconds pass); True if they are."""
        wanted = []
        for run in self.local.runs():
            newest, durable_newest = self.last_local_step(run), self.last_durable_step(run)
            if newest is not None and newest > (durable_newest if durable_newest is not None else -1):
                wanted.append((run, newest))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            for item in wanted:
                if item not in self._queue and item != self._busy:
                    self._queue.append(item)
            self._cond.notify_all()
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(1.0 if left is None else min(left, 1.0))
        return True

    # -- writing --------------------------------------------------------------------------
    def put(self, run: str, step: int, state: Any, *, meta: Any = None, parent: int | None = None,
            overwrite: bool = True, expect_unchanged: Collection[int] = (), epoch: int | None = None) -> str:
        """Put in the local tier (acknowledged local when it returns); the copy to the
        durable tier follows in the background, every ``durable_every``-th put of a run."""
        ref = self.local.put(run, step, state, meta=meta, parent=parent, overwrite=overwrite,
                             expect_unchanged=expect_unchanged, epoch=epoch)
        step = check_step(step)
        with self._cond:       # the pipeline only queues: the copier copies and prunes
            n = self._counts[run] = self._counts.get(run, 0) + 1
            if n % self.durable_every == 0:
                self._queue.append((run, step))
            if self.keep_local is not None:
                self._prune.add(run)
            self._cond.notify_all()
        return ref

    def can_confirm_unchanged(self, run: str) -> bool:
        return self.local.can_confirm_unchanged(run)

    def begin_epoch(self, run: str) -> int:
        return self.local.begin_epoch(run)

    def epoch(self, run: str) -> int | None:
        return self.local.epoch(run)

    def delete(self, run: str, step: int, *, epoch: int | None = None) -> None:
        """Delete (run, step) from both tiers (and from the copies not yet made)."""
        step = check_step(step)
        with self._cond:
            self._queue = deque(x for x in self._queue if x != (run, step))
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
        durable_newest = self._durable_newest.get(run)
        if durable_newest is None:
            durable_newest = self._durable_newest[run] = self.last_durable_step(run)
        waiting = {s for r, s in self.pending if r == run}
        deleted = 0
        for s in steps[:-self.keep_local]:
            if s in waiting or durable_newest is None or s > durable_newest:
                continue
            try:
                self.local.delete(run, s)
                deleted += 1
            except CheckpointNotFoundError:
                pass
        return deleted

    # -- the copier -----------------------------------------------------------------------
    def _copier(self) -> None:
        delay = RETRY_FIRST
        while True:
            with self._cond:
                while not self._queue and not self._prune and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return              # the next store opened on these tiers makes what is left
                if not self._queue:
                    prune, self._prune = self._prune, set()
                    self._busy = None
                else:
                    prune = set()
                    self._busy = self._queue.popleft()
            if self._busy is None:
                self._pruned(prune)
                continue
            run, step = self._busy
            gone = False
            try:
                self._copy(run, step)
                ok = True
            except Exception as e:     # the durable tier down, or the local copy gone: said, then retried
                ok = False
                why = f"{type(e).__name__}: {e}"
                if self._failure != why:
                    log.warning("agck: copying %s to the durable tier failed (%s); retrying", self.ref(run, step), why)
                self._failure = why
                try:
                    gone = step not in self.local.steps(run)     # deleted or pruned meanwhile: nothing to copy
                except Exception:
                    gone = False
                if getattr(e, "verdict", False) and not gone and self._local_damaged(run, step):
                    # the local copy is damaged: no retry can copy it (the durable tier keeps what it has)
                    log.warning("agck: %s is damaged in the local tier: not copied", self.ref(run, step))
                    gone = True
            with self._cond:
                self._busy = None
                if ok:
                    self._failure, delay = None, RETRY_FIRST
                    self.copied += 1
                    before = self._durable_newest.get(run)
                    self._durable_newest[run] = step if before is None else max(before, step)
                elif not gone:
                    self._queue.appendleft((run, step))     # oldest first: it stays first
                self._cond.notify_all()
                if not ok and not gone and not self._closing:
                    self._cond.wait(delay)
                    delay = min(delay * 2, RETRY_MOST)
            if ok and self.keep_local is not None:
                self._pruned({run})

    def _local_damaged(self, run: str, step: int) -> bool:
        """Whether the local tier's copy of (run, step) fails verification (not the durable tier's put)."""
        try:
            self.local.read(run, step, verify=True)
            return False
        except AgckError as e:
            return bool(getattr(e, "verdict", False))

    def _pruned(self, runs: set[str]) -> None:
        """:meth:`_retain` each of ``runs``, then collect the local tier's garbage if
        anything was deleted (on the copier's thread: never the pipeline's)."""
        try:
            if sum(self._retain(r) for r in sorted(runs)):
                self.local.collect_garbage()
        except Exception as e:      # pruning is housekeeping: said, and tried again after the next put
            log.warning("agck: pruning the local tier of %s failed: %s", self.local.url, e)

    def _copy(self, run: str, step: int) -> None:
        """(run, step) read back from the local tier, verified, and committed durable."""
        if step in self.durable.steps(run):
            return
        ck = self.local.read(run, step, verify=True)
        self.durable.put(run, step, ck.state, meta=ck.meta, parent=ck.parent, overwrite=True)

    # -- reading --------------------------------------------------------------------------
    def runs(self) -> list[str]:
        return sorted(set(self.local.runs()) | set(self.durable.runs()))

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        both = sorted(set(self.local.steps(run)) | set(self.durable.steps(run)))
        return both[-last:] if last else both

    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        """Every checkpoint of either tier once: the local tier's listing where it has one."""
        seen: dict[tuple[str, int], CheckpointInfo] = {}
        for tier in (self.durable, self.local):
            for info in tier.list(run):
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
            if step not in self.durable.steps(run):
                raise
            log.warning("agck: %s: the local tier's copy is %s; reading the durable one", self.ref(run, step),
                        "missing" if isinstance(e, CheckpointNotFoundError) else "damaged")
            return self.durable.read(run, step, verify=verify, map_location=map_location)

    def ref(self, run: str, step: int) -> str:
        return f"{self.local.ref(run, step)} (durable: {self.durable.ref(run, step)})"

    # -- journals: in the durable tier (a record is acknowledged once it is there) -------
    def log_append(self, run, records, *, sync: bool = True):
        return self.durable.log_append(run, records, sync=sync)

    def log_read(self, run: str, start: int = 0):
        return self.durable.log_read(run, start)

    def log_ref(self, run: str) -> str:
        return self.durable.log_ref(run)

    def log_runs(self) -> list[str]:
        return self.durable.log_runs()

    def log_claims(self, run: str):
        return self.durable.log_claims(run)

    @property
    def log_positions_are_bytes(self) -> bool:     # (the durable tier's journal)
        return self.durable.log_positions_are_bytes

    def _open_parts(self, create: bool):
        raise UsageError("a tiered store does not hold multi-rank checkpoints yet (replicas on peers are not "
                         "built)", ref=self.url, hint="give each rank's Snapshotter the durable store")

    # -- housekeeping: each tier's own -----------------------------------------------------
    def collect_garbage(self):
        self.local.collect_garbage()
        return self.durable.collect_garbage()

    def close(self) -> None:
        """Stop the copier after the copy in progress (queued copies are made by the
        next store opened on these tiers: it queues what the durable tier lacks), then
        close both tiers. :meth:`flush` first to make every copy now."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self.local.close()
        self.durable.close()
        super().close()
