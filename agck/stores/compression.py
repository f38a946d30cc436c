"""How a store compresses the chunks it writes: its ``compress`` and ``level`` options.

``compress``:

- ``"zstd"``: every chunk a chunked put writes is offered to :func:`agck.chunkcodec.encode`:
  byte planes then zstd where the chunk holds floats of one size (the tensor table
  says), zstd alone otherwise, and raw where that saves less than
  :data:`~agck.chunkcodec.MIN_SAVING`. Every compressed chunk is decoded again and
  checked against its address before it is written (a mismatch is stored raw,
  logged and counted in :attr:`ChunkEncoding.mismatches`).
- ``"none"``: every chunk raw, as agck wrote them before compression.
- ``"auto"`` (the default, unless the environment variable ``AGCK_COMPRESS`` names
  another): ``"zstd"`` where the store is reached over a network,
  ``"none"`` where it is on this machine (a directory, SQLite, a Postgres server or
  an object store on localhost or a Unix socket). Measured (BENCHMARKS.md, "Chunk
  compression"): zstd at level 1 compresses about 270-350 MB/s per thread, planes
  and verification included, where a local disk writes about 2 GB/s; compression
  pays in time only where the link is slower than the compressor (a 1 Gbit/s link
  moves 125 MB/s), and in space everywhere. :attr:`ChunkEncoding.reason` says which
  was chosen and why.

Only the chunks of chunked puts are compressed; a standalone container (a small
checkpoint under ``min_chunked``, a ``full_every`` one, ``agck.save``) is written
as it is, so every tool that reads AGCK files reads it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading

from .. import chunkcodec
from ..errors import UsageError

log = logging.getLogger("agck")

MODES = ("auto", "zstd", "none")
DEFAULT = None            # the store options' default: $AGCK_COMPRESS, else "auto"
ENV = "AGCK_COMPRESS"     # a process's default (a deployment's, the crash campaign's)
_MAX_REPORTED = 64     # mismatched addresses kept for a report


def is_local_host(host: str | None) -> bool:
    """Whether ``host`` names this machine: empty or a path (a Unix socket), localhost,
    or a loopback address."""
    if not host or host.startswith("/") or host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ChunkEncoding:
    """A store's compression setting and what it did. Thread-safe: a store's writer
    threads encode at once."""

    def __init__(self, compress: str | None = DEFAULT, level: int | None = None, *, local: bool,
                 what: str = "store", compressor: chunkcodec.Compressor | None = None):
        if compress is None:
            compress = os.environ.get(ENV) or "auto"
            if compress not in MODES:
                raise UsageError(f"{ENV}={compress!r} is not a compression setting",
                                 hint=f"set {ENV} to 'auto', 'zstd' or 'none', or unset it")
        if compress not in MODES:
            raise UsageError(f"compress={compress!r} is not a compression setting",
                             hint="pass 'auto' (the default), 'zstd' or 'none'")
        self.level = chunkcodec.DEFAULT_LEVEL if level is None else chunkcodec._check_level(level)
        if compressor is not None and not callable(compressor):
            raise UsageError(f"compressor must be callable or None, not {type(compressor).__name__}")
        self.requested = compress
        if compress == "auto":
            self.on = not local
            self.reason = (f"auto: compressed, the {what} is reached over a network (slower than zstd compresses)"
                           if self.on else
                           f"auto: raw, the {what} is on this machine (its disk writes faster than zstd compresses)")
        else:
            self.on = compress == "zstd"
            self.reason = f"{compress}: as asked"
        self.compressor = compressor
        self._lock = threading.Lock()
        self.raw_bytes = 0          # bytes of the chunks offered
        self.stored_bytes = 0       # bytes written for them
        self.framed_chunks = 0
        self.chunks = 0
        self.mismatches: list[bytes] = []   # addresses whose compressed form did not decode back (stored raw)
        self.mismatch_count = 0

    @property
    def mode(self) -> str:
        """What is done: "zstd" or "none"."""
        return "zstd" if self.on else "none"

    @property
    def active_level(self) -> int | None:
        """The zstd level where the store compresses, else None (what the journal and
        AppendLog compress their values with: :func:`agck.journalrec.compress_tree`)."""
        return self.level if self.on else None

    def encode(self, address: bytes, chunk, itemsize: int | None) -> chunkcodec.EncodedChunk:
        """How to store one chunk (``chunk``: its raw bytes, named by ``address``)."""
        if not self.on:
            n = memoryview(chunk).nbytes
            with self._lock:
                self.chunks += 1
                self.raw_bytes += n
                self.stored_bytes += n
            return chunkcodec.EncodedChunk(chunk, chunkcodec.Method.RAW, n, address)
        enc = chunkcodec.encode(chunk, itemsize=itemsize, mode="auto", level=self.level, address=address,
                                compressor=self.compressor)
        with self._lock:
            self.chunks += 1
            self.raw_bytes += enc.raw_size
            self.stored_bytes += memoryview(enc.stored).nbytes
            self.framed_chunks += enc.encoded
            if enc.mismatch is not None:
                self.mismatch_count += 1
                if len(self.mismatches) < _MAX_REPORTED:
                    self.mismatches.append(address)
        if enc.mismatch is not None:
            log.warning("agck: compressing chunk %s (%d bytes, %s) gave a frame that does not decode back to it; "
                        "stored raw. A faulty compressor or memory: report it if it repeats",
                        address.hex()[:16], enc.raw_size, enc.mismatch.name.lower())
        return enc

    def as_dict(self) -> dict:
        with self._lock:
            return {"compress": self.requested, "mode": self.mode, "level": self.level, "reason": self.reason,
                    "chunks": self.chunks, "framed_chunks": self.framed_chunks, "raw_bytes": self.raw_bytes,
                    "stored_bytes": self.stored_bytes, "mismatches": self.mismatch_count}
