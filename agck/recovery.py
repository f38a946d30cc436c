"""Recovery: find the newest checkpoint of a run that fully verifies.

The scanner walks from the newest step back. Every candidate it passes over is
reported with its ref and the reason; nothing is skipped silently. "Verifies"
means what the store's ``read(verify=True)`` checks: for every backend the
container's header, metadata, every blob digest and the footer, that the
container names the (run, step) it is stored under, and for SQL stores that
every chunk is present, in order, of the recorded size and matching the
manifest's checksum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .checkpoint import Checkpoint
from .errors import AgckError, DependencyError, NoValidCheckpointError, StoreConnectionError
from .stores import Rejection, Store, check_run, open_store


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


def _reject(store: Store, run: str, step: int, e: AgckError) -> Rejection:
    return Rejection(run=run, step=step, ref=getattr(e, "ref", None) or store.ref(run, step),
                     reason=getattr(e, "reason", str(e)), section=getattr(e, "section", None))


def recover_run(store: Store, run: str, *, map_location=None, strict: bool = False,
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
        try:
            rec.checkpoint = store.read(run, step, verify=True, map_location=map_location)
            break
        except (StoreConnectionError, DependencyError):
            raise  # an unreachable server or a missing torch says nothing about the checkpoint
        except AgckError as e:  # corrupt, malformed, or deleted while we walked
            rec.rejected.append(_reject(store, run, step, e))
    rec.seconds = time.perf_counter() - t0
    if strict and rec.checkpoint is None and steps:
        raise NoValidCheckpointError(f"none of the {len(steps)} checkpoints of run {run!r} verifies",
                                     ref=store.url, report=rec)
    return rec


def recover(store: Store | str, run: str | None = None, *, map_location=None, strict: bool = False):
    """Recover ``run`` and return a :class:`Recovery`; with ``run=None``, recover
    every run of the store and return ``{run: Recovery}``.

    ``store`` may be a Store or a URL. ``rec.checkpoint`` is the newest
    checkpoint that verifies (None if none does, or raise with ``strict``);
    ``rec.rejected`` lists every newer one refused, with ref and reason."""
    own = not isinstance(store, Store)
    s = open_store(store)
    try:
        if run is not None:
            return recover_run(s, run, map_location=map_location, strict=strict)
        return {r: recover_run(s, r, map_location=map_location, strict=strict) for r in s.runs()}
    finally:
        if own:
            s.close()


@dataclass
class VerifyReport:
    ok: list[tuple[str, int]] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"ok": len(self.ok), "corrupt": len(self.rejected),
                "rejected": [r.as_dict() for r in self.rejected], "orphans": self.orphans}


def verify_store(store: Store, run: str | None = None, *, progress: Callable[[], Any] | None = None) -> VerifyReport:
    """Fully verify every checkpoint (of ``run``, or of all runs)."""
    rep = VerifyReport(orphans=store.orphans(run))
    for r in ([run] if run is not None else store.runs()):
        for step in store.steps(r):
            try:
                store.read(r, step, verify=True)
                rep.ok.append((r, step))
            except (StoreConnectionError, DependencyError):
                raise
            except AgckError as e:
                rep.rejected.append(_reject(store, r, step, e))
            if progress:
                progress()
    return rep
