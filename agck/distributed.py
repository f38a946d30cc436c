"""Collective checkpoints under torch.distributed: every rank writes its part, one commit.

:class:`ShardedRun` runs the protocol of :mod:`agck.sharded` over a process group:

write step k (every rank, same order)
    1. write this rank's part (durable when ``put`` returns), or note why it failed;
    2. all-gather every rank's outcome (the part's nonce, or the error);
    3. rank 0, only if every part is durable: put the commit record (fenced by the
       epoch), then broadcast the outcome; every rank acknowledges the step, or
       raises the same failure, together.

restore (every rank)
    walk back from the newest committed step; at each one every rank reads the
    commit record and verifies its own part, and an all-gather decides: the step is
    taken only if every rank's part verifies, else every rank rejects it with the
    same reasons and goes one step back.

Ranks talk through a gloo group of agck's own (made collectively when the
ShardedRun is made), so the pipeline's collectives on its default group (NCCL
all-reduces) never interleave with ours, and what travels is msgpack bytes in
uint8 tensors: nothing is pickled.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Callable, Collection

import msgpack

from . import failpoints, sharded
from .checkpoint import Checkpoint
from .errors import (AgckError, CheckpointNotFoundError, ContentChangedError, DurabilityError, SnapshotError,
                     StaleEpochError, UsageError)
from .recovery import Rejection, Unsuitable, store_candidates, walk_back

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


def active() -> bool:
    """Whether a torch.distributed default process group with more than one rank is up."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Group:
    """A gloo process group of agck's own over the default group's ranks. Made
    collectively: every rank must make it at the same point of its program."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S):
        import torch
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError("no torch.distributed process group is initialized",
                             hint="call torch.distributed.init_process_group first, in every rank")
        self._torch, self._dist = torch, dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))

    # Messages travel in one collective of INLINE bytes (a length, then the message); only a
    # longer one takes a second collective of its exact size. Outcomes and step lists are
    # small, and each collective costs milliseconds with several ranks on few cores.
    INLINE = 1024

    def _frame(self, data: bytes):
        torch = self._torch
        buf = torch.zeros(self.INLINE, dtype=torch.uint8)
        buf[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        head = data[:self.INLINE - 8]
        if head:
            buf[8:8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        return buf

    def _unframe(self, buf, rest=None) -> Any:
        raw = buf.numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        data = raw[8:8 + n] if n <= self.INLINE - 8 else rest.numpy().tobytes()[:n]
        return msgpack.unpackb(data, raw=False)

    def broadcast(self, value: Any = None, src: int = 0) -> Any:
        """``value`` of rank ``src`` (plain data), on every rank."""
        torch, dist = self._torch, self._dist
        data = msgpack.packb(value, use_bin_type=True) if self.rank == src else b""
        buf = self._frame(data)
        dist.broadcast(buf, src=src, group=self.pg)
        n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
        rest = None
        if n > self.INLINE - 8:
            rest = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src else \
                torch.empty(n, dtype=torch.uint8)
            dist.broadcast(rest, src=src, group=self.pg)
        return self._unframe(buf, rest)

    def all_gather(self, value: Any) -> list:
        """Every rank's ``value`` (plain data), by rank, on every rank."""
        torch, dist = self._torch, self._dist
        data = msgpack.packb(value, use_bin_type=True)
        bufs = [torch.empty(self.INLINE, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(bufs, self._frame(data), group=self.pg)
        sizes = [int.from_bytes(b[:8].numpy().tobytes(), "little") for b in bufs]
        longest = max(sizes)
        rests = [None] * self.size
        if longest > self.INLINE - 8:
            mine = torch.zeros(longest, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            rests = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
            dist.all_gather(rests, mine, group=self.pg)
        return [self._unframe(b, r) for b, r in zip(bufs, rests)]

    def barrier(self) -> None:
        self._dist.barrier(group=self.pg)

    def close(self) -> None:
        """Tear this rank's end of the group down now. A gloo group left to be destroyed
        at interpreter exit can abort the process there ("terminate called without an
        active exception": 5 of 30 two-rank jobs that resumed at their last step).
        No barrier: a rank closing after an error must not wait for peers that may
        never come."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if self._dist.is_initialized():
            self._dist.destroy_process_group(pg)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class ShardedRun:
    """One run's multi-rank checkpoints, seen from one rank of ``group``."""

    def __init__(self, store, run: str, group: Group):
        self.store, self.run, self.group = store, run, group
        self.rank, self.world_size = group.rank, group.size
        self._committed: set[tuple[int, int]] = set()   # (epoch, step) this object committed
        # rank 0 makes the parts namespace (tables, a directory) before the others open it
        self.parts = self._from_rank0(store.parts_store, "open the store's parts namespace", send=False)
        if self.rank != 0:
            self.parts = store.parts_store()

    def _from_rank0(self, fn: Callable[[], Any], what: str, *, send: bool = True) -> Any:
        """``fn()`` on rank 0; its value (``send``) or its failure reaches every rank, so
        none waits in a collective for a rank that raised."""
        out: dict = {}
        value = None
        if self.rank == 0:
            try:
                value = fn()
                out = {"value": value if send else None}
            except Exception as e:
                out = {"error": _describe(e)}
        out = self.group.broadcast(out)
        if "error" in out:
            raise SnapshotError(f"run {self.run!r}: rank 0 could not {what}: {out['error']}", ref=self.store.url)
        return out["value"] if send else value

    def close(self) -> None:
        """Tear this rank's end of agck's process group down (see the group's ``close``)."""
        self.group.close()

    def part_run(self, epoch: int) -> str:
        """The run that holds this rank's parts written in ``epoch``."""
        return sharded.part_run(self.run, epoch, self.rank)

    def begin_epoch(self) -> int:
        """Rank 0 begins a new incarnation of the run; every rank gets its epoch."""
        return self._from_rank0(lambda: self.store.begin_epoch(self.run), "begin a new epoch")

    def clean_partial(self) -> list[str]:
        """Rank 0 removes the parts no commit record binds and none can any more
        (earlier incarnations'); every rank waits for it."""
        removed: list[str] = []
        if self.rank == 0:
            try:
                removed = sharded.clean_partial(self.store, self.run)
            except Exception as e:   # only housekeeping: `agck recover --clean` reports what is left
                log.warning("agck: run %r: removing partial parts failed: %s", self.run, _describe(e))
                removed = []
        self.group.barrier()
        return removed

    def delete_all(self, epoch: int) -> None:
        """resume=False: rank 0 deletes the run's commit records and their parts."""
        err = None
        if self.rank == 0:
            try:
                for s in self.store.steps(self.run):
                    self.store.delete(self.run, s, epoch=epoch)
                sharded.clean_partial(self.store, self.run)
            except Exception as e:
                err = _describe(e)
        err = self.group.broadcast(err)
        if err is not None:
            raise SnapshotError(f"run {self.run!r}: deleting the old checkpoints failed on rank 0: {err}",
                                ref=self.store.url)

    # -- write ---------------------------------------------------------------------
    def write(self, step: int, state: Any, *, meta: Any, parent: int | None, epoch: int,
              expect_unchanged: Collection[int] = ()) -> str:
        """Write this rank's part of ``step`` and take part in its commit; returns the
        commit record's ref once the step is committed, on every rank. Raises on every
        rank alike when it is not: :class:`ContentChangedError` when a rank's
        uncopied tensor changed (the step is dropped), :class:`StaleEpochError` when a
        newer incarnation fenced this one, else :class:`SnapshotError` naming the
        ranks that failed and why."""
        nonce = sharded.new_nonce()
        try:
            self.part_run(epoch)     # its name check, in here: it can fail on some ranks only
            if (epoch, step) in self._committed:
                # its parts are what the commit record binds: rewriting one would unbind the
                # acknowledged step (a job that resumes takes a new epoch, and new part runs)
                raise UsageError(f"step {step} of run {self.run!r} is already committed in epoch {epoch}",
                                 hint="checkpoint a later step, or begin a new epoch to rewrite it")
            sharded.put_part(self.parts, self.run, step, epoch, self.rank, self.world_size, nonce, state,
                             parent=parent, expect_unchanged=expect_unchanged)
            mine = {"ok": True, "nonce": nonce, "step": step, "epoch": epoch}
        except ContentChangedError as e:
            mine = {"ok": False, "changed": True, "error": _describe(e)}
        except Exception as e:   # reported to every rank: none may wait in the gather for this one
            mine = {"ok": False, "error": _describe(e)}
        failpoints.hit("dist.after_part")
        outcomes = self._parts_written(mine, step, epoch)
        result = None
        if self.rank == 0:
            failpoints.hit("dist.before_commit")
            nonces = [o["nonce"] for o in outcomes]
            try:
                result = {"ref": sharded.commit_step(self.store, self.run, step, epoch, nonces, meta=meta,
                                                     parent=parent)}
            except StaleEpochError as e:
                result = {"stale": str(e)}
            except DurabilityError as e:
                # the commit's outcome may be unknown (the connection failed during it): the
                # store says whether the record binding these parts is there
                there = sharded.committed(self.store, self.run, step, epoch, nonces)
                if there:
                    log.info("agck: run %r step %d: the commit's outcome was unknown (%s); its record is there",
                             self.run, step, e)
                    result = {"ref": self.store.ref(self.run, step)}
                else:
                    why = "" if there is False else "; whether it committed cannot be told now"
                    result = {"error": _describe(e) + why}
            except Exception as e:
                result = {"error": _describe(e)}
            failpoints.hit("dist.after_commit")
        result = self.group.broadcast(result)
        if "ref" in result:
            self._committed.add((epoch, step))
        if "stale" in result:
            raise StaleEpochError(result["stale"], ref=self.store.ref(self.run, step))
        if "error" in result:
            raise SnapshotError(f"step {step} of run {self.run!r}: every part is durable but the commit "
                                f"failed on rank 0: {result['error']}", ref=self.store.ref(self.run, step),
                                hint="the previous checkpoint is untouched")
        return result["ref"]

    def _parts_written(self, mine: dict, step: int, epoch: int) -> list[dict]:
        """Every rank's outcome of writing its part of ``step`` (``mine``: this rank's),
        gathered; raised on every rank alike unless every part is written, for this
        step of this epoch."""
        outcomes = self.group.all_gather(mine)
        failed = {r: o for r, o in enumerate(outcomes) if not o["ok"]}
        if not failed:      # one commit binds one step of one epoch: every rank must be writing it
            asked = {(o["step"], o["epoch"]) for o in outcomes}
            if len(asked) > 1:     # then some rank's differs from this one's
                failed = {r: {"error": f"it wrote step {o['step']} of epoch {o['epoch']}"}
                          for r, o in enumerate(outcomes) if (o["step"], o["epoch"]) != (step, epoch)}
        if failed:
            why = "; ".join(f"rank {r}: {o['error']}" for r, o in sorted(failed.items()))
            if all(o.get("changed") for o in failed.values()):
                raise ContentChangedError(f"step {step} of run {self.run!r} was not committed: {why}",
                                          ref=self.store.ref(self.run, step))
            raise SnapshotError(f"step {step} of run {self.run!r} was not committed: {why}",
                                ref=self.store.ref(self.run, step), hint="the previous checkpoint is untouched")
        return outcomes

    # -- restore -------------------------------------------------------------------
    def find(self, *, map_location=None) -> tuple[sharded.Commit | None, Checkpoint | None, list[Rejection], int]:
        """The newest step every rank can restore: (commit, this rank's part, the newer
        steps rejected (newest first, each naming the ranks whose part failed), the
        number of candidates). (None, None, rejected, n) when none can. The walk back
        is :func:`agck.recovery.walk_back`'s, with a judge that asks every rank."""
        steps = self._from_rank0(lambda: self.store.steps(self.run), "list the run's steps")
        rec = walk_back(self.run, store_candidates(self.store, self.run, steps),
                        lambda c: self._judge_everywhere(c.step, map_location), count=len(steps))
        commit, part = rec.checkpoint if rec.checkpoint is not None else (None, None)
        return commit, part, rec.rejected, len(steps)

    def _judge_everywhere(self, step: int, map_location) -> tuple[sharded.Commit, Checkpoint]:
        """(commit, this rank's part) of ``step`` if every rank can restore it. Each rank
        judges its own part and all of them learn every verdict (one all_gather): a
        rank's verdict rejects the step on every rank (a Rejection naming each such
        rank); anything that is not a verdict is raised on every rank."""
        commit = part = None
        try:
            commit = sharded.as_commit(self.store.read(self.run, step))
            if commit is None:
                mine = {"fatal": f"step {step} of run {self.run!r} is a single-process checkpoint, not a "
                                 f"multi-rank one", "usage": True}
            elif commit.world_size != self.world_size:
                mine = {"fatal": f"run {self.run!r} step {step} was checkpointed by {commit.world_size} ranks "
                                 f"and this job has {self.world_size}: a snapshot's per-rank state (its "
                                 "values and RNG states) cannot be resharded", "usage": True}
            else:
                part = sharded.read_part(self.store, commit, self.rank, map_location=map_location)
                mine = {"ok": True, "commit": [commit.epoch, [p.nonce for p in commit.parts]]}
        except AgckError as e:
            if e.verdict or isinstance(e, CheckpointNotFoundError):
                mine = {"reject": getattr(e, "reason", str(e)), "ref": getattr(e, "ref", None),
                        "section": getattr(e, "section", None)}
            else:
                mine = {"fatal": _describe(e), "local": e}
        except Exception as e:
            mine = {"fatal": _describe(e), "local": e}
        return self._decide(step, commit, part, mine)

    def _decide(self, step: int, commit, part, mine: dict) -> tuple[sharded.Commit, Checkpoint]:
        """Every rank's outcome for ``step`` (``mine``: this rank's: ``ok`` with its
        commit's epoch and nonces, ``reject`` with a verdict, or ``fatal``), gathered,
        and the step taken, rejected or raised on every rank alike."""
        local = mine.pop("local", None)
        outcomes = self.group.all_gather(mine)
        fatal = [(r, o) for r, o in enumerate(outcomes) if "fatal" in o]
        if fatal:
            if local is not None:
                raise local
            r, o = fatal[0]
            if o.get("usage"):
                raise UsageError(o["fatal"], ref=self.store.ref(self.run, step),
                                 hint="restore with the world size the run was checkpointed with, or save "
                                      "resharding-capable state (DTensor) through agck.dcp")
            raise SnapshotError(f"rank {r} cannot judge step {step} of run {self.run!r}: {o['fatal']}",
                                ref=self.store.ref(self.run, step))
        bad = [(r, o) for r, o in enumerate(outcomes) if "reject" in o]
        if bad:
            raise Unsuitable("; ".join(f"rank {r}: {o['reject']}" for r, o in bad),
                             ref=bad[0][1].get("ref") or self.store.ref(self.run, step),
                             section=bad[0][1].get("section"))
        if any(o["commit"] != outcomes[0]["commit"] for o in outcomes):
            # rewritten between two ranks' reads (a newer incarnation committed the
            # step again): restoring would mix parts of two attempts at it
            raise SnapshotError(f"the commit record of step {step} of run {self.run!r} changed while the "
                                "ranks read it", ref=self.store.ref(self.run, step),
                                hint="another job is writing this run; stop it, then restore again")
        return commit, part

