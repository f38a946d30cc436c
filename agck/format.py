"""The AGCK container: header, metadata, payload, footer. See FORMAT.md.

Pure: buffers in, buffers out. Writing yields the container as a sequence of
buffers (the blobs' own memory, never a concatenation) and hashes each blob on
the way; reading parses and verifies a buffer (bytes, bytearray, mmap).
Nothing here opens files, sockets or decides durability; a large payload is
hashed on a few threads (:func:`agck.memory.digests`).

    container := header[64] metadata[meta_len] zero-pad payload footer
    payload   := (zero-pad blob)*          every blob starts 64-aligned in the container
    footer    := digest[blob_count]:u64 header_digest:u64 total_len:u64 footer_digest:u64 "AGCK_END"
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Callable, Iterator, Sequence

import msgpack
import numpy as np
import xxhash

from . import memory, thresholds
from .errors import CorruptCheckpointError, FormatError, MalformedCheckpointError, UnsupportedVersionError
from .names import MAX_STEP

MAGIC = b"AGCK"
END_MAGIC = b"AGCK_END"
MAJOR = 1
MINOR = 0
HEADER_SIZE = 64
ALIGN = 64
FOOTER_TAIL_SIZE = 32

# Limits a reader enforces before allocating anything (FORMAT.md, "Limits").
MAX_META_LEN = 1 << 30   # not a threshold: a limit (FORMAT.md)
MAX_BLOBS = 1 << 24
MAX_TOTAL_LEN = 1 << 56

# The tree rules (FORMAT.md section 8), for the metadata and the state alike.
MAX_DEPTH = 256      # containers nest at most this deep; the outermost one is at depth 1
MAX_SAME_HASH = 8    # keys of one map (items of one set) that may share one Python hash

# Flag bits 0-15 are "required": a reader that does not know a set bit must refuse.
# Bits 16-31 are "optional": unknown ones are ignored. v1.0 defines none.
REQUIRED_FLAGS_MASK = 0x0000FFFF
FLAG_CHUNKED = 0x00000001   # version 1.1: the container lists chunks kept in its store (section 12)
# version 1.2: some chunks the listing names may be stored compressed (section 12, rules 12.8-12.12);
# only with CHUNKED. Required, so a 1.1 reader refuses the listing instead of judging a compressed
# chunk (shorter than its listed size) damaged.
FLAG_FRAMED = 0x00000002
KNOWN_REQUIRED_FLAGS = FLAG_CHUNKED | FLAG_FRAMED

_HEADER = struct.Struct("<4sHHIIQQQqQ")  # everything but the trailing header digest: 56 bytes
_TAIL = struct.Struct("<QQQ8s")
_DIGEST = xxhash.xxh3_64_intdigest
digest = _DIGEST             # the format's one checksum, XXH3-64 of a buffer, as an int
new_hasher = xxhash.xxh3_64  # the same, streaming: update(), intdigest()
_CHUNK = thresholds.HASH_WRITE_SLICE  # hash-while-writing granularity: stays in L2 between hash and copy

assert _HEADER.size == HEADER_SIZE - 8 and _TAIL.size == FOOTER_TAIL_SIZE


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


_ZEROS = bytes(ALIGN)
_NBYTES = attrgetter("nbytes")


@dataclass(frozen=True)
class Header:
    major: int
    minor: int
    flags: int
    blob_count: int
    meta_len: int
    payload_offset: int
    payload_len: int
    created_at_ns: int
    meta_digest: int
    header_digest: int

    @property
    def footer_offset(self) -> int:
        return self.payload_offset + self.payload_len

    @property
    def footer_len(self) -> int:
        return 8 * self.blob_count + FOOTER_TAIL_SIZE

    @property
    def total_len(self) -> int:
        return self.footer_offset + self.footer_len

    def as_dict(self) -> dict:
        return {
            "version": f"{self.major}.{self.minor}", "flags": self.flags,
            "blob_count": self.blob_count, "meta_len": self.meta_len,
            "payload_offset": self.payload_offset, "payload_len": self.payload_len,
            "footer_offset": self.footer_offset, "total_len": self.total_len,
            "created_at_ns": self.created_at_ns,
            "meta_xxh3": f"{self.meta_digest:016x}", "header_xxh3": f"{self.header_digest:016x}",
        }


# --- writing ----------------------------------------------------------------------

class ContainerWriter:
    """Lays out one container and yields it as buffers; see :meth:`parts`.

    ``meta`` is a msgpack-able dict (the reserved key ``blobs`` is added here);
    ``blobs`` are C-contiguous byte buffers (memoryviews of tensors' memory).
    The layout is fixed before the first byte is produced, so ``total_len`` is
    known up front and the writer never seeks back.
    """

    def __init__(self, meta: dict, blobs: Sequence[memoryview], *, created_at_ns: int | None = None,
                 minor: int = MINOR, flags: int = 0, meta_cuts: dict | None = None,
                 blob_keys: Sequence | None = None):
        self.blobs = [b if type(b) is memoryview and b.format == "B" and b.ndim == 1
                      else memoryview(b).cast("B") for b in blobs]
        if len(self.blobs) > MAX_BLOBS:
            raise ValueError(f"too many blobs: {len(self.blobs)} > {MAX_BLOBS}")
        # each blob starts at the next multiple of ALIGN after the one before it ends
        if self.blobs:
            sizes = np.fromiter(map(_NBYTES, self.blobs), dtype=np.uint64, count=len(self.blobs))
            ends = np.cumsum((sizes + np.uint64(ALIGN - 1)) & np.uint64(~(ALIGN - 1) & (2**64 - 1)))
            starts = np.empty_like(ends)
            starts[:1] = 0
            starts[1:] = ends[:-1]
            pos = int(starts[-1] + sizes[-1])
            self.offsets = starts.tolist()
            blob_table = np.stack([starts, sizes], axis=1).tolist()
        else:     # plain data alone: no arrays to lay out (numpy's calls would cost more than the rest)
            pos, self.offsets, blob_table = 0, [], []
        full_meta = dict(meta)
        full_meta["blobs"] = blob_table
        self.meta_bytes, spans = _pack_map(full_meta)
        # where each top-level value's bytes are in the container: (start, start of its
        # members or content, after a list's or bin's header; end)
        self.meta_spans = {k: (HEADER_SIZE + a, HEADER_SIZE + b, HEADER_SIZE + c) for k, (a, b, c) in spans.items()}
        # places a writer that splits the container may cut it: (offset, key, kind), from
        # offsets into a value's content (e.g. :attr:`agck.codec.Encoded.cuts` for the state)
        self.meta_cuts = [(self.meta_spans[k][1] + off, key, kind)
                          for k, cuts in (meta_cuts or {}).items() for off, key, kind in cuts]
        # what names each blob across the containers of one run (the path of its tensor), for
        # writers that compare a container with the last one; by default its index
        self.blob_keys = list(blob_keys) if blob_keys is not None else list(range(len(self.blobs)))
        if len(self.meta_bytes) > MAX_META_LEN:
            raise ValueError(f"metadata is {len(self.meta_bytes)} bytes, over the {MAX_META_LEN} limit")
        payload_offset = align(HEADER_SIZE + len(self.meta_bytes))
        head = _HEADER.pack(MAGIC, MAJOR, minor, flags, len(self.blobs), len(self.meta_bytes),
                            payload_offset, pos,
                            time.time_ns() if created_at_ns is None else created_at_ns,
                            _DIGEST(self.meta_bytes))
        self.header_bytes = head + struct.pack("<Q", _DIGEST(head))
        self.header = parse_header(self.header_bytes)
        self.digests: list[int] = []
        self.footer: bytes | None = None   # set once parts() has produced it

    @property
    def total_len(self) -> int:
        return self.header.total_len

    def layout(self) -> list[tuple[int, memoryview, bool]]:
        """``(offset, buffer, is_blob)`` for every byte before the footer: header,
        metadata, zero padding and blobs, in order. For writers that place the
        pieces themselves (in parallel, into one buffer) and then call
        :meth:`finish` with the blobs' digests (:func:`new_hasher` over each blob)."""
        h = self.header
        zeros = memoryview(_ZEROS)
        out = [(0, memoryview(self.header_bytes), False), (HEADER_SIZE, memoryview(self.meta_bytes), False)]
        pos = HEADER_SIZE + len(self.meta_bytes)
        out.append((pos, zeros[: h.payload_offset - pos], False))
        pos = 0
        for off, blob in zip(self.offsets, self.blobs):
            if off > pos:
                out.append((h.payload_offset + pos, zeros[: off - pos], False))
            out.append((h.payload_offset + off, blob, True))
            pos = off + blob.nbytes
        return out

    def finish(self, digests: Sequence[int]) -> bytes:
        """The footer, given every blob's digest (XXH3-64 of its bytes)."""
        if len(digests) != len(self.blobs):
            raise ValueError(f"{len(digests)} digests for {len(self.blobs)} blobs")
        self.digests = list(digests)
        self.footer = build_footer(self.header, self.digests)
        return self.footer

    def parts(self, chunk: int = _CHUNK) -> Iterator[memoryview | bytes]:
        """Yield the container's bytes in order. Blob digests are computed as the
        blob's bytes are yielded, so the data is read from memory once per pass
        of cache-sized chunks; the footer comes last."""
        h = self.header
        yield self.header_bytes
        yield self.meta_bytes
        pos = HEADER_SIZE + len(self.meta_bytes)
        yield _ZEROS[: h.payload_offset - pos]
        pos = 0
        digests = []
        for off, blob in zip(self.offsets, self.blobs):
            if off > pos:
                yield _ZEROS[: off - pos]
            n = blob.nbytes
            if n <= chunk:
                digests.append(_DIGEST(blob))
                yield blob
            else:
                hasher = xxhash.xxh3_64()
                for i in range(0, n, chunk):
                    piece = blob[i:i + chunk]
                    hasher.update(piece)
                    yield piece
                digests.append(hasher.intdigest())
            pos = off + n
        yield self.finish(digests)


def array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items."""
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def map_header(n: int) -> bytes:
    """msgpack's header of a map of ``n`` pairs."""
    if n < 16:
        return bytes((0x80 | n,))
    return b"\xde" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdf" + n.to_bytes(4, "big")


def bin_header(n: int) -> bytes:
    """msgpack's header of a bin of ``n`` bytes."""
    if n < 1 << 8:
        return b"\xc4" + bytes((n,))
    return b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xc6" + n.to_bytes(4, "big")


_PACKERS = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's msgpack packer: making one per value costs more than packing a
    small one (a packer is not safe to share between threads)."""
    try:
        return _PACKERS.packer
    except AttributeError:
        _PACKERS.packer = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass")
        return _PACKERS.packer


def _pack_map(m: dict) -> tuple[bytes, dict]:
    """``msgpack.packb(m)`` (a map is its header then each key and value, packed one
    after another), and where each value is: key -> (start, start of its members or
    content, end). A bytes value is copied once, into the result."""
    pack = _packer().pack
    parts = [map_header(len(m))]
    spans = {}
    pos = len(parts[0])
    for k, v in m.items():
        kb = pack(k)
        parts.append(kb)
        pos += len(kb)
        if type(v) is bytes:
            head = bin_header(len(v))
            parts += (head, v)
            n = len(head) + len(v)
        else:
            vb = pack(v)
            parts.append(vb)
            n = len(vb)
            head = array_header(len(v)) if type(v) is list else b""
        spans[k] = (pos, pos + len(head), pos + n)
        pos += n
    return b"".join(parts), spans


def build_footer(header: Header, digests: Sequence[int]) -> bytes:
    body = struct.pack(f"<{len(digests)}Q", *digests) + struct.pack("<QQ", header.header_digest, header.total_len)
    return body + struct.pack("<Q", _DIGEST(body)) + END_MAGIC


# --- reading ----------------------------------------------------------------------

def parse_header(buf, *, ref: str | None = None) -> Header:
    """Parse and check the 64-byte header (magic, version, checksum, flags, limits).

    Does not look at the container's actual length; :func:`open_container` does."""
    if len(buf) < HEADER_SIZE:
        if not MAGIC.startswith(bytes(buf[:4])):
            raise FormatError("not an AGCK container (bad magic)", ref=ref)
        raise CorruptCheckpointError(f"truncated: {len(buf)} bytes, shorter than the {HEADER_SIZE}-byte header",
                                     ref=ref, section="header")
    raw = bytes(buf[:HEADER_SIZE])
    if raw[:4] != MAGIC:
        raise FormatError(f"not an AGCK container (magic {raw[:4]!r}, expected {MAGIC!r})", ref=ref)
    (_, major, minor, flags, blob_count, meta_len, payload_offset, payload_len,
     created_at_ns, meta_digest) = _HEADER.unpack(raw[:56])
    (header_digest,) = struct.unpack("<Q", raw[56:])
    if _DIGEST(raw[:56]) != header_digest:
        raise CorruptCheckpointError(
            f"header checksum mismatch (stored {header_digest:016x}, computed {_DIGEST(raw[:56]):016x})",
            ref=ref, section="header")
    if major != MAJOR:
        raise UnsupportedVersionError(f"AGCK major version {major}.{minor}; this reader knows {MAJOR}.x",
                                      ref=ref)
    unknown = flags & REQUIRED_FLAGS_MASK & ~KNOWN_REQUIRED_FLAGS
    if unknown:
        raise UnsupportedVersionError(f"unknown required flag bits 0x{unknown:04x} (version {major}.{minor})",
                                      ref=ref)
    h = Header(major, minor, flags, blob_count, meta_len, payload_offset, payload_len, created_at_ns,
               meta_digest, header_digest)
    if flags & FLAG_FRAMED and not flags & FLAG_CHUNKED:
        raise MalformedCheckpointError("flag FRAMED (bit 1) is set without flag CHUNKED (bit 0): only a chunk "
                                       "listing's chunks are ever stored compressed (FORMAT.md 12.8)",
                                       ref=ref, section="header")
    if meta_len > MAX_META_LEN or blob_count > MAX_BLOBS or h.total_len > MAX_TOTAL_LEN:
        raise MalformedCheckpointError(
            f"header claims absurd sizes (meta_len={meta_len}, blobs={blob_count}, payload_len={payload_len})",
            ref=ref, section="header")
    if payload_offset != align(HEADER_SIZE + meta_len):
        raise MalformedCheckpointError(
            f"payload_offset {payload_offset} is not align64(64 + meta_len={meta_len})", ref=ref, section="header")
    return h


@dataclass
class Container:
    """A parsed container over a buffer. ``blob(i)`` is a zero-copy view of blob i."""

    header: Header
    meta: dict
    blobs: list          # [(offset_in_payload, nbytes)]
    digests: list        # [int], one per blob
    buffer: memoryview   # the whole container
    ref: str | None = None

    def blob(self, i: int) -> memoryview:
        off, n = self.blobs[i]
        start = self.header.payload_offset + off
        return self.buffer[start:start + n]

    def verify_payload(self, names: Sequence[str] | None = None) -> None:
        """Check every blob's digest and that every padding byte is zero. Blobs are
        hashed in parallel when large; the first bad one in container order is reported."""
        base, pos = self.header.payload_offset, 0
        buf = self.buffer
        got = memory.digests([self.blob(i) for i in range(len(self.blobs))], _DIGEST)
        for i, (off, n) in enumerate(self.blobs):
            if off > pos and any(buf[base + pos:base + off]):
                raise CorruptCheckpointError(f"non-zero padding before blob {i}", ref=self.ref, section="payload")
            if got[i] != self.digests[i]:
                what = names[i] if names else f"blob {i}"
                raise CorruptCheckpointError(
                    f"checksum mismatch in {what} (stored {self.digests[i]:016x}, computed {got[i]:016x})",
                    ref=self.ref, section="payload", tensor=what)
            pos = off + n


def open_container(buf, *, verify: bool = True, ref: str | None = None) -> Container:
    """Parse ``buf`` (bytes-like, whole container). Always checks header, metadata,
    blob table and footer (cheap, constant in the payload size); with ``verify``
    also every blob's digest and the padding."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf.cast("B")
    h = parse_header(mv, ref=ref)
    size = len(mv)
    if size < h.total_len:
        raise CorruptCheckpointError(f"truncated: {size} bytes, the header says {h.total_len}",
                                     ref=ref, section="footer")
    if size > h.total_len:
        raise CorruptCheckpointError(f"{size - h.total_len} unexpected bytes after the footer "
                                     f"(container is {h.total_len} bytes)", ref=ref, section="footer")
    footer = mv[h.footer_offset:]
    digests = parse_footer(h, footer, ref=ref)
    meta_end = HEADER_SIZE + h.meta_len
    meta_view = mv[HEADER_SIZE:meta_end]
    got = _DIGEST(meta_view)
    if got != h.meta_digest:
        raise CorruptCheckpointError(f"metadata checksum mismatch (stored {h.meta_digest:016x}, computed {got:016x})",
                                     ref=ref, section="metadata")
    if any(mv[meta_end:h.payload_offset]):
        raise CorruptCheckpointError("non-zero padding after metadata", ref=ref, section="metadata")
    meta = decode_metadata(meta_view, ref=ref)
    blobs = check_blob_table(h, meta.get("blobs"), ref=ref)
    c = Container(h, meta, blobs, digests, mv, ref)
    if verify:
        c.verify_payload(blob_names(meta, len(blobs)))
    return c


def blob_names(meta: dict, count: int) -> list[str]:
    """Name each blob after the tensors stored in it, for error messages."""
    names = [f"blob {i}" for i in range(count)]
    tensors = meta.get("tensors")
    if isinstance(tensors, list):
        seen: dict[int, list[str]] = {}
        for d in tensors:
            if isinstance(d, dict) and type(d.get("blob")) is int and 0 <= d["blob"] < count:
                seen.setdefault(d["blob"], []).append(str(d.get("path")))
        for i, paths in seen.items():
            names[i] = f"blob {i} (tensor {', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})"
    return names


def parse_footer(h: Header, footer, *, ref: str | None = None) -> list[int]:
    if len(footer) != h.footer_len:
        raise CorruptCheckpointError(f"footer is {len(footer)} bytes, expected {h.footer_len}",
                                     ref=ref, section="footer")
    tail = bytes(footer[-FOOTER_TAIL_SIZE:])
    hdr_digest, total_len, footer_digest, end = _TAIL.unpack(tail)
    if end != END_MAGIC:
        raise CorruptCheckpointError("footer end marker missing: the write never completed or was torn",
                                     ref=ref, section="footer")
    body = footer[:-16]
    got = _DIGEST(body)
    if got != footer_digest:
        raise CorruptCheckpointError(f"footer checksum mismatch (stored {footer_digest:016x}, computed {got:016x})",
                                     ref=ref, section="footer")
    if hdr_digest != h.header_digest or total_len != h.total_len:
        raise CorruptCheckpointError("footer belongs to another container (header digest or length differ)",
                                     ref=ref, section="footer")
    return list(struct.unpack(f"<{h.blob_count}Q", bytes(footer[:8 * h.blob_count])))


def decode_metadata(meta_bytes, *, ref: str | None = None) -> dict:
    """Unpack the metadata map. Extension types are refused here (``max_ext_len=0``
    also stops msgpack's own Timestamp, ext -1, before it becomes a value): the
    state tree travels as an opaque ``bin`` under the key ``state`` and is the codec's business."""

    def bad(msg):
        return MalformedCheckpointError(msg, ref=ref, section="metadata")

    def no_ext(code, data):
        raise bad(f"unexpected msgpack extension type {code} in metadata")

    tree = TreeBuilder(bad)
    try:
        meta = msgpack.unpackb(meta_bytes, raw=False, strict_map_key=False, ext_hook=no_ext, max_ext_len=0,
                               list_hook=tree.array, object_pairs_hook=tree.map, unicode_errors="surrogatepass")
    except (MalformedCheckpointError, MemoryError, RecursionError):
        raise
    except Exception as e:  # msgpack raises several types for bad input
        raise bad(f"metadata is not valid msgpack without extension types ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise bad(f"metadata is a {type(meta).__name__}, expected a map")
    return meta


# --- trees --------------------------------------------------------------------------

_NESTED = frozenset({list, dict, tuple, set, frozenset})
_SCANNED = _NESTED | {msgpack.Timestamp}


def crowded(keys, n: int) -> bool:
    """Whether more than MAX_SAME_HASH of the ``n`` ``keys`` share one hash.

    Python compares keys of equal hash pairwise when it builds a dict or set,
    so m such keys cost m**2 comparisons: ints that differ by multiples of
    2**61 - 1 (and floats, tuples, frozensets built from them) share a hash.
    Sorting the hashes finds such a group in n log n time, whatever the keys."""
    if n <= MAX_SAME_HASH:
        return False
    h = np.fromiter(map(hash, keys), np.int64, n)
    h.sort()
    return bool((h[MAX_SAME_HASH:] == h[:-MAX_SAME_HASH]).any())


_EXACT_KEYS = frozenset({str, int, bytes, bool, type(None)})   # types that hold no NaN
_NAN = object()     # only in _nan_bits' stand-ins: equal to no value a tree holds
_F64 = struct.Struct("<d")


def nan_twins(keys) -> bool:
    """Whether two of ``keys`` (distinct as Python values) are one key by the tree
    rules: equal but for NaNs of the same bits. Python's NaN is unequal even to
    itself, so a dict or set keeps both, though msgpack writes them as the same
    bytes. Keys of types that hold no NaN (str, int, ...) cost one scan in C."""
    if _EXACT_KEYS.issuperset(map(type, keys)):
        return False
    return len(set(map(_nan_bits, keys))) != len(keys)


def _nan_bits(k):
    """``k``, or where it holds a NaN (numpy's NaT too) a stand-in equal only to
    the stand-in of a value equal to ``k`` but for NaNs of the same bits."""
    t = type(k)
    if t is tuple:
        return tuple(map(_nan_bits, k))
    if t is frozenset:
        return frozenset(map(_nan_bits, k))
    if isinstance(k, float):     # numpy's float64 too: it equals the float, and metadata stores it as one
        return k if k == k else (_NAN, _F64.pack(k))
    if t is complex:
        return k if k == k else (_NAN, _F64.pack(k.real), _F64.pack(k.imag))
    if isinstance(k, np.generic):
        return k if k == k else (_NAN, k.dtype.str, k.tobytes())
    return k


class TreeBuilder:
    """msgpack hooks that build arrays and maps under the tree rules: containers
    nest at most MAX_DEPTH deep, a map's keys are distinct (as Python values, NaNs
    of the same bits equal: :func:`nan_twins`) and at most MAX_SAME_HASH of them
    share a hash.

    Hooks run bottom-up, so depth is checked as height: a container's height is
    1 + the greatest height among its items, kept by ``id`` (only when over 1)
    until its parent takes it. The codec extends this for tuples and sets."""

    def __init__(self, bad: Callable[[str], Exception]):
        self.bad = bad
        self.heights: dict[int, int] = {}

    def height(self, items) -> int:
        """1 + the greatest height among ``items``, taking their entries."""
        top, pop = 0, self.heights.pop
        for x in items:
            t = type(x)
            if t in _NESTED:
                h = pop(id(x), 1)
                if h > top:
                    top = h
            elif t is msgpack.Timestamp:
                raise self.bad("msgpack timestamp (extension type -1) in the tree")
        return top + 1

    def place(self, obj, h: int):
        if h > 1:
            if h > MAX_DEPTH:
                raise self.bad(f"containers nest deeper than {MAX_DEPTH}")
            self.heights[id(obj)] = h
        return obj

    # array and map run once per container of a tree: builtins are bound as defaults,
    # and a container holding no container (the common case) costs one scan in C.
    def array(self, items: list, _plain=_SCANNED.isdisjoint, _map=map, _type=type) -> list:
        if _plain(_map(_type, items)):
            return items
        return self.place(items, self.height(items))

    def map(self, pairs: list, _plain=_SCANNED.isdisjoint, _exact=_EXACT_KEYS.issuperset, _map=map, _type=type,
            _dict=dict, _len=len, _set=set, _flat=chain.from_iterable) -> dict:
        n = _len(pairs)
        try:
            if n > MAX_SAME_HASH and crowded([k for k, _ in pairs], n):
                raise self.bad(f"more than {MAX_SAME_HASH} keys of one map share a hash")
            d = _dict(pairs)
        except TypeError:
            raise self.bad("unhashable map key") from None
        kinds = _set(_map(_type, d))    # the keys' types, for both checks below: one scan in C
        if _len(d) != n or (not _exact(kinds) and nan_twins(d)):
            raise self.bad("duplicate map key")
        if _plain(kinds) and _plain(_map(_type, d.values())):
            return d
        return self.place(d, self.height(_flat(pairs)))

    def members(self, items: list, kind: type):
        """A set or frozenset of ``items``, under the same rules as map keys."""
        n = len(items)
        try:
            if crowded(items, n):
                raise self.bad(f"more than {MAX_SAME_HASH} items of one set share a hash")
            s = kind(items)
        except TypeError:
            raise self.bad("unhashable set item") from None
        if len(s) != n or nan_twins(s):
            raise self.bad("duplicate set item")
        return s


def check_blob_table(h: Header, table, *, ref: str | None = None) -> list[tuple[int, int]]:
    """Blobs: ascending, 64-aligned, non-overlapping, inside the payload, ending
    exactly at payload_len, as many as the header says."""

    def bad(msg):
        return MalformedCheckpointError(f"blob table: {msg}", ref=ref, section="metadata")

    if not isinstance(table, list) or len(table) != h.blob_count:
        raise bad(f"expected a list of {h.blob_count} [offset, nbytes] pairs")
    out, pos = [], 0
    for i, entry in enumerate(table):
        if (not isinstance(entry, list) or len(entry) != 2
                or not all(type(x) is int and x >= 0 for x in entry)):
            raise bad(f"entry {i} is not [offset, nbytes] of non-negative ints")
        off, n = entry
        if off % ALIGN or off < pos:
            raise bad(f"blob {i} at offset {off} is unaligned or overlaps the previous blob (ends at {pos})")
        if off - pos >= ALIGN:
            raise bad(f"blob {i} at offset {off} leaves a gap of {off - pos} bytes")
        pos = off + n
        if pos > h.payload_len:
            raise bad(f"blob {i} [{off}, {pos}) runs past the payload ({h.payload_len} bytes)")
        out.append((off, n))
    if pos != h.payload_len:
        raise bad(f"blobs end at {pos} but the payload is {h.payload_len} bytes")
    return out


# --- chunked containers (version 1.1, FORMAT.md section 12) -------------------------

CHUNKED_MINOR = 1            # what a writer writes; a reader takes any minor version (section 4)
FRAMED_MINOR = 2             # what a writer writes for a listing with FRAMED set
ADDRESS_SIZE = 32            # BLAKE3-256
MAX_CHUNKS = 1 << 24
MAX_CHUNK_SIZE = (1 << 32) - 1
_LISTING_KEYS = ("chunks", "sizes", "length")    # required; run, step, parent, meta may be absent (nil)


def is_chunked(h: Header) -> bool:
    return bool(h.flags & FLAG_CHUNKED)


@dataclass
class ChunkedContainer:
    """A checkpoint kept as chunks: the concatenation of the chunks at
    ``addresses`` (with ``sizes``) is its standalone 1.0 container."""

    run: object
    step: object
    parent: object
    meta: object
    addresses: list       # [bytes], 32 each, in order
    sizes: list           # [int]
    length: int           # sum(sizes): the standalone container's total_len
    header: Header
    ref: str | None = None

    @property
    def framed(self) -> bool:
        """Whether its chunks may be stored compressed (flag FRAMED, rule 12.8)."""
        return bool(self.header.flags & FLAG_FRAMED)


def claimed_meta_len(head) -> int:
    """The metadata length a header's bytes claim, unchecked (for salvage; 0 when
    there is no header)."""
    if len(head) < HEADER_SIZE:
        return 0
    return _HEADER.unpack(bytes(head[:56]))[5]


def salvage_addresses(buf) -> list[bytes] | None:
    """What a container that failed its checks may still list, for a collector that
    must not delete a chunk any listing names, whatever that listing's verdict: the
    ``chunks`` of its metadata, read without any checksum (header fields as they
    are, the metadata cut to the bytes there are). ``[]`` when what is there is
    readable and lists nothing (a standalone container); None when nothing can be
    told (no header, metadata that does not unpack): the caller must then assume
    it lists anything. Never raises."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_SIZE or bytes(mv[:4]) != MAGIC:
        return None
    meta_len = claimed_meta_len(mv)
    try:
        meta = msgpack.unpackb(mv[HEADER_SIZE:HEADER_SIZE + min(meta_len, MAX_META_LEN)], raw=False,
                               strict_map_key=False, max_ext_len=0, unicode_errors="surrogatepass")
    except Exception:   # damaged bytes: msgpack raises several types
        return None
    if not isinstance(meta, dict):
        return None
    chunks = meta.get("chunks")
    if chunks is None and "sizes" not in meta and "length" not in meta:
        return []
    if type(chunks) is not bytes or len(chunks) % ADDRESS_SIZE:
        return None
    return [chunks[i:i + ADDRESS_SIZE] for i in range(0, len(chunks), ADDRESS_SIZE)]


def dumps_chunked(*, run, step, parent, meta, addresses: Sequence[bytes], sizes: Sequence[int],
                  created_at_ns: int | None = None, framed: bool = False) -> bytes:
    """A chunked container listing ``addresses`` (BLAKE3-256 of each chunk) and ``sizes``;
    ``framed``: some of them are stored compressed (version 1.2, flag FRAMED)."""
    if len(addresses) != len(sizes) or not addresses:
        raise ValueError(f"{len(addresses)} addresses for {len(sizes)} sizes")
    m = {"run": run, "step": step, "parent": parent, "meta": meta, "chunks": b"".join(addresses),
         "sizes": list(sizes), "length": sum(sizes)}
    w = ContainerWriter(m, [], created_at_ns=created_at_ns, minor=FRAMED_MINOR if framed else CHUNKED_MINOR,
                        flags=FLAG_CHUNKED | (FLAG_FRAMED if framed else 0))
    return b"".join(bytes(p) for p in w.parts())


def open_chunked(c: Container) -> ChunkedContainer:
    """Check a parsed chunked container's listing: FORMAT.md rules 12.1 and 12.2
    (MalformedCheckpointError, section ``metadata``). Keys other than those rule
    12.2 names are ignored (section 5), ``tensors`` and ``state`` included."""
    h, m = c.header, c.meta

    def bad(msg):
        return MalformedCheckpointError(f"chunk listing: {msg}", ref=c.ref, section="metadata")

    if not is_chunked(h) or h.blob_count or h.payload_len:        # 12.1
        raise bad("not a chunked container (flag 0 unset, or it has a payload)")
    missing = [k for k in _LISTING_KEYS if k not in m]            # 12.2
    if missing:
        raise bad(f"no {', '.join(missing)}")
    run, step, parent = m.get("run"), m.get("step"), m.get("parent")
    if run is not None and type(run) is not str:
        raise bad(f"run {run!r} is not a str or nil")
    for name, v in (("step", step), ("parent", parent)):
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_STEP):
            raise bad(f"{name} {v!r} is not nil or an int in [0, 2**63)")
    chunks, sizes, length = m["chunks"], m["sizes"], m["length"]
    if type(chunks) is not bytes or len(chunks) % ADDRESS_SIZE:
        raise bad(f"chunks is not a multiple of {ADDRESS_SIZE} bytes")
    n = len(chunks) // ADDRESS_SIZE
    if not 1 <= n <= MAX_CHUNKS or type(sizes) is not list or len(sizes) != n:
        raise bad(f"{n} chunk addresses and {len(sizes) if type(sizes) is list else '?'} sizes")
    if not all(type(x) is int and 1 <= x <= MAX_CHUNK_SIZE for x in sizes):
        raise bad(f"a chunk size is not an integer in [1, {MAX_CHUNK_SIZE}]")
    if type(length) is not int or length != sum(sizes) or length > MAX_TOTAL_LEN:
        raise bad(f"length {length!r} is not the sum of the chunk sizes")
    addresses = [chunks[i:i + ADDRESS_SIZE] for i in range(0, len(chunks), ADDRESS_SIZE)]
    return ChunkedContainer(run, step, parent, m.get("meta"), addresses, sizes, length, h, c.ref)
