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

import re
import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from ..checkpoint import Checkpoint
from ..errors import AgckError, CheckpointNotFoundError, CorruptCheckpointError, InvalidRunNameError

_RUN_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._\-:@+=]{0,199}$")


def check_run(run: str) -> str:
    """Run names: 1-200 of letters, digits and ``._-:@+=``, not starting with '.' or '-'.
    The same rule on every backend, so a run can move between them and no name can
    reach outside a file store's root."""
    if not isinstance(run, str) or not _RUN_RE.match(run):
        raise InvalidRunNameError(f"invalid run name {run!r}")
    return run


def check_step(step: Any) -> int:
    if type(step) is not int or not 0 <= step < (1 << 63):
        raise AgckError(f"invalid step {step!r}: steps are integers in [0, 2^63)",
                        hint="pass a non-negative int")
    return step


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
        return asdict(self)


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


class Store(ABC):
    """Backend interface. Implementations must be safe to share between threads."""

    url: str

    def __init__(self):
        self._lock = threading.RLock()

    # -- writing ---------------------------------------------------------------
    @abstractmethod
    def put(self, run: str, step: int, state: Any, *, meta: Any = None, parent: int | None = None,
            overwrite: bool = True) -> str:
        """Write a checkpoint durably; returns its ref."""

    @abstractmethod
    def delete(self, run: str, step: int) -> None:
        """Remove one checkpoint (CheckpointNotFoundError if absent)."""

    # -- reading ---------------------------------------------------------------
    @abstractmethod
    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        """Checkpoints ordered by (run, step), without reading payloads."""

    @abstractmethod
    def runs(self) -> list[str]:
        """Run names, sorted."""

    @abstractmethod
    def steps(self, run: str) -> list[int]:
        """The run's steps, ascending; the cheapest listing the backend has."""

    @abstractmethod
    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        """Load exactly (run, step). Raises CorruptCheckpointError (with ``ref``)
        on anything that fails verification, CheckpointNotFoundError if absent."""

    @abstractmethod
    def ref(self, run: str, step: int) -> str:
        """A human-readable location of (run, step)."""

    def get(self, run: str, step: int | None = None, *, verify: bool = True, map_location=None) -> Checkpoint:
        """(run, step), or with ``step=None`` the newest checkpoint of ``run`` that verifies."""
        check_run(run)
        if step is not None:
            return self.read(run, check_step(step), verify=verify, map_location=map_location)
        from ..recovery import recover_run  # recovery owns the walk-back judgement
        rec = recover_run(self, run, map_location=map_location, strict=True)
        if rec.checkpoint is None:
            raise CheckpointNotFoundError(f"run {run!r} has no checkpoints", ref=self.url,
                                          hint="check the run name (`agck ls` lists the runs)")
        return rec.checkpoint

    # -- housekeeping ----------------------------------------------------------
    def orphans(self, run: str | None = None) -> list[str]:
        """Leftovers of interrupted writes (temp files, incomplete rows)."""
        return []

    def clean_orphans(self, run: str | None = None) -> list[str]:
        """Remove what :meth:`orphans` lists; returns what was removed."""
        return []

    def prune(self, run: str, *, keep_last: int | None = None, keep_every: int | None = None,
              before: int | None = None) -> list[int]:
        """Delete old checkpoints of ``run``; returns the deleted steps.

        Keeps the newest ``keep_last``, every step divisible by ``keep_every``,
        and all steps >= ``before`` (when given, only steps below it are
        candidates). Never deletes the newest checkpoint that verifies."""
        check_run(run)
        steps = self.steps(run)
        if not steps:
            return []
        keep = set()
        if keep_last is not None:
            if keep_last < 0:
                raise AgckError(f"keep_last must be >= 0, not {keep_last}")
            keep.update(steps[len(steps) - keep_last:] if keep_last else [])
        if keep_every is not None:
            if keep_every <= 0:
                raise AgckError(f"keep_every must be > 0, not {keep_every}")
            keep.update(s for s in steps if s % keep_every == 0)
        if before is not None:
            keep.update(s for s in steps if s >= before)
        if keep_last is None and keep_every is None and before is None:
            return []
        newest_valid = self._newest_valid(run, steps)
        if newest_valid is not None:
            keep.add(newest_valid)
        doomed = [s for s in steps if s not in keep]
        for s in doomed:
            self.delete(run, s)
        return doomed

    def _newest_valid(self, run: str, steps: list[int]) -> int | None:
        for s in reversed(steps):
            try:
                self.read(run, s, verify=True)
                return s
            except CorruptCheckpointError:
                continue
            except AgckError:
                continue
        return None

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


def iter_hashed(parts: Iterable, hasher) -> Iterable:
    """Pass ``parts`` through, feeding each to ``hasher`` (whole-container checksum)."""
    for p in parts:
        hasher.update(p)
        yield p


def check_identity(ck: Checkpoint, run: str, step: int, ref: str) -> None:
    """A container must say it is (run, step): catches a file or row swapped in
    from another run or step, which its own checksums cannot."""
    if ck.run != run or ck.step != step:
        raise CorruptCheckpointError(
            f"holds run {ck.run!r} step {ck.step}, expected run {run!r} step {step}: "
            "a checkpoint from elsewhere was put in its place", ref=ref, section="metadata")
