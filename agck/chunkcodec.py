"""How one chunk's bytes are stored: as they are, or compressed (zstd, or byte planes then zstd).

Pure: bytes in, bytes out; no I/O, and nothing about stores. A chunk is still
named by the BLAKE3-256 address of its raw bytes (agck/chunking.py); how it is
stored changes nothing about which chunk it is.

Methods:

- **raw**: the chunk's bytes as they are, with no frame around them (how every
  store has kept chunks so far; which stored chunks are framed is recorded by
  the store, next to the chunk, not guessed from its bytes).
- **zstd**: one zstd frame of the chunk's bytes.
- **planes+zstd**: for chunks of floating-point elements of 2, 4 or 8 bytes
  (bf16/fp16, fp32, fp64). The bytes are regrouped into byte planes (byte 0 of
  every element, then byte 1, ...) and the planes compressed as one zstd frame.
  Within a plane of exponent bytes and high mantissa bytes neighbours are
  alike, which zstd finds; in the interleaved elements it mostly does not.

An encoded chunk is **verified before it is returned**: its frame is decoded
again, through the same reader that will read it later, and the address of what
comes back compared with the raw chunk's address. On a mismatch the chunk is
stored raw and the result says so (:attr:`EncodedChunk.mismatch`), so a faulty
compressor (a library bug, a bit flipped in memory) can cost space, never data.

The frame, version 1 (FORMAT.md 12.10; every integer little-endian; 15 bytes, then the payload):

====== ====== ==================================================================
offset size   field
====== ====== ==================================================================
0      4      magic ``b"AGCZ"``
4      1      format version: 1. Any other is damage (a newer frame version
              comes with a new required listing flag, FORMAT.md 12.11).
5      1      method: 1 = zstd, 2 = planes+zstd. Any other number is damage
              (0: a raw chunk is never framed).
6      1      itemsize: 0 with method 1; 2, 4 or 8 with method 2 (the element
              size the planes were cut with). Anything else is damage.
7      8      raw length: the chunk's size in bytes (u64). It must equal the
              size the store lists for the chunk, and be at most
              :data:`MAX_RAW_SIZE`.
15     rest   payload: exactly one zstd frame (RFC 8878) whose Frame_Content_Size
              is present and equals the raw length, and nothing after it.
              Method 1: its content is the raw chunk. Method 2: with
              ``n = raw length // itemsize``, its content is plane 0 (byte 0 of
              elements 0..n-1, n bytes), plane 1 (byte 1 of each), ... plane
              itemsize-1, then the last ``raw length - n * itemsize`` bytes of
              the chunk as they are.
====== ====== ==================================================================

Reading a frame checks all of the above before decompressing (FORMAT.md 12.11), so a hostile or
damaged frame is refused without allocating more than the listed size; the
decompressed bytes are then compared with the chunk's address when one is given
(``address=``). A store that hashes every chunk it reads (``verify``) passes
none and checks the address itself, as it does for raw chunks; without either, a
damaged payload that zstd still accepts, or an itemsize byte changed from one
valid size to another, gives wrong bytes.
"""

from __future__ import annotations

import enum
import numbers
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import zstandard

from . import thresholds
from .chunking import DIGEST_SIZE, address as chunk_address
from .errors import AgckError, CorruptCheckpointError, UsageError

MAGIC = b"AGCZ"
VERSION = 1
HEADER = struct.Struct("<4sBBBQ")   # magic, version, method, itemsize, raw length
HEADER_SIZE = HEADER.size           # 15

#: A compressed form is kept only if it is at least this fraction smaller than the
#: raw chunk (frame included): below that, every read would pay to decompress for
#: almost no space.
MIN_SAVING = 0.03
#: The zstd level :func:`encode` uses unless told otherwise (BENCHMARKS.md, "Chunk
#: compression": level 1 keeps nearly all of level 3's saving at about twice the speed).
DEFAULT_LEVEL = 1
MIN_LEVEL = -131072                 # zstd's fastest level (ZSTD_minCLevel)
MAX_LEVEL = zstandard.MAX_COMPRESSION_LEVEL
#: Element sizes that are cut into byte planes.
PLANE_ITEMSIZES = (2, 4, 8)
#: The largest raw chunk a frame may claim: 32 of the largest chunks any store cuts
#: (OBJECT_GRID), so a forged frame or listing cannot make a read allocate more.
#: :func:`encode` stores a larger chunk raw.
MAX_RAW_SIZE = 32 * thresholds.OBJECT_GRID

MODES = ("auto", "zstd", "none")


class Method(enum.IntEnum):
    """How a chunk is stored; the value is the frame's method byte (RAW is never framed)."""

    RAW = 0
    ZSTD = 1
    PLANES_ZSTD = 2


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The fixed fields of a frame (:func:`read_header`)."""

    version: int
    method: Method
    itemsize: int
    raw_size: int


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """What :func:`encode` chose for one chunk.

    ``stored`` is what to store: a frame, or, when ``method`` is RAW, the raw
    chunk itself (the caller's buffer, not a copy). ``address`` is the raw chunk's
    BLAKE3-256 address (given, or computed here). ``mismatch`` is the method whose
    output did not decode back to that address, in which case the chunk is stored
    raw and the caller should report it; None when no output failed."""

    stored: bytes | memoryview
    method: Method
    raw_size: int
    address: bytes
    mismatch: Method | None = None

    @property
    def encoded(self) -> bool:
        """Whether ``stored`` is a frame (what the store records next to the chunk)."""
        return self.method is not Method.RAW


Compressor = Callable[[memoryview, int], bytes]   # (bytes, level) -> one zstd frame with its content size

_local = threading.local()   # zstd contexts are not thread-safe: one set per thread


def zstd_compress(data, level: int) -> bytes:
    """One zstd frame of ``data`` at ``level``, with its content size (the default compressor)."""
    contexts = _local.__dict__.setdefault("compressors", {})
    cctx = contexts.get(level)
    if cctx is None:
        cctx = contexts[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(data)


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = _local.__dict__.get("decompressor")
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


def _bytes_of(data, what: str) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise UsageError(f"{what} must be a bytes-like object, not {type(data).__name__}") from None
    if not view.c_contiguous:
        raise UsageError(f"{what} must be contiguous", hint="pass a contiguous buffer (bytes, bytearray, a view)")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _check_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, numbers.Integral) or not MIN_LEVEL <= level <= MAX_LEVEL:
        raise UsageError(f"level={level!r} is not a zstd level", hint=f"pass an integer from {MIN_LEVEL} to {MAX_LEVEL}, "
                         f"e.g. level={DEFAULT_LEVEL}")
    return int(level)


def _check_itemsize(itemsize) -> int | None:
    if itemsize is None:
        return None
    if isinstance(itemsize, bool) or not isinstance(itemsize, numbers.Integral) or not 1 <= itemsize <= 255:
        raise UsageError(f"itemsize={itemsize!r} is not an element size",
                         hint="pass the element size in bytes (1 to 255), or None for bytes of no element type")
    return int(itemsize)


def _check_address(address) -> bytes | None:
    if address is None:
        return None
    if not isinstance(address, bytes) or len(address) != DIGEST_SIZE:
        raise UsageError(f"address must be {DIGEST_SIZE} bytes (a chunk's BLAKE3-256 address), "
                         f"not {type(address).__name__}"
                         + (f" of {len(address)} bytes" if isinstance(address, (bytes, bytearray)) else ""))
    return address


# -- byte planes ----------------------------------------------------------------------

_UINT = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def split_planes(raw, itemsize: int) -> np.ndarray:
    """The chunk's bytes as planes (byte 0 of every element, then byte 1, ...), then
    the trailing partial element as it is: a new uint8 array of the same length."""
    src = np.frombuffer(raw, np.uint8)
    n = src.size // itemsize
    body = n * itemsize
    out = np.empty(src.size, np.uint8)
    # a strided read into contiguous planes: numpy's fastest direction for this copy
    out[:body].reshape(itemsize, n)[...] = src[:body].reshape(n, itemsize).T
    out[body:] = src[body:]
    return out


def join_planes(planes, out: np.ndarray, itemsize: int) -> None:
    """The inverse of :func:`split_planes`, written into ``out`` (uint8, same length):
    FORMAT.md 12.12."""
    src = np.frombuffer(planes, np.uint8)
    n = src.size // itemsize
    body = n * itemsize
    p = src[:body].reshape(itemsize, n)
    if itemsize in (2, 4):
        # as little-endian integers: plane k shifted into byte k (several times faster
        # than a transposing copy, whose inner loop is only itemsize bytes long)
        words = out[:body].view(_UINT[itemsize])
        np.copyto(words, p[0])
        shifted = np.empty(n, _UINT[itemsize])
        for k in range(1, itemsize):
            np.left_shift(p[k], 8 * k, out=shifted, dtype=_UINT[itemsize])
            words |= shifted
    else:
        out[:body].reshape(n, itemsize).T[...] = p
    out[body:] = src[body:]


# -- encoding -------------------------------------------------------------------------

def frame(raw, method: Method, *, itemsize: int | None = None, level: int = DEFAULT_LEVEL,
          compressor: Compressor | None = None) -> bytes:
    """The frame of ``raw`` by ``method`` (ZSTD, or PLANES_ZSTD with ``itemsize`` 2, 4 or 8),
    not verified: :func:`encode` is what a store calls."""
    view = _bytes_of(raw, "raw")
    level = _check_level(level)
    compress = zstd_compress if compressor is None else compressor
    if view.nbytes > MAX_RAW_SIZE:
        raise UsageError(f"a chunk of {view.nbytes} bytes is larger than a frame may hold ({MAX_RAW_SIZE})",
                         hint="store it raw")
    if method is Method.ZSTD:
        size_byte, content = 0, view
    elif method is Method.PLANES_ZSTD:
        if itemsize not in PLANE_ITEMSIZES:
            raise UsageError(f"planes+zstd needs an itemsize of 2, 4 or 8, not {itemsize!r}")
        size_byte, content = itemsize, split_planes(view, itemsize).data
    else:
        raise UsageError(f"{method!r} is not a compressed method", hint="pass Method.ZSTD or Method.PLANES_ZSTD")
    return HEADER.pack(MAGIC, VERSION, int(method), size_byte, view.nbytes) + compress(content, level)


def encode(raw, *, itemsize: int | None = None, mode: str = "auto", level: int = DEFAULT_LEVEL,
           address: bytes | None = None, compressor: Compressor | None = None) -> EncodedChunk:
    """How to store the chunk ``raw``: compressed when that saves at least
    :data:`MIN_SAVING` and decodes back to the chunk's address, else raw.

    ``itemsize``: the element size of the floating-point values the chunk holds
    (2, 4 or 8 are cut into byte planes), or None. ``mode``: "auto" (planes+zstd
    where ``itemsize`` allows, else zstd), "zstd" (zstd alone), "none" (always
    raw). ``address``: the chunk's BLAKE3-256 address if the caller has it (else it
    is computed). ``compressor``: replaces :func:`zstd_compress`."""
    view = _bytes_of(raw, "raw")
    itemsize = _check_itemsize(itemsize)
    level = _check_level(level)
    address = _check_address(address)
    if mode not in MODES:
        raise UsageError(f"mode={mode!r} is not a compression mode", hint="pass 'auto', 'zstd' or 'none'")
    if compressor is not None and not callable(compressor):
        raise UsageError(f"compressor must be callable or None, not {type(compressor).__name__}")
    if address is None:
        address = chunk_address(view)
    as_raw = EncodedChunk(raw, Method.RAW, view.nbytes, address)
    if mode == "none" or view.nbytes == 0 or view.nbytes > MAX_RAW_SIZE:
        return as_raw
    method = Method.PLANES_ZSTD if mode == "auto" and itemsize in PLANE_ITEMSIZES else Method.ZSTD
    stored = frame(view, method, itemsize=itemsize, level=level, compressor=compressor)
    if len(stored) > view.nbytes * (1 - MIN_SAVING):
        return as_raw
    try:
        verified = chunk_address(decode(stored, encoded=True, raw_size=view.nbytes)) == address
    except AgckError:   # the frame does not even read back: the same verdict as wrong bytes
        verified = False
    if not verified:
        return EncodedChunk(raw, Method.RAW, view.nbytes, address, mismatch=method)
    return EncodedChunk(stored, method, view.nbytes, address)


# -- decoding -------------------------------------------------------------------------

def _damaged(message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(message, section="chunk")


def read_header(stored) -> FrameHeader:
    """The fixed fields of the frame ``stored``, checked (the module's docstring)."""
    view = _bytes_of(stored, "stored")
    if view.nbytes < HEADER_SIZE:
        raise _damaged(f"a compressed chunk of {view.nbytes} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, version, method, itemsize, raw_size = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise _damaged(f"a chunk listed as compressed does not start with {MAGIC!r} (it starts with {bytes(magic)!r})")
    # A version or method this reader does not know is damage, not a newer format: the frame's
    # header has no checksum, so a flipped bit there reads as a "newer" version, and a chunk
    # is shared, so a read that only refused it would leave it for every later put to rely
    # on. A newer frame comes with a new required listing flag (FORMAT.md 12.11): no listing
    # this reader accepts holds one unless it is damaged, and a quarantine never deletes.
    if version != VERSION:
        raise _damaged(f"a compressed chunk has frame version {version}; the only one is {VERSION}")
    if method == 0:
        raise _damaged("a compressed chunk's frame names method 0 (raw), which is never framed")
    try:
        method = Method(method)
    except ValueError:
        raise _damaged(f"a compressed chunk names method {method}; the methods are "
                       f"{', '.join(f'{m.value} ({m.name.lower()})' for m in Method if m is not Method.RAW)}") \
            from None
    if (method is Method.ZSTD and itemsize != 0) or (method is Method.PLANES_ZSTD and itemsize not in PLANE_ITEMSIZES):
        raise _damaged(f"a compressed chunk's frame has itemsize {itemsize}, which method {method.name.lower()} "
                       f"does not use")
    if raw_size > MAX_RAW_SIZE:
        raise _damaged(f"a compressed chunk's frame claims {raw_size} raw bytes, more than any chunk holds "
                       f"({MAX_RAW_SIZE})")
    return FrameHeader(version, method, itemsize, raw_size)


def _decompress(view: memoryview, raw_size: int) -> tuple[FrameHeader, bytes]:
    header = read_header(view)
    if header.raw_size != raw_size:
        raise _damaged(f"a compressed chunk's frame holds {header.raw_size} raw bytes; its listing says {raw_size}")
    payload = view[HEADER_SIZE:]
    # zstd allocates what the frame's own content size says, whatever max_output_size
    # asks: so that size must be there and be the listed one before anything is decompressed
    try:
        content_size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise _damaged(f"a compressed chunk's payload is not a zstd frame ({e})") from None
    if content_size != raw_size:
        claimed = "no size" if content_size < 0 else f"{content_size} bytes"
        raise _damaged(f"a compressed chunk's zstd frame claims {claimed}; its header says {raw_size}")
    try:
        content = _decompressor().decompress(payload, max_output_size=raw_size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise _damaged(f"a compressed chunk's payload does not decompress ({e})") from None
    if len(content) != raw_size:
        raise _damaged(f"a compressed chunk decompressed to {len(content)} bytes, not {raw_size}")
    return header, content


def _check_against(data, address: bytes | None) -> None:
    if address is not None and chunk_address(data) != address:
        raise _damaged(f"a chunk's decoded bytes do not match its address {address.hex()}")


def decode(stored, *, encoded: bool, raw_size: int, address: bytes | None = None) -> bytes | memoryview:
    """The raw chunk that ``stored`` holds. ``encoded``: whether the store recorded it
    as a frame; ``raw_size``: the chunk's listed size (no frame may claim more);
    ``address``: when given, the result must match it. A raw chunk comes back as it
    is (no copy)."""
    view = _bytes_of(stored, "stored")
    address = _check_address(address)
    if isinstance(raw_size, bool) or not isinstance(raw_size, numbers.Integral) or raw_size < 0:
        raise UsageError(f"raw_size={raw_size!r} is not a chunk size", hint="pass the chunk's listed size in bytes")
    if not encoded:
        if view.nbytes != raw_size:
            raise _damaged(f"a raw chunk holds {view.nbytes} bytes; its listing says {raw_size}")
        _check_against(view, address)
        return stored
    header, content = _decompress(view, raw_size)
    if header.method is Method.PLANES_ZSTD:
        out = np.empty(raw_size, np.uint8)
        join_planes(content, out, header.itemsize)
        content = out.data   # a view of the joined bytes: no copy into a bytes object
    _check_against(content, address)
    return content


def decode_into(stored, out, *, encoded: bool, address: bytes | None = None) -> None:
    """Decode ``stored`` into ``out``, a writable contiguous buffer the size of the
    raw chunk (the chunk's place in the container being read): the planes are
    joined straight into it."""
    view = _bytes_of(stored, "stored")
    address = _check_address(address)
    try:
        target = memoryview(out)
    except TypeError:
        raise UsageError(f"out must be a writable buffer, not {type(out).__name__}") from None
    if target.readonly or not target.c_contiguous:
        raise UsageError("out must be a writable contiguous buffer", hint="pass a bytearray or a view of one")
    target = target if target.format == "B" and target.ndim == 1 else target.cast("B")
    raw_size = target.nbytes
    if not encoded:
        if view.nbytes != raw_size:
            raise _damaged(f"a raw chunk holds {view.nbytes} bytes; its listing says {raw_size}")
        target[:] = view
    else:
        header, content = _decompress(view, raw_size)
        if header.method is Method.PLANES_ZSTD:
            join_planes(content, np.frombuffer(target, np.uint8), header.itemsize)
        else:
            target[:] = content
    _check_against(target, address)
