"""Where a Snapshotter's checkpoints go and come from: one process's, or one rank's part.

Contract: :func:`open_run` chooses, once, between

- :class:`SingleRankRun`: this process owns the run; a checkpoint is one ``put``
  to the store, and restore walks back with :func:`agck.recovery.recover_run`;
- :class:`MultiRankRun`: this process is one rank of a torch.distributed job;
  a checkpoint is this rank's part of a collective write
  (:class:`agck.distributed.ShardedRun`: one part per rank, then one commit
  record), and restore takes the newest step every rank can verify.

Both implement :class:`SnapshotRun`, so the Snapshotter calls them without
asking which it has. A :class:`MultiRankRun` is made, and its ``begin_epoch``,
``find``, ``delete_all`` and ``write`` are called, collectively: by every rank,
in the same order. Neither closes the store.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Collection

from . import applog
from .distributed import Group, ShardedRun, active as dist_active
from .errors import UsageError
from .recovery import Recovery, recover_run
from .replicas import TieredShardedRun
from .sharded import is_commit
from .stores import Store
from .stores.tiered import TieredStore

log = logging.getLogger("agck")


class SnapshotRun(ABC):
    """One run's checkpoints, as a Snapshotter of this process reads and writes them."""

    #: whether a signal may add a checkpoint out of the ``every`` cadence
    checkpoint_on_signal: bool

    @abstractmethod
    def begin_epoch(self) -> int:
        """Begin a new incarnation of the run (:meth:`Store.begin_epoch`); its epoch."""

    @abstractmethod
    def find(self) -> tuple[Recovery, Any]:
        """The recovery outcome, and the record whose ``meta`` and ``ref`` stand for the
        step it found (None when it found none)."""

    def check_restorable(self, ck) -> None:
        """Raise :class:`UsageError` when this process cannot restore ``ck``."""

    @abstractmethod
    def delete_all(self, epoch: int) -> None:
        """Delete the run's checkpoints (``resume=False``)."""

    @abstractmethod
    def write(self, step: int, tree: Any, *, meta: Any, parent: int | None, epoch: int,
              expect_unchanged: Collection[int]) -> str:
        """Make ``step`` durable; its ref."""

    def log_dest(self) -> str:
        """Where the segments of this run's AppendLogs go (:class:`agck.applog.Segments`)."""
        return ""

    def write_segments(self, segments) -> None:
        """Make the segments of a snapshot's AppendLogs durable (:mod:`agck.applog`)."""
        if segments:
            applog.not_written(segments)
            raise UsageError("an AppendLog cannot be snapshotted under torch.distributed yet",
                             hint="keep the items in a list, or snapshot the log from one process")

    @abstractmethod
    def can_confirm_unchanged(self, epoch: int) -> bool:
        """Whether a write may pass tensors uncopied for the store to confirm."""

    def close(self) -> None:
        """Let go of what the run object holds (not the store)."""


class SingleRankRun(SnapshotRun):
    checkpoint_on_signal = True

    def __init__(self, store: Store, run: str):
        self.store, self.run = store, run

    def begin_epoch(self) -> int:
        return self.store.begin_epoch(self.run)

    def find(self) -> tuple[Recovery, Any]:
        recovery = recover_run(self.store, self.run)     # AppendLogs rebuilt by its judge (read_verified)
        return recovery, recovery.checkpoint

    def log_dest(self) -> str:
        return self.store.log_ref(self.run)

    def write_segments(self, segments) -> None:
        applog.write_segments(self.store, self.run, segments)

    def check_restorable(self, ck) -> None:
        if ck is not None and is_commit(ck):
            raise UsageError(f"run {self.run!r} step {ck.step} was checkpointed under torch.distributed "
                             f"with world size {next(iter(ck.state.values()))['world_size']}, and this "
                             "process runs alone (world size 1): a snapshot's per-rank state (its values and "
                             "RNG states) cannot be resharded", ref=ck.ref,
                             hint="restore it under torch.distributed with the same world size")

    def delete_all(self, epoch: int) -> None:
        old = self.store.steps(self.run)
        if old:
            log.warning("agck: resume=False: deleting %d old checkpoints of run %r (steps %d..%d)",
                        len(old), self.run, old[0], old[-1])
            for s in old:
                self.store.delete(self.run, s, epoch=epoch)

    def write(self, step, tree, *, meta, parent, epoch, expect_unchanged) -> str:
        return self.store.put(self.run, step, tree, meta=meta, parent=parent, expect_unchanged=expect_unchanged,
                              epoch=epoch)

    def can_confirm_unchanged(self, epoch: int) -> bool:
        return self.store.can_confirm_unchanged(self.run)


class MultiRankRun(SnapshotRun):
    # the ranks would not agree on the step of an extra one
    checkpoint_on_signal = False

    def __init__(self, sharded: ShardedRun):
        self.sharded = sharded

    def begin_epoch(self) -> int:
        epoch = self.sharded.begin_epoch()
        self.sharded.clean_partial()   # earlier incarnations' uncommitted parts can never commit now
        return epoch

    def find(self) -> tuple[Recovery, Any]:
        commit, ck, rejected, candidates = self.sharded.find()
        # the commit record, not this rank's part, carries the user's meta and names the step
        return Recovery(run=self.sharded.run, checkpoint=ck, rejected=rejected, candidates=candidates,
                        step=None if ck is None else ck.step, ref=None if ck is None else ck.ref), commit

    def delete_all(self, epoch: int) -> None:
        self.sharded.delete_all(epoch)

    def write(self, step, tree, *, meta, parent, epoch, expect_unchanged) -> str:
        return self.sharded.write(step, tree, meta=meta, parent=parent, epoch=epoch,
                                  expect_unchanged=expect_unchanged)

    def can_confirm_unchanged(self, epoch: int) -> bool:
        return self.sharded.parts.can_confirm_unchanged(self.sharded.part_run(epoch))

    def close(self) -> None:
        self.sharded.close()


def open_run(store: Store, run: str, distributed: bool | None) -> SnapshotRun:
    """The run object for ``distributed`` (None: multi-rank whenever a default process
    group of more than one rank is up). Multi-rank is collective: every rank makes it
    at the same point of its program."""
    if distributed or (distributed is None and dist_active()):
        if isinstance(store, TieredStore):      # parts on this host, on peers, then durable
            return MultiRankRun(TieredShardedRun(store, run, Group()))
        return MultiRankRun(ShardedRun(store, run, Group()))
    return SingleRankRun(store, run)
