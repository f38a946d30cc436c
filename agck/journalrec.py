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

import logging
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from . import checkpoint, chunkcodec, cipher, codec, format
from .errors import AgckError, CorruptCheckpointError, EncodeError, MalformedCheckpointError, UnsupportedVersionError

log = logging.getLogger("agck")

MAGIC = b"AGJR"
_HEAD = struct.Struct("<4sI")
_CHECK = struct.Struct("<Q")
HEAD_SIZE = _HEAD.size                  # 8
OVERHEAD = HEAD_SIZE + _CHECK.size      # 16 bytes per record besides its body
MAX_BODY = (1 << 32) - 1
#: The largest value tree a compressed record may claim to hold (FORMAT.md 17.3): what a
#: reader may be made to allocate for one record.
MAX_TREE = 1 << 30   # not a threshold: a limit (FORMAT.md 17.3)
KINDS = ("r", "i", "e", "s")
ENCS = ("t", "c", "z", "x")        # "x": sealed (FORMAT.md 18.8)


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

def encode_value(value: Any, what: str = "result", *, level: int | None = None) -> tuple[str, bytes]:
    """(enc, payload) for ``value``: plain msgpack where it is plain data, a codec tree
    where it holds no array or tensor, else a whole container. Raises EncodeError
    naming the path of what agck's codec cannot store (never pickled). ``level``: a
    tree of :data:`COMPRESS_MIN` bytes or more is compressed at that zstd level where
    that pays (:func:`compress_tree`); None (a store that does not compress): never."""
    packed = codec.plain_packed(value)
    if packed is not None:
        return compress_tree(packed, level)
    enc = codec.encode_state(value, root=what)
    if not enc.blobs:
        return compress_tree(enc.tree, level)
    return "c", checkpoint.dumps(value)


#: A value tree shorter than this is never compressed: a zstd frame's overhead (15 + about
#: 10 bytes) and a decompression on every replay cost more than text this short saves.
COMPRESS_MIN = 512


def compress_tree(tree: bytes, level: int | None) -> tuple[str, bytes]:
    """``("z", frame)``: the value tree as one zstd frame (FORMAT.md 17.3), when ``level``
    is given, the tree is at least :data:`COMPRESS_MIN` bytes, the frame saves at least
    ``chunkcodec.MIN_SAVING`` and decodes back to the same bytes (checked here, before
    the record exists); else ``("t", tree)``."""
    if level is None or len(tree) < COMPRESS_MIN or len(tree) > MAX_TREE:
        return "t", tree
    frame = chunkcodec.frame(tree, chunkcodec.Method.ZSTD, level=level)
    if len(frame) > len(tree) * (1 - chunkcodec.MIN_SAVING):
        return "t", tree
    try:
        back = chunkcodec.decode(frame, encoded=True, raw_size=len(tree))
    except AgckError:
        back = None
    if back is None or bytes(back) != tree:
        log.warning("agck: compressing a journal value of %d bytes gave a frame that does not decode back to it; "
                    "kept uncompressed. A faulty compressor or memory: report it if it repeats", len(tree))
        return "t", tree
    return "z", frame


def decode_value(entry: Entry, ref: str | None = None, sealer=None) -> Any:
    """The value a record holds, every checksum of a container verified; raises an
    AgckError (``verdict``: the data is bad) for anything malformed (FORMAT.md 17.3).
    ``sealer``: the store's data key, which opens a sealed value (enc ``"x"``, 18.8)."""
    if entry.enc == "x":
        return decode_value(_opened(entry, ref, sealer), ref)
    if entry.enc == "t":
        return codec.decode_state(entry.payload, [], _no_blob, 0, ref=ref)
    if entry.enc == "z":    # a value tree as one frame (FORMAT.md 17.3): its claimed size bounded first
        try:
            head = chunkcodec.read_header(entry.payload)
        except CorruptCheckpointError as e:
            raise MalformedCheckpointError(f"a journal record's compressed value: {e.reason}", ref=ref,
                                           section="record") from None
        if head.method is not chunkcodec.Method.ZSTD or head.raw_size > MAX_TREE:
            raise MalformedCheckpointError(f"a journal record's compressed value is not one zstd frame of at most "
                                           f"{MAX_TREE} bytes (method {head.method.name.lower()}, "
                                           f"{head.raw_size} bytes)", ref=ref, section="record")
        try:
            tree = chunkcodec.decode(entry.payload, encoded=True, raw_size=head.raw_size)
        except CorruptCheckpointError as e:
            raise MalformedCheckpointError(f"a journal record's compressed value: {e.reason}", ref=ref,
                                           section="record") from None
        return codec.decode_state(bytes(tree), [], _no_blob, 0, ref=ref)
    # "c" (parse_body admits no other): a standalone container, never a listing of chunks
    if format.is_chunked(format.parse_header(entry.payload, ref=ref)):
        raise MalformedCheckpointError("a journal record's container is a chunked container, which names chunks "
                                       "no journal holds (FORMAT.md 17.3)", ref=ref, section="record")
    return checkpoint.loads(entry.payload).state


def _opened(entry: Entry, ref: str | None, sealer) -> Entry:
    """A sealed record's value as it was before sealing: an entry of enc "t", "z" or "c"."""
    if sealer is None:
        raise MalformedCheckpointError("a journal record's value is sealed (enc \"x\") in a store with no key",
                                       ref=ref, section="record")
    try:
        inner = sealer.open(cipher.Kind.RECORDS, cipher.record_context(entry.kind, entry.name, entry.key,
                                                                        entry.index),
                            entry.payload, what=f"step {entry.name!r}'s sealed value")
    except (CorruptCheckpointError, UnsupportedVersionError) as e:   # a record's unknown version: damage too
        raise MalformedCheckpointError(e.reason, ref=ref, section="record") from None
    try:
        fields = msgpack.unpackb(bytes(inner), raw=False, use_list=True, ext_hook=_refuse_ext)
    except Exception as e:
        raise MalformedCheckpointError(f"a journal record's sealed value is not msgpack ({e})", ref=ref,
                                       section="record") from None
    if type(fields) is not list or len(fields) != 2 or fields[0] not in ("t", "c", "z") \
            or type(fields[1]) is not bytes:
        raise MalformedCheckpointError("a journal record's sealed value is not [enc, payload]", ref=ref,
                                       section="record")
    return Entry(entry.kind, entry.name, entry.key, entry.index, fields[0], fields[1])


def unsealed(records) -> int | None:
    """The index of the first of ``records`` (each one record's bytes, as a journal
    writes them) whose value is not sealed, or None: what an encrypted store checks
    before it appends a batch, so nothing reaches its log in the clear."""
    for i, r in enumerate(records):
        v, pos = memoryview(r).cast("B"), 0
        while pos < v.nbytes:       # an element may hold several records back to back
            try:
                if v.nbytes - pos < OVERHEAD or bytes(v[pos:pos + 4]) != MAGIC:
                    return i
                (n,) = struct.unpack_from("<I", v, pos + 4)
                if pos + OVERHEAD + n > v.nbytes:
                    return i
                e = parse_body(bytes(v[pos + HEAD_SIZE:pos + HEAD_SIZE + n]))
            except (ValueError, struct.error):
                return i
            if e.enc != "x" and e.kind != "e":
                return i
            pos += OVERHEAD + n
    return None


def first_value_sealed(data) -> bool | None:
    """Whether the first record of ``data`` (a log as :meth:`Store.log_read` returns it)
    that holds a value is sealed (enc ``"x"``); None when no such record can be read
    (FORMAT.md rule 18.9: how a store with no key slots knows it is encrypted)."""
    for _, e in scan(data).entries:
        if e.kind != "e":
            return e.enc == "x"
    return None


def _no_blob(i: int):
    raise IndexError(i)


# --- records ------------------------------------------------------------------------------

def record(kind: str, name: str, key: bytes, index: int, enc: str, payload: bytes, *, sealer=None) -> bytes:
    """The bytes of one record (FORMAT.md 17.1 and 17.2). ``sealer``: an encrypted store's
    data key (:class:`agck.cipher.DataKey`): the value is sealed (enc ``"x"``, FORMAT.md 18.8)."""
    if sealer is not None and kind != "e":
        inner = msgpack.packb([enc, payload], use_bin_type=True)
        enc, payload = "x", bytes(sealer.seal(cipher.Kind.RECORDS, cipher.record_context(kind, name, key, index),
                                              inner))
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
            or type(index) is not int or index < 0 or enc not in ENCS or type(payload) is not bytes:
        raise ValueError("fields of the wrong types")                          # FORMAT.md 17.2
    if not name:
        raise ValueError("an empty name")
    if kind == "r" and index != 0:
        raise ValueError(f"a result of index {index}, not 0")
    if kind == "e" and (enc, payload) != ("t", b"\xc0"):
        raise ValueError("an end whose value is not nil")
    return Entry(kind, name, key, index, enc, payload)


def _refuse_ext(code: int, data: bytes):
    raise ValueError(f"msgpack extension {code} in a record")


# --- batches (file logs) --------------------------------------------------------------------

BATCH_MAGIC = b"AGJB"
_BATCH = struct.Struct("<4sI")
BATCH_HEAD_SIZE = _BATCH.size + _CHECK.size     # 16


def batch(records: bytes) -> bytes:
    """One append of a file log (FORMAT.md 17.6): a batch header (its magic, the length of the records
    that follow, and an XXH3-64 of those 8 bytes) and the records. The checked length
    is what lets a reader tell a batch a crash cut short (fewer bytes than it says:
    never acknowledged) from records that were written whole and damaged later."""
    head = _BATCH.pack(BATCH_MAGIC, len(records))
    return b"".join((head, _CHECK.pack(xxhash.xxh3_64_intdigest(head)), records))


@dataclass
class Scan:
    """What :func:`scan` found in a log: the records that verify, with their offsets;
    the damaged ones (offset, reason); where the valid log ends (``end``: the next
    record goes there; bytes after it are a torn tail, never acknowledged, which a
    writer may cut off); and whether there is such a tail (``torn``)."""

    entries: list
    damaged: list
    end: int
    torn: bool


_CANNOT_TELL = "; nothing that verifies follows it, and it is not a write cut short: damaged after it was " \
               "written, or never written whole (a power cut can leave either), which a reader cannot tell apart"


def scan(buf, start: int = 0, *, tears: bool = True) -> Scan:
    """Read the records of ``buf`` from offset ``start`` (FORMAT.md 17.5, 17.7 and 17.8). ``tears``: the
    log can end in a batch a crash cut short (a file log; a database row or an object
    is written whole or not at all, so there every failure is damage).

    Bytes that fail their checks are damaged (reported in ``damaged``, kept) unless
    they are certainly a torn tail (``torn``; ``end`` is where it starts): a batch or
    a record whose checked length runs past the end of the log, or bytes that are all
    zero from where they fail to the end (never written). A batch is acknowledged
    whole or not at all: the records of a torn batch are not returned."""
    view = memoryview(buf).cast("B")
    size = len(view)
    entries: list = []
    damaged: list = []
    pos = end = start
    bad_at: int | None = None     # where unverified bytes began
    cut_at: int | None = None     # where they began with a record whose length runs past the end
    why = ""
    torn = False

    def bad(at: int, reason: str) -> None:
        nonlocal bad_at, why
        if bad_at is None:
            bad_at, why = at, reason

    def good(tail: str = "") -> None:
        nonlocal bad_at
        if bad_at is not None:    # damage followed by what verifies (or a torn tail): damage
            damaged.append((bad_at, why + tail))
            bad_at = None

    while pos < size:
        magic = bytes(view[pos:pos + 4])
        if magic == BATCH_MAGIC or (size - pos < 4 and BATCH_MAGIC.startswith(magic)):
            length = _batch_at(view, pos, size)
            if length is None and tears and _torn_head(view, pos):
                good(_CANNOT_TELL)                     # a batch header cut short, zeros after it
                torn, end = True, pos
                break
            if length is None:                         # its header fails its check
                bad(pos, "a batch header that fails its check")
            elif length < 0:                           # it runs past the end of the log: never whole
                if tears:
                    good(_CANNOT_TELL)
                    torn, end = True, pos
                    break
                bad(pos, "a batch cut short")
                break
            else:
                stop = pos + BATCH_HEAD_SIZE + length
                inner = _records(view, pos + BATCH_HEAD_SIZE, stop)
                last = bool(inner.damaged) and tears and _zeros(view, stop)
                if last and not any(view[stop - _CHECK.size:stop]):
                    # its last record's check is zeros (a written one is, one time in 2^64): the
                    # batch's end never reached the disk, so it was never acknowledged
                    good(_CANNOT_TELL)
                    torn, end = True, pos
                    break
                good()
                entries += inner.entries
                damaged += [(at, r + _CANNOT_TELL) for at, r in inner.damaged] if last else inner.damaged
                pos = end = stop
                continue
        else:
            ok, body_len, reason = _check_at(view, pos, size)
            if ok:
                good()
                _entry(view, pos, body_len, entries, damaged)
                pos = end = pos + OVERHEAD + body_len
                continue
            if tears and (_zeros(view, pos) or _torn_head(view, pos)):
                good(_CANNOT_TELL)                     # zeros to the end, or a header cut short: never written
                torn, end = True, pos
                break
            if bad_at is None and body_len < 0:        # cut short, if nothing that verifies follows
                cut_at = pos
            bad(pos, reason)
        nxt = _next_magic(view, pos + 1)
        if nxt < 0:
            break
        pos = nxt
    if bad_at is not None and tears and bad_at == cut_at:
        torn = True          # a record (unbatched: written before batch headers) cut short at the end
    elif bad_at is not None:
        good(_CANNOT_TELL if tears else "")
        end = size                                     # kept: what may have been acknowledged is never cut off
    return Scan(entries, damaged, end, torn)


def framing_only(found: Scan, at: int) -> bool:
    """Whether the damaged region at ``at`` is a batch header alone (FORMAT.md 17.9): a
    record that verifies starts right after its 16 bytes, so the records it framed are
    read and nothing of them is lost; no step holds it, so it is never healed."""
    return any(off == at + BATCH_HEAD_SIZE for off, _ in found.entries)


def healed(found: Scan, buf, at: int) -> bool:
    """FORMAT.md 17.9: whether the damaged record at ``at`` (in ``buf``, as ``found`` read
    it) was written again whole since: a record that verifies, after it, holds its
    step's result; or, for an item or an end, after it the same item or end, and its
    stream is whole (an end, and every item it counts). The stream's rule catches rot
    in an item's index, which reads as a sibling's: its own item is then missing. A
    damaged AppendLog segment is judged by the checkpoints that count it (17.11)."""
    who = identity_at(buf, at)
    if who is None:
        return False
    kind, name, key, index = who
    mine = [(off, e) for off, e in found.entries if e.name == name and e.key == key]
    later = [e for off, e in mine if off > at]
    if kind == "r":
        return any(e.kind == "r" for e in later)
    if kind not in ("i", "e"):
        return False
    ends = [e.index for _, e in mine if e.kind == "e"]
    if not ends or not set(range(ends[0])) <= {e.index for _, e in mine if e.kind == "i"}:
        return False
    if kind == "i":
        return index < ends[0] and any(e.kind == "i" and e.index == index for e in later)
    return any(e.kind == "e" for e in later)


def identity_at(buf, at: int) -> tuple | None:
    """Which record damaged bytes at ``at`` held, if the fields before its value can still
    be read (no check: for telling when it was written again, FORMAT.md 17.9): (kind,
    name, key, index), or None."""
    view = memoryview(buf).cast("B")
    if bytes(view[at:at + 4]) == BATCH_MAGIC:
        at += BATCH_HEAD_SIZE
    if len(view) - at < HEAD_SIZE:
        return None
    _, body_len = _HEAD.unpack_from(view, at)
    try:
        fields = msgpack.Unpacker(raw=False, unicode_errors="surrogatepass", ext_hook=_refuse_ext,
                                  max_buffer_size=max(1, min(body_len, len(view) - at - HEAD_SIZE)))
        fields.feed(bytes(view[at + HEAD_SIZE:at + HEAD_SIZE + body_len]))
        n = fields.read_array_header()
        kind, name, key, index = (fields.unpack() for _ in range(4))
    except Exception:     # damaged bytes: msgpack raises several types
        return None
    if n != 6 or kind not in KINDS or type(name) is not str or type(key) is not bytes or len(key) != 16 \
            or type(index) is not int or index < 0:
        return None
    return kind, name, key, index


def _zeros(view: memoryview, start: int) -> bool:
    """Whether every byte from ``start`` to the end is zero (never written)."""
    return not bytes(view[start:]).strip(b"\0")


def _torn_head(view: memoryview, start: int) -> bool:
    """Whether the bytes from ``start`` are the start of a batch header cut short, then
    zeros (a write that reached the disk only in part; an acknowledged batch has a whole
    header and records after it)."""
    head = bytes(view[start:start + BATCH_HEAD_SIZE + 1]).rstrip(b"\0")
    return len(head) < BATCH_HEAD_SIZE and BATCH_MAGIC.startswith(head[:4]) and _zeros(view, start + len(head))


def _records(view: memoryview, start: int, stop: int) -> Scan:
    """The records of one whole batch, ``view[start:stop]``: every failure is damage."""
    return scan(view[:stop], start, tears=False)


def _next_magic(view: memoryview, start: int) -> int:
    """Where the next record or batch magic starts, from ``start``; -1 if none."""
    data = bytes(view[start:])
    hits = [i for i in (data.find(MAGIC), data.find(BATCH_MAGIC)) if i >= 0]
    return start + min(hits) if hits else -1


def _batch_at(view: memoryview, pos: int, size: int) -> int | None:
    """The length of the records of the batch at ``pos``; -1 when the batch (its header
    included) runs past the end of the log; None when its header fails its check."""
    if size - pos < BATCH_HEAD_SIZE:
        return -1
    magic, length = _BATCH.unpack_from(view, pos)
    (stored,) = _CHECK.unpack_from(view, pos + _BATCH.size)
    if xxhash.xxh3_64_intdigest(view[pos:pos + _BATCH.size]) != stored:
        return None
    return -1 if size - pos - BATCH_HEAD_SIZE < length else length


def _entry(view: memoryview, pos: int, body_len: int, entries: list, damaged: list) -> None:
    body = bytes(view[pos + HEAD_SIZE:pos + HEAD_SIZE + body_len])
    try:
        entries.append((pos, parse_body(body)))
    except ValueError as e:   # its check held: written so by a writer, reported as damage
        damaged.append((pos, f"a record that verifies but is malformed: {e}"))


def _check_at(view: memoryview, pos: int, size: int) -> tuple[bool, int, str]:
    """Whether a whole record that verifies (FORMAT.md 17.1) starts at ``pos``, its body's length, and
    why not (body length -1: its length runs past the end of the log)."""
    if size - pos < OVERHEAD:
        if MAGIC.startswith(bytes(view[pos:pos + 4])):
            return False, -1, "a record cut short"
        return False, 0, "no record starts here"
    magic, body_len = _HEAD.unpack_from(view, pos)
    if magic != MAGIC:
        return False, 0, "no record starts here"
    if size - pos - OVERHEAD < body_len:
        return False, -1, f"a record of {body_len} bytes cut short at the end"
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


_MAX_DEPTH = 256       # as a value tree (FORMAT.md 8): deeper inputs, or ones that contain themselves, are refused


class _Fingerprint:
    def __init__(self, h, depth: int = 0):
        self.h = h
        self.depth = depth

    def value(self, x: Any, path: str) -> None:
        t = type(x)
        if t in (list, tuple, dict, set, frozenset) or isinstance(x, dict):
            if self.depth >= _MAX_DEPTH:
                raise EncodeError(f"{path}: inputs nest deeper than {_MAX_DEPTH} levels (or contain themselves)",
                                  hint="pass flatter inputs, or fingerprint them yourself into a str")
            self.depth += 1
            try:
                self._nested(x, t, path)
            finally:
                self.depth -= 1
            return
        self._leaf(x, t, path)

    def _nested(self, x: Any, t: type, path: str) -> None:
        up = self.h.update
        if t is list or t is tuple:
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
        else:     # set or frozenset
            items = sorted(self._alone(v, f"{path} item") for v in x)
            up(b"%s%d:" % (b"S" if t is set else b"Z", len(items)) + b"".join(items))

    def _leaf(self, x: Any, t: type, path: str) -> None:
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
        elif t is bytes or t is bytearray or t is memoryview:
            b = bytes(x)
            up(b"b%d:" % len(b) + b)
        elif t is complex:
            up(b"c" + _DOUBLE.pack(x.real) + _DOUBLE.pack(x.imag))
        elif isinstance(x, (np.ndarray, np.generic)):
            a = np.asarray(x)
            if a.dtype.hasobject:
                raise EncodeError(f"{path}: an array of Python objects has no content to fingerprint")
            self._array(b"a", a.dtype.str, a.shape, np.ascontiguousarray(a))
        elif _is_tensor(x):
            self._tensor(x, path)
        else:
            raise EncodeError(f"{path}: cannot fingerprint a {t.__module__}.{t.__qualname__} "
                              "(inputs are fingerprinted by content: plain data, arrays and tensors)",
                              hint="pass its content (a dict, an array) or fingerprint it yourself into a str")

    def _tensor(self, x: Any, path: str) -> None:
        torch = sys.modules["torch"]
        if x.is_nested or x.layout != torch.strided or x.device.type == "meta":
            what = "a nested" if x.is_nested else "a meta" if x.device.type == "meta" else f"a {x.layout}"
            raise EncodeError(f"{path}: {what} tensor has no dense content to fingerprint",
                              hint="pass a dense tensor (.to_dense()), or its content as a str")
        t_ = x.detach()
        if t_.device.type != "cpu":
            t_ = t_.cpu()
        t_ = t_.contiguous()
        arr = t_.reshape(-1).view(torch.uint8).numpy() if t_.numel() else np.empty(0, np.uint8)
        self._array(b"x", str(t_.dtype), tuple(t_.shape), arr)

    def _alone(self, x: Any, path: str) -> bytes:
        """A value's own 16-byte digest (to order a dict's keys or a set's items)."""
        sub = xxhash.xxh3_128()
        _Fingerprint(sub, self.depth).value(x, path)
        return sub.digest()

    def _array(self, tag: bytes, dtype: str, shape: tuple, data: np.ndarray) -> None:
        self.h.update(b"%s%s:%s;" % (tag, dtype.encode(), ",".join(map(str, shape)).encode()))
        # its bytes as uint8 (a buffer of datetime64 or timedelta64 cannot be taken as it is)
        self.h.update(data.reshape(-1).view(np.uint8) if data.nbytes else b"")


_DOUBLE = struct.Struct("<d")


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


