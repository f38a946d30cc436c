"""An append-only list for the results a pipeline accumulates in the state that
:func:`agck.checkpoint_every` snapshots, stored once per segment and never packed
again::

    state = {"done": 0, "results": agck.AppendLog()}

    @agck.checkpoint_every(500, store="ckpts/", run="summaries")
    def step(state, i):
        state["results"].append(summarize(docs[i]))
        state["done"] = i + 1
        return state

A snapshot writes the items appended since the one before as one segment, a record
of kind ``s`` in the run's journal log (:mod:`agck.journalrec`, FORMAT.md §17),
made durable before the checkpoint that counts them commits; the checkpoint holds
only a reference: the log's name, how many items it counts, and its chain (which
writer's segments hold which items). So a snapshot costs what changed since the
last one, whatever the run's length. Resume reads the segments back, every record
verified; a checkpoint whose items cannot all be read (a damaged or missing
segment) is rejected with that reason and recovery walks back to an older one.

Each process that appends to a log writes its segments under a generation of its
own (a random 16-byte key): items a killed process appended after its last
acknowledged checkpoint are in the log but no checkpoint counts them, and the
resumed process writes those indices again under its own generation. The chain
says, for each generation, the first index it holds.

What a log has written is kept per destination (a store's journal log of one
run): the same log snapshotted by two snapshotters, or restored from one run and
snapshotted into another, writes every item each destination's checkpoints count
into that destination, from its first item on. A checkpoint only ever refers to
segments in its own run's log.

Items are taken by value when the snapshot is captured (encoded on the pipeline's
thread: changing an item after that is not seen). They are anything agck's codec
stores; what it cannot is refused by name at the snapshot, never pickled.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from . import journalrec
from .errors import CorruptCheckpointError, EncodeError, UsageError

KIND = "log"
# agck.capture.TAG, the mark of a captured object in a saved tree (capture imports torch,
# and `import agck` must not: tests/test_applog.py holds the two equal)
TAG = "__agck__"


class AppendLog(Sequence):
    """A list that only grows (``append``, ``extend``; read like a list), for a
    snapshotted state (see the module's docstring)."""

    _agck_log = True      # what agck.capture looks for (it sits below this module)

    def __init__(self, items: Iterable = (), *, name: str | None = None):
        if name is not None and (not isinstance(name, str) or not name):
            raise UsageError(f"an AppendLog's name must be a non-empty str, not {name!r}")
        self.name = name or uuid.uuid4().hex
        if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
            raise UsageError(f"an AppendLog starts from an iterable of items, not a {type(items).__name__}",
                             hint="AppendLog() or AppendLog([first, second])")
        self._items: list = list(items)
        self._dests: dict[str, _Destination] = {}   # what each destination's log holds of this one
        self._lock = threading.Lock()

    # -- a list that only grows ------------------------------------------------------------
    def append(self, item: Any) -> None:
        """Add one item; it is stored with the segment the next snapshot closes."""
        self._items.append(item)

    def extend(self, items: Iterable) -> None:
        """Add every item of ``items`` (an iterable, not a string), in order."""
        if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
            raise UsageError(f"AppendLog.extend takes an iterable of items, not a {type(items).__name__}")
        self._items.extend(items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        return self._items[i]

    def __iter__(self):
        return iter(self._items)

    def __eq__(self, other) -> bool:
        if isinstance(other, AppendLog):
            return self._items == other._items
        if isinstance(other, list):
            return self._items == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"AppendLog({len(self._items)} items, name={self.name!r})"

    # -- snapshots (agck.capture, agck.snapshot) -----------------------------------------------
    def _capture(self, segments: list | None) -> dict:
        """The reference a checkpoint holds; the segment of the items appended since the
        last capture into the same destination (``segments.dest``, :class:`Segments`)
        goes to ``segments`` (to be made durable there before that checkpoint)."""
        if segments is None:
            raise UsageError(f"{self!r} is stored by a snapshotter (checkpoint_every, Snapshotter), not by a put",
                             hint="put list(log) to store its items as a plain list")
        key = getattr(segments, "dest", "")
        with self._lock:
            d = self._dests.setdefault(key, _Destination())
            n = len(self._items)
            if n > d.taken:
                if d.gen is None:
                    d.gen = os.urandom(16)
                    d.chain.append([d.gen, d.taken])
                try:
                    enc, payload = journalrec.encode_value(self._items[d.taken:n], "item",
                                                           level=getattr(segments, "level", None))
                except EncodeError as e:
                    raise EncodeError(f"AppendLog {self.name!r}, items {d.taken}..{n - 1}: {e.reason}",
                                      hint="append plain data, arrays or tensors (nothing is pickled)") from None
                segments.append(Segment(self, d, d.taken, n,
                                        journalrec.record("s", self.name, d.gen, d.taken, enc, payload,
                                                          sealer=getattr(segments, "sealer", None))))
                d.taken = n
            return {TAG: KIND, "name": self.name, "count": n, "chain": [list(c) for c in d.chain]}


class _Destination:
    """What one destination's log holds of an AppendLog: the chain of generations that
    wrote there (``[generation key, first index it holds]``, oldest first), this
    process's generation there once it has written, the items encoded into segments
    for it (written or on their way) and those durable there."""
    __slots__ = ("chain", "gen", "taken", "written")

    def __init__(self, chain: Sequence = (), count: int = 0):
        self.chain = [list(c) for c in chain]
        self.gen: bytes | None = None
        self.taken = self.written = count


class Segments(list):
    """The segments one snapshot captures, and where they go: ``dest`` names the journal
    log they are written to (:meth:`agck.stores.Store.log_ref`); ``level``: compress
    them at this zstd level where that pays (the store's, where it compresses);
    ``sealer``: an encrypted store's data key, which seals their values (FORMAT.md 18.8)."""

    def __init__(self, dest: str = "", level: int | None = None, sealer=None):
        super().__init__()
        self.dest = dest
        self.level = level     # the zstd level segments are compressed at, where the store compresses
        self.sealer = sealer


class Segment:
    """A segment on its way to a log: ``log``'s items ``first..end-1``, as a record, for
    the destination ``dest``."""
    __slots__ = ("log", "dest", "first", "end", "record")

    def __init__(self, log: AppendLog, dest: _Destination, first: int, end: int, record: bytes):
        self.log, self.dest, self.first, self.end, self.record = log, dest, first, end, record

    def written(self) -> None:
        with self.log._lock:
            self.dest.written = max(self.dest.written, self.end)

    def not_written(self) -> None:
        """Not made durable: the next capture writes again from the last one that was."""
        with self.log._lock:
            self.dest.taken = min(self.dest.taken, self.dest.written)


def write_segments(store, run: str, segments: Sequence[Segment]) -> None:
    """Make ``segments`` durable in the run's journal log (one append), or mark their logs
    to write them again at the next capture and raise."""
    if not segments:
        return
    try:
        store.log_append(run, [s.record for s in segments], sync=True)
    except BaseException:
        not_written(segments)
        raise
    for s in segments:
        s.written()


def not_written(segments: Sequence[Segment]) -> None:
    for s in segments:
        s.not_written()


def has_logs(tree: Any) -> bool:
    return any(True for _ in _refs(tree))


def _refs(tree: Any):
    """(container, key) of every log reference in a restored tree."""
    stack = [tree]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if isinstance(x, dict) and x.get(TAG) == KIND:
                    yield v, k
                elif isinstance(x, (dict, list, tuple)):
                    stack.append(x)
        elif isinstance(v, list):
            for k, x in enumerate(v):
                if isinstance(x, dict) and x.get(TAG) == KIND:
                    yield v, k
                elif isinstance(x, (dict, list, tuple)):
                    stack.append(x)
        elif isinstance(v, tuple):
            stack.extend(x for x in v if isinstance(x, (dict, list, tuple)))


def resolve_checkpoint(store, run: str, ck, logs: dict | None = None) -> None:
    """A snapshot checkpoint's AppendLogs, every item it counts read and verified from
    the run's log (:func:`resolve`); nothing for any other checkpoint. The one rule
    every reader judges such a checkpoint by (:func:`agck.recovery.read_verified`)."""
    if isinstance(ck.state, dict) and "state" in ck.state:
        resolve(store, run, ck.state, ck.ref, logs)


def resolve(store, run: str, tree: Any, ref: str, logs: dict | None = None) -> None:
    """Replace every log reference in a checkpoint's ``tree`` (dicts and lists, in
    place) with the :class:`AppendLog` it stands for, its items read from the run's
    log. Raises CorruptCheckpointError (a verdict: recovery walks back past this
    checkpoint) when an item it counts is missing or damaged. ``logs``: the segments
    read so far, by run, shared by the checks of many checkpoints (the log is read once)."""
    refs = list(_refs(tree))
    if not refs:
        return
    segs = None if logs is None else logs.get(run)
    if segs is None:
        data, _ = store.log_read(run)
        segs = {}
        for _, e in journalrec.scan(data, tears=store.log_positions_are_bytes).entries:
            if e.kind == "s":
                segs.setdefault((e.name, e.key), []).append(e)
        if logs is not None:
            logs[run] = segs
    for holder, k in refs:
        holder[k] = _rebuild(holder[k], segs, store.log_ref(run), ref, store.sealer)


def _rebuild(r: dict, segs, where: str, ref: str, sealer=None) -> AppendLog:
    """The AppendLog a reference stands for (FORMAT.md 17.10 and 17.11: the reference, its items)."""
    name, count, chain = r.get("name"), r.get("count"), r.get("chain")
    if not isinstance(name, str) or type(count) is not int or count < 0 or not isinstance(chain, list) or any(
            not isinstance(c, list) or len(c) != 2 or type(c[0]) is not bytes or len(c[0]) != 16
            or type(c[1]) is not int
            for c in chain) or [c[1] for c in chain] != sorted(c[1] for c in chain):
        raise CorruptCheckpointError(f"a malformed AppendLog reference {r!r}", ref=ref, section="tree")
    items: list = []
    for i, (gen, first) in enumerate(chain):
        upto = chain[i + 1][1] if i + 1 < len(chain) else count
        if first != len(items):
            raise CorruptCheckpointError(f"AppendLog {name!r}: its chain does not follow on at item {len(items)}",
                                         ref=ref, section="tree")
        got: dict[int, Any] = {}
        for e in segs.get((name, gen), ()):      # later segments of one generation win: a rewrite after a failure
            if e.index < upto:
                try:
                    values = journalrec.decode_value(e, ref=where, sealer=sealer)
                except Exception as err:
                    if hasattr(err, "verdict") and not err.verdict:
                        raise
                    continue        # damaged: if nothing else holds its items, they are missing below
                if not isinstance(values, list):
                    continue
                for j, v in enumerate(values):
                    got[e.index + j] = v
        for idx in range(first, upto):
            if idx not in got:
                raise CorruptCheckpointError(
                    f"AppendLog {name!r}: item {idx} of the {count} this checkpoint counts is missing or damaged "
                    f"in the run's journal log", ref=where, section="log",
                    hint="an older checkpoint of the run may count fewer items")
            items.append(got[idx])
    log = AppendLog(items, name=name)
    log._dests[where] = _Destination(chain, count)     # what this run's log holds; any other gets every item
    return log
