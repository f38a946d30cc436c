"""Reading LangGraph checkpoints back from the store, and reporting a damaged one.

:class:`_CheckpointReader` is the half of ``AgckSaver`` that only reads:
``get_tuple``, ``list``, ``get_delta_channel_history`` and the reads that writing
and deleting build on (``_load``, ``_damaged``). It holds what both halves share:
the store, the value codec, and the records last written or read. Inside the
package a damaged part is a ``_Damage``; it becomes the public
:class:`DamagedCheckpointError`, with ``previous``, once, through ``_damaged``,
where the caller decides how to report it.

A damaged checkpoint
--------------------
Every read verifies checksums. A checkpoint is damaged when its record, the
stored value of one of its channels, or one of its pending writes fails
verification, is missing, or is malformed. Reading it (``get_tuple`` with or
without ``checkpoint_id``, ``list``) raises :class:`DamagedCheckpointError`, a
``CorruptCheckpointError`` naming the thread, namespace, checkpoint id, the
damaged part and its store ref, whose ``.previous`` is the newest older
checkpoint of the same namespace that reads back whole (a ``CheckpointTuple``,
or None if none does). Nothing is silently skipped: resuming from an older
checkpoint would run again the steps after it, side effects included, so that
is the caller's decision::

    try:
        graph.invoke(None, config)
    except DamagedCheckpointError as e:
        if e.previous is None:
            raise
        graph.invoke(None, e.previous.config)    # resume from the newest valid one

``AgckSaver(..., on_damaged="previous")`` makes ``get_tuple`` without a
``checkpoint_id`` (what resuming a thread reads) return ``.previous`` instead,
logging a warning that names what it passed over; everything else still raises.
``prune(strategy="keep_latest")`` keeps a damaged newest checkpoint and every one
down to the newest valid one, and deletes nothing in a namespace where none is
valid.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (BaseCheckpointSaver, CheckpointTuple, DeltaChannelHistory, get_checkpoint_id,
                                       writes_sort_key)

from ...checkpoint import Checkpoint
from ...errors import AgckError, CheckpointNotFoundError, CorruptCheckpointError, MalformedCheckpointError, UsageError
from ...recovery import Candidate, Unsuitable, store_candidates, walk_back
from ...stores import Store
from .layout import (_FORMAT, _Runs, _is_place, _is_records_run, _matches, _prefilter, _renamed, _thread_prefixes,
                     checkpoint_key)
from .values import _ValueCodec

logger = logging.getLogger("agck.langgraph")


class DamagedCheckpointError(CorruptCheckpointError):
    """A LangGraph checkpoint failed verification. ``thread_id``, ``checkpoint_ns``,
    ``checkpoint_id`` say which; ``part`` says what failed (its record, the value of a
    channel, a pending write) and ``ref`` where it is stored; ``cause`` is the agck
    error; ``previous`` is the newest older checkpoint of the namespace that reads back
    whole (a ``CheckpointTuple``), or None."""

    def __init__(self, message: str, *, ref: str | None = None, hint: str | None = None,
                 section: str | None = None, tensor: str | None = None, thread_id: str | None = None,
                 checkpoint_ns: str | None = None, checkpoint_id: str | None = None, part: str | None = None,
                 cause: BaseException | None = None, previous: Any = None):
        super().__init__(message, ref=ref, hint=hint, section=section, tensor=tensor)
        self.thread_id = thread_id
        self.checkpoint_ns = checkpoint_ns
        self.checkpoint_id = checkpoint_id
        self.part = part
        self.cause = cause
        self.previous = previous


class _Damage(Exception):
    """Internal: a part of one checkpoint failed; the public error is made once, with
    ``previous``, by whoever decides how to report it."""

    def __init__(self, part: str, cause: BaseException, ref: str | None):
        super().__init__(part)
        self.part, self.cause, self.ref = part, cause, ref


_UNSURE = object()


@dataclass(frozen=True)
class _Read:
    """What a reading generator asks of the store: ``read(run, step)``, or with
    ``step=None`` ``read_newest(run)``."""
    run: str
    step: int | None


@dataclass(frozen=True)
class _Steps:
    """What a reading generator asks of the store: ``steps(run)``."""
    run: str


def _record_places(rec: Any) -> tuple[dict, dict | None]:
    """A record's ``where`` (each channel's place) and the small values it holds
    itself (None in a record written before they moved into it); raises ValueError
    for a malformed record."""
    where = rec["where"]
    inline = rec.get("values")
    if not (isinstance(where, dict) and all(_is_place(e) for e in where.values())
            and (inline is None or isinstance(inline, dict))):
        raise ValueError("fields of the wrong types")
    return where, inline


class _CheckpointReader(BaseCheckpointSaver[int]):
    """What ``AgckSaver`` reads with: its store, its value codec, the records it last
    wrote or read, and every method that reads checkpoints back."""

    def __init__(self, store: Store, values: _ValueCodec, on_damaged: str):
        self.store = store
        self._values = values
        super().__init__(serde=values.serde)
        self.on_damaged = on_damaged
        # The records this saver last wrote or read: a put finds its parent's channel
        # locations here instead of reading the parent back (one read per super-step).
        self._recent: OrderedDict = OrderedDict()
        self._recent_lock = threading.Lock()
        self._legacy: dict[tuple[str, str], _Runs] = {}    # (thread, ns) -> its runs, where named as before

    def _runs(self, thread_id: str, ns: str) -> _Runs:
        """The runs of (thread, namespace): named as now, unless only earlier versions'
        name for them (a raw name with capitals, layout._renamed) holds records, in which
        case the thread goes on there (looked up once per saver)."""
        runs = _Runs.of(thread_id, ns)
        if not (_renamed(thread_id) or _renamed(ns)):
            return runs
        got = self._legacy.get((thread_id, ns))
        if got is None:
            old = _Runs.of(thread_id, ns, legacy=True)
            got = old if self.store.steps(old.records, last=1) and not self.store.steps(runs.records, last=1) \
                else runs
            self._legacy[(thread_id, ns)] = got
        return got

    _RECENT_MAX = 256

    def _remember(self, run: str, key: int, cid: str, versions: Mapping, where: Mapping) -> None:
        with self._recent_lock:
            self._recent[(run, key)] = (cid, dict(versions), dict(where))
            self._recent.move_to_end((run, key))
            if len(self._recent) > self._RECENT_MAX:
                self._recent.popitem(last=False)

    def _recall(self, run: str, key: int, cid: str) -> tuple | None:
        with self._recent_lock:
            hit = self._recent.get((run, key))
        return hit[1:] if hit is not None and hit[0] == cid else None

    def _forget(self) -> None:
        with self._recent_lock:
            self._recent.clear()

    # -- config helpers --
    @staticmethod
    def _thread_ns(config: RunnableConfig | None, require_ns: bool = True) -> tuple[str, str | None]:
        conf = (config or {}).get("configurable") or {}
        tid = conf.get("thread_id")
        if tid is None:
            raise UsageError("the config has no configurable.thread_id",
                             hint='pass config={"configurable": {"thread_id": ...}}')
        if not isinstance(tid, str):
            if isinstance(tid, bool) or not isinstance(tid, (int, uuid.UUID)):
                raise UsageError(f"thread_id must be a string, not {type(tid).__name__} {tid!r}")
            tid = str(tid)
        ns = conf.get("checkpoint_ns")
        if ns is None and require_ns:
            ns = ""
        if ns is not None and not isinstance(ns, str):
            raise UsageError(f"checkpoint_ns must be a string, not {type(ns).__name__} {ns!r}")
        return tid, ns

    @staticmethod
    def _config(thread_id: str, ns: str, checkpoint_id: str) -> RunnableConfig:
        return {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}}

    # -- reading ----------------------------------------------------------------------
    # The reads below are generators that yield what they need from the store (a
    # _Read or a _Steps) and are sent its answer, or thrown its error: one definition
    # of how a checkpoint is read, run by the sync methods through _sync and by the
    # async ones through _async (awaiting the store's own async reads where it has them).
    def _sync(self, reads: Iterator) -> Any:
        """Run ``reads`` against the store, on this thread."""
        try:
            ask = next(reads)
            while True:
                try:
                    got = self._ask(ask)
                except BaseException as e:
                    ask = reads.throw(e)
                else:
                    ask = reads.send(got)
        except StopIteration as done:
            return done.value

    async def _async(self, reads: Iterator) -> Any:
        """Run ``reads`` against the store's async reads (a store that has them), awaited."""
        try:
            ask = next(reads)
            while True:
                try:
                    if type(ask) is _Read:
                        got = await (self.store.aread(ask.run, ask.step) if ask.step is not None
                                     else self.store.aread_newest(ask.run))
                    else:
                        got = await self.store.asteps(ask.run)
                except BaseException as e:
                    ask = reads.throw(e)
                else:
                    ask = reads.send(got)
        except StopIteration as done:
            return done.value

    def _ask(self, ask: "_Read | _Steps") -> Any:
        if type(ask) is _Read:
            return self.store.read(ask.run, ask.step) if ask.step is not None else self.store.read_newest(ask.run)
        return self.store.steps(ask.run)

    def _load(self, runs: _Runs, key: int, expect_id: str | None = None,
              expect: tuple[str, str] | None = None, record: Checkpoint | None = None) -> CheckpointTuple | None:
        return self._sync(self._reading(runs, key, expect_id, expect, record))

    def _reading(self, runs: _Runs, key: int, expect_id: str | None = None,
                 expect: tuple[str, str] | None = None, record: Checkpoint | None = None) -> Iterator:
        """The checkpoint at ``key`` (its record already read: ``record``), or None if there
        is none (or it is another id or another thread's). Raises _Damage for a damaged part."""
        if record is not None:
            ck = record
        else:
            try:
                ck = yield _Read(runs.records, key)
            except CheckpointNotFoundError:
                return None
            except AgckError as e:
                if e.verdict:
                    raise _Damage("its record", e, self.store.ref(runs.records, key)) from None
                raise
        m = ck.meta
        try:
            thread_id, ns, cid = m["thread_id"], m["checkpoint_ns"], m["checkpoint_id"]
            parent_id = m.get("parent_checkpoint_id")
            if m.get("lg") != _FORMAT or checkpoint_key(cid) != key:
                raise ValueError("its meta does not describe this checkpoint")
        except Exception as e:
            raise _Damage("its record", MalformedCheckpointError(f"unexpected record: {e}", ref=ck.ref),
                          self.store.ref(runs.records, key)) from None
        if (expect_id is not None and cid != expect_id) or (expect is not None and (thread_id, ns) != expect):
            return None
        try:
            rec = ck.state
            body = self._values.decode(rec["checkpoint"])
            metadata = self._values.decode(rec["metadata"])
            where, inline = _record_places(rec)
            if not (isinstance(body, dict) and isinstance(metadata, dict)):
                raise ValueError("fields of the wrong types")
        except Exception as e:
            raise _Damage("its record", MalformedCheckpointError(f"unexpected record: {e}", ref=ck.ref),
                          self.store.ref(runs.records, key)) from None
        self._remember(runs.records, key, cid, body.get("channel_versions") or {}, where)
        body["channel_values"] = yield from self._channel_values(runs, where, None, key, inline)
        pending = yield from self._pending_writes(runs, key)
        return CheckpointTuple(
            config=self._config(thread_id, ns, cid),
            checkpoint=body,
            metadata=metadata,
            parent_config=self._config(thread_id, ns, parent_id) if parent_id else None,
            pending_writes=pending,
        )

    def _channel_values(self, runs: _Runs, where: dict, channels: set | None, key: int | None = None,
                        inline: dict | None = None) -> Iterator:
        """The values of ``channels`` (all when None) of the checkpoint whose record at
        ``key`` holds ``where`` and its own small values ``inline``."""
        out: dict[str, Any] = {}
        by_entry: dict[tuple[str, int], list[str]] = {}
        for c, e in where.items():
            if e is None or (channels is not None and c not in channels):
                continue
            if type(e) is list:
                by_entry.setdefault((runs.own(c), e[0]), []).append(c)
            elif e == key and inline is not None and c in inline:
                out[c] = self._value(inline, c, self.store.ref(runs.records, key))
            else:
                by_entry.setdefault((runs.values, e), []).append(c)
        for (run, e), chans in sorted(by_entry.items()):
            what = "the value of channel " + ", ".join(repr(c) for c in sorted(chans))
            entry, ref = yield from self._stored_values(runs, run, e, chans, what)
            for c in chans:
                out[c] = self._value(entry, c, ref)
        return out

    def _stored_values(self, runs: _Runs, run: str, e: int, chans: list[str], what: str) -> Iterator:
        """The entry holding ``chans`` at key ``e`` of ``run`` and its ref. The small values
        of checkpoint ``e`` are in its record, or (written by an older version, or kept
        when the record was deleted) in the values run."""
        damage = None
        if run == runs.values:
            ref = self.store.ref(runs.records, e)
            try:
                values = (yield _Read(runs.records, e)).state.get("values")
                if isinstance(values, dict) and all(c in values for c in chans):
                    return values, ref
            except CheckpointNotFoundError:
                pass
            except AgckError as err:
                if not err.verdict:
                    raise
                damage = _Damage(what, err, ref)     # unless the values run has them
            except Exception as err:
                damage = _Damage(what, MalformedCheckpointError(f"unexpected record: {err}", ref=ref), ref)
        ref = self.store.ref(run, e)
        try:
            return (yield _Read(run, e)).state, ref
        except CheckpointNotFoundError as err:
            raise damage or _Damage(what + " (its stored entry is missing)", err, ref) from None
        except AgckError as err:
            if err.verdict:
                raise damage or _Damage(what, err, ref) from None
            raise

    def _value(self, entry: Any, c: str, ref: str) -> Any:
        try:
            return self._values.decode(entry[c])
        except Exception as err:
            raise _Damage(f"the value of channel {c!r}",
                          MalformedCheckpointError(f"cannot rebuild it: {err}", ref=ref), ref) from None

    def _pending_writes(self, runs: _Runs, key: int) -> Iterator:
        run = runs.writes(key)
        rows = []
        for s in (yield _Steps(run)):
            ref = self.store.ref(run, s)
            try:
                entry = (yield _Read(run, s)).state
            except CheckpointNotFoundError:
                continue
            except AgckError as err:
                if err.verdict:
                    raise _Damage("a pending write", err, ref) from None
                raise
            try:
                task_id = entry["task_id"]
                for idx, (c, v, path) in entry["writes"].items():
                    rows.append((writes_sort_key(path, task_id, idx), (task_id, c, self._values.decode(v))))
            except Exception as err:
                raise _Damage("a pending write", MalformedCheckpointError(f"cannot rebuild it: {err}", ref=ref),
                              ref) from None
        rows.sort(key=lambda r: r[0])
        return [w for _, w in rows]

    def _previous(self, runs: _Runs, below: int, expect: tuple[str, str] | None) -> CheckpointTuple | None:
        """The newest checkpoint of the namespace below key ``below`` that verifies
        (:func:`agck.recovery.walk_back`), None if none does."""
        def judge(c: Candidate) -> CheckpointTuple:
            try:
                t = self._load(runs, c.step, expect=expect)
            except _Damage as d:
                raise Unsuitable(f"{d.part}: {getattr(d.cause, 'reason', d.cause)}", ref=d.ref) from None
            if t is None:
                raise Unsuitable("gone, or another thread's or namespace's", ref=c.ref)
            return t

        steps = [s for s in self.store.steps(runs.records) if s < below]
        return walk_back(runs.records, store_candidates(self.store, runs.records, steps), judge,
                         count=len(steps)).checkpoint

    def _identify(self, runs: _Runs, key: int, thread_id, ns, cid) -> tuple:
        """Who a damaged checkpoint is, from whichever of its parts still says: its record,
        the store's listing of it (SQL stores keep meta apart), its values or writes entries."""
        def metas():
            yield lambda: self.store.read(runs.records, key).meta
            yield lambda: next(i.meta for i in self.store.list(runs.records) if i.step == key)
            yield lambda: self.store.read(runs.values, key).meta
            for s in self.store.steps(runs.writes(key)):
                yield lambda s=s: self.store.read(runs.writes(key), s).meta
        for get in metas():
            try:
                m = get()
                if not isinstance(m, dict) or checkpoint_key(m.get("checkpoint_id")) != key:
                    continue
            except Exception:
                continue
            cid = cid or m["checkpoint_id"]
            if thread_id is None and isinstance(m.get("thread_id"), str) and isinstance(m.get("checkpoint_ns"), str):
                thread_id, ns = m["thread_id"], m["checkpoint_ns"]
            if thread_id is not None:
                break
        return thread_id, ns, cid

    def _damaged(self, runs: _Runs, key: int, thread_id: str | None, ns: str | None, cid: str | None,
                 d: _Damage) -> DamagedCheckpointError:
        if thread_id is None or cid is None:
            thread_id, ns, cid = self._identify(runs, key, thread_id, ns, cid)
        expect = (thread_id, ns) if thread_id is not None and ns is not None else None
        prev = self._previous(runs, key, expect)
        cause = d.cause
        reason = cause.reason if isinstance(cause, AgckError) else str(cause)
        ident = f"checkpoint {cid or '(id unreadable, key %d)' % key} of thread {thread_id!r} namespace {ns!r}"
        if prev is not None:
            pid = prev.config["configurable"]["checkpoint_id"]
            hint = (f"the newest valid checkpoint of the namespace is {pid} (err.previous): resume from it with "
                    "graph.invoke(None, err.previous.config), or delete the thread's damaged checkpoints")
        else:
            hint = "no earlier checkpoint of the namespace verifies: start the thread over (saver.delete_thread)"
        return DamagedCheckpointError(
            f"{ident} is damaged: {d.part} failed verification: {reason}", ref=d.ref, hint=hint,
            section=getattr(cause, "section", None), tensor=getattr(cause, "tensor", None), thread_id=thread_id,
            checkpoint_ns=ns, checkpoint_id=cid, part=d.part, cause=cause, previous=prev)

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        thread_id, ns = self._thread_ns(config)
        runs = self._runs(thread_id, ns)
        cid = get_checkpoint_id(config)
        if cid:
            key = checkpoint_key(cid)
            if key is None:
                return None
            try:
                return self._load(runs, key, expect_id=cid, expect=(thread_id, ns))
            except _Damage as d:
                raise self._damaged(runs, key, thread_id, ns, cid, d) from None
        try:
            newest = self.store.read_newest(runs.records)   # the record almost always wanted, in one read
        except AgckError as e:
            if not e.verdict:
                raise
            newest = None    # damaged: judged below, where its key is known
        else:
            if newest is None:
                return None
        for key in self._newest_first(runs.records, newest):
            try:
                t = self._load(runs, key, expect=(thread_id, ns),
                               record=newest if newest is not None and key == newest.step else None)
            except _Damage as d:
                err = self._damaged(runs, key, thread_id, ns, None, d)
                if self.on_damaged == "previous" and err.previous is not None:
                    logger.warning("%s; returning the previous valid checkpoint %s", err,
                                   err.previous.config["configurable"]["checkpoint_id"])
                    return err.previous
                raise err from None
            if t is not None:
                return t
        return None

    def _reading_newest(self, runs: _Runs, expect: tuple[str, str]) -> Iterator:
        """The namespace's newest checkpoint, when its record reads back whole and is the
        namespace's (``_UNSURE`` otherwise: ``get_tuple`` walks back and reports); None
        when it has none. Raises _Damage for a damaged part."""
        try:
            newest = yield _Read(runs.records, None)
        except AgckError as e:
            if e.verdict:
                return _UNSURE
            raise
        if newest is None:
            return None
        t = yield from self._reading(runs, newest.step, expect=expect, record=newest)
        return _UNSURE if t is None else t

    def _newest_first(self, run: str, newest: Checkpoint | None = None) -> Iterator[int]:
        """The run's steps, newest first: the newest alone (``newest``, already read, or
        asked for: the one almost always wanted, so a long thread's get costs no more
        than a short one's), the rest only if the caller goes on."""
        last = [newest.step] if newest is not None else self.store.steps(run, last=1)
        yield from last
        if last:
            yield from (s for s in reversed(self.store.steps(run)) if s < last[0])

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        if limit is not None and limit <= 0:
            return
        if config:     # None or {}: every thread, as LangGraph's own savers do
            thread_id, ns = self._thread_ns(config, require_ns=False)
            cid = get_checkpoint_id(config)
            if ns is not None:
                runs_list = [self._runs(thread_id, ns).records]
            else:
                prefixes = _thread_prefixes(thread_id)
                runs_list = [r for r in self.store.runs() if r.startswith(prefixes) and _is_records_run(r)]
        else:
            thread_id = ns = cid = None
            runs_list = [r for r in self.store.runs() if _is_records_run(r)]
        before_id = get_checkpoint_id(before) if before else None
        if before_id is not None and not isinstance(before_id, str):
            raise UsageError(f"list(before=...) has checkpoint_id {before_id!r} of type {type(before_id).__name__}",
                             hint="pass the checkpoint id as a string (str(id)), as LangGraph's configs hold it")
        before_key = checkpoint_key(before_id) if before_id else None
        only_key = None
        if cid:
            only_key = checkpoint_key(cid)
            if only_key is None:
                return

        items: list[tuple[int, str, Any]] = []
        for run in runs_list:
            if filter:
                for info in self.store.list(run):
                    if _prefilter(info.meta, filter):
                        items.append((info.step, run, info.meta))
            else:
                items += [(s, run, None) for s in self.store.steps(run)]
        items.sort(key=lambda it: (it[0], it[1]), reverse=True)

        count = 0
        for key, run, _ in items:
            if only_key is not None and key != only_key:
                continue
            if before_key is not None and key > before_key:
                continue
            runs = _Runs.from_records(run)
            expect = (thread_id, ns) if thread_id is not None and ns is not None else None
            try:
                t = self._load(runs, key, expect_id=cid or None, expect=expect)
            except _Damage as d:
                if key == before_key:   # the bound itself (or, unknowable, an id sharing its key)
                    did = self._identify(runs, key, None, None, None)[2]
                    if did is None or did >= before_id:
                        continue
                known = expect or (None, None)
                raise self._damaged(runs, key, *known, cid or None, d) from None
            if t is None:
                continue
            conf = t.config["configurable"]
            if thread_id is not None and conf["thread_id"] != thread_id:
                continue
            if before_id is not None and not conf["checkpoint_id"] < before_id:
                continue
            if not _matches(t.metadata, filter):
                continue
            yield t
            count += 1
            if limit is not None and count >= limit:
                return

    def get_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]
                                  ) -> Mapping[str, DeltaChannelHistory]:
        """As LangGraph's default (walk the parent chain, collect each channel's writes
        until an ancestor stores a value for it), reading only the records, the pending
        writes and the seed values needed, not every ancestor's whole state."""
        if not channels:
            return {}
        thread_id, ns = self._thread_ns(config)
        runs = self._runs(thread_id, ns)
        target = self.get_tuple(config)
        collected: dict[str, list] = {c: [] for c in channels}
        seeds: dict[str, Any] = {}
        remaining = set(channels)
        cursor = target.parent_config["configurable"]["checkpoint_id"] if target and target.parent_config else None
        while cursor is not None and remaining:
            key = checkpoint_key(cursor)
            if key is None:
                break
            try:
                ck = self.store.read(runs.records, key)
                if not isinstance(ck.meta, dict) or ck.meta.get("checkpoint_id") != cursor:
                    break
                try:
                    where, inline = _record_places(ck.state)
                except Exception:
                    raise _Damage("its record", MalformedCheckpointError("unexpected record", ref=ck.ref),
                                  self.store.ref(runs.records, key)) from None
                writes = self._sync(self._pending_writes(runs, key))
                found = {c for c in remaining if where.get(c) is not None}
                values = self._sync(self._channel_values(runs, where, found, key, inline))
            except CheckpointNotFoundError:
                break
            except _Damage as d:
                raise self._damaged(runs, key, thread_id, ns, cursor, d) from None
            except AgckError as e:
                if e.verdict:
                    raise self._damaged(runs, key, thread_id, ns, cursor,
                                        _Damage("its record", e, self.store.ref(runs.records, key))) from None
                raise
            for w in reversed(writes):
                if w[1] in remaining:
                    collected[w[1]].append(w)
            for c in found:
                seeds[c] = values[c]
                remaining.discard(c)
            cursor = ck.meta.get("parent_checkpoint_id")
        out: dict[str, DeltaChannelHistory] = {}
        for c in channels:
            entry: DeltaChannelHistory = {"writes": list(reversed(collected[c]))}
            if c in seeds:
                entry["seed"] = seeds[c]
            out[c] = entry
        return out
