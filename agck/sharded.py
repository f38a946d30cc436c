"""Multi-rank checkpoints: each rank's part, and the commit record that makes a step visible.

A checkpoint of step k taken by N ranks is N *parts* and one *commit record*:

* rank r's part is an ordinary checkpoint at step k of the *part run*
  ``"<run>.e<epoch>.r<r>"`` in the store's parts namespace
  (:meth:`agck.stores.Store.parts_store`: ``<root>/.parts`` for a file store,
  tables ``<prefix>_parts_*`` for SQLite and Postgres), so it is written with the
  store's own durability, chunking and checksums, and its metadata names the step,
  rank, world size, epoch and a random nonce of this write;
* the commit record is an ordinary checkpoint at (run, k) of the run itself,
  written last, by one rank, only once every part is durable, fenced by the
  epoch (FORMAT.md section 13 gives its shape). It names each rank's part run and
  nonce, so it binds exactly the bytes that were written for it.

The step is visible exactly when its commit record is, so a rank that dies
mid-write leaves no step k, only parts that no commit record binds (*partial*
parts, reported by :func:`partial_parts` and removed by :func:`clean_partial`).
Part runs carry the epoch, so a writer of an older incarnation never writes where
the newer one does; its commit is refused by the epoch check.

Pure store-interface code: no torch.distributed here (:mod:`agck.distributed`
runs the collective), no backend imported.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from . import codec
from .checkpoint import Checkpoint
from .errors import (AgckError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedVersionError,
                     UsageError)
from .names import check_run, check_step

COMMIT_KEY = "agck.commit"    # the single key of a commit record's state
PART_KEY = "agck.part"        # the key of a part's meta that binds it to its step
COMMIT_VERSION = 1

# decimal without sign or leading zeros (FORMAT.md 13.3): one name per (run, epoch, rank)
_PART_RUN_RE = re.compile(r"(?P<run>.+)\.e(?P<epoch>0|[1-9][0-9]{0,18})\.r(?P<rank>0|[1-9][0-9]{0,8})", re.ASCII)
_MAX_RANKS = 1 << 20   # not a threshold: a count of ranks
_MAX_EPOCH = (1 << 63) - 1


def part_run(run: str, epoch: int, rank: int) -> str:
    """The run that holds ``rank``'s parts of ``run`` written in ``epoch``."""
    check_run(run)
    name = f"{run}.e{int(epoch)}.r{int(rank)}"
    if len(name) > 200:
        raise UsageError(f"run name {run!r} is too long for a multi-rank run ({len(run)} characters)",
                         hint="multi-rank runs take names of at most about 170 characters")
    return name


def parse_part_run(name: str) -> tuple[str, int, int] | None:
    """(run, epoch, rank) of a part run, None for another name."""
    m = _PART_RUN_RE.fullmatch(name)
    if m is None:
        return None
    return m["run"], int(m["epoch"]), int(m["rank"])


def new_nonce() -> str:
    return os.urandom(12).hex()


@dataclass(frozen=True)
class PartRef:
    """Where one rank's part of a committed step is, and the nonce that binds it."""

    rank: int
    run: str      # the part run (``part_run``)
    nonce: str


@dataclass
class Commit:
    """A decoded commit record."""

    run: str
    step: int
    epoch: int
    world_size: int
    parts: list[PartRef]
    kind: str = "snapshot"        # "snapshot" (Snapshotter) or "dcp" (torch.distributed.checkpoint)
    extra: Any = None             # kind-specific plain data (DCP: its metadata)
    ref: str | None = None
    meta: Any = None              # the user's metadata, as put with the record

    def state(self) -> dict:
        """The commit record's state, as stored (FORMAT.md section 13)."""
        return {COMMIT_KEY: {"version": COMMIT_VERSION, "kind": self.kind, "epoch": self.epoch,
                             "world_size": self.world_size,
                             "parts": [[p.run, p.nonce] for p in self.parts], "extra": self.extra}}


def put_part(parts, run: str, step: int, epoch: int, rank: int, world_size: int, nonce: str, state: Any,
             **put) -> str:
    """Write ``rank``'s part of ``step`` into the parts namespace ``parts``
    (:meth:`agck.stores.Store.parts_store`): an ordinary put to the part run of
    ``epoch``, with the meta that binds it to its step and this write's ``nonce``.
    ``put``: more arguments of the put (``parent``, ``expect_unchanged``)."""
    return parts.put(part_run(run, epoch, rank), step, state,
                     meta=part_meta(run, step, epoch, rank, world_size, nonce), **put)


def commit_step(store, run: str, step: int, epoch: int, nonces: list[str], *, kind: str = "snapshot",
                extra: Any = None, meta: Any = None, parent: int | None = None) -> str:
    """Make ``step`` visible: put its commit record, binding the part of each rank
    (``nonces[rank]``, the nonce it wrote its part with), fenced by ``epoch``. Call
    only once every part is durable. Returns the record's ref."""
    commit = Commit(run=run, step=step, epoch=epoch, world_size=len(nonces),
                    parts=[PartRef(r, part_run(run, epoch, r), n) for r, n in enumerate(nonces)],
                    kind=kind, extra=extra)
    return store.put(run, step, commit.state(), meta=meta, parent=parent, epoch=epoch)


def committed(store, run: str, step: int, epoch: int, nonces: list[str]) -> bool | None:
    """After a commit whose outcome is unknown (the connection failed during it): is
    the step's commit record there, binding these parts in this epoch (True), or not
    (False)? None when the store cannot say now (unreachable). Read from the store,
    never from what this process remembers."""
    try:
        commit = as_commit(store.read(run, step))
    except CheckpointNotFoundError:
        return False
    except AgckError as e:
        return False if e.verdict else None
    return commit is not None and commit.epoch == epoch and [p.nonce for p in commit.parts] == list(nonces)


def part_meta(run: str, step: int, epoch: int, rank: int, world_size: int, nonce: str, user: Any = None) -> dict:
    """The meta a part is put with: what binds it to its step."""
    return {PART_KEY: {"run": run, "step": step, "epoch": epoch, "rank": rank, "world_size": world_size,
                       "nonce": nonce}, "user": user}


def is_commit(ck: Checkpoint) -> bool:
    """FORMAT.md 13.1: a state map whose one key is ``agck.commit``; beside other keys
    that key is the user's own (an ordinary checkpoint)."""
    return isinstance(ck.state, dict) and COMMIT_KEY in ck.state and len(ck.state) == 1


def _uint(x, top: int) -> bool:
    """An int in [0, top] (a bool is not one: msgpack keeps them apart)."""
    return type(x) is int and 0 <= x <= top


def as_commit(ck: Checkpoint) -> Commit | None:
    """The commit record ``ck`` holds, None when it is a single-process checkpoint;
    :class:`CorruptCheckpointError` (section ``commit``) when its record is malformed
    (FORMAT.md 13.3: ``kind`` any str, ``extra`` may be absent, other keys ignored)."""
    if not is_commit(ck):
        return None
    body = ck.state[COMMIT_KEY]

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"malformed commit record: {why}", ref=ck.ref, section="commit")

    if not isinstance(body, dict):
        raise bad("not a map")
    version = body.get("version")
    if type(version) is not int or version < 1:
        raise bad(f"version {version!r}")
    if version > COMMIT_VERSION:
        raise UnsupportedVersionError(f"commit record version {version}; this agck reads up to {COMMIT_VERSION}",
                                      ref=ck.ref, hint="upgrade agck to read this run")
    epoch, world, parts, kind = body.get("epoch"), body.get("world_size"), body.get("parts"), body.get("kind")
    if not _uint(epoch, _MAX_EPOCH):
        raise bad(f"epoch {epoch!r}")
    if not _uint(world, _MAX_RANKS) or world < 1:
        raise bad(f"world_size {world!r}")
    if not isinstance(kind, str):
        raise bad(f"kind {kind!r}")
    if not isinstance(parts, list) or len(parts) != world:
        raise bad(f"{len(parts) if isinstance(parts, list) else parts!r} parts for {world} ranks")
    refs = []
    for rank, p in enumerate(parts):
        if (not isinstance(p, list) or len(p) != 2 or not all(isinstance(x, str) for x in p)
                or parse_part_run(p[0]) != (ck.run, epoch, rank)):
            raise bad(f"part {rank}: {p!r} is not rank {rank}'s part of run {ck.run!r} at epoch {epoch}")
        refs.append(PartRef(rank, p[0], p[1]))
    extra = body.get("extra")
    if extra is not None and codec.plain_packed(extra) is None:
        raise bad(f"extra is a {type(extra).__name__} holding more than plain data (FORMAT.md section 5)")
    return Commit(run=ck.run, step=ck.step, epoch=epoch, world_size=world, parts=refs, kind=kind,
                  extra=extra, ref=ck.ref, meta=ck.meta)


def read_part(store, commit: Commit, rank: int, *, verify=True, map_location=None, parts=None) -> Checkpoint:
    """Rank ``rank``'s part of a committed step, verified and checked to be the part
    the commit record binds (FORMAT.md 13.4). CorruptCheckpointError, section
    ``part``, naming the rank and why, if it is missing, does not verify (whatever
    part of it failed) or is another write's; a part of a newer format version is
    UnsupportedVersionError, as for any checkpoint. ``parts``: the parts namespace
    to read (default the store's)."""
    p = commit.parts[rank]
    parts = store.parts_store() if parts is None else parts
    try:
        ck = parts.read(p.run, commit.step, verify=verify, map_location=map_location)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"rank {rank}'s part is missing ({e.reason})", ref=parts.ref(p.run, commit.step),
                                     section="part") from None
    except AgckError as e:
        if not e.verdict:      # (a newer format version: not a judgement of the part)
            raise
        where = f" (its {e.section})" if getattr(e, "section", None) else ""
        raise CorruptCheckpointError(f"rank {rank}'s part does not verify{where}: {e.reason}", ref=e.ref,
                                     section="part") from None
    return check_bound(ck, commit, rank)


def check_bound(ck: Checkpoint, commit: Commit, rank: int) -> Checkpoint:
    """``ck`` if it is rank ``rank``'s part that ``commit`` binds (its meta names the
    step, rank, world size, epoch and nonce: FORMAT.md 13.4), else CorruptCheckpointError."""
    p = commit.parts[rank]
    bound = ck.meta.get(PART_KEY) if isinstance(ck.meta, dict) else None
    want = {"run": commit.run, "step": commit.step, "epoch": commit.epoch, "rank": rank,
            "world_size": commit.world_size, "nonce": p.nonce}
    # the same keys, each value equal and of the same type (1 is not 1.0 nor true)
    if (type(bound) is not dict or bound.keys() != want.keys()
            or any(type(bound[k]) is not type(v) or bound[k] != v for k, v in want.items())):
        raise CorruptCheckpointError(f"rank {rank}'s part is not the one the commit record binds "
                                     f"(it says {bound!r})", ref=ck.ref, section="part")
    return ck


def verify_parts(store, commit: Commit, *, verify=True) -> None:
    """Read and verify every part of a committed step (raises on the first bad one):
    what makes a step verify, with its record (FORMAT.md rule 13.5)."""
    for rank in range(commit.world_size):
        read_part(store, commit, rank, verify=verify)


@dataclass
class PartialPart:
    """A part that no commit record binds: a step whose commit never happened (a rank
    or the coordinator died mid-checkpoint), or a part of an incarnation since fenced."""

    run: str
    step: int
    epoch: int
    rank: int
    ref: str
    reason: str
    removable: bool = field(default=True)   # False: it may belong to a checkpoint in flight

    def as_dict(self) -> dict:
        """The partial part as JSON-able values (``agck ls --parts --json``)."""
        return {"run": self.run, "step": self.step, "epoch": self.epoch, "rank": self.rank, "ref": self.ref,
                "reason": self.reason, "removable": self.removable}


def part_runs(store, run: str | None = None) -> list[tuple[str, str, int, int]]:
    """(part run, run, epoch, rank) of every part run in the store (of ``run``)."""
    parts = store.parts_store(create=False)
    if parts is None:
        return []
    out = []
    for name in parts.runs():
        parsed = parse_part_run(name)
        if parsed is not None and (run is None or parsed[0] == run):
            out.append((name, *parsed))
    return out


def partial_parts(store, run: str | None = None) -> list[PartialPart]:
    """Every part of ``run`` (of every run) that no commit record binds.

    A part of the run's current epoch may be a checkpoint in flight (at a new step,
    or rewriting an older one: a resumed job, a DCP save of an existing step):
    listed with ``removable=False``. Once a newer epoch begins, it is removable
    (FORMAT.md rule 13.6)."""
    found = part_runs(store, run)
    if not found:
        return []
    parts = store.parts_store()
    out: list[PartialPart] = []
    commits: dict[tuple[str, int], Commit | None] = {}
    by_run: dict[str, list] = {}
    for pr, r, epoch, rank in found:
        by_run.setdefault(r, []).append((pr, epoch, rank))
    for r, prs in sorted(by_run.items()):
        steps = set(store.steps(r))
        current = store.epoch(r)
        for pr, epoch, rank in sorted(prs):
            for step in parts.steps(pr):
                key = (r, step)
                if key not in commits:
                    commits[key] = _commit_at(store, r, step) if step in steps else None
                c = commits[key]
                if c is not None and c.epoch == epoch and rank < c.world_size and c.parts[rank].run == pr:
                    continue
                if c is None:
                    reason = "no commit record at this step" if step not in steps else \
                        "the step's commit record does not verify or is not multi-rank"
                else:
                    reason = f"the step was committed by epoch {c.epoch} with {c.world_size} ranks"
                in_flight = current is not None and epoch >= current
                out.append(PartialPart(r, step, epoch, rank, parts.ref(pr, step), reason, removable=not in_flight))
    return out


def _commit_at(store, run: str, step: int) -> Commit | None:
    """The commit record at (run, step); None where none verifies (rules 13.2 and
    13.3: a verdict on its bytes, or gone). Anything that is not a verdict (a newer
    version) is raised."""
    try:
        return as_commit(store.read(run, step))
    except AgckError as e:
        if e.verdict or isinstance(e, CheckpointNotFoundError):
            return None
        raise


def clean_partial(store, run: str | None = None) -> list[str]:
    """Delete the removable parts :func:`partial_parts` lists; returns their refs."""
    removed = []
    parts = store.parts_store(create=False)
    if parts is None:
        return removed
    for p in partial_parts(store, run):
        if not p.removable:
            continue
        try:
            parts.delete(part_run(p.run, p.epoch, p.rank), p.step)
        except CheckpointNotFoundError:
            continue
        removed.append(p.ref)
    if removed:
        parts.collect_garbage()
    return removed


def delete_parts(store, commit: Commit) -> None:
    """Delete the parts a commit record binds (after the record itself is deleted)."""
    parts = store.parts_store()
    for p in commit.parts:
        try:
            parts.delete(p.run, check_step(commit.step))
        except CheckpointNotFoundError:
            pass
