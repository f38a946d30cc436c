"""The fuzz targets: every parser that reads bytes or text from outside.

Each target takes the fuzzer's bytes and must either succeed or raise an
``agck.AgckError``: anything else (another exception, a hang, memory past the
bound) is a finding. Run them coverage-guided with ``scripts/fuzz`` (atheris,
libFuzzer's engine); ``tests/test_fuzz.py`` replays the kept corpus
(``fuzz/corpus/<target>/``) without atheris, so a fixed finding stays fixed.

Targets:

* ``container``          ``agck.loads`` of the bytes, every checksum verified;
* ``container_resealed`` the bytes with their header and metadata checksums (and
                         the footer's own) recomputed first, loaded without
                         payload verification: what random mutation cannot reach
                         past the checksums, the metadata and tree decoders, the
                         chunked listing, a commit record;
* ``journal``            a journal log: every record scanned, every value decoded;
* ``s3_record``          an object store's commit record and its inline bytes;
* ``store_url``          store URLs and Postgres DSNs (parsing, redaction; no connection);
* ``cli``                the ``agck`` command's arguments (parsing only);
* ``chunk_listing``      a chunked checkpoint's listing (FORMAT.md section 12): the
                         bytes are its metadata map, framed here in a chunked
                         container whose checksums hold, and read as a store reads
                         one: ``content.listed_addresses`` (what a collector reads)
                         and ``content.decode`` over a fixed set of chunks (rules
                         12.1-12.5: every chunk fetched and its size and address
                         checked, the listed content decoded, its run, step, parent
                         and meta compared with the listing's), verified, lazily and
                         verified once for many (``agck verify``);
* ``chunk_frame``        a stored chunk that may be compressed (FORMAT.md rules 12.9-12.12):
                         decoded as a store's reader decodes one (``chunkcodec.decode``
                         and ``decode_into`` at the size its header claims and at
                         another, the assembly's ``_fetched``), and judged as scrub
                         judges one (``damage.verdict``, with and without a size);
* ``commit_part``        a multi-rank step (FORMAT.md section 13): the commit record's
                         state tree (``codec.decode_state``) judged by
                         ``sharded.as_commit``, a ``"dcp"`` record's metadata by
                         ``dcp.metadata_from_plain``, then each rank's part, its
                         container's metadata map framed as the chunk listing's is,
                         read through ``content.decode`` and bound by
                         ``sharded.read_part``. Sections: see :func:`sections`.
"""

from __future__ import annotations

import functools
import os
import struct
import sys

import xxhash

import agck
from agck import checkpoint, codec, format, journalrec, sharded
from agck.errors import AgckError, CheckpointNotFoundError


def container(data: bytes) -> None:
    try:
        sharded.as_commit(agck.loads(data))
    except AgckError:
        pass


def reseal(data: bytes) -> bytes:
    """``data`` with the checksums a mutation broke put right (FORMAT.md sections 2-3):
    the metadata digest and the header digest, and the footer's copy of it, its
    total length and its own digest where a footer is where the header says."""
    if len(data) < 64 or data[:4] != format.MAGIC:
        return data
    buf = bytearray(data)
    meta_len = struct.unpack_from("<Q", buf, 16)[0]
    if 64 + meta_len <= len(buf):
        struct.pack_into("<Q", buf, 48, xxhash.xxh3_64_intdigest(bytes(buf[64:64 + meta_len])))
    struct.pack_into("<Q", buf, 56, xxhash.xxh3_64_intdigest(bytes(buf[:56])))
    blob_count = struct.unpack_from("<I", buf, 12)[0]
    payload_offset, payload_len = struct.unpack_from("<QQ", buf, 24)
    start = payload_offset + payload_len
    end = start + 8 * blob_count + 32
    if end == len(buf) and blob_count < 1 << 20:
        hd = 8 * blob_count
        buf[start + hd:start + hd + 8] = buf[56:64]
        struct.pack_into("<Q", buf, start + hd + 8, len(buf))
        struct.pack_into("<Q", buf, start + hd + 16, xxhash.xxh3_64_intdigest(bytes(buf[start:start + hd + 16])))
    return bytes(buf)


def container_resealed(data: bytes) -> None:
    buf = reseal(data)
    try:
        c = format.open_container(buf, verify=False)
        if format.is_chunked(c.header):      # a store's chunk listing
            format.open_chunked(c)
            return
        sharded.as_commit(agck.loads(buf, verify=False))     # the state tree, a commit record
    except AgckError:
        pass


def journal(data: bytes) -> None:
    found = journalrec.scan(data)
    for _, e in found.entries:
        if e.kind != "e":
            try:
                journalrec.decode_value(e)
            except AgckError:
                pass


def s3_record(data: bytes) -> None:
    from agck.stores.s3 import log as s3log
    try:
        record = s3log.decode_record(data, "fuzz")
        s3log.record_inline(data, "fuzz")
    except AgckError:
        return
    try:
        s3log.fold(s3log.RunState(), [(1, record)])
    except AgckError:
        pass


def store_url(data: bytes) -> None:
    from agck.stores import dsn
    from agck.stores.s3 import client as objclient
    from agck.stores.sqlite.store import sqlite_path
    text = data.decode("utf-8", "surrogateescape")
    for fn in (dsn.redact_dsn, dsn.dsn_without_password, dsn.dsn_secrets, dsn.split_agck_params, dsn.is_kv_dsn,
               objclient.parse_url, sqlite_path):
        try:
            fn(text)
        except AgckError:
            pass


def cli(data: bytes) -> None:
    from agck import cli as cli_mod
    argv = data.decode("utf-8", "surrogateescape").split("\0")
    parser = cli_mod.build_parser()
    devnull = open(os.devnull, "w", errors="backslashreplace")     # as sys.stderr is
    saved = sys.stderr, sys.stdout
    sys.stderr = sys.stdout = devnull
    try:
        parser.parse_args(argv)
    except SystemExit:       # argparse's usage error: exit 2, by design
        pass
    except AgckError:
        pass
    finally:
        sys.stderr, sys.stdout = saved
        devnull.close()


# --- framing what a target fuzzes without its container ---------------------------

def frame(meta: bytes, *, chunked: bool = False) -> bytes:
    """A container of no payload around the metadata bytes ``meta``, its checksums
    right (FORMAT.md sections 1-3): a chunked one (flag 0, minor 1), as a store keeps
    a listing, or a plain 1.0 one. Any bytes: the reader judges them."""
    minor, flags = (format.CHUNKED_MINOR, format.FLAG_CHUNKED) if chunked else (format.MINOR, 0)
    end = format.align(format.HEADER_SIZE + len(meta))
    head = struct.pack("<4sHHIIQQQqQ", format.MAGIC, format.MAJOR, minor, flags, 0, len(meta), end, 0, 0,
                       format.digest(meta))
    head += struct.pack("<Q", format.digest(head))
    return head + meta + bytes(end - format.HEADER_SIZE - len(meta)) + \
        format.build_footer(format.parse_header(head), [])


def sections(data: bytes) -> list[bytes]:
    """``data`` as sections, each a 2-byte little-endian length and that many bytes
    (the last one short if the data ends first); :func:`join` makes them."""
    out, pos = [], 0
    while pos + 2 <= len(data):
        n = int.from_bytes(data[pos:pos + 2], "little")
        out.append(data[pos + 2:pos + 2 + n])
        pos += 2 + n
    return out


def join(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(2, "little") + p for p in parts)


REF = "fuzz"


# --- chunk listings ----------------------------------------------------------------

LISTED_RUN = "r"


@functools.cache
def listed_checkpoints() -> tuple[dict[bytes, bytes], list[bytes]]:
    """Two checkpoints of one run as a store keeps them (agck's writer: plan_chunks,
    listing), sharing chunks: every chunk (address -> bytes) and the two listings."""
    import numpy as np
    from agck.stores import content
    chunks: dict[bytes, bytes] = {}
    listings = []
    base = {"w": np.arange(30_000, dtype=np.float32), "b": np.ones(3000), "l": [1, 2.5, None]}
    for step, parent, s, meta in ((3, 2, "x", {"k": 1}), (4, 3, "y", None)):
        w = checkpoint.encode({**base, "s": s}, run=LISTED_RUN, step=step, parent=parent, meta=meta,
                              created_at_ns=1_700_000_000_000_000_000 + step)
        plan = content.plan_chunks(w)
        chunks.update((a, bytes(v)) for a, v in plan.missing(set()))
        listings.append(content.listing(w, plan.chunks, run=LISTED_RUN, step=step, parent=parent, meta=meta))
    return chunks, listings


class MemoryObjects:
    """A store's chunks in memory, read as the file store reads its chunk files
    (ObjectDir.get and read_into)."""

    def __init__(self, chunks: dict[bytes, bytes]):
        self.chunks = chunks

    def get(self, address: bytes, size: int):
        data = self.chunks.get(address)
        return None if data is None else data[:size + 1]

    def read_into(self, address: bytes, view: memoryview):
        data = self.chunks.get(address)
        if data is None or len(data) != view.nbytes:
            return None if data is None else len(data)
        view[:] = data
        return len(data)


def chunk_listing(data: bytes) -> None:
    """``data``: a listing's metadata map; the chunks are those of listed_checkpoints."""
    from agck import chunking
    from agck.stores import content
    buf = frame(data, chunked=True)
    try:
        content.listed_addresses(buf, verify=True, ref=REF)                 # a collector's read
    except AgckError:
        return
    objects = MemoryObjects(listed_checkpoints()[0])
    for verify, fetch_into in ((True, objects.read_into), (False, None), (chunking.CheckedChunks(), None)):
        try:
            content.decode(buf, objects.get, verify=verify, map_location=None, ref=REF, fetch_into=fetch_into)
        except AgckError:
            pass


# --- commit records and parts ------------------------------------------------------

COMMIT_RUN, COMMIT_STEP = "r", 3     # where the commit record is read from
MAX_PARTS_READ = 8                   # ranks whose part is read (world_size goes up to 2**20)


class MemoryParts:
    """A store's parts namespace holding, for rank r, the container framed
    around ``metas[r]`` (a part's metadata map); no chunks."""

    def __init__(self, metas: list[bytes]):
        self.metas = metas

    def parts_store(self, create: bool = True):
        return self

    def ref(self, run: str, step: int) -> str:
        return f"{REF}/.parts/{run}/{step}"

    def read(self, run: str, step: int, *, verify=True, map_location=None):
        from agck.stores import content
        rank = sharded.parse_part_run(run)[2]
        if rank >= len(self.metas):
            raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=self.ref(run, step))
        return content.decode(frame(self.metas[rank]), MemoryObjects({}).get, verify=verify,
                              map_location=map_location, ref=self.ref(run, step))


@functools.cache
def dcp_module():
    """agck.dcp, or None without torch.distributed."""
    try:
        from agck import dcp
    except ImportError:      # no torch (torch.distributed): the record is judged without it
        return None
    return dcp


def no_blob(i: int):
    raise AssertionError("a state of no tensors reads no blob")     # the decoder asked for a blob it lacks


def commit_part(data: bytes) -> None:
    """``data``: :func:`sections`, the commit record's state tree (codec-encoded, as
    under the key ``state`` of its container's metadata), then rank r's part's
    metadata map for each rank r (a rank without one has no part)."""
    found = sections(data)
    if not found:
        return
    try:
        state = codec.decode_state(found[0], [], no_blob, 0, copy=True, map_location=None, ref=REF)
        commit = sharded.as_commit(checkpoint.Checkpoint(state=state, meta=None, run=COMMIT_RUN, step=COMMIT_STEP,
                                                         parent=None, created_at=0.0, version="1.0", ref=REF))
    except AgckError:
        return
    if commit is None:
        return
    dcp = dcp_module() if commit.kind == "dcp" else None
    if dcp is not None:
        try:
            dcp.metadata_from_plain(commit.extra, ref=REF)
        except AgckError:
            pass
    store = MemoryParts(found[1:])
    for rank in range(min(commit.world_size, MAX_PARTS_READ)):
        try:
            sharded.read_part(store, commit, rank)
        except AgckError:
            pass


FRAME_ADDRESS = bytes(range(32))   # no chunk has it: every judgement says "does not match"


def chunk_frame(data: bytes) -> None:
    from agck import chunkcodec
    from agck.stores import content, damage
    sizes = {len(data) + 1, 4096}
    if len(data) >= chunkcodec.HEADER_SIZE:
        claimed = struct.unpack_from("<Q", data, 7)[0]
        if claimed <= chunkcodec.MAX_RAW_SIZE and claimed < 1 << 24:   # the fuzzer's memory bound
            sizes.add(claimed)
    for size in sorted(sizes):
        try:
            chunkcodec.decode(data, encoded=True, raw_size=size)
        except AgckError:
            pass
        try:
            chunkcodec.decode_into(data, bytearray(size), encoded=True)
        except AgckError:
            pass
        try:
            content._fetched(0, FRAME_ADDRESS, size, data, "fuzz")
        except AgckError:
            pass
        damage.verdict(FRAME_ADDRESS, data, size)
    damage.verdict(FRAME_ADDRESS, data)


TARGETS = {"container": container, "container_resealed": container_resealed, "journal": journal,
           "s3_record": s3_record, "store_url": store_url, "cli": cli, "chunk_listing": chunk_listing,
           "commit_part": commit_part, "chunk_frame": chunk_frame}
