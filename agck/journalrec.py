"""Journal records: what a step journal (:mod:`agck.journal`) stores per step, as
bytes. Pure: bytes in, bytes out, no I/O (FORMAT.md, "Journals").

A record is::

    magic  b"AGJR"                       4 bytes
    length u32 little-endian            of the body
    body   msgpack [kind, name, key, index, enc, payload]
    check  u64 little-endian            XXH3-64 of magic, length and body

``kind`` is ``"r"`` (the result of a step), ``"i"`` (item ``index`` of a streamed
step), ``"e"`` (the end of a streamed step: ``index`` items) or ``"s"`` (a segment
of an :class:`agck.AppendLog`: its items from ``index`` on, as a list; ``name`` the
log's name, ``key`` its writer's generation); ``name`` the step's
name; ``key`` the 16-byte fingerprint of its inputs (:func:`fingerprint`);
``payload`` the value, encoded as ``enc`` says: ``"t"`` a codec tree without
tensors (plain msgpack for plain data), ``"c"`` a whole AGCK container (a value
holding arrays or tensors). Records follow one another in a log; :func:`scan`
reads a log back, verifying every record, and says where each damaged one is and
whether the log ends in a torn record (a write cut short: never acknowledged).

The fixed cost per record is a msgpack array and one XXH3 (a few microseconds), not
a container's: a journal of millions of small steps pays per step what the step
produced, and a container only for values that hold tensors.
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from . import checkpoint, codec
from .errors import EncodeError

MAGIC = b"AGJR"
_HEAD = struct.Struct("<4sI")
_CHECK = struct.Struct("<Q")
HEAD_SIZE = _HEAD.size                  # 8
OVERHEAD = HEAD_SIZE + _CHECK.size      # 16 bytes per record besides its body
MAX_BODY = (1 << 32) - 1
KINDS = ("r", "i", "e", "s")


@dataclass(frozen=True)
class Entry:
    """One record of a journal, its value still encoded (:func:`decode_value`)."""

    kind: str
    name: str
    key: bytes
    index: int
    enc: str
    payload: bytes


# --- values -------------------------------------------------------------------------------

def encode_value(value: Any, what: str = "result") -> tuple[str, bytes]:
    """(enc, payload) for ``value``: plain msgpack where it is plain data, a codec tree
    where it holds no array or tensor, else a whole container. Raises EncodeError
    naming the path of what agck's codec cannot store (never pickled)."""
    packed = codec.plain_packed(value)
    if packed is not None:
        return "t", packed
    enc = codec.encode_state(value, root=what)
    if not enc.blobs:
        return "t", enc.tree
    return "c", checkpoint.dumps(value)


def decode_value(entry: Entry, ref: str | None = None) -> Any:
    """The value a record holds, every checksum of a container verified; raises an
    AgckError (``verdict``: the data is bad) for anything malformed."""
    if entry.enc == "t":
        return codec.decode_state(entry.payload, [], _no_blob, 0, ref=ref)
    return checkpoint.loads(entry.payload).state     # "c" (parse_body admits no other)


def _no_blob(i: int):
    raise IndexError(i)


# --- records ------------------------------------------------------------------------------

def record(kind: str, name: str, key: bytes, index: int, enc: str, payload: bytes) -> bytes:
    """The bytes of one record."""
    body = msgpack.packb([kind, name, key, index, enc, payload], use_bin_type=True, unicode_errors="surrogatepass")
    if len(body) > MAX_BODY:
        raise EncodeError(f"step {name!r}: a journal record holds at most {MAX_BODY} bytes, not {len(body)}")
    head = _HEAD.pack(MAGIC, len(body))
    h = xxhash.xxh3_64(head)
    h.update(body)
    return b"".join((head, body, _CHECK.pack(h.intdigest())))


def parse_body(body: bytes) -> Entry:
    """The entry a verified body holds; ValueError when its fields are not a record's."""
    try:
        fields = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True, unicode_errors="surrogatepass",
                                 ext_hook=_refuse_ext)
    except ValueError:
        raise
    except Exception as e:   # msgpack reports bad input with several exception types
        raise ValueError(f"not msgpack ({type(e).__name__}: {e})") from None
    if type(fields) is not list or len(fields) != 6:
        raise ValueError("not a 6-field record")
    kind, name, key, index, enc, payload = fields
    if kind not in KINDS or type(name) is not str or type(key) is not bytes or len(key) != 16 \
            or type(index) is not int or index < 0 or enc not in ("t", "c") or type(payload) is not bytes:
        raise ValueError("fields of the wrong types")
    return Entry(kind, name, key, index, enc, payload)


def _refuse_ext(code: int, data: bytes):
    raise ValueError(f"msgpack extension {code} in a record")


@dataclass
class Scan:
    """What :func:`scan` found in a log: the records that verify, with their offsets;
    the damaged ones (offset, reason); where the valid log ends (``end``: the next
    record goes there), and whether bytes after it are a record cut short (``torn``)."""

    entries: list
    damaged: list
    end: int
    torn: bool


def scan(buf, start: int = 0) -> Scan:
    """Read the records of ``buf`` from offset ``start``. A record that fails its check
    and is followed by one that verifies is damaged (reported, skipped); bytes that fail
    with nothing valid after them are a torn tail (a write cut short by a crash)."""
    view = memoryview(buf).cast("B")
    size = len(view)
    entries: list = []
    damaged: list = []
    pos = end = start
    bad_at: int | None = None     # where unverified bytes began
    why = ""
    while pos < size:
        ok, body_len, reason = _check_at(view, pos, size)
        if ok:
            if bad_at is not None:   # damage followed by a good record: damage, not a torn tail
                damaged.append((bad_at, why))
                bad_at = None
            body = bytes(view[pos + HEAD_SIZE:pos + HEAD_SIZE + body_len])
            try:
                entries.append((pos, parse_body(body)))
            except ValueError as e:   # its check held: written so by a writer, reported as damage
                damaged.append((pos, f"a record that verifies but is malformed: {e}"))
            pos = end = pos + OVERHEAD + body_len
            continue
        if bad_at is None:
            bad_at, why = pos, reason
        nxt = bytes(view[pos + 1:]).find(MAGIC)     # look for the next record
        if nxt < 0:
            break
        pos = pos + 1 + nxt
    return Scan(entries, damaged, end, bad_at is not None)


def _check_at(view: memoryview, pos: int, size: int) -> tuple[bool, int, str]:
    if size - pos < OVERHEAD:
        return False, 0, "a record cut short"
    magic, body_len = _HEAD.unpack_from(view, pos)
    if magic != MAGIC:
        return False, 0, "no record starts here"
    if size - pos - OVERHEAD < body_len:
        return False, 0, f"a record of {body_len} bytes cut short at the end"
    stop = pos + HEAD_SIZE + body_len
    (stored,) = _CHECK.unpack_from(view, stop)
    if xxhash.xxh3_64_intdigest(view[pos:stop]) != stored:
        return False, 0, "checksum mismatch"
    return True, body_len, ""


# --- fingerprints -------------------------------------------------------------------------

def fingerprint(args: tuple, kwargs: dict) -> bytes:
    """16 bytes (XXH3-128) that equal inputs share and different ones do not: plain data
    by value (a dict's or set's order does not count, a tuple differs from a list), numpy
    arrays and torch tensors by dtype, shape and content. Raises EncodeError naming the
    path of anything else (an object of another type: its identity is not its content)."""
    h = xxhash.xxh3_128()
    _Fingerprint(h).value(("args", args, "kwargs", dict(sorted(kwargs.items()))), "inputs")
    return h.digest()


class _Fingerprint:
    def __init__(self, h):
        self.h = h

    def value(self, x: Any, path: str) -> None:
        t = type(x)
        up = self.h.update
        if t is str:
            b = x.encode("utf-8", "surrogatepass")
            up(b"s%d:" % len(b) + b)
        elif t is int:
            up(b"i%d;" % x)
        elif t is float:
            up(b"f" + _DOUBLE.pack(x if x == x else math.nan))     # one NaN
        elif x is None:
            up(b"N")
        elif t is bool:
            up(b"T" if x else b"F")
        elif t is list or t is tuple:
            up(b"%s%d:" % (b"l" if t is list else b"t", len(x)))
            for i, v in enumerate(x):
                self.value(v, f"{path}[{i}]")
        elif t is dict and all(type(k) is str for k in x):     # the common case: ordered by the keys
            up(b"D%d:" % len(x))
            for k in sorted(x):
                b = k.encode("utf-8", "surrogatepass")
                up(b"%d:" % len(b) + b)
                self.value(x[k], f"{path}[{k!r}]")
        elif isinstance(x, dict):
            pairs = sorted(((self._alone(k, f"{path} key {k!r}"), k) for k in x), key=lambda p: p[0])
            up(b"d%d:" % len(pairs))
            for kb, k in pairs:
                up(kb)
                self.value(x[k], f"{path}[{k!r}]")
        elif t is bytes or t is bytearray or t is memoryview:
            b = bytes(x)
            up(b"b%d:" % len(b) + b)
        elif t is complex:
            up(b"c" + _DOUBLE.pack(x.real) + _DOUBLE.pack(x.imag))
        elif t is set or t is frozenset:
            items = sorted(self._alone(v, f"{path} item") for v in x)
            up(b"%s%d:" % (b"S" if t is set else b"Z", len(items)) + b"".join(items))
        elif isinstance(x, (np.ndarray, np.generic)):
            a = np.asarray(x)
            if a.dtype.hasobject:
                raise EncodeError(f"{path}: an array of Python objects has no content to fingerprint")
            self._array(b"a", a.dtype.str, a.shape, np.ascontiguousarray(a))
        elif _is_tensor(x):
            t_ = x.detach()
            if t_.device.type != "cpu":
                t_ = t_.cpu()
            t_ = t_.contiguous()
            arr = t_.reshape(-1).view(sys.modules["torch"].uint8).numpy() if t_.numel() else np.empty(0, np.uint8)
            self._array(b"x", str(t_.dtype), tuple(t_.shape), arr)
        else:
            raise EncodeError(f"{path}: cannot fingerprint a {t.__module__}.{t.__qualname__} "
                              "(inputs are fingerprinted by content: plain data, arrays and tensors)",
                              hint="pass its content (a dict, an array) or fingerprint it yourself into a str")

    def _alone(self, x: Any, path: str) -> bytes:
        """A value's own 16-byte digest (to order a dict's keys or a set's items)."""
        sub = xxhash.xxh3_128()
        _Fingerprint(sub).value(x, path)
        return sub.digest()

    def _array(self, tag: bytes, dtype: str, shape: tuple, data: np.ndarray) -> None:
        self.h.update(b"%s%s:%s;" % (tag, dtype.encode(), ",".join(map(str, shape)).encode()))
        self.h.update(memoryview(data).cast("B") if data.nbytes else b"")


_DOUBLE = struct.Struct("<d")


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


