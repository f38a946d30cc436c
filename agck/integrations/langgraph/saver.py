"""``AgckSaver``: the LangGraph checkpointer. It adds to its reading half
(``reading._CheckpointReader``) everything that changes the store (``put``,
``put_writes``, deleting, copying, pruning), its construction and lifecycle, and
the async form of every method (the sync one on the saver's worker threads, as
many as the store has connections: an asyncio server's conversations wait for
one without holding a thread each).

A ``put`` writes its record (holding the small values it changed) and an entry
per large value with one ``put_many`` of the store: on SQLite and Postgres one
transaction (one commit), on the file store one file after another with the
record last; a checkpoint without large values is one store entry. Either way it
is durable before ``put`` returns, and a crash leaves a checkpoint either
complete or not there (on the file store, at worst an unreferenced large value).
Deleting (``delete_thread``, ``prune``, ``delete_for_runs``) removes store
checkpoints, records before the values they use and a thread's records newest
first, so a crash part way leaves older checkpoints whole; a deleted record's
small values that a remaining checkpoint uses are first written to the values
run (see ``layout``); on an incremental store the
chunks they no longer use are freed by ``saver.store.collect_garbage()`` (``agck
gc STORE``).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (WRITES_IDX_MAP, ChannelVersions, Checkpoint, CheckpointMetadata,
                                       CheckpointTuple, DeltaChannelHistory, get_checkpoint_id,
                                       get_checkpoint_metadata)

from ...errors import AgckError, CheckpointExistsError, CheckpointNotFoundError, EncodeError, UsageError
from ...stores import PutEntry, Store, open_store
from .layout import (_FORMAT, _MAX_STEP, _OWN_ENTRY_BYTES, _UNDECIDED, _is_lg_run, _is_records_run,
                     _metadata_projection, _name_part, _Runs, _task_slot, _thread_prefix, _thread_prefixes,
                     checkpoint_key)
from .reading import _UNSURE, _CheckpointReader, _Damage
from .values import _normalize_types, _Refused, _ValueCodec

logger = logging.getLogger("agck.langgraph")

_END = object()   # alist's next() in a worker thread: a StopIteration cannot cross the await


class _MustRead(Exception):
    """A put that its async form runs on a worker thread (see ``_plan_put``)."""


@dataclass
class _PutPlan:
    """A put's store entries (the record last) and what it remembers once they are written."""

    runs: _Runs
    key: int
    cid: str
    thread_id: str
    ns: str
    where_txt: str
    ref: str
    versions: Mapping
    where: dict
    entries: list

    def refused(self, e: EncodeError) -> EncodeError:
        """agck's codec refused a value (an object array): say whose."""
        reason = e.reason              # the path in the record's small values is the channel's
        if reason.startswith("state['values']"):
            reason = "state" + reason[len("state['values']"):]
        return EncodeError(f"checkpoint {self.cid} of {self.where_txt}: channel value {reason}",
                           ref=e.ref or self.ref, hint=e.hint)


class _Workers:
    """The threads a saver's async methods run on: ``size`` of them, started at first use."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="agck-saver")
            return self._pool

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


class AgckSaver(_CheckpointReader):
    """A LangGraph checkpointer on an agck store (see the package's docstring).

    ``store``: an agck ``Store`` (not closed by the saver) or a store URL (a directory,
    ``sqlite:///...``, ``postgresql://...``), opened with ``open_options`` (as
    ``agck.open_store`` takes them) and closed by :meth:`close`. ``allowed_types``:
    classes, or (module, name) pairs, that stored values may hold beyond LangGraph's
    safe list. ``on_damaged``: ``"raise"`` (the default) or ``"previous"``, what
    ``get_tuple`` without a checkpoint id does when the newest checkpoint is damaged."""

    def __init__(self, store: Store | str, *, allowed_types: Iterable = (), on_damaged: str = "raise",
                 **open_options):
        if on_damaged not in ("raise", "previous"):
            raise UsageError(f"on_damaged must be 'raise' or 'previous', not {on_damaged!r}")
        if isinstance(store, Store):
            if open_options:
                raise UsageError(f"options {sorted(open_options)} are for opening a store URL; this store is open",
                                 ref=store.url)
            self._own = False
        else:
            store, self._own = open_store(store, **open_options), True
        super().__init__(store, _ValueCodec(_normalize_types(allowed_types)), on_damaged)
        self._workers = _Workers(getattr(store, "pool_size", 4))   # shared with clones

    # -- lifecycle --
    def close(self) -> None:
        """End the async methods' worker threads; close the store if the saver opened it."""
        self._workers.shutdown()     # idle threads end; a later async call starts them again
        if self._own:
            self.store.close()

    def __enter__(self) -> "AgckSaver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "AgckSaver":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<AgckSaver {self.store.url}>"

    def with_allowlist(self, extra_allowlist) -> "AgckSaver":
        """A shallow copy whose allowlist also holds ``extra_allowlist`` (LangGraph calls this
        when it compiles a graph in strict msgpack mode, with the graph's state types)."""
        extra = _normalize_types(extra_allowlist)
        if extra <= self._values.allowed:
            return self
        clone = copy.copy(self)
        clone._values = _ValueCodec(self._values.allowed | extra)
        clone.serde = clone._values.serde
        clone._own = False   # the original owns the store
        return clone

    def get_next_version(self, current: Any, channel: Any = None) -> Any:
        if current is None:
            return 1
        if isinstance(current, int) and not isinstance(current, bool):
            return current + 1
        if isinstance(current, float):
            return int(current) + 1
        if isinstance(current, str) and current.split(".")[0].isdigit():   # written by a saver with string versions
            return f"{int(current.split('.')[0]) + 1:032}.{random.random():016}"
        raise UsageError(f"channel {channel!r} has a version of type {type(current).__name__}: {current!r}")

    def _encode(self, value: Any, what: str, ref: str | None, size: list | None = None) -> Any:
        try:
            return self._values.encode(value, [0] if size is None else size)
        except _Refused as e:
            path = "".join(reversed(e.path))
            raise EncodeError(f"{what}{path}: {e.msg}", ref=ref, hint=e.hint) from None

    def _put_entry(self, run: str, key: int, state: Any, meta: dict, runs: _Runs, cid: str, where_txt: str,
                   parent: int | None = None) -> None:
        """Put one part of checkpoint ``cid`` at ``key``, replacing one only if it is ``cid``'s
        own (a put repeated) or belongs to no readable checkpoint."""
        try:
            try:
                self.store.put(run, key, state, meta=meta, parent=parent, overwrite=False)
            except CheckpointExistsError:
                self._same_checkpoint(runs, key, cid, where_txt)
                self.store.put(run, key, state, meta=meta, parent=parent)
        except EncodeError as e:   # agck's codec refused a value (an object array): say whose
            raise EncodeError(f"checkpoint {cid} of {where_txt}: channel value {e.reason}",
                              ref=self.store.ref(run, key), hint=e.hint) from None

    # -- writing ----------------------------------------------------------------------
    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        plan = self._plan_put(config, checkpoint, metadata, new_versions)
        try:
            self.store.put_many(plan.entries)   # one transaction on the SQL stores; the record last on any
        except CheckpointExistsError:           # a put repeated, or a key taken: decided entry by entry
            self._put_one_by_one(plan)
        except EncodeError as e:
            raise plan.refused(e) from None
        return self._put_done(plan)

    def _plan_put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                  new_versions: ChannelVersions, *, may_read: bool = True) -> "_PutPlan":
        """The store entries of a put: every value encoded, the record last. Without
        ``may_read``, raises _MustRead, before encoding anything, where placing an
        unchanged channel needs a read (its parent's record is not among those this
        saver last wrote or read)."""
        thread_id, ns = self._thread_ns(config)
        cid = checkpoint.get("id")
        runs = self._runs(thread_id, ns)
        key = checkpoint_key(cid)
        where_txt = f"thread {thread_id!r} namespace {ns!r}"
        if key is None:
            raise UsageError(f"checkpoint id {cid!r} of {where_txt} is not a UUID in canonical form",
                             ref=f"{self.store.url} run {runs.records}",
                             hint="let LangGraph make checkpoint ids (langgraph.checkpoint.base.id.uuid6): "
                                  "AgckSaver orders a thread's checkpoints by them")
        parent_id = (config.get("configurable") or {}).get("checkpoint_id")
        parent_key = checkpoint_key(parent_id) if parent_id else None
        ref = self.store.ref(runs.records, key)
        values = checkpoint.get("channel_values") or {}
        versions = checkpoint.get("channel_versions") or {}

        # where the unchanged channels are, first: a put that must read for it reads before it encodes
        unchanged = [c for c in versions if c not in new_versions]
        located = self._locate(runs, key, parent_id, parent_key, {c: versions[c] for c in unchanged}, where_txt,
                               may_read) if unchanged else {}
        where: dict[str, Any] = {}
        grouped: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for c, v in new_versions.items():
            if c not in versions:
                continue
            if c in values:
                size = [0]
                tree = self._encode(values[c], f"checkpoint {cid} of {where_txt}: channel {c!r}", ref, size)
                if size[0] >= _OWN_ENTRY_BYTES:
                    own[c], where[c] = tree, [key]
                else:
                    grouped[c], where[c] = tree, key
            else:
                where[c] = None    # a version without a value (an emptied channel)
        if own and not may_read:
            raise _MustRead   # a large value: encoded, hashed and written off the event loop, by put
        where.update(located)

        rest = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        full_metadata = get_checkpoint_metadata(config, metadata)
        record = {
            "checkpoint": self._encode(rest, f"checkpoint {cid} of {where_txt}: field", ref),
            "metadata": self._encode(full_metadata, f"checkpoint {cid} of {where_txt}: metadata", ref),
            "where": where,
        }
        if grouped:    # the small values it changed travel in the record: one store entry, one row
            record["values"] = grouped
        proj, full = _metadata_projection(full_metadata)
        meta = {"lg": _FORMAT, "thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid,
                "parent_checkpoint_id": parent_id if isinstance(parent_id, str) else None,
                "metadata": proj, "mfull": full}
        vmeta = {"lg": _FORMAT, "thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid}
        entries = [PutEntry(runs.own(c), key, {c: tree}, {**vmeta, "channel": c}, overwrite=False)
                   for c, tree in own.items()]
        entries.append(PutEntry(runs.records, key, record, meta, parent=parent_key, overwrite=False))  # the commit
        return _PutPlan(runs, key, cid, thread_id, ns, where_txt, ref, versions, where, entries)

    def _put_one_by_one(self, plan: "_PutPlan") -> None:
        for e in plan.entries:
            self._put_entry(e.run, plan.key, e.state, e.meta, plan.runs, plan.cid, plan.where_txt, parent=e.parent)

    def _put_done(self, plan: "_PutPlan") -> RunnableConfig:
        self._remember(plan.runs.records, plan.key, plan.cid, plan.versions, plan.where)
        return self._config(plan.thread_id, plan.ns, plan.cid)

    def _same_checkpoint(self, runs: _Runs, key: int, cid: str, where_txt: str) -> None:
        """Whether (run, key) may be replaced by checkpoint ``cid``: it holds ``cid`` (a put
        repeated), nothing, or a damaged record; not another checkpoint's."""
        try:
            ck = self.store.read(runs.records, key)
        except CheckpointNotFoundError:
            return
        except AgckError as e:
            if e.verdict:
                return
            raise
        other = ck.meta.get("checkpoint_id") if isinstance(ck.meta, dict) else None
        if other != cid:
            raise CheckpointExistsError(
                f"checkpoint {cid} of {where_txt} has the same key ({key}) as checkpoint {other}, already stored: "
                "two checkpoints made in the same 100 ns", ref=self.store.ref(runs.records, key),
                hint="write each thread from one process at a time; put the checkpoint again with a new id")

    def _locate(self, runs: _Runs, key: int, parent_id: Any, parent_key: int | None, wanted: dict,
                where_txt: str, may_read: bool = True) -> dict:
        """Where the values of unchanged channels are: in the parent's record if it has
        them at these versions (what LangGraph does), else in the newest earlier record
        that has (two branches forked from one checkpoint can give one version two values,
        so a later record is not searched). A channel found nowhere is left out, as
        LangGraph's own savers do."""
        found: dict[str, Any] = {}
        # the parent whatever its key: a child made on a host whose clock is behind has a lower id
        candidates: Iterable[int] = [parent_key] if parent_key is not None and parent_key != key else []
        tried = set()
        hit = self._recall(runs.records, parent_key, parent_id) if candidates else None
        if hit is not None:
            pv, pw = hit
            for c in list(wanted):
                if c in pw and pv.get(c) == wanted[c]:
                    found[c] = pw[c]
                    del wanted[c]
            if not wanted:
                return found
        if not may_read:
            raise _MustRead

        def older():
            yield from candidates
            for s in reversed(self.store.steps(runs.records)):
                if s < key:
                    yield s

        for s in older():
            if s in tried:
                continue
            tried.add(s)
            try:
                ck = self.store.read(runs.records, s)
                rec = ck.state
                pv = self._values.decode(rec["checkpoint"]).get("channel_versions") or {}
                pw = rec["where"]
            except CheckpointNotFoundError:
                continue
            except Exception as e:   # a damaged older record: the value may be found further back
                if isinstance(e, AgckError) and not e.verdict:
                    raise
                continue
            for c in list(wanted):
                if c in pw and pv.get(c) == wanted[c]:
                    found[c] = pw[c]
                    del wanted[c]
            if not wanted:
                break
        if wanted:
            logger.warning("%s: channels %s have versions no stored checkpoint has a value for; they are left out",
                           where_txt, sorted(wanted))
        return found

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        plan = self._plan_writes(config, writes, task_id, task_path)
        if plan is not None:
            self._put_writes(*plan)

    def _plan_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                     task_path: str) -> tuple | None:
        """What ``put_writes`` stores, encoded: None when there is nothing to store."""
        thread_id, ns = self._thread_ns(config)
        cid = (config.get("configurable") or {}).get("checkpoint_id")
        key = checkpoint_key(cid)
        where_txt = f"thread {thread_id!r} namespace {ns!r}"
        if key is None:
            raise UsageError(f"put_writes for {where_txt} needs the checkpoint id (a canonical UUID) of the "
                             f"checkpoint the writes follow, not {cid!r}")
        runs = self._runs(thread_id, ns)
        run = runs.writes(key)
        slot = _task_slot(task_id)
        ref = self.store.ref(run, slot)
        new: dict[int, list] = {}
        for i, w in enumerate(writes):
            if not (isinstance(w, (tuple, list)) and len(w) == 2 and isinstance(w[0], str)):
                raise UsageError(f"put_writes for task {task_id} of {where_txt}: write {i} is {w!r}, "
                                 "not a (channel, value) pair")
            c, v = w
            idx = WRITES_IDX_MAP.get(c, i)
            new[idx] = [c, self._encode(v, f"pending write {c!r} of task {task_id} of checkpoint {cid} "
                                           f"of {where_txt}", ref), task_path]
        if not new:
            return None
        meta = {"lg": _FORMAT, "thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid, "task_id": task_id}
        return runs, key, run, slot, task_id, cid, where_txt, new, meta

    def _put_writes(self, runs: _Runs, key: int, run: str, slot: int, task_id: str, cid: str, where_txt: str,
                    new: dict, meta: dict) -> None:
        thread_id, ns = meta["thread_id"], meta["checkpoint_ns"]
        ref = self.store.ref(run, slot)
        for _ in range(64):    # probing past tasks whose ids hash to the same slot
            try:
                self.store.put(run, slot, {"task_id": task_id, "writes": new}, meta=meta, overwrite=False)
                return
            except CheckpointExistsError:
                pass
            except EncodeError as e:
                raise EncodeError(f"pending writes of task {task_id} of checkpoint {cid} of {where_txt}: {e.reason}",
                                  ref=ref, hint=e.hint) from None
            try:
                entry = self.store.read(run, slot).state
                other, stored = entry["task_id"], entry["writes"]
                if not isinstance(stored, dict):
                    raise ValueError("writes are not a map")
            except CheckpointNotFoundError:
                continue   # deleted meanwhile: put again
            except Exception as e:
                if isinstance(e, AgckError) and not e.verdict:
                    raise
                raise self._damaged(runs, key, thread_id, ns, cid,
                                    _Damage(f"the pending writes stored at slot {slot}", e,
                                            self.store.ref(run, slot))) from None
            if other != task_id:
                slot = (slot + 1) & _MAX_STEP
                continue
            merged, changed = dict(stored), False
            for idx, w in new.items():
                if idx >= 0 and idx in merged:   # as LangGraph's savers: a task's regular write is written once
                    continue
                merged[idx], changed = w, True
            if changed:
                self.store.put(run, slot, {"task_id": task_id, "writes": merged}, meta=meta)
            return
        raise CheckpointExistsError(f"no free slot for the writes of task {task_id}", ref=ref)

    # -- deleting and copying -----------------------------------------------------------
    def _delete_steps(self, run: str, steps: Iterable[int] | None = None) -> None:
        """Delete ``steps`` of ``run`` (all of them when None, newest first: a crash part way
        through a thread's records leaves its older checkpoints, each with its parents)."""
        self._forget()   # a put must not take a deleted checkpoint's value entries from memory
        for s in (reversed(self.store.steps(run)) if steps is None else steps):
            try:
                self.store.delete(run, s)
            except CheckpointNotFoundError:
                pass

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint, value and pending write of the thread, all namespaces."""
        thread_id, _ = self._thread_ns({"configurable": {"thread_id": thread_id}})
        prefixes = _thread_prefixes(thread_id)
        runs = [r for r in self.store.runs() if r.startswith(prefixes) and _is_lg_run(r)]
        # records first: a crash part way leaves unreferenced entries, never a record without its parts
        for r in sorted(runs, key=lambda r: (not r.endswith(".c"), r.endswith(".v"), r)):
            self._delete_steps(r)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their pending writes) whose metadata ``run_id`` is
        in ``run_ids``, in every thread; values no remaining checkpoint uses go with them.
        A record that cannot be read is kept (its run id is unknown)."""
        wanted = set(run_ids)
        if not wanted:
            return
        all_runs = self.store.runs()
        for run in [r for r in all_runs if _is_records_run(r)]:
            runs = _Runs.from_records(run)
            doomed = []
            for info in self.store.list(run):
                m = info.meta
                if not isinstance(m, dict) or not isinstance(m.get("metadata"), dict):
                    continue
                rid = m["metadata"].get("run_id", _UNDECIDED)
                if rid is _UNDECIDED and not m.get("mfull"):
                    try:
                        rid = self._values.decode(self.store.read(run, info.step).state["metadata"]).get("run_id")
                    except Exception:
                        continue
                if isinstance(rid, str) and rid in wanted:
                    doomed.append(info.step)
            if doomed:
                self._delete_checkpoints(runs, doomed, all_runs)

    def _delete_checkpoints(self, runs: _Runs, keys: list[int], all_runs: list[str]) -> None:
        self._move_values(runs, set(keys))
        for k in keys:
            self._delete_steps(runs.records, [k])
            self._delete_steps(runs.writes(k))
        self._collect_values(runs, all_runs)

    def _move_values(self, runs: _Runs, doomed: set[int]) -> None:
        """Before records in ``doomed`` are deleted: the small values a record holds that
        a remaining record uses (an unchanged channel) are written to the values run at
        the same key, where reading looks when the record is gone. All of a doomed
        record's values are moved when a remaining record cannot be read (what it uses
        is unknown); those no record uses are collected later."""
        needed: set[int] | None = set()
        for s in self.store.steps(runs.records):
            if s in doomed:
                continue
            try:
                where = self.store.read(runs.records, s).state["where"]
                needed |= {e for e in where.values() if type(e) is int and e in doomed}
            except CheckpointNotFoundError:
                continue
            except Exception as e:
                if isinstance(e, AgckError) and not e.verdict:
                    raise
                needed = None
                break
        for k in sorted(doomed if needed is None else needed):
            try:
                ck = self.store.read(runs.records, k)
                values = ck.state.get("values")
            except Exception as e:
                if isinstance(e, AgckError) and not e.verdict:
                    raise
                continue    # gone or damaged: nothing readable to keep
            if not isinstance(values, dict) or not values:
                continue
            meta = {k2: ck.meta[k2] for k2 in ("lg", "thread_id", "checkpoint_ns", "checkpoint_id")
                    if isinstance(ck.meta, dict) and k2 in ck.meta}
            try:
                self.store.put(runs.values, k, values, meta=meta, overwrite=False)
            except CheckpointExistsError:
                pass        # moved by an earlier deletion that stopped part way

    def _collect_values(self, runs: _Runs, all_runs: list[str]) -> None:
        """Delete the value entries no record of the namespace refers to. Entries newer
        than the newest record may belong to a put in progress and are kept, and so is
        everything when a record cannot be read."""
        steps = self.store.steps(runs.records)
        used: dict[str, set] = {}
        for s in steps:
            try:
                where = self.store.read(runs.records, s).state["where"]
                for c, e in where.items():
                    if e is not None:
                        run, k = (runs.own(c), e[0]) if type(e) is list else (runs.values, e)
                        used.setdefault(run, set()).add(k)
            except CheckpointNotFoundError:
                continue
            except Exception:
                return
        newest = steps[-1] if steps else -1
        value_runs = [r for r in all_runs if r == runs.values or r.startswith(runs.base + "b")]
        for run in value_runs:
            keep = used.get(run, set())
            self._delete_steps(run, [e for e in self.store.steps(run) if e not in keep and e <= newest])

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``"delete"``: delete the threads. ``"keep_latest"``: keep, per namespace, the newest
        checkpoint (with its pending writes and the values it uses) and delete the others;
        a damaged newest one is kept with every one down to the newest valid one (nothing is
        deleted where none is valid); ancestors a ``DeltaChannel`` of the kept one is
        rebuilt from (back to its nearest stored value) are kept too."""
        if strategy not in ("keep_latest", "delete"):
            raise UsageError(f"unknown prune strategy {strategy!r}", hint="use 'keep_latest' or 'delete'")
        for tid in thread_ids:
            if strategy == "delete":
                self.delete_thread(tid)
                continue
            tid, _ = self._thread_ns({"configurable": {"thread_id": tid}})
            all_runs = [r for r in self.store.runs() if r.startswith(_thread_prefixes(tid))]
            for run in [r for r in all_runs if _is_records_run(r)]:
                self._keep_latest(_Runs.from_records(run), tid, all_runs)

    def _keep_latest(self, runs: _Runs, thread_id: str, all_runs: list[str]) -> None:
        steps = self.store.steps(runs.records)
        keep: set[int] = set()
        latest = None
        for s in reversed(steps):
            keep.add(s)
            try:
                latest = self._load(runs, s)
            except _Damage:
                continue
            if latest is not None:
                if latest.config["configurable"]["thread_id"] != thread_id:
                    return   # another thread's namespace under a colliding name: not ours to prune
                break
        if latest is None:
            return
        counters = latest.metadata.get("counters_since_delta_snapshot") or {}
        remaining = {c for c in counters if c not in latest.checkpoint["channel_values"]}
        cursor = latest.parent_config["configurable"]["checkpoint_id"] if latest.parent_config else None
        while cursor is not None and remaining:
            key = checkpoint_key(cursor)
            if key is None:
                break
            try:
                ck = self.store.read(runs.records, key)
                where, cursor = ck.state["where"], ck.meta.get("parent_checkpoint_id")
                remaining = {c for c in remaining if where.get(c) is None}
            except CheckpointNotFoundError:
                break
            except Exception as e:
                if isinstance(e, AgckError) and not e.verdict:
                    raise
                return   # the chain a delta channel needs cannot be judged: delete nothing
            keep.add(key)
        doomed = [s for s in steps if s not in keep]
        if doomed:
            self._delete_checkpoints(runs, doomed, all_runs)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint of a thread (all namespaces, values, pending writes) to
        another thread id, verified as read; checkpoints the target has with the same ids
        are replaced. Records are copied last, so a failure leaves the target's visible
        checkpoints whole."""
        src, _ = self._thread_ns({"configurable": {"thread_id": source_thread_id}})
        dst, _ = self._thread_ns({"configurable": {"thread_id": target_thread_id}})
        if src == dst:
            return
        dp = _thread_prefix(dst)
        runs = [(sp, r) for sp in _thread_prefixes(src) for r in self.store.runs()
                if r.startswith(sp) and _is_lg_run(r)]
        for sp, run in sorted(runs, key=lambda x: (x[1].endswith(".c"), x[1])):
            kind = run[run.rindex(".") + 1:]
            ns_part = run[len(sp):run.rindex(".")]
            if ns_part.startswith("r"):     # named raw (perhaps by an earlier version): as it is named now
                ns_part = _name_part(ns_part[1:])
            target_runs = _Runs(f"{dp}{ns_part}.")
            for s in self.store.steps(run):
                try:
                    ck = self.store.read(run, s)
                except CheckpointNotFoundError:
                    continue
                except AgckError as e:
                    if e.verdict:
                        key = int(kind[1:], 16) if kind[0] == "w" else s
                        raise self._damaged(_Runs(run[:run.rindex(".") + 1]), key, None, None, None,
                                            _Damage(f"a stored entry of {run}", e, self.store.ref(run, s))) from None
                    raise
                meta = ck.meta
                if not isinstance(meta, dict) or meta.get("thread_id") != src:
                    continue    # another thread's, under a colliding name
                meta = {**meta, "thread_id": dst}
                # a large value's run is named from its channel anew: the target's thread id
                # may make the name one that is hashed (or no longer hashed)
                target = target_runs.own(meta["channel"]) if kind[0] == "b" and isinstance(
                    meta.get("channel"), str) else target_runs.base + kind
                self.store.put(target, s, ck.state, meta=meta, parent=ck.parent)

    # -- async: the sync methods on the saver's worker threads ------------------------------
    async def _off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on one of the saver's worker threads, in this task's
        context. There are as many as the store has connections (a Postgres store's
        pool; 4 on the others): more would only queue on the pool holding a thread
        each; the coroutines waiting beyond them hold none."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._workers.get(), call)

    @property
    def _native(self) -> bool:
        """Whether the store reads and writes on the event loop (Postgres: agck.stores.postgres.aio)."""
        return self.store.native_async

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        if self._native:
            thread_id, ns = self._thread_ns(config)
            runs = self._runs(thread_id, ns)
            cid = get_checkpoint_id(config)
            key = checkpoint_key(cid) if cid else None
            if cid and key is None:
                return None
            try:
                t = await self._async(self._reading(runs, key, expect_id=cid, expect=(thread_id, ns)) if cid
                                      else self._reading_newest(runs, (thread_id, ns)))
            except _Damage:
                t = _UNSURE   # judged and reported, with the previous valid checkpoint, by the sync path
            if t is not _UNSURE:
                return t
        return await self._off_loop(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None
                    ) -> AsyncIterator[CheckpointTuple]:
        it = self.list(config, filter=filter, before=before, limit=limit)
        while True:
            item = await self._off_loop(next, it, _END)
            if item is _END:
                return
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        if self._native:
            try:
                plan = self._plan_put(config, checkpoint, metadata, new_versions, may_read=False)
            except _MustRead:
                pass
            else:
                try:
                    await self.store.aput_many(plan.entries)
                except CheckpointExistsError:     # a put repeated, or a key taken: decided entry by entry
                    await self._off_loop(self._put_one_by_one, plan)
                except EncodeError as e:
                    raise plan.refused(e) from None
                return self._put_done(plan)
        return await self._off_loop(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        if self._native:
            plan = self._plan_writes(config, writes, task_id, task_path)
            if plan is None:
                return
            runs, key, run, slot, task_id, cid, where_txt, new, meta = plan
            try:
                await self.store.aput_many([PutEntry(run, slot, {"task_id": task_id, "writes": new}, meta,
                                                     overwrite=False)])
                return
            except CheckpointExistsError:   # the task wrote before, or another's hashes to the slot
                pass
            except EncodeError as e:
                raise EncodeError(f"pending writes of task {task_id} of checkpoint {cid} of {where_txt}: {e.reason}",
                                  ref=self.store.ref(run, slot), hint=e.hint) from None
            await self._off_loop(self._put_writes, *plan)
            return
        await self._off_loop(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self._off_loop(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self._off_loop(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self._off_loop(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self._off_loop(self.prune, thread_ids, strategy=strategy)

    async def aget_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]
                                         ) -> Mapping[str, DeltaChannelHistory]:
        return await self._off_loop(self.get_delta_channel_history, config=config, channels=channels)


