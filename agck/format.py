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
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import msgpack
import xxhash

from . import memory
from .errors import CorruptCheckpointError, FormatError, MalformedCheckpointError, UnsupportedVersionError

MAGIC = b"AGCK"
END_MAGIC = b"AGCK_END"
MAJOR = 1
MINOR = 0
HEADER_SIZE = 64
ALIGN = 64
FOOTER_TAIL_SIZE = 32

# Limits a reader enforces before allocating anything (FORMAT.md, "Limits").
MAX_META_LEN = 1 << 30
MAX_BLOBS = 1 << 24
MAX_TOTAL_LEN = 1 << 56

# Flag bits 0-15 are "required": a reader that does not know a set bit must refuse.
# Bits 16-31 are "optional": unknown ones are ignored. v1.0 defines none.
REQUIRED_FLAGS_MASK = 0x0000FFFF
KNOWN_REQUIRED_FLAGS = 0

_HEADER = struct.Struct("<4sHHIIQQQqQ")  # everything but the trailing header digest: 56 bytes
_TAIL = struct.Struct("<QQQ8s")
_DIGEST = xxhash.xxh3_64_intdigest
digest = _DIGEST             # the format's one checksum, XXH3-64 of a buffer, as an int
new_hasher = xxhash.xxh3_64  # the same, streaming: update(), intdigest()
_CHUNK = 1 << 20  # hash-while-writing granularity: stays in L2 between hash and copy

assert _HEADER.size == HEADER_SIZE - 8 and _TAIL.size == FOOTER_TAIL_SIZE


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


_ZEROS = bytes(ALIGN)


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

    def __init__(self, meta: dict, blobs: Sequence[memoryview], *, created_at_ns: int | None = None):
        self.blobs = [b if isinstance(b, memoryview) and b.format == "B" and b.ndim == 1
                      else memoryview(b).cast("B") for b in blobs]
        if len(self.blobs) > MAX_BLOBS:
            raise ValueError(f"too many blobs: {len(self.blobs)} > {MAX_BLOBS}")
        offsets, pos = [], 0
        for b in self.blobs:
            pos = align(pos)
            offsets.append(pos)
            pos += b.nbytes
        self.offsets = offsets
        full_meta = dict(meta)
        full_meta["blobs"] = [[o, b.nbytes] for o, b in zip(offsets, self.blobs)]
        self.meta_bytes = msgpack.packb(full_meta, use_bin_type=True, unicode_errors="surrogatepass")
        if len(self.meta_bytes) > MAX_META_LEN:
            raise ValueError(f"metadata is {len(self.meta_bytes)} bytes, over the {MAX_META_LEN} limit")
        payload_offset = align(HEADER_SIZE + len(self.meta_bytes))
        head = _HEADER.pack(MAGIC, MAJOR, MINOR, 0, len(self.blobs), len(self.meta_bytes),
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


def build_footer(header: Header, digests: Sequence[int]) -> bytes:
    body = struct.pack(f"<{len(digests)}Q", *digests) + struct.pack("<QQ", header.header_digest, header.total_len)
    return body + struct.pack("<Q", _DIGEST(body)) + END_MAGIC


# --- reading ----------------------------------------------------------------------

def parse_header(buf, *, ref: str | None = None) -> Header:
    """Parse and check the 64-byte header (magic, version, checksum, flags, limits).

    Does not look at the container's actual length; :func:`open_container` does."""
    if len(buf) < HEADER_SIZE:
        if len(buf) >= 4 and bytes(buf[:4]) != MAGIC:
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
    """Unpack the metadata map. Extension types are refused here: the state tree
    travels as an opaque ``bin`` under the key ``state`` and is the codec's business."""

    def no_ext(code, data):
        raise MalformedCheckpointError(f"unexpected msgpack extension type {code} in metadata",
                                       ref=ref, section="metadata")

    try:
        meta = msgpack.unpackb(meta_bytes, raw=False, strict_map_key=False, ext_hook=no_ext,
                               unicode_errors="surrogatepass")
    except MalformedCheckpointError:
        raise
    except Exception as e:  # msgpack raises several types for bad input
        raise MalformedCheckpointError(f"metadata is not valid msgpack ({type(e).__name__}: {e})",
                                       ref=ref, section="metadata") from None
    if not isinstance(meta, dict):
        raise MalformedCheckpointError(f"metadata is a {type(meta).__name__}, expected a map",
                                       ref=ref, section="metadata")
    return meta


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
