"""The JSON form of a checkpoint's ``meta``, as SQL manifests keep it for listing and queries.

:func:`meta_to_json` maps any msgpack value to JSON that Postgres JSONB
accepts (SQLite keeps the same text), losing nothing silently: what JSON
cannot hold is tagged (``$bytes``, ``$float``, ``$str``). It is a view for
:meth:`Store.list` and SQL queries; ``read().meta`` always returns the exact
value from the container.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any


def meta_to_json(meta: Any) -> Any:
    """The JSON form of a checkpoint's ``meta`` kept in the manifest for listing and queries.

    ``meta`` is plain msgpack data; JSON (and Postgres JSONB) cannot hold all of it,
    so: bytes become ``{"$bytes": "<base64>"}``; non-string dict keys become ``str(key)``;
    tuples become lists; NaN and infinities become ``{"$float": "nan" | "inf" | "-inf"}``;
    strings JSONB cannot store (a NUL character, a lone surrogate) become
    ``{"$str": "<base64 of their UTF-8, surrogates passed through>"}``.
    This form is for :meth:`Store.list` and SQL queries only; ``read().meta`` returns
    the exact value from the container."""
    t = type(meta)
    if meta is None or t is bool or t is int:
        return meta
    if t is float or isinstance(meta, float):
        if math.isfinite(meta):
            return float(meta)
        return {"$float": "nan" if math.isnan(meta) else ("inf" if meta > 0 else "-inf")}
    if isinstance(meta, str):
        if "\x00" in meta or not utf8_ok(meta):
            return {"$str": base64.b64encode(meta.encode("utf-8", "surrogatepass")).decode("ascii")}
        return str(meta)
    if isinstance(meta, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(meta)).decode("ascii")}
    if isinstance(meta, dict):
        out = {}
        for k, v in meta.items():
            key = meta_to_json(k) if isinstance(k, str) else str(k)
            if not isinstance(key, str):      # a key JSONB cannot hold: keep it readable
                key = repr(k)
            out[key] = meta_to_json(v)
        return out
    if isinstance(meta, (list, tuple)):
        return [meta_to_json(v) for v in meta]
    if isinstance(meta, int):
        return int(meta)
    return str(meta)


def meta_json_text(meta: Any) -> str:
    """:func:`meta_to_json` as compact JSON text, the manifest's ``meta`` column."""
    return json.dumps(meta_to_json(meta), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def utf8_ok(s: str) -> bool:
    """Whether ``s`` is valid UTF-8 text (no lone surrogates), as JSON columns need."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
