"""Postgres store: checkpoints as bytea chunk rows streamed over binary COPY.

    postgresql://user@host:5432/db     (postgres:// too; postgresql:/// uses the libpq
                                        environment: PGHOST, PGUSER, PGPASSWORD, ...)

Tables (``prefix`` defaults to ``agck``, optionally inside Postgres ``schema``)::

    {prefix}_schema_version(version int)
    {prefix}_manifest(run, step, parent, size, checksum, nchunks, created_at, meta jsonb, length, listing)
                                                                   PRIMARY KEY(run, step)
    {prefix}_chunks(run, step, idx, data bytea STORAGE EXTERNAL)   PRIMARY KEY(run, step, idx)
    {prefix}_objects(address bytea, size, data bytea STORAGE EXTERNAL)       PRIMARY KEY(address)
    {prefix}_gc(generation bigint)                                 one row
    {prefix}_epochs(run, epoch bigint)         PRIMARY KEY(run); made by the first begin_epoch (fencing)
    {prefix}_quarantine(address, size, data, detected_at, reason)   objects found damaged, moved out
                                               of objects; made by the first one found
    {prefix}_parts_*                           the same tables again: the parts of multi-rank
                                               checkpoints (FORMAT.md section 13), made by the first one

Each checkpoint is one container kept as chunk rows: ``size`` is the
container's bytes, ``checksum`` the xxh3-64 of its footer, ``length`` the
checkpoint's own size (what :meth:`list` reports). By default
(``incremental=True``) that container is a small chunk listing (FORMAT.md,
version 1.1; ``listing`` is true) and the content is kept in ``objects``, one
row per distinct BLAKE3-256 address, shared by every checkpoint holding those
bytes; only the objects the store lacks are sent. A container under
``min_chunked`` bytes (64 KiB) is stored standalone all the same.
``incremental=False`` stores standalone 1.0 containers.

Writers and the collector exclude each other with one transaction advisory
lock per store (:mod:`agck.stores.content`, rule 2): a put holds it shared
from the moment it looks for the objects it relies on until its COMMIT; the
collector holds it exclusively while it reads every listing and deletes the
objects none lists. So no object a put relies on can be deleted before its
listing commits, and a collection sees every listing committed before it
began, with no per-object row or lock per checkpoint (a checkpoint's cost
stays proportional to what it sends). A collection that deleted anything
increments ``{prefix}_gc.generation``; a store object asks the database only
about objects it has not itself committed while the generation it read is
current. Schema 2 kept a ``refs`` row per listed object instead; ``migrate``
drops it.

A put is one transaction: ``synchronous_commit = on``, a transaction advisory
lock on (run, step), the old rows deleted; then, incremental, the store lock
shared, the objects the store already holds found with one query and the
missing ones streamed over ``COPY ... FROM STDIN (FORMAT binary)``; then the
container streamed as chunk rows the same way (the COPY stream is generated
from the container's own buffers while psycopg2 reads it: the container is
never assembled, never hex-encoded), then the manifest row with the xxh3-64
of the container, then COMMIT. ``put_many`` writes several checkpoints in
one such transaction (one COPY of objects, one of chunk rows, one manifest
INSERT, one COMMIT). A client killed mid-way leaves an aborted
transaction: nothing visible, no objects either. A read is one snapshot: the
manifest and the chunk lengths are checked first, then ``COPY (SELECT data
...) TO STDOUT (FORMAT binary)`` is parsed straight into one preallocated
buffer that the checkpoint's tensors are views of (a listing's objects are
fetched by one more COPY). Objects no checkpoint refers to are deleted by
:meth:`PostgresStore.collect_garbage`.

The schema is versioned: :meth:`PostgresStore.init_schema` creates it
(``agck db init DSN``), :meth:`PostgresStore.migrate` moves it forward
(``agck db migrate DSN``), :meth:`PostgresStore.schema_status` says where it stands.
Passwords never appear in ``store.url`` or in error messages.
"""

from __future__ import annotations

import os
import shlex
import struct
import threading
import time
from abc import ABC, abstractmethod
from functools import partial
from typing import Any, Callable

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from .. import codec, failpoints
from ..checkpoint import Checkpoint
from ..errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                      DurabilityError, SchemaMismatchError, SchemaUninitializedError, StoreConnectionError,
                      StoreError)
from ..memory import new_buffer
from . import content
from .base import MIN_CHUNKED, CheckpointInfo, Store, check_identity, check_last, check_run, check_step
from .sqlrows import (decode_read, DEFAULT_CHUNK_SIZE, PreparedPut, TransactionalPuts, check_chunk_size, check_checksum,
                      check_identifier, chunk_plan, dsn_secrets, dsn_without_password, nchunks_for, parts_prefix,
                      redact_dsn, split_chunks, sql_row)

SCHEMA_VERSION = 3

# How often a put starts over when the database refused its objects (a collector
# deleted one it relies on, or a deadlock with a collector); then DurabilityError.
PUT_RETRIES = 1
# How often collect_garbage starts over when writers got in its way.
GC_RETRIES = 5
# How often a put sends its missing objects again after another writer sent one of them first.
_OBJECT_ROUNDS = 8
# Objects a store object remembers having committed (32 bytes each), so a put asks the
# database only about the others while no collection has run (the gc generation).
_KNOWN_OBJECTS_MAX = 1 << 22

# How much COPY data one read() hands to libpq, and one write() gets back at most:
# large enough that per-call Python overhead vanishes, small enough to stay in cache.
COPY_IO_SIZE = 4 << 20
SMALL_READ_MAX = 256 << 10   # a standalone container up to this size is read in one statement

_XACT_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
_XACT_LOCK_SHARED = "SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 0))"
_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_COPY_HEADER = _COPY_SIGNATURE + struct.pack("!ii", 0, 0)
_COPY_TRAILER = struct.pack("!h", -1)
_ROW_HEAD = struct.pack("!h", 4)
_I32 = struct.Struct("!i")
_ROW_TAIL = struct.Struct("!iqiii")    # step (len, int8), idx (len, int4), data length


# --- messages without secrets ------------------------------------------------------------

def _secrets(dsn: str) -> list[str]:
    """The password's spellings in ``dsn``, as agck reads it and as libpq does."""
    found = dsn_secrets(dsn)
    try:
        pw = psycopg2.extensions.parse_dsn(dsn).get("password")
    except psycopg2.Error:
        pw = None
    return sorted(set(found) | ({pw} if pw else set()), key=len, reverse=True)


def _scrub(text: str, secrets: list[str]) -> str:
    """``text`` without the password, on one line: libpq's messages span several
    (a hint on the next, or the query echoed with a caret under it)."""
    for s in secrets:
        text = text.replace(s, "***")
    lines = [ln.strip() for ln in text.splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("LINE ") and set(ln) != {"^"})


# --- the binary COPY streams -------------------------------------------------------------

class _CopyStream(ABC):
    """A file-like whose read(n) hands psycopg2 a binary COPY stream generated by
    ``_stream()``: row headers are a few bytes built here, row data are views of
    the caller's buffers, copied once, into the bytes object psycopg2 requires."""

    def __init__(self):
        self.error: BaseException | None = None   # psycopg2 reports read() errors as a cancelled COPY
        self._it = self._stream()
        self._pending = None

    @abstractmethod
    def _stream(self):
        """The stream's pieces in order (each subclass yields its own rows)."""

    def read(self, n: int = COPY_IO_SIZE) -> bytes:
        try:
            out, size = [], 0
            while size < n:
                p = self._pending
                if p is None:
                    p = next(self._it, None)
                    if p is None:
                        break
                k = len(p)
                if size + k <= n:
                    out.append(p)
                    size += k
                    self._pending = None
                else:
                    take = n - size
                    out.append(p[:take])
                    self._pending = p[take:]
                    size = n
            if len(out) == 1 and type(out[0]) is bytes:
                return out[0]
            return b"".join(out)
        except BaseException as e:
            self.error = e
            raise


class _CopyIn(_CopyStream):
    """``COPY {chunks} (run, step, idx, data) FROM STDIN (FORMAT binary)`` from the
    buffers of one or more containers, each given as (run, step, parts, total)."""

    def __init__(self, containers: list[tuple[str, int, Any, int]], chunk_size: int):
        self.containers = [(run.encode("utf-8"), step, split_chunks(parts, total, chunk_size))
                           for run, step, parts, total in containers]
        self.nchunks = [0] * len(containers)
        self.last_point: str | None = None    # a fail point hit before the stream's last bytes
        super().__init__()

    def _stream(self):
        yield _COPY_HEADER
        fired = False
        for k, (run_b, step, pieces) in enumerate(self.containers):
            head = _ROW_HEAD + _I32.pack(len(run_b)) + run_b
            cur = -1
            for idx, clen, piece in pieces:
                if idx != cur:
                    if idx == 1 and not fired:
                        failpoints.hit("pg.mid_copy")
                        fired = True
                    cur = idx
                    self.nchunks[k] = idx + 1
                    yield head + _ROW_TAIL.pack(8, step, 4, idx, clen)
                yield piece
        if not fired:
            failpoints.hit("pg.mid_copy")
        if self.last_point is not None:
            failpoints.hit(self.last_point)
        yield _COPY_TRAILER


_OBJECT_HEAD = struct.Struct("!hi32siq")   # 3 fields; address (len, 32 bytes); size (len, int8)


class _ObjectsIn(_CopyStream):
    """``COPY {objects} (address, size, data) FROM STDIN (FORMAT binary)`` from chunks."""

    def __init__(self, chunks: list[tuple[bytes, memoryview]]):
        self.chunks = chunks
        super().__init__()

    def _stream(self):
        yield _COPY_HEADER
        for address, view in self.chunks:
            n = view.nbytes
            yield _OBJECT_HEAD.pack(3, 32, address, 8, n) + _I32.pack(n)
            for i in range(0, n, COPY_IO_SIZE):
                yield view[i:i + COPY_IO_SIZE]
        yield _COPY_TRAILER


class _ObjectsOut:
    """A file-like whose write() parses ``COPY (SELECT address, data ...) TO STDOUT
    (FORMAT binary)`` into ``found`` (address -> bytes). Like :class:`_CopyOut` it
    never raises: the first problem is kept in ``error``."""

    def __init__(self):
        self.found: dict[bytes, bytes] = {}
        self.error: BaseException | None = None
        self.done = False
        self._buf = bytearray()
        self._header = False

    def write(self, data) -> int:
        if self.error is None:
            try:
                self._buf += data
                self._parse()
            except BaseException as e:
                self.error = e
        return len(data)

    def _parse(self) -> None:
        b = self._buf
        pos = 0
        if not self._header:
            if len(b) < 19:
                return
            if bytes(b[:11]) != _COPY_SIGNATURE:
                raise StoreError("the server sent an unknown COPY format")
            pos = 19 + _I32.unpack_from(b, 15)[0]
            if len(b) < pos:
                return
            self._header = True
        with memoryview(b) as mv:
            while not self.done and len(b) - pos >= 2:
                (count,) = struct.unpack_from("!h", b, pos)
                if count == -1:
                    self.done = True
                    pos += 2
                    break
                if count != 2:
                    raise StoreError(f"unexpected COPY row of {count} fields")
                if len(b) - pos < 6:
                    break
                alen = _I32.unpack_from(b, pos + 2)[0]
                dpos = pos + 6 + max(alen, 0)
                if len(b) - dpos < 4:
                    break
                dlen = _I32.unpack_from(b, dpos)[0]
                end = dpos + 4 + max(dlen, 0)
                if len(b) < end:
                    break
                if alen >= 0 and dlen >= 0:
                    self.found[bytes(mv[pos + 6:dpos])] = bytes(mv[dpos + 4:end])
                pos = end
        del b[:pos]

    def finish(self) -> dict:
        if self.error is not None:
            raise self.error
        if not self.done:
            raise StoreError("the COPY stream of objects ended early")
        return self.found


class _Background:
    """Run ``fn(*args)`` on a thread now; ``result()`` waits for it."""

    def __init__(self, fn, *args):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._value = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class _CopyOut:
    """A file-like whose write() parses ``COPY (SELECT data ...) TO STDOUT (FORMAT binary)``
    into the buffer ``make_buffer()`` returns (called when the first row arrives, so the
    buffer can be prepared while the server works), checking every row against the
    expected chunk lengths. It never raises (psycopg2 would leave the connection
    mid-COPY): the first problem is kept in ``error`` and the rest is discarded."""

    _SIG, _FIELDS, _LEN, _DATA, _SKIP, _DONE = range(6)

    def __init__(self, make_buffer: Callable[[], Any], expected: list[int], chunk_ref: Callable[[int], str]):
        self.make_buffer = make_buffer
        self.buf: memoryview | None = None
        self.expected = expected
        self.chunk_ref = chunk_ref
        self.pos = 0
        self.row = 0
        self.need = 0
        self.head = bytearray()
        self.state = self._SIG
        self.error: BaseException | None = None

    def _fail(self, msg: str) -> None:
        raise CorruptCheckpointError(msg, ref=self.chunk_ref(self.row), section="chunks",
                                     hint="the chunk rows changed while being read; retry the read")

    def write(self, data) -> int:
        if self.error is None:
            try:
                self._feed(memoryview(data))
            except BaseException as e:
                self.error = e
        return len(data)

    def _header(self, mv: memoryview, i: int, want: int) -> tuple[int, bytes | None]:
        take = min(want - len(self.head), len(mv) - i)
        self.head += mv[i:i + take]
        i += take
        if len(self.head) < want:
            return i, None
        h = bytes(self.head)
        self.head.clear()
        return i, h

    def _feed(self, mv: memoryview) -> None:
        i, n = 0, len(mv)
        while i < n:
            st = self.state
            if st == self._DATA:
                take = min(self.need, n - i)
                piece = mv[i:i + take]
                if self.buf is None:
                    self.buf = memoryview(self.make_buffer())
                self.buf[self.pos:self.pos + take] = piece
                self.pos += take
                self.need -= take
                i += take
                if not self.need:
                    self.row += 1
                    self.state = self._FIELDS
            elif st == self._SIG:
                i, h = self._header(mv, i, 19)
                if h is not None:
                    if h[:11] != _COPY_SIGNATURE:
                        self._fail("the server sent an unknown COPY format")
                    self.need = _I32.unpack(h[15:19])[0]
                    self.state = self._SKIP if self.need else self._FIELDS
            elif st == self._SKIP:
                take = min(self.need, n - i)
                i += take
                self.need -= take
                if not self.need:
                    self.state = self._FIELDS
            elif st == self._FIELDS:
                i, h = self._header(mv, i, 2)
                if h is not None:
                    (count,) = struct.unpack("!h", h)
                    if count == -1:
                        self.state = self._DONE
                    elif count != 1:
                        self._fail(f"unexpected COPY row of {count} fields")
                    else:
                        self.state = self._LEN
            elif st == self._LEN:
                i, h = self._header(mv, i, 4)
                if h is not None:
                    (length,) = _I32.unpack(h)
                    if self.row >= len(self.expected):
                        self._fail(f"unexpected chunk {self.row}")
                    if length != self.expected[self.row]:
                        self._fail(f"chunk {self.row} is {length} bytes, expected {self.expected[self.row]}")
                    self.need = length
                    self.state = self._DATA if length else self._FIELDS
            else:
                return

    def finish(self) -> None:
        if self.error is not None:
            raise self.error
        if self.state != self._DONE or self.row != len(self.expected):
            self._fail(f"the COPY stream ended after {self.row} of {len(self.expected)} chunks")


# --- the schema's steps -----------------------------------------------------------------

def _objects_ddl(n: "_Names") -> str:
    """The objects table (the same since schema version 2)."""
    return f"""
        CREATE TABLE IF NOT EXISTS {n.objects} (
            address bytea NOT NULL CHECK (octet_length(address) = 32), size bigint NOT NULL,
            data bytea NOT NULL, PRIMARY KEY (address));
        ALTER TABLE {n.objects} ALTER COLUMN data SET STORAGE EXTERNAL;"""


def _create_shared_tables(cur, n: "_Names") -> None:
    """The content shared between checkpoints (schema version 3)."""
    cur.execute(_objects_ddl(n) + f"""
        ALTER TABLE {n.manifest} ADD COLUMN IF NOT EXISTS listing boolean NOT NULL DEFAULT false;
        CREATE TABLE IF NOT EXISTS {n.gc} (generation bigint NOT NULL);
        INSERT INTO {n.gc} (generation) SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM {n.gc});""")


def _migrate_1_to_2(cur, n: "_Names") -> None:
    """Shared content (objects, refs) and the checkpoint's own size (manifest.length).
    Version 1 checkpoints are standalone containers and stay readable as they are."""
    cur.execute(_objects_ddl(n) + f"""
        ALTER TABLE {n.manifest} ADD COLUMN IF NOT EXISTS length bigint;
        CREATE TABLE IF NOT EXISTS {n.refs} (
            run text COLLATE "C" NOT NULL,
            step bigint NOT NULL,
            address bytea NOT NULL,
            PRIMARY KEY (run, step, address),
            FOREIGN KEY (run, step) REFERENCES {n.manifest} (run, step) ON DELETE CASCADE,
            FOREIGN KEY (address) REFERENCES {n.objects} (address));""")


def _migrate_2_to_3(cur, n: "_Names") -> None:
    """Listings are flagged on the manifest (``listing``), ``refs`` is dropped and
    ``gc`` counts collections: writers and the collector exclude each other with
    the store's advisory lock instead of a row per listed object per checkpoint."""
    cur.execute(f"""
        ALTER TABLE {n.manifest} ADD COLUMN IF NOT EXISTS listing boolean NOT NULL DEFAULT false;
        UPDATE {n.manifest} m SET listing = true
            WHERE EXISTS (SELECT 1 FROM {n.refs} r WHERE r.run = m.run AND r.step = m.step);
        DROP TABLE {n.refs};""")
    _create_shared_tables(cur, n)


# Steps from version N to N+1, each run inside the migrate() transaction: {N: fn(cursor, names)}.
_MIGRATIONS: dict[int, Callable[[Any, "_Names"], None]] = {1: _migrate_1_to_2, 2: _migrate_2_to_3}


# --- the store ------------------------------------------------------------------------

class _Refused(Exception):
    """The database refused a put's objects in a way a new attempt gets past."""


class _Names:
    """Table names: SQL text for statements, plain text for refs and messages."""

    def __init__(self, conn, prefix: str, schema: str | None):
        def ident(name):
            return (sql.Identifier(schema, name) if schema else sql.Identifier(name)).as_string(conn)

        self.schema = schema
        self.label = f"{schema}.{prefix}" if schema else prefix
        self.version = ident(f"{prefix}_schema_version")
        self.manifest = ident(f"{prefix}_manifest")
        self.chunks = ident(f"{prefix}_chunks")
        self.objects = ident(f"{prefix}_objects")
        self.refs = ident(f"{prefix}_refs")          # schema 2 only (migrate drops it)
        self.gc = ident(f"{prefix}_gc")
        self.epochs = ident(f"{prefix}_epochs")      # made by the first begin_epoch
        self.quarantine = ident(f"{prefix}_quarantine")   # made by the first damaged object found
        self.meta_index = sql.Identifier(f"{prefix}_manifest_meta").as_string(conn)
        self.schema_sql = sql.Identifier(schema).as_string(conn) if schema else None
        dot = f"{schema}." if schema else ""
        self.version_ref = f"{dot}{prefix}_schema_version"
        self.manifest_ref = f"{dot}{prefix}_manifest"
        self.chunks_ref = f"{dot}{prefix}_chunks"
        self.objects_ref = f"{dot}{prefix}_objects"
        self.gc_ref = f"{dot}{prefix}_gc"
        self.quarantine_ref = f"{dot}{prefix}_quarantine"
        self.tables = (self.version, self.manifest, self.chunks, self.objects, self.gc)
        self.table_refs = (self.version_ref, self.manifest_ref, self.chunks_ref, self.objects_ref, self.gc_ref)
        self.store_lock = f"agck objects {self.label}"   # shared by puts, exclusive for the collector


class PostgresStore(TransactionalPuts, Store):
    """Checkpoints in Postgres; one connection, shared between threads under a lock.

    ``prefix`` names the tables, ``schema`` the Postgres schema holding them (the
    search path when None), ``chunk_size`` the bytes per chunk row (bytea holds at
    most 1 GiB), ``init=True`` creates a missing schema instead of refusing,
    ``check_schema=False`` opens without looking at the schema (``agck db``),
    ``incremental=False`` writes standalone containers instead of chunk listings,
    ``full_every=K`` one in every K puts of a run, ``min_chunked`` a container of fewer
    bytes (:meth:`Store._set_policy`)."""

    def __init__(self, url: str, *, prefix: str = "agck", schema: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, init: bool = False, check_schema: bool = True,
                 connect_timeout: int = 10, incremental: bool = True,
                 full_every: int | None = None, min_chunked: int = MIN_CHUNKED,
                 verify_reused: str = content.DEFAULT_VERIFY_REUSED):
        super().__init__()
        if not isinstance(url, str) or not url:
            raise StoreConnectionError(f"not a Postgres URL: {type(url).__name__}",
                                       hint="use postgresql://user@host:port/dbname")
        self._dsn = url
        self._secrets = _secrets(url)
        self.url = redact_dsn(url)
        self.prefix = check_identifier(prefix, "table prefix")
        self.schema = check_identifier(schema, "schema name") if schema is not None else None
        self.chunk_size = check_chunk_size(chunk_size)
        self._set_policy(incremental, full_every, min_chunked, verify_reused)
        self.last_put: content.Chunks | None = None
        self._connect_timeout = connect_timeout
        self._conn = None
        self._closed = False
        self._inherited = []      # a parent's connections, kept open: closing one would end the parent's session
        self._connect()
        self.names = _Names(self._conn, self.prefix, self.schema)
        if init:
            self.init_schema()
        elif check_schema:
            self._check_schema()

    # -- connection ------------------------------------------------------------------
    def _connect(self) -> None:
        extra = {"application_name": "agck"}
        try:
            given = psycopg2.extensions.parse_dsn(self._dsn)
        except psycopg2.Error as e:
            raise StoreConnectionError(f"invalid Postgres URL: {_scrub(str(e), self._secrets)}",
                                       ref=self.url) from None
        if "connect_timeout" not in given:
            extra["connect_timeout"] = self._connect_timeout
        try:
            conn = psycopg2.connect(self._dsn, **{k: v for k, v in extra.items() if k not in given})
        except psycopg2.Error as e:
            raise StoreConnectionError(f"cannot connect to Postgres: {_scrub(str(e), self._secrets)}",
                                       ref=self.url) from None
        conn.autocommit = True   # transactions are explicit: BEGIN travels with the first statement
        self._conn = conn
        self._pid = os.getpid()
        # objects committed through this connection, as of gc generation _known_generation;
        # forgotten with it: a failover or a restore may have lost them
        self._known_objects: set[bytes] = set()
        self._known_generation = None

    def _cursor(self):
        if self._closed:
            raise StoreError("the store is closed", ref=self.url, hint="open it again")
        if self._conn is not None and self._pid != os.getpid():
            self._inherited.append(self._conn)
            self._conn = None
        if self._conn is None or self._conn.closed:
            self._connect()
        return self._conn.cursor()

    def _abort(self, cur) -> None:
        """Roll back after an error; a connection that cannot is dropped and reopened later."""
        try:
            cur.execute("ROLLBACK")
        except psycopg2.Error:
            try:
                self._conn.close()
            except psycopg2.Error:
                pass

    def _db_error(self, e: psycopg2.Error, what: str, ref: str, cls=StoreError) -> AgckError:
        msg = _scrub(str(e).strip() or type(e).__name__, self._secrets)
        if isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError)) and self._conn is not None \
                and self._conn.closed:
            return StoreConnectionError(f"{what}: lost the connection to Postgres ({msg})", ref=ref)
        if isinstance(e, psycopg2.errors.UndefinedTable):
            return SchemaUninitializedError(f"{what}: {msg}", ref=ref,
                                            hint=self._db_hint("init", "or call store.init_schema()"))
        return cls(f"{what}: {msg}", ref=ref)

    def _db_hint(self, action: str, alternative: str | None = None) -> str:
        """An ``agck db`` command for these very tables, quoted for a shell, to run as shown."""
        cmd = f"agck db {action} {shlex.quote(dsn_without_password(self._dsn))}"
        if self.prefix != "agck":
            cmd += f" --prefix {self.prefix}"
        if self.schema:
            cmd += f" --schema {self.schema}"
        text = f"run `{cmd}`" + (" with the password added" if self._secrets else "")
        return f"{text}, {alternative}" if alternative else text

    def _open_parts(self, create: bool) -> "PostgresStore | None":
        try:
            return PostgresStore(self._dsn, prefix=parts_prefix(self.prefix), schema=self.schema,
                                 chunk_size=self.chunk_size, init=create, connect_timeout=self._connect_timeout,
                                 **self._policy())
        except SchemaUninitializedError:
            if create:
                raise
            return None

    def close(self) -> None:
        super().close()
        with self._lock:
            self._closed = True
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
                self._conn = None

    # -- schema ------------------------------------------------------------------------
    def _read_version(self, cur) -> tuple[int | None, list[str]]:
        """(version, missing tables). version None: no version table or no row."""
        n = self.names
        cur.execute("SELECT " + ", ".join(["to_regclass(%s) IS NULL"] * len(n.tables)), n.tables)
        flags = cur.fetchone()
        missing = [t for t, gone in zip(n.table_refs, flags) if gone]
        if flags[0]:
            return None, missing
        cur.execute(f"SELECT max(version) FROM {n.version}")
        return cur.fetchone()[0], missing

    def schema_status(self) -> dict:
        """Where the schema stands: ``state`` is ``current``, ``uninitialized``,
        ``incomplete``, ``outdated`` (run migrate) or ``newer`` (a newer agck made it)."""
        with self._lock:
            cur = self._cursor()
            try:
                version, missing = self._read_version(cur)
            except psycopg2.Error as e:
                raise self._db_error(e, "cannot read the schema version", self.names.label) from None
        if version is None:
            state = "incomplete" if len(missing) < len(self.names.tables) else "uninitialized"
        elif version > SCHEMA_VERSION:
            state = "newer"
        elif version < SCHEMA_VERSION:
            state = "outdated"
        else:
            state = "incomplete" if missing else "current"
        return {"state": state, "version": version, "expected": SCHEMA_VERSION, "prefix": self.prefix,
                "schema": self.schema, "missing_tables": missing, "url": self.url}

    def _check_schema(self) -> None:
        st = self.schema_status()
        where = self.names.label
        if st["state"] == "current":
            return
        if st["state"] in ("uninitialized", "incomplete"):
            detail = "" if st["state"] == "uninitialized" else f" (missing {', '.join(st['missing_tables'])})"
            raise SchemaUninitializedError(f"no agck schema with prefix {self.prefix!r} in this database{detail}",
                                           ref=where,
                                           hint=self._db_hint("init", "or open with init=True"))
        if st["state"] == "outdated":
            raise SchemaMismatchError(f"schema version {st['version']}, this agck uses {SCHEMA_VERSION}", ref=where,
                                      hint=self._db_hint("migrate"))
        raise SchemaMismatchError(f"schema version {st['version']} is newer than this agck's {SCHEMA_VERSION}",
                                  ref=where, hint="upgrade agck to the version that created this schema")

    def init_schema(self) -> dict:
        """Create the tables if missing (idempotent, safe to race: under an advisory lock).

        A schema that is already complete is left alone: its DDL (CREATE INDEX IF
        NOT EXISTS, ALTER ... SET STORAGE) would still take table locks, and those
        deadlock against another process's put in flight."""
        n = self.names
        with self._lock:
            cur = self._cursor()
            try:
                cur.execute("BEGIN; " + _XACT_LOCK, (f"agck schema {n.label}",))
                version, missing = self._read_version(cur)
                if version == SCHEMA_VERSION and not missing:
                    cur.execute("COMMIT")
                    return self.schema_status()   # the store's lock is reentrant
                if version is not None and version != SCHEMA_VERSION:
                    raise SchemaMismatchError(
                        f"schema version {version} exists, this agck uses {SCHEMA_VERSION}", ref=n.label,
                        hint=self._db_hint("migrate") if version < SCHEMA_VERSION
                        else "upgrade agck to the version that created this schema")
                if n.schema_sql:
                    cur.execute(f"CREATE SCHEMA IF NOT EXISTS {n.schema_sql}")
                cur.execute(f"""
                    CREATE TABLE IF NOT EXISTS {n.version} (version int NOT NULL);
                    CREATE TABLE IF NOT EXISTS {n.manifest} (
                        run text COLLATE "C" NOT NULL,
                        step bigint NOT NULL CHECK (step >= 0),
                        parent bigint,
                        size bigint NOT NULL,
                        checksum text NOT NULL,
                        nchunks int NOT NULL,
                        created_at timestamptz NOT NULL DEFAULT now(),
                        meta jsonb,
                        length bigint,
                        PRIMARY KEY (run, step));
                    CREATE INDEX IF NOT EXISTS {n.meta_index} ON {n.manifest} USING gin (meta);
                    CREATE TABLE IF NOT EXISTS {n.chunks} (
                        run text COLLATE "C" NOT NULL,
                        step bigint NOT NULL,
                        idx int NOT NULL,
                        data bytea NOT NULL,
                        PRIMARY KEY (run, step, idx));
                    ALTER TABLE {n.chunks} ALTER COLUMN data SET STORAGE EXTERNAL;""")
                _create_shared_tables(cur, n)
                cur.execute(f"SELECT max(version) FROM {n.version}")
                if cur.fetchone()[0] is None:
                    cur.execute(f"INSERT INTO {n.version} (version) VALUES (%s)", (SCHEMA_VERSION,))
                cur.execute("COMMIT")
            except BaseException as e:
                self._abort(cur)
                if isinstance(e, psycopg2.Error):
                    raise self._db_error(e, "cannot create the schema", n.label) from None
                raise
        return self.schema_status()

    def migrate(self) -> list[int]:
        """Bring the schema to this agck's version; returns the versions applied.
        Runs in one transaction under the schema's advisory lock."""
        n = self.names
        applied: list[int] = []
        with self._lock:
            cur = self._cursor()
            try:
                cur.execute("BEGIN; " + _XACT_LOCK, (f"agck schema {n.label}",))
                version, missing = self._read_version(cur)
                if version is None:
                    raise SchemaUninitializedError(f"no agck schema with prefix {self.prefix!r} to migrate",
                                                   ref=n.label, hint=self._db_hint("init"))
                if version > SCHEMA_VERSION:
                    raise SchemaMismatchError(f"schema version {version} is newer than this agck's "
                                              f"{SCHEMA_VERSION}", ref=n.label,
                                              hint="upgrade agck; schemas are never migrated backwards")
                for v in range(version, SCHEMA_VERSION):
                    step_fn = _MIGRATIONS.get(v)
                    if step_fn is None:
                        raise SchemaMismatchError(f"no migration from schema version {v}", ref=n.label,
                                                  hint="migrate with the agck version that knows it")
                    step_fn(cur, n)
                    applied.append(v + 1)
                if applied:
                    cur.execute(f"DELETE FROM {n.version}; INSERT INTO {n.version} (version) VALUES (%s)",
                                (SCHEMA_VERSION,))
                cur.execute("COMMIT")
            except BaseException as e:
                self._abort(cur)
                if isinstance(e, psycopg2.Error):
                    raise self._db_error(e, "migration failed", n.label) from None
                raise
        return applied

    # -- refs ------------------------------------------------------------------------------
    def ref(self, run: str, step: int) -> str:
        return sql_row(self.names.manifest_ref, check_run(run), check_step(step))

    def _chunk_ref(self, run: str, step: int, idx: int) -> str:
        return sql_row(self.names.chunks_ref, run, step, idx)

    def _row_lock_key(self, run: str, step: int) -> str:
        return f"agck {self.names.label} {run} {step}"

    # -- writing ---------------------------------------------------------------------------
    def _write(self, puts: list[PreparedPut], epoch: int | None) -> None:
        with self._lock:
            for attempt in range(PUT_RETRIES + 1):
                try:
                    self._put_once(puts, epoch)
                    break
                except _Refused as e:
                    if attempt == PUT_RETRIES:
                        raise DurabilityError(f"the database refused the checkpoint's objects {attempt + 1} "
                                              f"times ({e.args[0]})", ref=puts[0].ref,
                                              hint="a garbage collection ran alongside; put it again") from None
            last = puts[-1].plan
            self.last_put = last.chunks if last is not None else None
        for p in puts:
            if p.cache is not None:
                self._caches.give(p.run, p.cache)
        failpoints.hit("pg.after_commit")

    def _put_once(self, puts: list[PreparedPut], epoch: int | None = None) -> None:
        """One write transaction: each container of ``puts`` as chunk rows (a standalone
        checkpoint, or a listing after the objects its plan lacks) and its manifest row.
        Statements travel together where no answer is awaited in between: when every
        manifest row is known before the chunk rows (listings, small standalone
        containers) the COMMIT follows the COPY in one exchange, so a put of a small
        checkpoint is one round trip; a large standalone one takes two (BEGIN to COPY,
        then INSERT and COMMIT); a listing's objects take two more before.
        Raises _Refused when the database refused it for a reason another attempt can get past."""
        n = self.names
        ref = puts[0].ref
        stream = None
        cur = self._cursor()
        try:
            plans = [p.plan for p in puts if p.plan is not None]
            begin, args = self._begin_sql(puts)
            if plans:
                addresses = list(dict.fromkeys(a for plan in plans for a in plan.distinct))
                sized = content.checks_size(self.verify_reused)
                # verify_reused "size" and "full": every address the put relies on is looked at (its
                # stored size), not only those this store object did not commit itself
                unknown = addresses if sized else [a for a in addresses if a not in self._known_objects]
                cur.execute(begin + "; " + _XACT_LOCK_SHARED + "; SELECT (SELECT generation FROM "
                            f"{n.gc}), ARRAY(SELECT address FROM {n.objects} WHERE address = ANY(%s::bytea[]) "
                            "ORDER BY address), ARRAY(SELECT octet_length(data) FROM "
                            f"{n.objects} WHERE address = ANY(%s::bytea[]) ORDER BY address)",
                            (*args, n.store_lock, unknown, unknown if sized else []))
                generation, found, lengths = cur.fetchone()
                found = [bytes(a) for a in found]
                sizes = dict(zip(found, lengths)) if sized else {}
                found += self._still_known(cur, generation, [] if sized else addresses)
                if self.verify_reused != "none":
                    self._heal_reused(cur, plans, {a: sizes.get(a) for a in found}, found)
                self._put_objects(cur, plans, set(found))
                failpoints.hit("pg.after_objects")
                begin = ""
            stream = _CopyIn([(p.run, p.step, p.parts(), p.total) for p in puts], self.chunk_size)
            copy = f"COPY {n.chunks} (run, step, idx, data) FROM STDIN (FORMAT binary)"
            row = "(%s, %s, %s, %s, %s, %s, to_timestamp(%s), %s::jsonb, %s, %s)"
            insert = (f"INSERT INTO {n.manifest} (run, step, parent, size, checksum, nchunks, created_at, meta, "
                      f"length, listing) VALUES " + ", ".join([row] * len(puts)))
            if epoch is None and all(p.ready for p in puts):
                # every manifest row is known: one exchange from here, the COMMIT following the COPY
                values = [v for p in puts for v in p.manifest_row(nchunks_for(p.total, self.chunk_size))]
                failpoints.hit("pg.before_copy")
                failpoints.hit("pg.before_manifest")
                stream.last_point = "pg.before_commit"    # the COMMIT runs once the stream ends
                sql = cur.mogrify((begin + "; " if begin else "") + insert, [*(args if begin else ()), *values])
                try:
                    cur.copy_expert(self._text(sql) + "; " + copy + "; COMMIT", stream, size=COPY_IO_SIZE)
                except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                    if stream.error is not None:
                        raise stream.error from None
                    if self._commit_unknown(e):
                        raise self._commit_failed(e, ref) from None
                    raise       # the server's verdict (a lock or statement timeout, disk full): rolled back
                if stream.error is not None:
                    raise stream.error
            else:
                failpoints.hit("pg.before_copy")
                if begin:    # nothing asked of the database yet: the transaction begins with the COPY
                    copy = self._text(cur.mogrify(begin, args)) + "; " + copy
                cur.copy_expert(copy, stream, size=COPY_IO_SIZE)
                if stream.error is not None:
                    raise stream.error
                for p, nchunks in zip(puts, stream.nchunks):
                    if nchunks != nchunks_for(p.total, self.chunk_size):
                        raise DurabilityError(f"streamed {nchunks} chunks, expected "
                                              f"{nchunks_for(p.total, self.chunk_size)}", ref=p.ref)
                values = [v for p, k in zip(puts, stream.nchunks) for v in p.manifest_row(k)]
                # a client killed here, or after the INSERT, leaves the same: an aborted transaction
                failpoints.hit("pg.before_manifest")
                if epoch is not None:
                    cur.execute(insert, values)
                    for run in dict.fromkeys(p.run for p in puts):
                        self._check_epoch(cur, run, epoch, ref)
                    failpoints.hit("pg.before_commit")
                    commit, values = "COMMIT", None
                else:
                    failpoints.hit("pg.before_commit")
                    commit = insert + "; COMMIT"
                try:
                    cur.execute(commit, values)
                except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                    if self._commit_unknown(e):
                        raise self._commit_failed(e, ref) from None
                    raise       # the server's verdict (a lock or statement timeout, disk full): rolled back
            self._committed_objects(plans)
        except BaseException as e:
            if stream is not None and stream.error is not None and isinstance(e, psycopg2.Error):
                e = stream.error   # the real cause behind psycopg2's "COPY cancelled"
            self._abort(cur)
            if isinstance(e, AgckError):
                raise e.at(ref)
            if isinstance(e, psycopg2.errors.UniqueViolation) and not all(p.overwrite for p in puts):
                raise self._exists(puts) from None
            if isinstance(e, (psycopg2.errors.ForeignKeyViolation, psycopg2.errors.DeadlockDetected)):
                raise _Refused(_scrub(str(e).strip(), self._secrets)) from None
            if isinstance(e, psycopg2.Error):
                raise self._db_error(e, "write failed", ref, DurabilityError) from None
            if isinstance(e, OSError):
                raise DurabilityError(f"write failed: {e.strerror or e}", ref=ref) from e
            raise

    def _text(self, sql: bytes) -> str:
        """A statement psycopg2 interpolated (in the connection's encoding) as text,
        to put in front of a COPY."""
        return sql.decode(psycopg2.extensions.encodings.get(self._conn.encoding, "utf-8"))

    def _commit_unknown(self, e: psycopg2.Error) -> bool:
        """Whether a write ended without the server's verdict on it (the connection lost,
        no SQLSTATE), so its COMMIT may have happened. An error the server sent (a lock
        or statement timeout, a deadlock, a full disk) rolled the transaction back."""
        return e.pgcode is None or self._conn is None or bool(self._conn.closed)

    def _commit_failed(self, e: psycopg2.Error, ref: str) -> DurabilityError:
        return DurabilityError(
            f"the connection failed during COMMIT: the checkpoint may or may not have been written "
            f"({_scrub(str(e), self._secrets)})", ref=ref,
            hint="check store.steps(run) once the server is reachable, and put it again if absent")

    def _begin_sql(self, puts: list[PreparedPut]) -> tuple[str, list]:
        """The statements that open a put's durable transaction: the (run, step) locks,
        taken in one order by every writer (no deadlock between two put_many), then
        the rows of the entries it may replace deleted, chunks first. An entry not to
        be replaced is left alone: its rows, if any, collide with the new ones
        (UniqueViolation) and the transaction is rolled back."""
        n = self.names
        locks = sorted({self._row_lock_key(p.run, p.step) for p in puts})
        stmts, args = ["BEGIN", "SET LOCAL synchronous_commit = on"] + [_XACT_LOCK] * len(locks), list(locks)
        replaced = [(p.run, p.step) for p in puts if p.overwrite]
        if replaced:
            which = " OR ".join(["(run = %s AND step = %s)"] * len(replaced))
            keys = [v for key in replaced for v in key]
            stmts += [f"DELETE FROM {n.chunks} WHERE {which}", f"DELETE FROM {n.manifest} WHERE {which}"]
            args += keys + keys
        return "; ".join(stmts), args

    def _exists(self, puts: list[PreparedPut]) -> CheckpointExistsError:
        """After a put refused for a key already taken: name the entry (not to be
        replaced) whose checkpoint is there."""
        kept = [p for p in puts if not p.overwrite]
        try:
            taken = {(r, s) for r, s in self._query(
                f"SELECT run, step FROM {self.names.manifest} WHERE "
                + " OR ".join(["(run = %s AND step = %s)"] * len(kept)), [v for p in kept for v in (p.run, p.step)])}
        except AgckError:
            taken = set()
        p = next((p for p in kept if (p.run, p.step) in taken), kept[0])
        return CheckpointExistsError("a checkpoint already exists here", ref=p.ref)

    def _still_known(self, cur, generation: int, addresses: list[bytes]) -> list[bytes]:
        """Those of ``addresses`` this store object committed itself and the store still
        holds, as of gc ``generation``: while no collection (or quarantine) ran, all it
        knows; after one, those of them a query finds."""
        if generation != self._known_generation:    # a collection ran: what this store knew may be gone
            known_before = self._known_objects
            self._known_objects = set()
            self._known_generation = generation
            return list(self._present(cur, [a for a in addresses if a in known_before]))
        return [a for a in addresses if a in self._known_objects]

    def _put_objects(self, cur, plans: list["content.Plan"], present: set[bytes]) -> None:
        """Send the objects of ``plans`` the store lacks (not in ``present``). The store
        lock is held shared: no collector deletes an object before this transaction
        ends. Another writer may send one of them first: the COPY then fails on its
        key, and is done again, in a savepoint, without the ones that have arrived."""
        n = self.names
        for _ in range(_OBJECT_ROUNDS):
            missing, seen = [], set(present)
            for plan in plans:      # an object two of them hold is sent once
                m = plan.missing(seen)
                seen.update(a for a, _ in m)
                missing += m
            if not missing:
                return
            missing.sort()      # writers sending the same new objects meet them in one order: no deadlock
            stream = _ObjectsIn(missing)
            try:     # the savepoint stays open to COMMIT, which commits what it holds
                cur.copy_expert(f"SAVEPOINT agck_objects; COPY {n.objects} (address, size, data) FROM STDIN "
                                "(FORMAT binary)", stream, size=COPY_IO_SIZE)
            except psycopg2.errors.UniqueViolation:
                if stream.error is not None:
                    raise
                cur.execute("ROLLBACK TO SAVEPOINT agck_objects")
                present |= self._present(cur, [a for a, _ in missing])
                continue
            except psycopg2.Error:
                if stream.error is not None:
                    raise stream.error from None
                raise
            if stream.error is not None:
                raise stream.error
            return
        raise _Refused("other writers kept sending the same objects")

    def _heal_reused(self, cur, plans: list["content.Plan"], stored: dict[bytes, int], found: list[bytes]) -> None:
        """``verify_reused``: check the objects the put relies on (``stored``: address ->
        stored size); quarantine the damaged ones, in this transaction, and drop them
        from ``found`` so they are sent afresh."""
        sizes = {}
        for plan in plans:
            for a in plan.distinct:
                sizes.setdefault(a, plan.size(a))
        bad = content.reused_damage(stored, sizes.__getitem__, self.verify_reused, self._reread_turn(),
                                    lambda addresses: self._read_objects(cur, addresses))
        if bad:
            self._quarantine_rows(cur, bad)
            found[:] = [a for a in found if a not in bad]
            self._known_objects.difference_update(bad)

    def _quarantine_rows(self, cur, bad: dict[bytes, str]) -> None:
        """In a write transaction: move the objects ``bad`` names (address -> why) to the
        quarantine table, and move the gc generation on: every store object forgets
        what it knew to be stored, so none relies on them without looking."""
        n = self.names
        cur.execute("SAVEPOINT agck_quarantine")
        try:     # two first quarantines may race to create the table
            cur.execute(f"CREATE TABLE IF NOT EXISTS {n.quarantine} (address bytea NOT NULL, size bigint NOT NULL, "
                        "data bytea NOT NULL, detected_at timestamptz NOT NULL DEFAULT now(), reason text NOT NULL); "
                        "RELEASE SAVEPOINT agck_quarantine")
        except (psycopg2.errors.UniqueViolation, psycopg2.errors.DuplicateTable, psycopg2.errors.DuplicateObject):
            cur.execute("ROLLBACK TO SAVEPOINT agck_quarantine")
        addresses, reasons = list(bad), list(bad.values())
        cur.execute(f"INSERT INTO {n.quarantine} (address, size, data, reason) SELECT o.address, octet_length(o.data), "
                    f"o.data, r.reason FROM {n.objects} o JOIN unnest(%s::bytea[], %s::text[]) AS r(address, reason) "
                    f"ON o.address = r.address; DELETE FROM {n.objects} WHERE address = ANY(%s::bytea[]); "
                    f"UPDATE {n.gc} SET generation = generation + 1", (addresses, reasons, addresses))

    def quarantine(self, addresses) -> dict[bytes, str]:
        wanted = list(dict.fromkeys(bytes(a) for a in addresses))

        def body(cur):
            out, bad = content.judge(wanted, self._read_objects(cur, wanted))
            if bad:
                self._quarantine_rows(cur, bad)
            elif "missing" in out.values():   # writers that knew it stored look again
                cur.execute(f"UPDATE {self.names.gc} SET generation = generation + 1")
            return out

        out = self._exclusive(body, "quarantining damaged objects failed")
        self._known_objects.difference_update(wanted)
        return out

    def _exclusive(self, body, what: str):
        """``body(cur)`` in one durable transaction holding the store lock exclusively
        (it waits for puts in flight to commit, and puts wait for it), started over on
        a deadlock or serialization failure; COMMIT after it returns."""
        n = self.names
        with self._lock:
            for attempt in range(GC_RETRIES + 1):
                cur = self._cursor()
                try:
                    cur.execute("BEGIN; SET LOCAL synchronous_commit = on; " + _XACT_LOCK, (n.store_lock,))
                    result = body(cur)
                    cur.execute("COMMIT")
                    return result
                except BaseException as e:
                    self._abort(cur)
                    retry = isinstance(e, (psycopg2.errors.DeadlockDetected, psycopg2.errors.SerializationFailure))
                    if retry and attempt < GC_RETRIES:
                        time.sleep(0.01 * (attempt + 1))
                        continue
                    if isinstance(e, psycopg2.Error):
                        raise self._db_error(e, what, n.label, DurabilityError) from None
                    raise
        raise AssertionError("unreachable")

    def quarantined(self) -> list[content.QuarantinedChunk]:
        n = self.names
        if not self._query("SELECT to_regclass(%s) IS NOT NULL", (n.quarantine,))[0][0]:
            return []
        rows = self._query(f"SELECT ctid::text, address, size, extract(epoch FROM detected_at)::float8, reason "
                           f"FROM {n.quarantine} ORDER BY detected_at, ctid")
        return [content.QuarantinedChunk(address=bytes(a).hex(), size=size, detected_at=t, reason=why,
                                          ref=f"{n.quarantine_ref}(ctid='{tid}')")
                for tid, a, size, t, why in rows]

    def _scrub(self, progress) -> content.ScrubReport:
        """In one snapshot (REPEATABLE READ): every listing, then every object, read in
        batches in address order."""
        n = self.names
        with self._lock:
            cur = self._cursor()
            try:
                cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
                            f"SELECT run, step, checksum FROM {n.manifest} WHERE listing ORDER BY run, step")
                keys = cur.fetchall()

                def listed(run, step, checksum, ref):
                    cur.execute(f"SELECT data FROM {n.chunks} WHERE run = %s AND step = %s ORDER BY idx", (run, step))
                    buf = b"".join(bytes(d) for (d,) in cur.fetchall())
                    check_checksum(buf, checksum, ref)
                    return content.listed_addresses(buf, verify=True, ref=ref)

                def stored():
                    after = b""
                    while True:
                        cur.execute(f"SELECT address, size, data FROM {n.objects} WHERE address > %s "
                                    "ORDER BY address LIMIT 16", (after,))
                        rows = cur.fetchall()
                        if not rows:
                            return
                        for a, size, data in rows:
                            a = bytes(a)
                            yield a, size, f"{n.objects_ref}(address='\\x{a.hex()}')", (lambda d=data: d)
                        after = bytes(rows[-1][0])

                listings = [(self.ref(r, s), partial(listed, r, s, c, self.ref(r, s))) for r, s, c in keys]
                rep = content.scrub(self.url, listings, stored(), progress)
                cur.execute("COMMIT")
                return rep
            except BaseException as e:
                self._abort(cur)
                if isinstance(e, psycopg2.Error):
                    raise self._db_error(e, "scrub failed", n.label) from None
                raise

    def _committed_objects(self, plans: list["content.Plan"]) -> None:
        """After a put's COMMIT: its objects are in the store until a collection runs."""
        if not plans:
            return
        if len(self._known_objects) > _KNOWN_OBJECTS_MAX:
            self._known_objects = set()
        for plan in plans:
            self._known_objects.update(plan.distinct)

    def _present(self, cur, addresses: list[bytes]) -> set[bytes]:
        cur.execute(f"SELECT address FROM {self.names.objects} WHERE address = ANY(%s::bytea[])", (addresses,))
        return {bytes(a) for (a,) in cur.fetchall()}

    def _begin_and_delete(self, cur, run: str, step: int) -> bool:
        """Open a durable write transaction holding (run, step)'s lock and delete its
        rows, chunks first; returns whether a checkpoint was there. A put's
        transaction takes the same lock (:meth:`_begin_sql`), so they serialise."""
        n = self.names
        cur.execute(
            "BEGIN; SET LOCAL synchronous_commit = on; " + _XACT_LOCK + "; "
            f"DELETE FROM {n.chunks} WHERE run = %s AND step = %s; "
            f"DELETE FROM {n.manifest} WHERE run = %s AND step = %s RETURNING 1",
            (self._row_lock_key(run, step), run, step, run, step))
        return cur.fetchone() is not None

    # -- fencing: a row per run in <prefix>_epochs ---------------------------------
    def begin_epoch(self, run: str) -> int:
        check_run(run)
        n = self.names
        with self._lock:
            for attempt in range(2):     # two first begin_epochs may race to create the table
                cur = self._cursor()
                try:
                    cur.execute("BEGIN; SET LOCAL synchronous_commit = on; "
                                f"CREATE TABLE IF NOT EXISTS {n.epochs} (run text PRIMARY KEY, epoch bigint NOT NULL); "
                                f"INSERT INTO {n.epochs} AS e (run, epoch) VALUES (%s, 1) "
                                "ON CONFLICT (run) DO UPDATE SET epoch = e.epoch + 1 RETURNING epoch", (run,))
                    epoch = cur.fetchone()[0]
                    cur.execute("COMMIT")
                    return epoch
                except BaseException as e:
                    self._abort(cur)
                    if isinstance(e, psycopg2.errors.UniqueViolation) and attempt == 0:
                        continue
                    if isinstance(e, psycopg2.Error):
                        raise self._db_error(e, f"cannot begin a new epoch of run {run!r}", n.label,
                                             DurabilityError) from None
                    raise
        raise AssertionError("unreachable")

    def _check_epoch(self, cur, run: str, epoch: int, ref: str) -> None:
        """In a write transaction, before COMMIT: refuse unless ``epoch`` is the run's
        newest. The row stays share-locked until COMMIT, so begin_epoch waits for it."""
        try:
            cur.execute(f"SELECT epoch FROM {self.names.epochs} WHERE run = %s FOR SHARE", (run,))
        except psycopg2.errors.UndefinedTable:   # no begin_epoch yet on this store: no epoch is the newest
            raise self._stale(run, epoch, None, ref) from None
        row = cur.fetchone()
        if row is None or row[0] != epoch:
            raise self._stale(run, epoch, None if row is None else row[0], ref)

    def epoch(self, run: str) -> int | None:
        check_run(run)
        n = self.names
        rows = self._query("SELECT to_regclass(%s) IS NOT NULL", (n.epochs,))
        if not rows[0][0]:
            return None
        rows = self._query(f"SELECT epoch FROM {n.epochs} WHERE run = %s", (run,))
        return rows[0][0] if rows else None

    def delete(self, run: str, step: int, *, epoch: int | None = None) -> None:
        step = check_step(step)
        ref = self.ref(run, step)
        with self._lock:
            cur = self._cursor()
            try:
                if not self._begin_and_delete(cur, run, step):
                    raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref)
                if epoch is not None:
                    self._check_epoch(cur, run, epoch, ref)
                cur.execute("COMMIT")
            except BaseException as e:
                self._abort(cur)
                if isinstance(e, psycopg2.Error):
                    raise self._db_error(e, "delete failed", ref, DurabilityError) from None
                raise

    # -- reading -----------------------------------------------------------------------------
    def _query(self, query: str, args=()) -> list:
        with self._lock:
            cur = self._cursor()
            try:
                cur.execute(query, args)
                return cur.fetchall()
            except psycopg2.Error as e:
                raise self._db_error(e, "query failed", self.names.label) from None

    def runs(self) -> list[str]:
        return [r for (r,) in self._query(f"SELECT DISTINCT run FROM {self.names.manifest} ORDER BY run")]

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        check_run(run)
        return [s for (s,) in reversed(self._query(   # LIMIT NULL: no limit
            f"SELECT step FROM {self.names.manifest} WHERE run = %s ORDER BY step DESC LIMIT %s",
            (run, check_last(last))))]

    def list(self, run: str | None = None) -> list[CheckpointInfo]:
        n = self.names
        q = (f"SELECT run, step, coalesce(length, size), extract(epoch FROM created_at)::float8, parent, meta, checksum "
             f"FROM {n.manifest}")
        rows = (self._query(q + " ORDER BY run, step") if run is None
                else self._query(q + " WHERE run = %s ORDER BY step", (check_run(run),)))
        return [CheckpointInfo(run=r, step=s, ref=sql_row(n.manifest_ref, r, s), size=size, created_at=created,
                               parent=parent, meta=meta, checksum=checksum)
                for r, s, size, created, parent, meta, checksum in rows]

    def read(self, run: str, step: int, *, verify: bool = True, map_location=None) -> Checkpoint:
        step = check_step(step)
        ref = self.ref(run, step)
        map_location = codec.check_map_location(map_location)
        n = self.names
        chunk_ref = lambda i: self._chunk_ref(run, step, i)  # noqa: E731
        layout = (f"SELECT m.size, m.checksum, m.nchunks, c.idxs, c.lens{{data}} FROM {n.manifest} m "
                  f"LEFT JOIN LATERAL (SELECT array_agg(idx ORDER BY idx) AS idxs, "
                  f"array_agg(octet_length(data) ORDER BY idx) AS lens{{agg}} FROM {n.chunks} "
                  f"WHERE run = m.run AND step = m.step) c ON true "
                  f"WHERE m.run = %s AND m.step = %s")
        with self._lock:
            cur = self._cursor()
            try:
                # A small standalone container comes with its manifest row, in one statement
                # (one snapshot, no transaction to end): one round trip. Anything else, or a
                # listing found there, is read below in one transaction.
                cur.execute(layout.format(
                    data=", c.data", agg=", string_agg(data, ''::bytea ORDER BY idx) FILTER "
                                         "(WHERE m.size <= %s AND m.listing IS NOT TRUE) AS data"),
                    (SMALL_READ_MAX, run, step))
                row = cur.fetchone()
            except psycopg2.Error as e:
                self._abort(cur)
                raise self._db_error(e, "read failed", ref) from None
        if row is None:
            raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref,
                                          hint=f"store.steps({run!r}) lists the steps")
        size, checksum, nchunks, idxs, lens, data = row
        chunk_plan(size, nchunks, idxs or [], lens or [], manifest_ref=ref, chunk_ref=chunk_ref)
        if data is not None:
            if len(data) != size:   # chunk_plan has checked each row's length in this snapshot
                raise CorruptCheckpointError(f"the chunks hold {len(data)} bytes, not the manifest's {size}",
                                             ref=ref, section="chunks")
            buf = new_buffer(size)
            memoryview(buf).cast("B")[:] = memoryview(data).cast("B")
            check_checksum(buf, checksum, ref)
            data = buf if content.listed_addresses(buf, verify=verify, ref=ref) is None else None
        if data is not None:
            ck = content.decode(data, content.fetcher({}, []), verify=verify, map_location=map_location, ref=ref)
            check_identity(ck, run, step, ref)
            return ck
        with self._lock:
            cur = self._cursor()
            try:
                # One snapshot for the manifest, the chunk layout, the data and the objects.
                cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; " + layout.format(data="", agg=""),
                            (run, step))
                row = cur.fetchone()
                if row is None:
                    raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref,
                                                  hint=f"store.steps({run!r}) lists the steps")
                size, checksum, nchunks, idxs, lens = row
                expected = chunk_plan(size, nchunks, idxs or [], lens or [], manifest_ref=ref, chunk_ref=chunk_ref)
                # Populate the buffer's pages on another core while the server starts the COPY.
                pending = _Background(new_buffer, size)
                sink = _CopyOut(pending.result, expected, chunk_ref)
                query = cur.mogrify(f"COPY (SELECT data FROM {n.chunks} WHERE run = %s AND step = %s ORDER BY idx) "
                                    f"TO STDOUT (FORMAT binary)", (run, step)).decode("utf-8")
                cur.copy_expert(query, sink, size=COPY_IO_SIZE)
                sink.finish()
                buf = pending.result()
                check_checksum(buf, checksum, ref)
                addresses = content.listed_addresses(buf, verify=verify, ref=ref)
                found = self._read_objects(cur, addresses) if addresses is not None else {}
                cur.execute("COMMIT")
            except BaseException as e:
                self._abort(cur)
                if isinstance(e, psycopg2.Error):
                    raise self._db_error(e, "read failed", ref) from None
                raise
        return decode_read(self, buf, found, addresses, run=run, step=step, verify=verify,
                           map_location=map_location, ref=ref)

    def _read_objects(self, cur, addresses: list[bytes]) -> dict:
        """The listed objects the store holds (address -> bytes), in one COPY."""
        sink = _ObjectsOut()
        query = cur.mogrify(f"COPY (SELECT address, data FROM {self.names.objects} WHERE address = ANY(%s::bytea[])) "
                            f"TO STDOUT (FORMAT binary)", (list(dict.fromkeys(addresses)),)).decode("utf-8")
        cur.copy_expert(query, sink, size=COPY_IO_SIZE)
        return sink.finish()

    # -- shared content ----------------------------------------------------------------------
    def collect_garbage(self) -> content.Collected:
        """Delete the objects no listing refers to, in one transaction holding the
        store lock exclusively: it waits for puts in flight to commit, and puts wait
        for it. A damaged listing keeps nothing alive (nothing could ever rebuild
        its content); one that cannot be read here (a newer format) stops the
        collection before anything is deleted."""
        n = self.names

        def body(cur):
            live, listings, damaged = self._live_objects(cur)
            cur.execute("CREATE TEMP TABLE agck_live (address bytea PRIMARY KEY) ON COMMIT DROP")
            cur.execute("INSERT INTO agck_live SELECT unnest(%s::bytea[])", (list(live),))
            cur.execute(
                f"WITH gone AS (DELETE FROM {n.objects} o WHERE NOT EXISTS "
                f"(SELECT 1 FROM agck_live l WHERE l.address = o.address) RETURNING o.size) "
                f"SELECT count(*), coalesce(sum(size), 0)::bigint FROM gone")
            deleted, nbytes = cur.fetchone()
            if deleted:   # what writers know to be present may be gone: they look again
                cur.execute(f"UPDATE {n.gc} SET generation = generation + 1")
            cur.execute("SELECT to_regclass(%s) IS NOT NULL", (n.quarantine,))
            if cur.fetchone()[0]:     # quarantined objects are kept until healed or listed by no checkpoint
                cur.execute(f"DELETE FROM {n.quarantine} q WHERE NOT EXISTS (SELECT 1 FROM agck_live l WHERE "
                            f"l.address = q.address) OR EXISTS (SELECT 1 FROM {n.objects} o WHERE o.address = q.address)")
            return content.Collected(listings=listings, live_chunks=len(live), deleted_chunks=deleted,
                                     deleted_bytes=int(nbytes), damaged=damaged)

        return self._exclusive(body, "collecting garbage failed")

    def _live_objects(self, cur) -> tuple[set[bytes], int, list[str]]:
        """What every listing lists (:func:`content.live_chunks`), read in this transaction."""
        n = self.names
        cur.execute(f"SELECT run, step, checksum FROM {n.manifest} WHERE listing ORDER BY run, step")

        def load(run, step, checksum, ref):
            cur.execute(f"SELECT data FROM {n.chunks} WHERE run = %s AND step = %s ORDER BY idx", (run, step))
            buf = b"".join(bytes(d) for (d,) in cur.fetchall())
            check_checksum(buf, checksum, ref)
            return buf

        refs = [(self.ref(r, s), r, s, c) for r, s, c in cur.fetchall()]
        return content.live_chunks([(ref, partial(load, r, s, c, ref)) for ref, r, s, c in refs])

    # -- housekeeping ------------------------------------------------------------------------
    def _orphan_where(self, run: str | None) -> tuple[str, tuple]:
        n = self.names
        where = (f"NOT EXISTS (SELECT 1 FROM {n.manifest} m WHERE m.run = c.run AND m.step = c.step)")
        if run is not None:
            return where + " AND c.run = %s", (check_run(run),)
        return where, ()

    def orphans(self, run: str | None = None) -> list[str]:
        """Chunk rows without a manifest row. A put writes both in one transaction, so
        these come only from manual changes to the tables."""
        where, args = self._orphan_where(run)
        rows = self._query(f"SELECT DISTINCT c.run, c.step FROM {self.names.chunks} c WHERE {where} "
                           f"ORDER BY c.run, c.step", args)
        return [sql_row(self.names.chunks_ref, r, s) for r, s in rows]

    def clean_orphans(self, run: str | None = None) -> list[str]:
        where, args = self._orphan_where(run)
        n = self.names
        with self._lock:
            cur = self._cursor()
            try:
                cur.execute(f"BEGIN; DELETE FROM {n.chunks} c WHERE {where} RETURNING c.run, c.step", args)
                rows = sorted(set(cur.fetchall()))
                cur.execute("COMMIT")
            except BaseException as e:
                self._abort(cur)
                if isinstance(e, psycopg2.Error):
                    raise self._db_error(e, "cleaning orphans failed", n.label, DurabilityError) from None
                raise
        return [sql_row(n.chunks_ref, r, s) for r, s in rows]
