"""How LangGraph's channel values and pending writes are stored, and the allowlist
of classes that loading them may rebuild.

``_ValueCodec.encode`` gives the tree agck's codec stores for a value, or raises
``_Refused`` with the path inside the value (the saver names the channel in an
``EncodeError``). ``_ValueCodec.decode`` gives the value back from such a tree;
a stored form it does not know, or one naming a class off the allowlist, raises
ValueError having imported and called nothing (the saver reports the checkpoint
damaged). ``_opaque`` is the one definition of what goes whole to LangGraph's
serializer.

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
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
import ormsgpack
from langgraph.checkpoint.serde import _msgpack as _lg_msgpack
from langgraph.checkpoint.serde import jsonplus as _jsonplus
from langgraph.checkpoint.serde.types import _DeltaSnapshot

from ...errors import UsageError

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

    # the verdicts of ``blocked`` on extension payloads already parsed, by their bytes: a chat's
    # earlier messages come back in every put and get of the thread, and parsing them again
    # was a fifth of a small put's own time; bounded, for payloads up to _VERDICT_MAX_BYTES
    _VERDICTS_MAX = 512        # at most 8 MiB of payloads kept
    _VERDICT_MAX_BYTES = 16384

    def __init__(self, allowed: frozenset):
        self.allowed = allowed
        self._verdicts: dict[tuple[int, bytes], tuple[str, ...]] = {}
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
        verdicts = self._verdicts

        def hook(code: int, payload: bytes):
            if len(payload) <= self._VERDICT_MAX_BYTES:
                known = verdicts.get((code, payload))
                if known is not None:
                    out.extend(known)
                    return None
                start = len(out)
                judge(code, payload)
                if len(verdicts) >= self._VERDICTS_MAX:
                    verdicts.clear()
                verdicts[(code, payload)] = tuple(out[start:])
            else:
                judge(code, payload)
            return None

        def judge(code: int, payload: bytes) -> None:
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

