"""Recovery: judge checkpoints, and find the newest one of a run that fully verifies.

The scanner walks from the newest step back. Every candidate it passes over is
reported with its ref and the reason; nothing is skipped silently. "Verifies"
means what the store's ``read(verify=True)`` checks: for every backend the
container's header, metadata, every blob digest and the footer, that the
container names the (run, step) it is stored under, and for SQL stores that
every chunk is present, in order, of the recorded size and matching the
manifest's checksum.

Only a verdict on a checkpoint's bytes (:func:`is_verdict`) lets the scanner
pass over it. Anything else (a missing torch, a ``map_location`` this machine
cannot honour, an unreachable server, a container of a newer format version)
says nothing about the checkpoint, so it is raised, never walked past, and
retention never deletes because of it.

This module works on any object with the store interface (``steps``, ``read``,
``ref``, ``delete``, ``orphans``, ``url``) and imports no backend: the stores
use it for ``get(run)`` and ``prune``, and the layers above open the stores.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from . import sharded
from .checkpoint import Checkpoint
from .chunking import CheckedChunks
from .errors import (AgckError, CheckpointNotFoundError, CorruptCheckpointError, FormatError,
                     NoValidCheckpointError, UnsupportedVersionError, UsageError)
from .names import check_run


def is_verdict(e: BaseException) -> bool:
    """True when ``e`` judges the checkpoint's own bytes (damaged, truncated,
    malformed, not a container at all), so an earlier checkpoint may stand in.

    A newer format version is not a verdict: this reader cannot judge it, and
    resuming from an older checkpoint would overwrite the newer run."""
    if isinstance(e, UnsupportedVersionError):
        return False
    return isinstance(e, (CorruptCheckpointError, FormatError))


@dataclass
class Rejection:
    """A candidate recovery (or verify) refused, and why."""

    run: str
    step: int
    ref: str
    reason: str
    section: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Recovery:
    """The outcome of recovering one run."""

    run: str
    checkpoint: Checkpoint | None          # None: nothing in the run verifies
    rejected: list[Rejection] = field(default_factory=list)  # newer candidates refused, newest first
    orphans: list[str] = field(default_factory=list)         # leftovers of interrupted writes
    candidates: int = 0                    # checkpoints the run holds
    seconds: float = 0.0

    @property
    def step(self) -> int | None:
        return None if self.checkpoint is None else self.checkpoint.step

    @property
    def ref(self) -> str | None:
        return None if self.checkpoint is None else self.checkpoint.ref

    @property
    def walked_back(self) -> bool:
        return bool(self.rejected)

    def as_dict(self) -> dict:
        return {"run": self.run, "step": self.step, "ref": self.ref, "candidates": self.candidates,
                "walked_back": self.walked_back, "rejected": [r.as_dict() for r in self.rejected],
                "orphans": list(self.orphans), "seconds": round(self.seconds, 6)}


def _reject(store, run: str, step: int, e: AgckError) -> Rejection:
    return Rejection(run=run, step=step, ref=getattr(e, "ref", None) or store.ref(run, step),
                     reason=getattr(e, "reason", str(e)), section=getattr(e, "section", None))


def _judge(store, run: str, step: int, *, map_location=None, verify=True
           ) -> tuple[Checkpoint | None, Rejection | None]:
    """(checkpoint, None) if it verifies, (None, rejection) on a verdict; raises
    anything else. A checkpoint deleted while we look is rejected as gone. A
    multi-rank commit record verifies only with every part it binds."""
    try:
        ck = store.read(run, step, verify=verify, map_location=map_location)
        commit = sharded.as_commit(ck)
        if commit is not None and verify is not False:   # a multi-rank step verifies with all its parts
            sharded.verify_parts(store, commit)
        return ck, None
    except AgckError as e:
        if is_verdict(e) or isinstance(e, CheckpointNotFoundError):
            return None, _reject(store, run, step, e)
        raise


def recover_run(store, run: str, *, map_location=None, strict: bool = False,
                on_candidate: Callable[[int], None] | None = None) -> Recovery:
    """Recover one run. With ``strict``, raise NoValidCheckpointError when the
    run holds checkpoints but none verifies (the error carries the report)."""
    check_run(run)
    t0 = time.perf_counter()
    steps = store.steps(run)
    rec = Recovery(run=run, checkpoint=None, candidates=len(steps), orphans=store.orphans(run))
    for step in reversed(steps):
        if on_candidate:
            on_candidate(step)
        ck, rejection = _judge(store, run, step, map_location=map_location)
        if ck is not None:
            rec.checkpoint = ck
            break
        rec.rejected.append(rejection)
    rec.seconds = time.perf_counter() - t0
    if strict and rec.checkpoint is None and steps:
        raise NoValidCheckpointError(f"none of the {len(steps)} checkpoints of run {run!r} verifies",
                                     ref=store.url, report=rec)
    return rec


def newest_valid(store, run: str) -> tuple[int | None, list[Rejection]]:
    """The newest step of ``run`` that verifies (None if none does), and the newer
    ones rejected on the way. Raises on anything that is not a verdict."""
    rec = recover_run(store, run)
    return rec.step, rec.rejected


def prune(store, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
          before: int | None = None, epoch: int | None = None) -> list[int]:
    """Delete old checkpoints of ``run``; returns the deleted steps, ascending.

    Keeps the newest ``keep_last``, every step divisible by ``keep_every``, and
    all steps >= ``before`` (when given, only steps below it are candidates).
    Always keeps the newest checkpoint that verifies. Deletes nothing when that
    checkpoint cannot be found: when no checkpoint verifies
    (NoValidCheckpointError), or when one cannot be judged here (a missing
    torch, an unreachable server: that error is raised). ``epoch`` fences each
    delete (:meth:`agck.stores.Store.begin_epoch`)."""
    check_run(run)
    for name, v, lo in (("keep_last", keep_last, 0), ("keep_every", keep_every, 1), ("before", before, 0)):
        if v is not None and (type(v) is not int or v < lo):
            raise UsageError(f"{name} must be an int >= {lo}, not {v!r}")
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
    if not doomed:
        return []
    valid, _ = newest_valid(store, run)
    if valid is None:
        raise NoValidCheckpointError(f"no checkpoint of run {run!r} verifies; prune deletes nothing",
                                     ref=store.url, hint="inspect them with `agck verify`; delete by hand "
                                     "only what you are sure of")
    deleted = []
    for s in doomed:
        if s == valid:
            continue
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
        return {"ok": len(self.ok), "corrupt": len(self.rejected),
                "rejected": [r.as_dict() for r in self.rejected], "orphans": self.orphans}


def verify_store(store, run: str | None = None, *, progress: Callable[[], Any] | None = None) -> VerifyReport:
    """Fully verify every checkpoint (of ``run``, or of all runs). A chunk shared by
    several checkpoints is checked once (:class:`agck.chunking.CheckedChunks`)."""
    rep = VerifyReport(orphans=store.orphans(run))
    checked = CheckedChunks()
    for r in ([run] if run is not None else store.runs()):
        for step in store.steps(r):
            ck, rejection = _judge(store, r, step, verify=checked)
            if ck is not None:
                rep.ok.append((r, step))
            else:
                rep.rejected.append(rejection)
            if progress:
                progress()
    return rep
