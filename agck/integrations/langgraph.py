"""A LangGraph checkpointer on agck's stores: :class:`AgckSaver`.

    from agck.integrations.langgraph import AgckSaver

    saver = AgckSaver("ckpts/")              # or "sqlite:///ckpts.db", "postgresql://...", or a Store
    graph = builder.compile(checkpointer=saver)
    graph.invoke(inputs, {"configurable": {"thread_id": "chat-42"}})

Needs ``langgraph`` (``pip install 'agck[langgraph]'``); ``import agck`` does not
import this module. Every method of LangGraph's ``BaseCheckpointSaver`` is
implemented: ``get_tuple``, ``list``, ``put``, ``put_writes``, ``delete_thread``,
``delete_for_runs``, ``copy_thread``, ``prune`` and ``get_delta_channel_history``,
and their ``a...`` forms. The async forms run the sync ones in a worker thread
(``asyncio.to_thread``), so the event loop is never blocked by a store's I/O.

Layout in the store
-------------------
A thread's namespace (``thread_id``, ``checkpoint_ns``) owns these runs, where
``T`` and ``N`` encode the thread id and the namespace::

    lg.T.N.c            one store checkpoint per LangGraph checkpoint: its record
                        (the checkpoint without channel values, its metadata, and
                        where each channel's value is); the store's ``meta`` holds
                        the ids and the plain-JSON part of the metadata, for listing
    lg.T.N.v            the values of the channels a checkpoint changed
                        (``new_versions`` of ``put``) that are smaller than 64 KiB
                        stored, one store checkpoint per LangGraph checkpoint
    lg.T.N.b<C>         the values of channel C (encoded as T is, or hashed when the
                        name would pass the store's 200 characters) of 64 KiB or more
                        stored (tensors, long histories), one store checkpoint per
                        version: reading a checkpoint reads the large values it
                        holds, never one another channel was stored with, and the
                        store's incremental writes compare each version with the
                        channel's previous one
    lg.T.N.w<key hex>   the pending writes of one checkpoint, one store checkpoint
                        per task (step: a 63-bit hash of the task id)

A record refers to the entry holding each channel's value, so a channel whose
version did not change is not written again: a large unchanged channel is
stored once, whatever the number of super-steps after it.

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

A ``put`` writes its values entries and its record with one ``put_many`` of
the store: on SQLite and Postgres one transaction (one commit), on the file
store one file after another with the record last. Either way it is durable
before ``put`` returns, and a crash leaves a checkpoint either complete or not
there (on the file store, at worst an unreferenced values entry). Deleting (``delete_thread``, ``prune``,
``delete_for_runs``) removes store checkpoints, records before the values they
use and a thread's records newest first, so a crash part way leaves older
checkpoints whole; on an incremental store the
chunks they no longer use are freed by ``saver.store.collect_garbage()`` (``agck
gc STORE``).

One process writes a thread at a time, as LangGraph assumes; deleting or pruning
a thread while a graph writes it is not supported (a put may refer to values the
deletion frees).

Values
------
Channel values and pending writes go through agck's codec: numpy arrays and
torch tensors (anywhere in dicts, lists, tuples, sets) are raw, checksummed
blobs; None, bool, int, float, complex, str, bytes, lists, tuples, dicts and
sets are stored as themselves (msgpack). Any other object (LangChain messages,
documents, ``Send``, ``Interrupt``, ``Command``, datetimes, UUIDs; pydantic
models, dataclasses and enums once allowed, below) is stored as the bytes of
LangGraph's own ``JsonPlusSerializer`` in its msgpack mode, and comes back as
that serializer returns it (a tuple inside such an object as a list); a list
of such objects only (a chat's messages) is stored as one such value, as
LangGraph's savers store a channel, and comes back as the same list. Never
pickle: the serializer is made without ``pickle_fallback``, anything it cannot
encode without pickle is refused (``agck.EncodeError`` naming the channel), and
only its "msgpack" form is ever stored or read.

Rebuilding such objects calls their class: only classes on an allowlist are
ever imported or called. The allowlist is LangGraph's ``SAFE_MSGPACK_TYPES``
(messages, documents, ``Send``, ``Interrupt``, ``Command``, datetime, UUID,
Decimal, ...) plus ``allowed_types=[(module, name), ...]`` (or classes) given
to the saver, plus what LangGraph adds through ``with_allowlist`` when it
compiles a graph in strict msgpack mode. A value holding any other class is
refused when it is put (``EncodeError``: the class would not be rebuilt on
load), and a stored value naming one is refused when read (the checkpoint is
reported damaged) without importing or calling anything.

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

import asyncio
import copy
import hashlib
import logging
import math
import random
import re
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                      DependencyError, EncodeError, MalformedCheckpointError, UsageError)
from ..recovery import is_verdict
from ..stores import PutEntry, Store, open_store
from ..stores.sqlrows import utf8_ok


class LangGraphMissingError(DependencyError, ImportError):
    """``langgraph`` cannot be imported here (an ImportError too, so optional imports of this module work)."""

    default_hint = "pip install 'agck[langgraph]' (langgraph and langchain-core)"


try:
    import ormsgpack
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import (WRITES_IDX_MAP, BaseCheckpointSaver, ChannelVersions, Checkpoint,
                                           CheckpointMetadata, CheckpointTuple, DeltaChannelHistory,
                                           get_checkpoint_id, get_checkpoint_metadata, writes_sort_key)
    from langgraph.checkpoint.serde import _msgpack as _lg_msgpack
    from langgraph.checkpoint.serde import jsonplus as _jsonplus
    from langgraph.checkpoint.serde.types import _DeltaSnapshot
except ImportError as _e:   # pragma: no cover - exercised only where langgraph is absent
    raise LangGraphMissingError(f"agck.integrations.langgraph needs langgraph, which cannot be imported here ({_e})"
                                ) from None

__all__ = ["AgckSaver", "DamagedCheckpointError", "LangGraphMissingError", "checkpoint_key"]

logger = logging.getLogger("agck.langgraph")

_FORMAT = 1                      # the layout version, in every entry's meta as "lg"
_PREFIX = "lg."
_MAX_STEP = (1 << 63) - 1


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


# --- names ---------------------------------------------------------------------------

_RAW_NAME = re.compile(r"[A-Za-z0-9_\-:@+=]{0,64}", re.ASCII)


_MAX_RUN = 200     # agck.names: a store's run names are 1-200 characters


def _name_part(s: str) -> str:
    return "r" + s if _RAW_NAME.fullmatch(s) else _hashed(s)


def _hashed(s: str) -> str:
    return "h" + hashlib.blake2b(s.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


@dataclass(frozen=True)
class _Runs:
    """The store runs of one (thread, namespace): ``base`` is ``lg.T.N.``."""

    base: str

    @classmethod
    def of(cls, thread_id: str, ns: str) -> "_Runs":
        return cls(f"{_PREFIX}{_name_part(thread_id)}.{_name_part(ns)}.")

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
        name = f"{self.base}b{_name_part(channel)}"
        if len(name) > _MAX_RUN:   # a thread, namespace and channel of 64 characters each
            name = f"{self.base}b{_hashed(channel)}"
        return name


def _thread_prefix(thread_id: str) -> str:
    return f"{_PREFIX}{_name_part(thread_id)}."


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
    """Where a record says a channel's value is: None (no value), a key in the shared
    values run, or [key] in the channel's own run."""
    if type(e) is list and len(e) == 1:
        e = e[0]
    return e is None or (type(e) is int and 0 <= e <= _MAX_STEP)


def _task_slot(task_id: str) -> int:
    digest = hashlib.blake2b(task_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


# --- values ----------------------------------------------------------------------------

# A channel value of about this many stored bytes or more (a tensor, a long history)
# gets a store checkpoint of its own (run lg.T.N.b<channel>), so reading a checkpoint
# never reads a large value that another, smaller channel happened to be stored with;
# smaller ones changed by one checkpoint share one entry (one durable write, not one each).
_OWN_ENTRY_BYTES = 64 << 10

# Objects that are not agck values are stored as (_MARK, kind, payload) tuples; a
# user's tuple that starts with _MARK is stored escaped, so the form is unambiguous.
_MARK = "\x00agck.langgraph"
_K_MSGPACK = "m"         # JsonPlusSerializer msgpack bytes
_K_TUPLE = "t"           # an escaped tuple: payload is its encoded items
_K_BYTEARRAY = "ba"
_K_DELTA = "ds"          # _DeltaSnapshot: payload is its encoded value (tensors stay raw)

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_CTOR_EXTS = frozenset({_jsonplus.EXT_CONSTRUCTOR_SINGLE_ARG, _jsonplus.EXT_CONSTRUCTOR_POS_ARGS,
                        _jsonplus.EXT_CONSTRUCTOR_KW_ARGS, _jsonplus.EXT_PYDANTIC_V1, _jsonplus.EXT_PYDANTIC_V2})


def _opaque(x: Any) -> bool:
    """Whether ``_ValueCodec.encode`` hands ``x`` whole to LangGraph's msgpack serializer
    (it is none of the values agck stores itself): the one definition encode dispatches on."""
    t = type(x)
    if t in _PLAIN_SCALARS or t is list or t is tuple or t is set or t is frozenset or t is bytearray \
            or t is _DeltaSnapshot or isinstance(x, (dict, np.ndarray, np.generic)):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not isinstance(x, torch.Tensor)


class _Refused(Exception):
    def __init__(self, msg: str, hint: str | None = None):
        super().__init__(msg)
        self.msg, self.hint, self.path = msg, hint, []


def _normalize_types(types: Iterable) -> frozenset:
    out = set()
    for t in types:
        if isinstance(t, type):
            out.add((t.__module__, t.__name__))
        elif isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(p, str) for p in t):
            out.add((t[0], t[1]))
        else:
            raise UsageError(f"allowed_types takes classes or (module, name) pairs, not {t!r}")
    return frozenset(out)


class _ValueCodec:
    """LangGraph values <-> trees agck's codec stores (see the module's docstring)."""

    def __init__(self, allowed: frozenset):
        self.allowed = allowed
        # Never pickle_fallback; a strict allowlist: nothing else is imported or called on load.
        self.serde = _jsonplus.JsonPlusSerializer(allowed_msgpack_modules=sorted(allowed) or None)

    # -- encode --
    def encode(self, x: Any, size: list) -> Any:
        """The tree agck stores for ``x``; adds about its stored bytes to ``size[0]``."""
        t = type(x)
        if t in _PLAIN_SCALARS:
            size[0] += len(x) if t is str or t is bytes else 9
            return x
        size[0] += 5
        if _opaque(x):
            data = self._msgpack(x)
            size[0] += len(data)
            return (_MARK, _K_MSGPACK, data)
        if t is list:
            if len(x) > 1 and all(map(_opaque, x)):
                # a list of objects only (a chat's messages): one msgpack for the list, as
                # LangGraph's own savers store it, instead of one per item; the same bytes
                # per item, so it decodes to the same list. On refusal the items are
                # encoded one by one, to name the item refused.
                try:
                    data = self._msgpack(x)
                except _Refused:
                    pass
                else:
                    size[0] += len(data)
                    return (_MARK, _K_MSGPACK, data)
            return [self._item(v, i, size) for i, v in enumerate(x)]
        if isinstance(x, dict):   # OrderedDict, defaultdict: come back as dict, as from any saver
            return {self._item(k, "<key>", size): self._item(v, k, size) for k, v in x.items()}
        if t is tuple:
            items = tuple(self._item(v, i, size) for i, v in enumerate(x))
            if items and type(x[0]) is str and x[0] == _MARK:
                return (_MARK, _K_TUPLE, items)
            return items
        if t is set or t is frozenset:
            return t(self._item(v, "<item>", size) for v in x)
        if isinstance(x, (np.ndarray, np.generic)):
            size[0] += x.nbytes
            return x
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            size[0] += x.element_size() * x.nelement()
            return x
        if t is bytearray:
            size[0] += len(x)
            return (_MARK, _K_BYTEARRAY, bytes(x))
        # what is left is a _DeltaSnapshot: everything else was dispatched above or is opaque
        return (_MARK, _K_DELTA, self._item(x.value, ".value", size))

    def _item(self, v, where, size):
        try:
            return self.encode(v, size)
        except _Refused as e:
            tag = isinstance(where, str) and where.startswith(("<", "."))   # "<key>", ".value": not an index
            e.path.append(where if tag else f"[{where!r}]")
            raise
        except RecursionError:
            raise _Refused("nesting too deep") from None

    def _msgpack(self, x) -> bytes:
        try:
            kind, data = self.serde.dumps_typed(x)
        except Exception as e:   # ormsgpack's error, or a TypeError from the serializer's default
            raise _Refused(f"cannot encode {type(x).__module__}.{type(x).__qualname__} without pickle ({e})",
                           "store plain data, arrays or tensors there, or a class LangGraph's msgpack encoding "
                           "handles (pydantic model, dataclass, enum)") from None
        if kind != "msgpack":
            raise _Refused(f"LangGraph's serializer gave a {kind!r} encoding for {type(x).__qualname__}; "
                           "only 'msgpack' is stored")
        blocked = self.blocked(data)
        if blocked:
            names = ", ".join(sorted(set(blocked)))
            raise _Refused(f"holds {names}, which is not on the saver's allowlist of classes to rebuild on load "
                           "(it would come back as plain data)",
                           f"if you trust it, pass AgckSaver(..., allowed_types=[{_pairs(blocked)}])")
        return data

    def blocked(self, data: bytes) -> list[str]:
        """The classes (and methods) ``data`` would have LangGraph's loader call that the
        allowlist does not allow. Parses only: imports and calls nothing."""
        out: list[str] = []

        def hook(code: int, payload: bytes):
            if code in _CTOR_EXTS or code == _jsonplus.EXT_METHOD_SINGLE_ARG:
                tup = ormsgpack.unpackb(payload, ext_hook=hook, option=ormsgpack.OPT_NON_STR_KEYS)
                if not isinstance(tup, (list, tuple)) or len(tup) < 3 or not all(type(p) is str for p in tup[:2]):
                    out.append(f"a malformed msgpack extension {code}")
                elif code == _jsonplus.EXT_METHOD_SINGLE_ARG:
                    if len(tup) < 4 or (tup[0], tup[1], tup[3]) not in _lg_msgpack.SAFE_MSGPACK_METHODS:
                        out.append(f"{tup[0]}.{tup[1]}.{tup[3] if len(tup) > 3 else '?'}()")
                elif (tup[0], tup[1]) not in _lg_msgpack.SAFE_MSGPACK_TYPES and (tup[0], tup[1]) not in self.allowed:
                    out.append(f"{tup[0]}.{tup[1]}")
            elif code == _jsonplus.EXT_DELTA_SNAPSHOT:
                ormsgpack.unpackb(payload, ext_hook=hook, option=ormsgpack.OPT_NON_STR_KEYS)
            elif code != _jsonplus.EXT_NUMPY_ARRAY:
                out.append(f"an unknown msgpack extension {code}")
            return None

        ormsgpack.unpackb(data, ext_hook=hook, option=ormsgpack.OPT_NON_STR_KEYS)
        return out

    # -- decode --
    def decode(self, y: Any) -> Any:
        t = type(y)
        if t is list:
            return [self.decode(v) for v in y]
        if t is dict:
            return {self.decode(k): self.decode(v) for k, v in y.items()}
        if t is tuple:
            if y and type(y[0]) is str and y[0] == _MARK:
                return self._special(y)
            return tuple(self.decode(v) for v in y)
        if t is set or t is frozenset:
            return t(self.decode(v) for v in y)
        return y

    def _special(self, y: tuple):
        if len(y) != 3:
            raise ValueError("a marked value that is not (mark, kind, payload)")
        kind, payload = y[1], y[2]
        if kind == _K_MSGPACK and type(payload) is bytes:
            try:
                blocked = self.blocked(payload)
            except Exception as e:
                raise ValueError(f"stored msgpack that does not parse ({e})") from None
            if blocked:
                raise ValueError(f"a stored object names {', '.join(sorted(set(blocked)))}, which is not on the "
                                 "allowlist: refused without importing or calling it")
            return self.serde.loads_typed(("msgpack", payload))
        if kind == _K_TUPLE and type(payload) is tuple:
            return tuple(self.decode(v) for v in payload)
        if kind == _K_BYTEARRAY and type(payload) is bytes:
            return bytearray(payload)
        if kind == _K_DELTA:
            return _DeltaSnapshot(self.decode(payload))
        raise ValueError(f"a marked value of unknown kind {kind!r}")


def _pairs(names: list[str]) -> str:
    out = []
    for n in sorted(set(names)):
        mod, _, name = n.rpartition(".")
        if mod and "(" not in n and " " not in n:
            out.append(f"({mod!r}, {name!r})")
    return ", ".join(out) or "..."


# --- metadata for listing ---------------------------------------------------------------

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


# --- the saver ---------------------------------------------------------------------------

_END = object()


class AgckSaver(BaseCheckpointSaver[int]):
    """A LangGraph checkpointer on an agck store (see the module's docstring).

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
            self.store, self._own = store, False
        else:
            self.store, self._own = open_store(store, **open_options), True
        self._values = _ValueCodec(_normalize_types(allowed_types))
        super().__init__(serde=self._values.serde)
        self.on_damaged = on_damaged
        # The records this saver last wrote or read: a put finds its parent's channel
        # locations here instead of reading the parent back (one read per super-step).
        self._recent: OrderedDict = OrderedDict()
        self._recent_lock = threading.Lock()

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

    # -- lifecycle --
    def close(self) -> None:
        """Close the store if the saver opened it."""
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
        thread_id, ns = self._thread_ns(config)
        cid = checkpoint.get("id")
        runs = _Runs.of(thread_id, ns)
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
        unchanged = [c for c in versions if c not in where]
        if unchanged:
            where.update(self._locate(runs, key, parent_id, parent_key, {c: versions[c] for c in unchanged},
                                      where_txt))

        rest = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        full_metadata = get_checkpoint_metadata(config, metadata)
        record = {
            "checkpoint": self._encode(rest, f"checkpoint {cid} of {where_txt}: field", ref),
            "metadata": self._encode(full_metadata, f"checkpoint {cid} of {where_txt}: metadata", ref),
            "where": where,
        }
        proj, full = _metadata_projection(full_metadata)
        meta = {"lg": _FORMAT, "thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid,
                "parent_checkpoint_id": parent_id if isinstance(parent_id, str) else None,
                "metadata": proj, "mfull": full}
        vmeta = {"lg": _FORMAT, "thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid}
        entries = [PutEntry(runs.own(c), key, {c: tree}, {**vmeta, "channel": c}, overwrite=False)
                   for c, tree in own.items()]
        if grouped:
            entries.append(PutEntry(runs.values, key, grouped, vmeta, overwrite=False))
        entries.append(PutEntry(runs.records, key, record, meta, parent=parent_key, overwrite=False))  # the commit
        try:
            self.store.put_many(entries)   # one transaction on the SQL stores; the record last on any
        except CheckpointExistsError:      # a put repeated, or a key taken: decided entry by entry
            for e in entries:
                self._put_entry(e.run, key, e.state, e.meta, runs, cid, where_txt, parent=e.parent)
        except EncodeError as e:           # agck's codec refused a value (an object array): say whose
            raise EncodeError(f"checkpoint {cid} of {where_txt}: channel value {e.reason}",
                              ref=e.ref or ref, hint=e.hint) from None
        self._remember(runs.records, key, cid, versions, where)
        return self._config(thread_id, ns, cid)

    def _same_checkpoint(self, runs: _Runs, key: int, cid: str, where_txt: str) -> None:
        """Whether (run, key) may be replaced by checkpoint ``cid``: it holds ``cid`` (a put
        repeated), nothing, or a damaged record; not another checkpoint's."""
        try:
            ck = self.store.read(runs.records, key)
        except CheckpointNotFoundError:
            return
        except AgckError as e:
            if is_verdict(e):
                return
            raise
        other = ck.meta.get("checkpoint_id") if isinstance(ck.meta, dict) else None
        if other != cid:
            raise CheckpointExistsError(
                f"checkpoint {cid} of {where_txt} has the same key ({key}) as checkpoint {other}, already stored: "
                "two checkpoints made in the same 100 ns", ref=self.store.ref(runs.records, key),
                hint="write each thread from one process at a time; put the checkpoint again with a new id")

    def _locate(self, runs: _Runs, key: int, parent_id: Any, parent_key: int | None, wanted: dict,
                where_txt: str) -> dict:
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
                if isinstance(e, AgckError) and not is_verdict(e):
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
        thread_id, ns = self._thread_ns(config)
        cid = (config.get("configurable") or {}).get("checkpoint_id")
        key = checkpoint_key(cid)
        where_txt = f"thread {thread_id!r} namespace {ns!r}"
        if key is None:
            raise UsageError(f"put_writes for {where_txt} needs the checkpoint id (a canonical UUID) of the "
                             f"checkpoint the writes follow, not {cid!r}")
        runs = _Runs.of(thread_id, ns)
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
            return
        meta = {"lg": _FORMAT, "thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": cid, "task_id": task_id}
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
                if isinstance(e, AgckError) and not is_verdict(e):
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

    # -- reading ----------------------------------------------------------------------
    def _load(self, runs: _Runs, key: int, expect_id: str | None = None,
              expect: tuple[str, str] | None = None) -> CheckpointTuple | None:
        """The checkpoint at ``key``, or None if there is none (or it is another id or
        another thread's). Raises _Damage for a damaged part."""
        try:
            ck = self.store.read(runs.records, key)
        except CheckpointNotFoundError:
            return None
        except AgckError as e:
            if is_verdict(e):
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
            where = rec["where"]
            if not (isinstance(body, dict) and isinstance(metadata, dict) and isinstance(where, dict)
                    and all(_is_place(e) for e in where.values())):
                raise ValueError("fields of the wrong types")
        except Exception as e:
            raise _Damage("its record", MalformedCheckpointError(f"unexpected record: {e}", ref=ck.ref),
                          self.store.ref(runs.records, key)) from None
        self._remember(runs.records, key, cid, body.get("channel_versions") or {}, where)
        body["channel_values"] = self._channel_values(runs, where, None)
        pending = self._pending_writes(runs, key)
        return CheckpointTuple(
            config=self._config(thread_id, ns, cid),
            checkpoint=body,
            metadata=metadata,
            parent_config=self._config(thread_id, ns, parent_id) if parent_id else None,
            pending_writes=pending,
        )

    def _channel_values(self, runs: _Runs, where: dict, channels: set | None) -> dict:
        by_entry: dict[tuple[str, int], list[str]] = {}
        for c, e in where.items():
            if e is not None and (channels is None or c in channels):
                place = (runs.own(c), e[0]) if type(e) is list else (runs.values, e)
                by_entry.setdefault(place, []).append(c)
        out = {}
        for (run, e), chans in sorted(by_entry.items()):
            what = "the value of channel " + ", ".join(repr(c) for c in sorted(chans))
            ref = self.store.ref(run, e)
            try:
                entry = self.store.read(run, e).state
            except CheckpointNotFoundError as err:
                raise _Damage(what + " (its stored entry is missing)", err, ref) from None
            except AgckError as err:
                if is_verdict(err):
                    raise _Damage(what, err, ref) from None
                raise
            for c in chans:
                try:
                    out[c] = self._values.decode(entry[c])
                except Exception as err:
                    raise _Damage(f"the value of channel {c!r}",
                                  MalformedCheckpointError(f"cannot rebuild it: {err}", ref=ref), ref) from None
        return out

    def _pending_writes(self, runs: _Runs, key: int) -> list:
        run = runs.writes(key)
        rows = []
        for s in self.store.steps(run):
            ref = self.store.ref(run, s)
            try:
                entry = self.store.read(run, s).state
            except CheckpointNotFoundError:
                continue
            except AgckError as err:
                if is_verdict(err):
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
        for s in reversed(self.store.steps(runs.records)):
            if s >= below:
                continue
            try:
                t = self._load(runs, s, expect=expect)
            except _Damage:
                continue
            if t is not None:
                return t
        return None

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
        runs = _Runs.of(thread_id, ns)
        cid = get_checkpoint_id(config)
        if cid:
            key = checkpoint_key(cid)
            if key is None:
                return None
            try:
                return self._load(runs, key, expect_id=cid, expect=(thread_id, ns))
            except _Damage as d:
                raise self._damaged(runs, key, thread_id, ns, cid, d) from None
        for key in self._newest_first(runs.records):
            try:
                t = self._load(runs, key, expect=(thread_id, ns))
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

    def _newest_first(self, run: str) -> Iterator[int]:
        """The run's steps, newest first: the newest asked for alone (the one almost
        always wanted: a long thread's get costs no more than a short one's), the rest
        only if the caller goes on."""
        newest = self.store.steps(run, last=1)
        yield from newest
        if newest:
            yield from (s for s in reversed(self.store.steps(run)) if s < newest[0])

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        if limit is not None and limit <= 0:
            return
        if config:     # None or {}: every thread, as LangGraph's own savers do
            thread_id, ns = self._thread_ns(config, require_ns=False)
            cid = get_checkpoint_id(config)
            if ns is not None:
                runs_list = [_Runs.of(thread_id, ns).records]
            else:
                prefix = _thread_prefix(thread_id)
                runs_list = [r for r in self.store.runs() if r.startswith(prefix) and _is_records_run(r)]
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
        runs = _Runs.of(thread_id, ns)
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
                where = ck.state["where"] if isinstance(ck.state, dict) else None
                if not isinstance(where, dict) or not all(_is_place(e) for e in where.values()):
                    raise _Damage("its record", MalformedCheckpointError("unexpected record", ref=ck.ref),
                                  self.store.ref(runs.records, key))
                writes = self._pending_writes(runs, key)
                found = {c for c in remaining if where.get(c) is not None}
                values = self._channel_values(runs, where, found)
            except CheckpointNotFoundError:
                break
            except _Damage as d:
                raise self._damaged(runs, key, thread_id, ns, cursor, d) from None
            except AgckError as e:
                if is_verdict(e):
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
        prefix = _thread_prefix(thread_id)
        runs = [r for r in self.store.runs() if r.startswith(prefix) and _is_lg_run(r)]
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
        for k in keys:
            self._delete_steps(runs.records, [k])
            self._delete_steps(runs.writes(k))
        self._collect_values(runs, all_runs)

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
            prefix = _thread_prefix(tid)
            all_runs = [r for r in self.store.runs() if r.startswith(prefix)]
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
                if isinstance(e, AgckError) and not is_verdict(e):
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
        sp, dp = _thread_prefix(src), _thread_prefix(dst)
        runs = [r for r in self.store.runs() if r.startswith(sp) and _is_lg_run(r)]
        for run in sorted(runs, key=lambda r: (r.endswith(".c"), r)):
            kind = run[run.rindex(".") + 1:]
            target_runs = _Runs(dp + run[len(sp):run.rindex(".") + 1])
            for s in self.store.steps(run):
                try:
                    ck = self.store.read(run, s)
                except CheckpointNotFoundError:
                    continue
                except AgckError as e:
                    if is_verdict(e):
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

    # -- async: the sync methods in a worker thread ----------------------------------------
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await asyncio.to_thread(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None
                    ) -> AsyncIterator[CheckpointTuple]:
        it = self.list(config, filter=filter, before=before, limit=limit)
        while True:
            item = await asyncio.to_thread(next, it, _END)
            if item is _END:
                return
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        return await asyncio.to_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)

    async def aget_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]
                                         ) -> Mapping[str, DeltaChannelHistory]:
        return await asyncio.to_thread(self.get_delta_channel_history, config=config, channels=channels)

