"""Recovery: judge checkpoints, and find the newest one of a run that fully verifies.

The scanner walks from the newest step back. Every candidate it passes over is
reported with its ref and the reason; nothing is skipped silently. "Verifies"
means what the store's ``read(verify=True)`` checks: for every backend the
container's header, metadata, every blob digest and the footer, that the
container names the (run, step) it is stored under, and for SQL stores that
every chunk is present, in order, of the recorded size and matching the
manifest's checksum.

Only a verdict on a checkpoint's bytes (the ``verdict`` of its error class,
:class:`agck.errors.AgckError`) lets the scanner pass over it. Anything else (a missing torch, a ``map_location`` this machine
cannot honour, an unreachable server, a container of a newer format version)
says nothing about the checkpoint, so it is raised, never walked past, and
retention never deletes because of it.

This module works on any object with the store interface (``steps``, ``read``,
``ref``, ``delete``, ``orphans``, ``url``) and imports no backend: the stores
use it for ``get(run)`` and ``prune``, and the layers above open the stores.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from . import applog, sharded
from .checkpoint import Checkpoint
from .chunking import CheckedChunks
from .errors import AgckError, CheckpointNotFoundError, NoValidCheckpointError, UsageError
from .names import check_run

log = logging.getLogger("agck")


class Unsuitable(AgckError):
    """A judge's verdict that is not an error of the candidate's own bytes: it verifies
    but cannot be resumed from (weights only, not a framework's checkpoint), it is a
    dangling link, or another rank judged its part (the multi-rank walk). A verdict:
    the walk goes on past it, and it never leaves :func:`walk_back`."""

    verdict = True

    def __init__(self, reason: str, *, ref: str | None = None, section: str | None = None):
        super().__init__(reason, ref=ref)
        self.section = section


@dataclass
class Rejection:
    """A candidate a walk back (recovery, verify, a framework's resume scan) refused, and why."""

    run: str
    step: int | None          # None where candidates have no step (files ordered by time)
    ref: str
    reason: str
    section: str | None = None

    @property
    def path(self) -> str:
        """The candidate's location (for file candidates: its path)."""
        return self.ref

    def as_dict(self) -> dict:
        """The rejection as JSON-able values (``agck recover --json``)."""
        return asdict(self)


@dataclass
class Recovery:
    """The outcome of walking back one run: the newest candidate that verifies (what
    the judge returned for it), and every newer one refused, newest first."""

    run: str
    checkpoint: Any = None                 # None: nothing in the run verifies
    rejected: list[Rejection] = field(default_factory=list)  # newer candidates refused, newest first
    orphans: list[str] = field(default_factory=list)         # leftovers of interrupted writes
    candidates: int = 0                    # candidates the run holds
    seconds: float = 0.0
    step: int | None = None                # the chosen candidate's step
    ref: str | None = None                 # and where it is

    @property
    def path(self) -> str | None:
        """The chosen candidate's location (for file candidates: its path)."""
        return self.ref

    @property
    def walked_back(self) -> bool:
        """Whether a newer candidate was rejected on the way to the chosen one."""
        return bool(self.rejected)

    def as_dict(self) -> dict:
        """The recovery as JSON-able values (``agck recover --json``)."""
        return {"run": self.run, "step": self.step, "ref": self.ref, "candidates": self.candidates,
                "walked_back": self.walked_back, "rejected": [r.as_dict() for r in self.rejected],
                "orphans": list(self.orphans), "seconds": round(self.seconds, 6)}


@dataclass(frozen=True)
class Candidate:
    """One place a walk back may stop: its step (None if it has none) and where it is."""

    step: int | None
    ref: str


def walk_back(run: str, candidates: Iterable[Candidate], judge: Callable[[Candidate], Any], *,
              orphans: list[str] | None = None, on_reject: Callable[[Rejection], None] | None = None,
              count: int | None = None) -> Recovery:
    """The one walk back: ``candidates`` newest first; ``judge(candidate)`` returns
    what the candidate holds if it verifies, or raises. A verdict on the
    candidate's bytes (``e.verdict``) or a candidate gone while judged
    (CheckpointNotFoundError) is a :class:`Rejection`, reported to ``on_reject``,
    and the walk goes on; any other error is raised: it says nothing about the
    candidate, and walking past it could resume from an older state for no reason.
    ``count``: how many candidates there are, when ``candidates`` is a generator made
    lazily (a run of 10,000 steps usually stops at its newest)."""
    t0 = time.perf_counter()
    cands = candidates if count is not None else list(candidates)
    rec = Recovery(run=run, candidates=len(cands) if count is None else count, orphans=list(orphans or []))
    for c in cands:
        try:
            found = judge(c)
        except AgckError as e:
            if not (e.verdict or isinstance(e, CheckpointNotFoundError)):
                raise
            r = Rejection(run=run, step=c.step, ref=getattr(e, "ref", None) or c.ref,
                          reason=getattr(e, "reason", str(e)), section=getattr(e, "section", None))
            rec.rejected.append(r)
            if on_reject is not None:
                on_reject(r)
            continue
        rec.checkpoint, rec.step, rec.ref = found, c.step, c.ref
        break
    rec.seconds = time.perf_counter() - t0
    return rec


def store_candidates(store, run: str, steps: list[int]) -> Iterable[Candidate]:
    """The steps newest first, each made when the walk reaches it."""
    return (Candidate(s, store.ref(run, s)) for s in reversed(steps))


def read_verified(store, run: str, step: int, *, map_location=None, verify=True, logs: dict | None = None
                  ) -> Checkpoint:
    """(run, step) read and verified; a multi-rank commit record verifies only with
    every part it binds, a snapshot with every AppendLog item it counts (its state's
    logs rebuilt, :func:`agck.applog.resolve_checkpoint`; ``logs`` shares the run's
    log between many such checks). Raises what the read raises."""
    ck = store.read(run, step, verify=verify, map_location=map_location)
    if verify is False:
        return ck
    commit = sharded.as_commit(ck)
    if commit is not None:   # a multi-rank step verifies with all its parts
        sharded.verify_parts(store, commit)
    else:
        applog.resolve_checkpoint(store, run, ck, logs)
    return ck


def recover_run(store, run: str, *, map_location=None, strict: bool = False,
                on_candidate: Callable[[int], None] | None = None) -> Recovery:
    """Recover one run: the newest checkpoint that verifies (``.checkpoint``, a
    :class:`agck.checkpoint.Checkpoint`), with what it refers to outside itself (a
    snapshot's AppendLogs, :func:`read_verified`). With ``strict``, raise
    NoValidCheckpointError when the run holds checkpoints but none verifies (the
    error carries the report)."""
    check_run(run)
    steps = store.steps(run)

    def judge(c: Candidate) -> Checkpoint:
        if on_candidate:
            on_candidate(c.step)
        return read_verified(store, run, c.step, map_location=map_location)

    rec = walk_back(run, store_candidates(store, run, steps), judge, orphans=store.orphans(run), count=len(steps))
    if rec.checkpoint is not None:
        rec.ref = rec.checkpoint.ref or rec.ref
    if strict and rec.checkpoint is None and steps:
        raise NoValidCheckpointError(f"none of the {len(steps)} checkpoints of run {run!r} verifies",
                                     ref=store.where, report=rec)
    return rec


class WalkBackPolicies:
    """The policies :class:`agck.stores.Store` delegates to (``store.get(run)``,
    ``store.prune``), installed by agck's public face (:attr:`Store.policies`)."""

    def newest(self, store, run: str, *, map_location=None) -> Checkpoint:
        rec = recover_run(store, run, map_location=map_location, strict=True)
        if rec.checkpoint is None:
            raise CheckpointNotFoundError(f"run {run!r} has no checkpoints", ref=store.where,
                                          hint="check the run name (`agck ls` lists the runs)")
        return rec.checkpoint

    def prune(self, store, run: str, *, keep_last=None, keep_every=None, before=None, epoch=None,
              drop_unverified=False) -> list[int]:
        deleted = prune(store, run, keep_last=keep_last, keep_every=keep_every, before=before, epoch=epoch,
                        drop_unverified=drop_unverified)
        if deleted:
            store.collect_garbage()
            sharded.clean_partial(store, run)   # the parts of pruned multi-rank steps
        return deleted


POLICIES = WalkBackPolicies()


def newest_valid(store, run: str) -> tuple[int | None, list[Rejection]]:
    """The newest step of ``run`` that verifies (None if none does), and the newer
    ones rejected on the way. Raises on anything that is not a verdict."""
    rec = recover_run(store, run)
    return rec.step, rec.rejected


def prune(store, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
          before: int | None = None, epoch: int | None = None, drop_unverified: bool = False) -> list[int]:
    """Delete old checkpoints of ``run``; returns the deleted steps, ascending.

    Keeps the newest ``keep_last``, every step divisible by ``keep_every``, and
    all steps >= ``before`` (when given, only steps below it are candidates).
    Always keeps the newest checkpoint that verifies and every checkpoint newer
    than it: those did not verify here, and a verdict of damage deletes nothing by
    itself (the read that judged them may be what is wrong: a bug, a flaky disk, a
    network error). ``drop_unverified=True`` deletes those newer ones too, each
    logged with the reason it was refused. Deletes nothing when the newest valid
    checkpoint cannot be found: when no checkpoint verifies
    (NoValidCheckpointError), or when one cannot be judged here (a missing torch,
    an unreachable server: that error is raised). ``epoch`` fences each delete
    (:meth:`agck.stores.Store.begin_epoch`)."""
    check_run(run)
    for name, v, lo in (("keep_last", keep_last, 0), ("keep_every", keep_every, 1), ("before", before, 0)):
        if v is not None and (type(v) is not int or v < lo):
            raise UsageError(f"{name} must be an int >= {lo}, not {v!r}")
    if type(drop_unverified) is not bool:
        raise UsageError(f"drop_unverified must be True or False, not {drop_unverified!r}")
    if keep_last is None and keep_every is None and before is None:
        return []
    steps = store.steps(run)
    if not steps:
        return []
    keep = set(steps[len(steps) - keep_last:] if keep_last else [])
    if keep_every is not None:
        keep.update(s for s in steps if s % keep_every == 0)
    if before is not None:
        keep.update(s for s in steps if s >= before)
    doomed = [s for s in steps if s not in keep]
    if not doomed and not drop_unverified:
        return []
    valid, rejected = newest_valid(store, run)
    if valid is None:
        raise NoValidCheckpointError(f"no checkpoint of run {run!r} verifies; prune deletes nothing",
                                     ref=store.where, hint="inspect them with `agck verify`; delete by hand "
                                     "only what you are sure of")
    doomed = [s for s in doomed if s < valid]
    if drop_unverified:
        for r in rejected:
            log.warning("agck: prune deletes %s, which does not verify: %s", r.ref, r.reason)
        doomed = sorted(set(doomed) | {r.step for r in rejected if r.step is not None})
    deleted = []
    for s in doomed:
        try:
            store.delete(run, s, epoch=epoch)
        except CheckpointNotFoundError:
            continue  # removed by someone else meanwhile
        deleted.append(s)
    return deleted


@dataclass
class VerifyReport:
    ok: list[tuple[str, int]] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The report as JSON-able values (``agck verify --json``): counts, rejections, orphans."""
        return {"ok": len(self.ok), "corrupt": len(self.rejected),
                "rejected": [r.as_dict() for r in self.rejected], "orphans": self.orphans}


def verify_store(store, run: str | None = None, *, progress: Callable[[], Any] | None = None) -> VerifyReport:
    """Fully verify every checkpoint (of ``run``, or of all runs). A chunk shared by
    several checkpoints is checked once (:class:`agck.chunking.CheckedChunks`)."""
    rep = VerifyReport(orphans=store.orphans(run))
    checked = CheckedChunks()
    logs: dict = {}
    for r in ([run] if run is not None else store.runs()):
        for step in store.steps(r):
            # each checkpoint judged on its own, as a walk of one candidate
            one = walk_back(r, [Candidate(step, store.ref(r, step))],
                            lambda c: read_verified(store, r, c.step, verify=checked, logs=logs))
            if one.checkpoint is not None:
                rep.ok.append((r, step))
            else:
                rep.rejected.extend(one.rejected)
            if progress:
                progress()
    return rep
