"""How LangGraph's threads, namespaces and checkpoints map to an agck store's runs
and steps, and what a checkpoint's record holds.

Names and numbers only: nothing here reads or writes a store or imports LangGraph.

A thread's namespace (``thread_id``, ``checkpoint_ns``) owns these runs, where
``T`` and ``N`` encode the thread id and the namespace (``r`` and the name itself
when it is at most 64 of lowercase letters, digits and ``_-:@+=``; else ``h`` and
its BLAKE2b-160 in hex: so no two names differ in case only, which a
case-insensitive file system would make one directory)::

    lg.T.N.c            one store checkpoint per LangGraph checkpoint: its record
                        (the checkpoint without channel values, its metadata,
                        where each channel's value is, and under ``values`` the
                        values of the channels it changed (``new_versions`` of
                        ``put``) that are smaller than 64 KiB stored); the store's
                        ``meta`` holds the ids and the plain-JSON part of the
                        metadata, for listing. A put of a checkpoint without large
                        values is this one store checkpoint: one write, one row.
    lg.T.N.v            the small values of checkpoint K, at step K, when its
                        record is not there to hold them: kept here when the record
                        is deleted while a remaining checkpoint still uses them (an
                        unchanged channel), and where the first version of this
                        layout wrote them; reading looks in the record at K first
    lg.T.N.b<C>         the values of channel C (encoded as T was before capitals
                        were hashed, or hashed when the name would pass the
                        store's 200 characters) of 64 KiB or more
                        stored (tensors, long histories), one store checkpoint per
                        version: reading a checkpoint reads the large values it
                        holds, never one another channel was stored with, and the
                        store's incremental writes compare each version with the
                        channel's previous one
    lg.T.N.w<key hex>   the pending writes of one checkpoint, one store checkpoint
                        per task (step: a 63-bit hash of the task id)

A record refers to the entry holding each channel's value (``where``: None for
no value, K for the small values of checkpoint K, [K] for step K of the
channel's own run), so a channel whose version did not change is not written
again: a large unchanged channel is stored once, whatever the number of
super-steps after it.

``T`` (and ``N``) is ``r`` followed by the string itself when it is at most 64
characters of ``[A-Za-z0-9_-:@+=]`` (so ``thread-1`` is ``rthread-1``, the root
namespace ``""`` is ``r``), and otherwise ``h`` followed by the hex BLAKE2b-160
of its UTF-8 (lone surrogates passed through). Both forms exclude ``.``, so the
runs of a thread are those starting ``lg.T.``. Records keep the real thread id
and namespace, and reads check them.

The step of checkpoint ``id`` in these runs is its *key*: ``id`` must be a UUID
in canonical form (LangGraph makes them with ``uuid6``, time ordered); the key is
the top 63 bits of its 128 bits with the version and variant bits taken out (for
a uuid6: its 60-bit timestamp and 3 bits of its clock sequence). Keys order as
the ids do (ids of one UUID version, as LangGraph's all are), so a thread's
newest checkpoint is the store's newest step of its run, found without reading
any metadata, and ``before=`` is a bound on steps.
Two ids of one namespace with the same key (two checkpoints in the same 100 ns
from two processes) are refused by ``put`` with ``CheckpointExistsError``,
having overwritten nothing. An id that is not a canonical UUID is refused with
``UsageError``.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ... import thresholds
from ...stores.sqlrows import utf8_ok

_FORMAT = 1                      # the layout version, in every entry's meta as "lg"
_PREFIX = "lg."
_MAX_STEP = (1 << 63) - 1

# A channel value of about this many stored bytes or more (a tensor, a long history)
# gets a store checkpoint of its own (run lg.T.N.b<channel>), so reading a checkpoint
# never reads a large value that another, smaller channel happened to be stored with;
# smaller ones changed by one checkpoint share one entry (one durable write, not one each).
_OWN_ENTRY_BYTES = thresholds.LANGGRAPH_OWN_ENTRY


# --- names ---------------------------------------------------------------------------

# Names kept as they are, prefixed "r": no capitals, since two names differing in case
# only would share a directory on a case-insensitive file system (macOS, Windows). Any
# other name is hashed (prefix "h", lowercase hex). Earlier versions kept capitals
# (_LEGACY_RAW_NAME): a thread they wrote is still found under its old name (the saver's
# _runs), and channels keep that rule (their entries' names are read back by it).
_RAW_NAME = re.compile(r"[a-z0-9_\-:@+=]{0,64}", re.ASCII)
_LEGACY_RAW_NAME = re.compile(r"[A-Za-z0-9_\-:@+=]{0,64}", re.ASCII)


_MAX_RUN = 200     # agck.names: a store's run names are 1-200 characters


def _name_part(s: str, legacy: bool = False) -> str:
    return "r" + s if (_LEGACY_RAW_NAME if legacy else _RAW_NAME).fullmatch(s) else _hashed(s)


def _renamed(s: str) -> bool:
    """Whether ``s`` had another name part in earlier versions (a raw name with capitals)."""
    return _RAW_NAME.fullmatch(s) is None and _LEGACY_RAW_NAME.fullmatch(s) is not None


def _hashed(s: str) -> str:
    return "h" + hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


@dataclass(frozen=True)
class _Runs:
    """The store runs of one (thread, namespace): ``base`` is ``lg.T.N.``."""

    base: str

    @classmethod
    def of(cls, thread_id: str, ns: str, legacy: bool = False) -> "_Runs":
        return cls(f"{_PREFIX}{_name_part(thread_id, legacy)}.{_name_part(ns, legacy)}.")

    @classmethod
    def from_records(cls, run: str) -> "_Runs":
        return cls(run[:-1])

    @property
    def records(self) -> str:
        return self.base + "c"

    @property
    def values(self) -> str:
        return self.base + "v"

    def writes(self, key: int) -> str:
        return f"{self.base}w{key:016x}"

    def own(self, channel: str) -> str:
        name = f"{self.base}b{_name_part(channel, legacy=True)}"
        if len(name) > _MAX_RUN:   # a thread, namespace and channel of 64 characters each
            name = f"{self.base}b{_hashed(channel)}"
        return name


def _thread_prefix(thread_id: str, legacy: bool = False) -> str:
    return f"{_PREFIX}{_name_part(thread_id, legacy)}."


def _thread_prefixes(thread_id: str) -> tuple[str, ...]:
    """The prefixes of a thread's runs: its name now, and the one earlier versions gave it."""
    if _renamed(thread_id):
        return _thread_prefix(thread_id), _thread_prefix(thread_id, legacy=True)
    return (_thread_prefix(thread_id),)


def _is_records_run(run: str) -> bool:
    return run.startswith(_PREFIX) and run.endswith(".c") and run.count(".") == 3


def _is_lg_run(run: str) -> bool:
    return run.startswith(_PREFIX) and run.count(".") == 3


_LOW62 = (1 << 62) - 1


def checkpoint_key(checkpoint_id: Any) -> int | None:
    """The store step of a checkpoint id (see the module's docstring); None when the id
    is not a UUID in canonical form (lowercase, hyphenated)."""
    if not isinstance(checkpoint_id, str) or len(checkpoint_id) != 36:
        return None
    try:
        u = uuid.UUID(checkpoint_id)
    except ValueError:
        return None
    if str(u) != checkpoint_id:
        return None
    n = u.int
    payload = ((n >> 80) << 74) | (((n >> 64) & 0xFFF) << 62) | (n & _LOW62)   # 122 bits: no version, no variant
    return payload >> 59


def _is_place(e: Any) -> bool:
    """Where a record says a channel's value is: None (no value), K (among the small
    values of checkpoint K: its record, else the values run), or [K] in the channel's
    own run."""
    if type(e) is list and len(e) == 1:
        e = e[0]
    return e is None or (type(e) is int and 0 <= e <= _MAX_STEP)


def _task_slot(task_id: str) -> int:
    digest = hashlib.blake2b(task_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


# --- metadata for listing ---------------------------------------------------------------
# The store's meta of a record holds the JSON-native part of the checkpoint's metadata,
# so list(filter=...) passes over most checkpoints that do not match without reading them.

class _NotJson(Exception):
    pass


def _json_plain(x: Any, depth: int = 0) -> Any:
    """``x`` as JSON-native data that every store's listing returns equal (tuples as
    lists); raises _NotJson for anything else."""
    t = type(x)
    if x is None or t is bool:
        return x
    if t is int:
        if -(1 << 63) <= x < (1 << 63):
            return x
        raise _NotJson
    if t is float:
        if math.isfinite(x):
            return x
        raise _NotJson
    if t is str:
        if "\x00" in x or not utf8_ok(x):
            raise _NotJson
        return x
    if depth > 24:
        raise _NotJson
    if t is list or t is tuple:
        return [_json_plain(v, depth + 1) for v in x]
    if t is dict:
        out = {}
        for k, v in x.items():
            if type(k) is not str or k.startswith("$"):
                raise _NotJson
            out[_json_plain(k, depth + 1)] = _json_plain(v, depth + 1)
        return out
    raise _NotJson


def _metadata_projection(metadata: Mapping) -> tuple[dict, bool]:
    """The JSON-native part of ``metadata`` (for listing filters) and whether it is all of it."""
    proj, full = {}, True
    for k, v in metadata.items():
        if type(k) is not str:
            full = False
            continue
        try:
            proj[_json_plain(k)] = _json_plain(v)
        except _NotJson:
            full = False
    return proj, full


_UNDECIDED = object()


def _prefilter(meta: Any, filt: Mapping) -> bool:
    """False only when the listed meta proves the checkpoint does not match ``filt``;
    candidates are confirmed on the full metadata once read."""
    if not isinstance(meta, dict) or not isinstance(meta.get("metadata"), dict):
        return True
    proj, full = meta["metadata"], meta.get("mfull") is True
    for k, q in filt.items():
        try:
            qn = _json_plain(q)
        except _NotJson:
            qn = _UNDECIDED
        if isinstance(k, str) and k in proj:
            if qn is not _UNDECIDED and qn != proj[k]:
                return False
        elif full and q is not None:
            return False
    return True


def _matches(metadata: Mapping, filt: Mapping | None) -> bool:
    return not filt or all(q == metadata.get(k) for k, q in filt.items())
