"""The fuzz targets: every parser that reads bytes or text from outside.

Each target takes the fuzzer's bytes and must either succeed or raise an
``agck.AgckError``: anything else (another exception, a hang, memory past the
bound) is a finding. Run them coverage-guided with ``scripts/fuzz`` (atheris,
libFuzzer's engine); ``tests/test_fuzz_corpus.py`` replays the kept corpus
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
* ``cli``                the ``agck`` command's arguments (parsing only).
"""

from __future__ import annotations

import os
import struct
import sys

import xxhash

import agck
from agck import format, journalrec, sharded
from agck.errors import AgckError


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
    from agck.stores import s3log
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
    from agck.stores import dsn, objclient
    from agck.stores.sqlite import sqlite_path
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


TARGETS = {"container": container, "container_resealed": container_resealed, "journal": journal,
           "s3_record": s3_record, "store_url": store_url, "cli": cli}
