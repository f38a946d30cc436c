"""Postgres store: checkpoints as bytea chunk rows streamed over binary COPY.

    postgresql://user@host:5432/db     (postgres:// too; postgresql:/// uses the libpq
                                        environment: PGHOST, PGUSER, PGPASSWORD, ...)

The tables (``{prefix}_manifest``, ``_chunks``, ``_objects``, ``_gc``, ...) are
listed in :mod:`agck.stores.postgres.schema`, which creates and migrates them; the
binary COPY streams are framed and parsed in :mod:`agck.stores.postgres.copy`; the
shared objects, and how writers and the collector exclude each other (one
advisory lock per store), are :mod:`agck.stores.postgres.objects`.

Each checkpoint is one container kept as chunk rows: ``size`` is the
container's bytes, ``checksum`` the xxh3-64 of its footer, ``length`` the
checkpoint's own size (what :meth:`list` reports). By default
(``incremental=True``) that container is a small chunk listing (FORMAT.md,
version 1.1; ``listing`` is true) and the content is kept in ``objects``, one
row per distinct BLAKE3-256 address, shared by every checkpoint holding those
bytes; only the objects the store lacks are sent. A container under
``min_chunked`` bytes (64 KiB) is stored standalone all the same.
``incremental=False`` stores standalone 1.0 containers.

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

import functools
import shlex
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

import psycopg2
import psycopg2.errors
import psycopg2.extensions

from ... import failpoints, thresholds
from ...args import check_seconds
from ...errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, DurabilityError,
                      SchemaUninitializedError, StoreConnectionError, StoreError, UsageError)
from .. import compression, content, damage, encryption
from . import schema as pgschema
from ..base import Store, check_run, check_step
from ..dsn import dsn_secrets, dsn_without_password, redact_dsn
from ..s3.chunks import ObjectChunks
from ..s3.client import parse_url
from .copy import COPY_IO_SIZE, CopyIn
from .aio import AsyncConnections, AsyncMethods
from .log import JournalLogs
from .reads import LARGE, Reads
from .objects import Refused, SharedObjects
from .pool import DEFAULT_POOL_SIZE, DEFAULT_POOL_TIMEOUT, ConnectionPool
from .schema import SCHEMA_VERSION, XACT_LOCK, XACT_LOCK_SHARED, Names
from ..sqlrows import (batch_ref, DEFAULT_CHUNK_SIZE, PreparedPut, TransactionalPuts, check_chunk_size,
                      check_identifier, nchunks_for, parts_prefix, sql_row)

# How often a put starts over when the database refused its objects (a collector
# deleted one it relies on, or a deadlock with a collector); then DurabilityError.
PUT_RETRIES = 1

SMALL_PUT_MAX = thresholds.SMALL_PUT    # standalone containers up to this size in all are written in one statement

T = TypeVar("T")


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


def _connect_args(dsn: str, secrets: list[str], url: str, connect_timeout: int) -> tuple[str, dict]:
    """``psycopg2.connect``'s arguments: the DSN, and agck's defaults where it sets none."""
    extra = {"application_name": "agck"}
    try:
        given = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.Error as e:
        raise StoreConnectionError(f"invalid Postgres URL: {_scrub(str(e), secrets)}", ref=url) from None
    if "connect_timeout" not in given:
        extra["connect_timeout"] = connect_timeout
    return dsn, {k: v for k, v in extra.items() if k not in given}


def _connect(dsn: str, secrets: list[str], url: str, connect_timeout: int):
    """A new autocommit connection (a module function: the pool holds no reference to
    its store, so a store dropped without close() is freed, and its connections closed,
    at once)."""
    dsn, kwargs = _connect_args(dsn, secrets, url, connect_timeout)
    try:
        conn = psycopg2.connect(dsn, **kwargs)
    except psycopg2.Error as e:
        raise StoreConnectionError(f"cannot connect to Postgres: {_scrub(str(e), secrets)}", ref=url) from None
    conn.autocommit = True   # transactions are explicit: BEGIN travels with the first statement
    return conn


def _text(cur, sql: bytes) -> str:
    """A statement psycopg2 interpolated (in the connection's encoding) as text,
    to put in front of a COPY."""
    return sql.decode(psycopg2.extensions.encodings.get(cur.connection.encoding, "utf-8"))


def _weak(method) -> Callable[[], None]:
    """``method()`` while its object lives, without keeping it alive."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        m = ref()
        if m is not None:
            m()
    return call


def _local_server(conn) -> bool:
    """Whether the connection's server is on this machine (a Unix socket or loopback)."""
    try:
        return compression.is_local_host(conn.info.host)
    except Exception:      # no answer: count it as remote, where compressing costs no more than it saves
        return False


def _commit_unknown(e: psycopg2.Error, cur) -> bool:
    """Whether a write ended without the server's verdict on it (the connection lost,
    no SQLSTATE), so its COMMIT may have happened. An error the server sent (a lock
    or statement timeout, a deadlock, a full disk) rolled the transaction back."""
    return e.pgcode is None or bool(cur.connection.closed)


# --- the store ------------------------------------------------------------------------

class PostgresStore(TransactionalPuts, SharedObjects, AsyncMethods, JournalLogs, Reads, Store):
    """Checkpoints in Postgres, through a pool of connections shared by the threads of a process.

    ``prefix`` names the tables, ``schema`` the Postgres schema holding them (the
    search path when None), ``chunk_size`` the bytes per chunk row (bytea holds at
    most 1 GiB), ``init=True`` creates a missing schema instead of refusing,
    ``check_schema=False`` opens without looking at the schema (``agck db``),
    ``incremental=False`` writes standalone containers instead of chunk listings,
    ``full_every=K`` one in every K puts of a run, ``min_chunked`` a container of fewer
    bytes (:meth:`Store._set_policy`). ``pool`` bounds the connections open at once
    (``agck_pool=N`` in the URL; :mod:`.pool`), ``pool_timeout`` how long an
    operation waits for one when all are busy."""

    def __init__(self, url: str, *, prefix: str = "agck", schema: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, init: bool = False, check_schema: bool = True,
                 connect_timeout: int = 10, incremental: bool = True,
                 full_every: int | None = None, min_chunked: int | None = None,
                 verify_reused: str = damage.DEFAULT_VERIFY_REUSED, objects: "str | ObjectChunks | None" = None,
                 pool: "int | str" = DEFAULT_POOL_SIZE, pool_timeout: float = DEFAULT_POOL_TIMEOUT,
                 compress: str = compression.DEFAULT, level: int | None = None, key=None,
                 seal_meta: bool = False):
        super().__init__()
        compression.ChunkEncoding(compress, level, local=True)     # the options checked before any connection
        given = encryption.given_key(key)
        self.seal_meta = encryption.check_seal_meta(seal_meta, given)
        if not isinstance(url, str) or not url:
            raise StoreConnectionError(f"not a Postgres URL: {type(url).__name__}",
                                       hint="use postgresql://user@host:port/dbname")
        if isinstance(objects, str):
            parse_url(objects)       # refused before any connection (a URL with credentials never reaches the database)
        elif objects is not None and not isinstance(objects, ObjectChunks):
            raise UsageError(f"objects must be an s3:// URL (str) or None, not {type(objects).__name__}",
                             hint="e.g. objects='s3://bucket/prefix'")
        pool_timeout = check_seconds(pool_timeout, "pool_timeout")
        self._dsn = url
        self._secrets = _secrets(url)
        self.url = redact_dsn(url)
        self.prefix = check_identifier(prefix, "table prefix")
        self.schema = check_identifier(schema, "schema name") if schema is not None else None
        self.chunk_size = check_chunk_size(chunk_size)
        self._set_policy(incremental, full_every, min_chunked, verify_reused)
        self._compress_args = (compress, level)   # set once it is known where the bytes go (below)
        self.last_put: content.Chunks | None = None
        self._connect_timeout = connect_timeout
        self._known_lock = threading.Lock()
        self._forget_objects()
        self._claims: dict[bytes, threading.Event] = {}    # objects a thread of this store object is sending
        self._claimed = threading.local()                   # this thread's claims (objects.py)
        # a connection dropped broken: a failover or a restore may have lost what this store object saw committed
        self._journal_lock = threading.Lock()
        self._journal_heads: dict[str, int] = {}     # run -> the last journal batch number this object knows
        self._journal_known: set[str] = set()        # runs whose heads row this object has seen made
        self._journal_statements: dict[bool, tuple[str, str]] = {}
        self._connect_one = functools.partial(_connect, url, self._secrets, self.url, connect_timeout)
        self._pool = ConnectionPool(self._connect_one, pool, timeout=pool_timeout, where=self.url,
                                    on_broken=_weak(self._forget_objects))
        self._aconns = AsyncConnections(functools.partial(_connect_args, url, self._secrets, self.url,
                                                          connect_timeout),
                                        self._pool.size, pool_timeout, self.url, _weak(self._forget_objects))
        try:
            with self._pool.connection() as conn:    # the first connection now: a bad URL or server fails here
                self.names = Names(conn, self.prefix, self.schema, self.url)
                local = _local_server(conn)
            self._objects: ObjectChunks | None = None
            if init:
                self.init_schema()
            elif check_schema:
                self._check_schema()
            if init or check_schema:
                self._objects = self._object_store(objects)
            if self._objects is not None:     # the chunks' bytes go to the bucket
                self._set_compression(*self._compress_args, local=self._objects.c.local, what="object store")
            else:
                self._set_compression(*self._compress_args, local=local, what="Postgres server")
            if init or check_schema:
                self._set_encryption(PgKeySlots(self), given, where=self.names.where)
        except BaseException:
            self._pool.close()     # refused (no schema, another bucket): its connection closed now, not at a GC
            raise

    def location(self) -> tuple:
        """The server's system identifier (the same cluster however its host is spelled),
        the database, the schema and the prefix."""
        try:
            (server,) = self._query("SELECT system_identifier::text FROM pg_control_system()")[0]
        except AgckError:      # a server that does not say: its address as this connection sees it
            (server,) = self._query("SELECT coalesce(host(inet_server_addr()), 'socket') || ':' || "
                                    "current_setting('port')")[0]
        (db,) = self._query("SELECT current_database()")[0]
        return ("postgres", server, db, self.schema or "public", self.prefix)

    def _stored_head(self, run: str, step: int) -> bytes | None:
        rows = self._query(f"SELECT substring(data from 1 for 8) FROM {self.names.chunks} WHERE run = %s AND "
                           "step = %s AND idx = 0", (run, step))
        return bytes(rows[0][0]) if rows else None

    # what the asyncio methods (aio.AsyncMethods) and the journal logs (log.py) share with the sync ones
    _put_retries = PUT_RETRIES
    _refused = Refused
    _large = LARGE
    _commit_unknown = staticmethod(_commit_unknown)

    @property
    def where(self) -> str:
        """The database and its tables, as error messages name them."""
        return self.names.where       # the URL and its tables ({schema.}{prefix}_*)

    # -- connection ------------------------------------------------------------------
    @property
    def pool_size(self) -> int:
        """The most connections this store object opens at once (``agck_pool``)."""
        return self._pool.size

    @contextmanager
    def _cursor(self):
        """A cursor on a connection of the pool, this thread's until the block ends."""
        with self._pool.connection() as conn:
            yield conn.cursor()

    @staticmethod
    def _abort(cur) -> None:
        """Roll back after an error; a connection that cannot is dropped (the pool opens another)."""
        try:
            cur.execute("ROLLBACK")
        except psycopg2.Error:
            try:
                cur.connection.close()
            except psycopg2.Error:
                pass

    def _db_error(self, e: psycopg2.Error, what: str, ref: str, cls=StoreError, conn=None) -> AgckError:
        msg = _scrub(str(e).strip() or type(e).__name__, self._secrets)
        # any error class: a COPY cut off by the server's death is a bare DatabaseError
        # ("error with status PGRES_COPY_OUT and no message from the libpq")
        if conn is not None and conn.closed:
            return StoreConnectionError(f"{what}: lost the connection to Postgres ({msg})", ref=ref)
        if isinstance(e, psycopg2.errors.UndefinedTable):
            return SchemaUninitializedError(f"{what}: {msg}", ref=ref,
                                            hint=self._db_hint("init", "or call store.init_schema()"))
        return cls(f"{what}: {msg}", ref=ref)

    def _transaction(self, begin: str, args, body: Callable[[Any], T], what: str, ref: str, cls=StoreError, *,
                     retry: tuple[type[BaseException], ...] = (), retries: int = 0, pause: float = 0.0) -> T:
        """One transaction under the store's lock: ``begin`` (BEGIN and the statements
        sent with it, in one round trip), then ``body(cur)``, then COMMIT; returns
        what ``body`` returned. Any error rolls it back; a database error is raised as
        ``cls`` (``what: message``, at ``ref``), anything else as it is. An error of a
        ``retry`` type starts it over, at most ``retries`` times, ``pause`` seconds
        more each time."""
        for attempt in range(retries + 1):
            with self._cursor() as cur:
                try:
                    cur.execute(begin, args)
                    result = body(cur)
                    cur.execute("COMMIT")
                    return result
                except BaseException as e:
                    self._abort(cur)
                    if isinstance(e, retry) and attempt < retries:
                        if pause:
                            time.sleep(pause * (attempt + 1))
                        continue
                    if isinstance(e, psycopg2.Error):
                        raise self._db_error(e, what, ref, cls, cur.connection) from None
                    raise
        raise AssertionError("unreachable")

    def _db_hint(self, action: str, alternative: str | None = None) -> str:
        """An ``agck db`` command for these very tables, quoted for a shell, to run as shown."""
        cmd = f"agck db {action} {shlex.quote(dsn_without_password(self._dsn))}"
        if self.prefix != "agck":
            cmd += f" --prefix {self.prefix}"
        if self.schema:
            cmd += f" --schema {self.schema}"
        text = f"run `{cmd}`" + (" with the password added" if self._secrets else "")
        return f"{text}, {alternative}" if alternative else text

    def _object_store(self, given: "str | ObjectChunks | None") -> "ObjectChunks | None":
        """The object store holding this catalog's chunks: the one it was bound to
        (``{prefix}_gc.objects``), or ``given``, bound to it now (:mod:`agck.stores.s3.chunks`)."""
        n = self.names
        (url,) = self._query(f"SELECT objects FROM {n.gc}")[0]
        if given is None:
            return ObjectChunks(url) if url is not None else None
        ext = given if isinstance(given, ObjectChunks) else ObjectChunks(given)

        def check_same(url: str) -> None:    # the bucket and prefix; the endpoint may be spelt otherwise
            if parse_url(url)[:2] != (ext.c.bucket, ext.c.prefix):
                raise UsageError(f"this catalog keeps its chunks at {url}, not at {ext.url}", ref=n.where,
                                 hint="open it with that agck_objects, or without one")

        def bind(cur):
            cur.execute(f"SELECT objects FROM {n.gc} FOR UPDATE")
            (url,) = cur.fetchone()
            if url is not None:       # bound meanwhile by another process
                return check_same(url)
            catalog = uuid.uuid4().hex
            ext.bind(catalog, n.where)
            cur.execute(f"UPDATE {n.gc} SET objects = %s, objects_id = %s", (ext.url, catalog))

        if url is None:
            self._transaction("BEGIN; " + XACT_LOCK, (n.schema_lock,), bind, "binding the object store failed",
                              n.where)
        else:
            check_same(url)
        return ext

    def _open_parts(self, create: bool) -> "PostgresStore | None":
        try:
            return PostgresStore(self._dsn, prefix=parts_prefix(self.prefix), schema=self.schema,
                                 chunk_size=self.chunk_size, init=create, connect_timeout=self._connect_timeout,
                                 pool=self.pool_size,
                                 objects=self._objects.child("parts") if self._objects is not None else None,
                                 key=self.sealer and encryption.Inherited(self.sealer), seal_meta=self.seal_meta, **self._policy())
        except SchemaUninitializedError:
            if create:
                raise
            return None

    def close(self) -> None:
        super().close()
        if self._objects is not None:
            self._objects.close()
        self._pool.close()
        self._aconns.close()

    # -- schema (its tables and steps: schema.py) ---------------------------------------------
    def schema_status(self) -> dict:
        """Where the schema stands: ``state`` is ``current``, ``uninitialized``,
        ``incomplete``, ``outdated`` (run migrate) or ``newer`` (a newer agck made it)."""
        with self._cursor() as cur:
            try:
                version, missing = pgschema.read_version(cur, self.names)
            except psycopg2.Error as e:
                raise self._db_error(e, "cannot read the schema version", self.names.where, conn=cur.connection) \
                    from None
        state = pgschema.state(version, missing, self.names)
        objects = None
        if state == "current":      # the bucket the catalog's chunks are bound to, if any (agck_objects)
            (objects,) = self._query(f"SELECT objects FROM {self.names.gc}")[0]
        return {"state": state, "version": version, "expected": SCHEMA_VERSION,
                "prefix": self.prefix, "schema": self.schema, "missing_tables": missing, "url": self.url,
                "pool": self.pool_size, "objects": objects}

    def _check_schema(self) -> None:
        pgschema.require_current(self.schema_status(), self.names, self._db_hint)

    def init_schema(self) -> dict:
        """Create the tables if missing (idempotent, safe to race: under an advisory lock);
        a complete schema is left alone (:func:`pgschema.create_tables`)."""
        n = self.names
        self._transaction("BEGIN; " + XACT_LOCK, (n.schema_lock,),
                          lambda cur: pgschema.create_tables(cur, n, self._db_hint),
                          "cannot create the schema", n.where)
        return self.schema_status()

    def migrate(self) -> list[int]:
        """Bring the schema to this agck's version; returns the versions applied.
        Runs in one transaction under the schema's advisory lock."""
        n = self.names
        return self._transaction("BEGIN; " + XACT_LOCK, (n.schema_lock,),
                                 lambda cur: pgschema.migrate(cur, n, self._db_hint), "migration failed", n.where)

    # -- refs ------------------------------------------------------------------------------
    def ref(self, run: str, step: int) -> str:
        return sql_row(self.names.manifest_ref, check_run(run), check_step(step))

    def _chunk_ref(self, run: str, step: int, idx: int) -> str:
        return sql_row(self.names.chunks_ref, run, step, idx)

    def _row_lock_key(self, run: str, step: int) -> str:
        return f"agck {self.names.label} {run} {step}"

    # -- writing ---------------------------------------------------------------------------
    def _write(self, puts: list[PreparedPut], epoch: int | None) -> None:
        with self._cursor() as cur:
            for attempt in range(PUT_RETRIES + 1):
                try:
                    self._put_once(cur, puts, epoch)
                    break
                except Refused as e:
                    if attempt == PUT_RETRIES:
                        raise self._refused_too_often(e, puts) from None
            last = puts[-1].plan
            self.last_put = last.chunks if last is not None else None
        for p in puts:
            if p.cache is not None:
                self._caches.give(p.run, p.cache)
        failpoints.hit("pg.after_commit")

    @staticmethod
    def _refused_too_often(e: Refused, puts: list[PreparedPut]) -> DurabilityError:
        return DurabilityError(f"the database refused the checkpoint {PUT_RETRIES + 1} times ({e.args[0]})",
                               ref=batch_ref(puts), hint="another writer or a garbage collection ran alongside; "
                                                     "put it again")

    def _put_once(self, cur, puts: list[PreparedPut], epoch: int | None = None) -> None:
        """One write transaction: each container of ``puts`` as chunk rows (a standalone
        checkpoint, or a listing after the objects its plan lacks) and its manifest row.
        Statements travel together where no answer is awaited in between: when every
        manifest row is known before the chunk rows (listings, small standalone
        containers) the COMMIT follows the COPY in one exchange, so a put of a small
        checkpoint is one round trip; a large standalone one takes two (BEGIN to COPY,
        then INSERT and COMMIT); a listing's objects take two more before.
        Raises Refused when the database refused it for a reason another attempt can get past."""
        n = self.names
        ref = batch_ref(puts)
        stream = None
        try:
            plans = [p.plan for p in puts if p.plan is not None]
            begin, args = self._begin_sql(puts)
            if plans:
                addresses = list(dict.fromkeys(a for plan in plans for a in plan.distinct))
                sized = damage.checks_size(self.verify_reused)
                # verify_reused "size" and "full": every address the put relies on is looked at (its
                # stored size), not only those this store object did not commit itself
                unknown = addresses if sized else [a for a in addresses if a not in self._known_objects]
                names = self._sealed.names(unknown) if self._sealed is not None else None
                asked = unknown if names is None else list(names)
                cur.execute(begin + "; " + XACT_LOCK_SHARED + "; SELECT (SELECT generation FROM "
                            f"{n.gc}), ARRAY(SELECT address FROM {n.objects} WHERE address = ANY(%s::bytea[]) "
                            "ORDER BY address), ARRAY(SELECT octet_length(data) FROM "
                            f"{n.objects} WHERE address = ANY(%s::bytea[]) ORDER BY address)",
                            (*args, n.store_lock, asked, asked if sized else []))
                generation, found, lengths = cur.fetchone()
                found = [bytes(a) for a in found]
                sizes = dict(zip(found, lengths)) if sized else {}
                if names is not None:     # rows keyed by name, sealed (48 bytes more)
                    sizes = self._sealed.sizes(sizes, names)
                    found = [names[a] for a in found]
                if self._objects is not None and sized:    # a row without data: the stored size is the object's
                    heads = self._object_sizes([a for a, k in sizes.items() if k is None])
                    lost = {a for a, k in heads.items() if k is None}    # the bucket lost it: sent again
                    sizes.update({a: k for a, k in heads.items() if k is not None})
                    for a in lost:
                        del sizes[a]
                    found = [a for a in found if a not in lost]
                found += self._still_known(cur, generation, [] if sized else addresses)
                if self.verify_reused != "none":
                    self._heal_reused(cur, plans, {a: sizes.get(a) for a in found}, found)
                self._put_objects(cur, plans, set(found))
                failpoints.hit("pg.after_objects")
                begin = ""
            insert = self._manifest_insert(len(puts))
            if epoch is None and self._is_small(puts):
                self._put_small(cur, puts, insert, begin, args)
                return
            stream = CopyIn([(p.run, p.step, p.parts(), p.total) for p in puts], self.chunk_size)
            copy = f"COPY {n.chunks} (run, step, idx, data) FROM STDIN (FORMAT binary)"
            if epoch is None and all(p.ready for p in puts):
                # every manifest row is known: one exchange from here, the COMMIT following the COPY
                values = [v for p in puts for v in p.manifest_row(nchunks_for(p.total, self.chunk_size))]
                failpoints.hit("pg.before_copy")
                failpoints.hit("pg.before_manifest")
                stream.last_point = "pg.before_commit"    # the COMMIT runs once the stream ends
                sql = cur.mogrify((begin + "; " if begin else "") + insert, [*(args if begin else ()), *values])
                try:
                    cur.copy_expert(_text(cur, sql) + "; " + copy + "; COMMIT", stream, size=COPY_IO_SIZE)
                except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
                    if stream.error is not None:
                        raise stream.error from None
                    if _commit_unknown(e, cur):
                        raise self._commit_failed(e, ref) from None
                    raise       # the server's verdict (a lock or statement timeout, disk full): rolled back
                if stream.error is not None:
                    raise stream.error
            else:
                failpoints.hit("pg.before_copy")
                if begin:    # nothing asked of the database yet: the transaction begins with the COPY
                    copy = _text(cur, cur.mogrify(begin, args)) + "; " + copy
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
                    if _commit_unknown(e, cur):
                        raise self._commit_failed(e, ref) from None
                    raise       # the server's verdict (a lock or statement timeout, disk full): rolled back
            self._committed_objects(plans)
        except BaseException as e:
            if stream is not None and stream.error is not None and isinstance(e, psycopg2.Error):
                e = stream.error   # the real cause behind psycopg2's "COPY cancelled"
            self._abort(cur)
            raise self._put_error(e, puts, cur.connection) from (e if isinstance(e, OSError) else None)
        finally:
            self._release_claims()      # the transaction has ended: a thread waiting for these objects looks again

    def _manifest_insert(self, rows: int) -> str:
        row = "(%s, %s, %s, %s, %s, %s, to_timestamp(%s), %s::jsonb, %s, %s)"
        return (f"INSERT INTO {self.names.manifest} (run, step, parent, size, checksum, nchunks, created_at, meta, "
                f"length, listing) VALUES " + ", ".join([row] * rows))

    @staticmethod
    def _is_small(puts: list[PreparedPut]) -> bool:
        """Whether ``puts`` are standalone containers written in one statement (:meth:`_put_small`)."""
        return all(p.plan is None and p.data is not None for p in puts) and sum(p.total for p in puts) <= SMALL_PUT_MAX

    def _put_error(self, e: BaseException, puts: list[PreparedPut], conn) -> BaseException:
        """What a put's transaction, rolled back by ``e``, raises: ``Refused`` where another
        attempt can get past it."""
        ref = batch_ref(puts)
        if isinstance(e, AgckError):
            return e.at(ref)
        if isinstance(e, psycopg2.errors.UniqueViolation):
            if not all(p.overwrite for p in puts):
                return self._exists(puts)
            # a put that does not replace takes no lock: one may commit the key between
            # this put's DELETE and INSERT; the next attempt deletes what it committed
            return Refused("another writer put the same step at the same time")
        if isinstance(e, (psycopg2.errors.ForeignKeyViolation, psycopg2.errors.DeadlockDetected)):
            return Refused(_scrub(str(e).strip(), self._secrets))
        if isinstance(e, psycopg2.Error):
            return self._db_error(e, "write failed", ref, DurabilityError, conn)
        if isinstance(e, OSError):
            return DurabilityError(f"write failed: {e.strerror or e}", ref=ref)
        return e

    def _scrubbed(self, e: BaseException) -> str:
        """An error's text without the URL's secrets."""
        return _scrub(str(e), self._secrets)

    def _commit_failed(self, e: psycopg2.Error, ref: str) -> DurabilityError:
        return DurabilityError(
            f"the connection failed during COMMIT: the checkpoint may or may not have been written "
            f"({_scrub(str(e), self._secrets)})", ref=ref,
            hint="check store.steps(run) once the server is reachable, and put it again if absent")

    def _put_small(self, cur, puts: list[PreparedPut], insert: str, begin: str, args: list) -> None:
        """Small standalone containers, written in one statement and one round trip: BEGIN,
        the locks and deletes, the manifest rows, the chunk rows (bytea parameters, not a
        COPY, which would take a second exchange) and COMMIT. A client killed at any of
        its fail points has sent nothing."""
        sql, params = self._small_put_sql(puts, insert, begin, args)
        try:
            cur.execute(sql, params)
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as e:
            if _commit_unknown(e, cur):
                raise self._commit_failed(e, batch_ref(puts)) from None
            raise       # the server's verdict (a lock or statement timeout, disk full): rolled back

    def _small_put_sql(self, puts: list[PreparedPut], insert: str | None = None, begin: str | None = None,
                       args: list | None = None) -> tuple[str, list]:
        """:meth:`_put_small`'s one statement and its parameters, its fail points hit."""
        if begin is None:
            begin, args = self._begin_sql(puts)
        rows, values = [], []
        for p in puts:
            data = memoryview(p.data).cast("B")
            for idx, at in enumerate(range(0, max(len(data), 1), self.chunk_size)):
                rows.append("(%s, %s, %s, %s)")
                values += [p.run, p.step, idx, data[at:at + self.chunk_size]]
        manifest = [v for p in puts for v in p.manifest_row(nchunks_for(p.total, self.chunk_size))]
        for point in ("pg.before_copy", "pg.mid_copy", "pg.before_manifest", "pg.before_commit"):
            failpoints.hit(point)
        return (f"{begin}; {insert or self._manifest_insert(len(puts))}; INSERT INTO {self.names.chunks} "
                f"(run, step, idx, data) VALUES {', '.join(rows)}; COMMIT", [*args, *manifest, *values])

    def _begin_sql(self, puts: list[PreparedPut]) -> tuple[str, list]:
        """The statements that open a put's durable transaction: the (run, step) locks of
        the entries it replaces, taken in one order by every writer (no deadlock between
        two put_many), then
        the rows of the entries it may replace deleted, chunks first. An entry not to
        be replaced is left alone: its rows, if any, collide with the new ones
        (UniqueViolation) and the transaction is rolled back."""
        n = self.names
        # only a put that replaces takes the (run, step) lock: it serialises its DELETE and
        # INSERT with other writers of the key; one that does not replace relies on the
        # manifest's primary key (a second INSERT of the key waits, then fails)
        locks = sorted({self._row_lock_key(p.run, p.step) for p in puts if p.overwrite})
        stmts, args = ["BEGIN", "SET LOCAL synchronous_commit = on"] + [XACT_LOCK] * len(locks), list(locks)
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
        return CheckpointExistsError.refused(p.ref, p.step)

    def _delete_sql(self, run: str, step: int) -> tuple[str, tuple]:
        """The statements that open a durable write transaction holding (run, step)'s
        lock and delete its rows, chunks first; they return a row if a checkpoint was
        there. A put's transaction takes the same lock (:meth:`_begin_sql`), so they serialise."""
        n = self.names
        return ("BEGIN; SET LOCAL synchronous_commit = on; " + XACT_LOCK + "; "
                f"DELETE FROM {n.chunks} WHERE run = %s AND step = %s; "
                f"DELETE FROM {n.manifest} WHERE run = %s AND step = %s RETURNING 1",
                (self._row_lock_key(run, step), run, step, run, step))

    # -- fencing: a row per run in <prefix>_epochs ---------------------------------
    def begin_epoch(self, run: str) -> int:
        check_run(run)
        n = self.names
        return self._transaction(
            f"BEGIN; SET LOCAL synchronous_commit = on; {pgschema.epochs_ddl(n)}; "
            f"INSERT INTO {n.epochs} AS e (run, epoch) VALUES (%s, 1) "
            "ON CONFLICT (run) DO UPDATE SET epoch = e.epoch + 1 RETURNING epoch", (run,),
            lambda cur: cur.fetchone()[0], f"cannot begin a new epoch of run {run!r}", n.where, DurabilityError,
            retry=(psycopg2.errors.UniqueViolation,), retries=1)   # two first begin_epochs may race to create the table

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

        def body(cur):
            if cur.fetchone() is None:
                raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref)
            if epoch is not None:
                self._check_epoch(cur, run, epoch, ref)

        self._transaction(*self._delete_sql(run, step), body, "delete failed", ref, DurabilityError)

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
        rows = self._transaction(f"BEGIN; DELETE FROM {n.chunks} c WHERE {where} RETURNING c.run, c.step", args,
                                 lambda cur: sorted(set(cur.fetchall())), "cleaning orphans failed", n.where,
                                 DurabilityError)
        return [sql_row(n.chunks_ref, r, s) for r, s in rows]


class PgKeySlots:
    """A Postgres store's key slots (FORMAT.md 18.6): rows of ``<prefix>_keys`` (id, the
    slot's JSON), made by the first slot; nothing secret in them."""

    def __init__(self, store: PostgresStore):
        self.store = weakref.proxy(store)     # no cycle: a store dropped without close() frees its connections

    def load(self) -> list[dict]:
        st, n = self.store, self.store.names
        if not st._query("SELECT to_regclass(%s) IS NOT NULL", (n.keys_ref,))[0][0]:
            return []
        return [encryption.parse_slot(text, i, f"{n.keys_ref}(id={i!r})")
                for i, text in st._query(f"SELECT id, slot FROM {n.keys} ORDER BY id")]

    def save(self, slot: dict) -> None:
        st, n = self.store, self.store.names

        def body(cur):
            cur.execute(f"CREATE TABLE IF NOT EXISTS {n.keys} (id text PRIMARY KEY, slot text NOT NULL); "
                        f"INSERT INTO {n.keys} (id, slot) VALUES (%s, %s) ON CONFLICT (id) DO NOTHING RETURNING id",
                        (slot["id"], encryption.slot_json(slot)))
            return cur.fetchone() is not None

        # two first slots may race to create the table: the loser's CREATE fails, and it tries again
        made = st._transaction("BEGIN; SET LOCAL synchronous_commit = on", None, body, "cannot write a key slot",
                               n.where, DurabilityError,
                               retry=(psycopg2.errors.UniqueViolation, psycopg2.errors.DuplicateTable,
                                      psycopg2.errors.DuplicateObject), retries=3, pause=0.01)
        if not made:
            raise CheckpointExistsError(f"key slot {slot['id']} exists", ref=n.keys_ref)

    def remove(self, slot_id: str, check) -> None:
        """In one transaction holding the table's lock from the check to the commit
        (FORMAT.md rule 18.12): two removals at once run one after the other."""
        st, n = self.store, self.store.names

        def body(cur):
            cur.execute(f"LOCK TABLE {n.keys} IN EXCLUSIVE MODE")
            cur.execute(f"SELECT id, slot FROM {n.keys} ORDER BY id")
            check([encryption.parse_slot(text, i, f"{n.keys_ref}(id={i!r})") for i, text in cur.fetchall()])
            cur.execute(f"DELETE FROM {n.keys} WHERE id = %s", (slot_id,))

        st._transaction("BEGIN; SET LOCAL synchronous_commit = on", None, body,
                        "cannot remove a key slot", n.where, DurabilityError)
