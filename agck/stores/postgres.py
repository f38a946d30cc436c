"""Postgres store: checkpoints as bytea chunk rows streamed over binary COPY.

    postgresql://user@host:5432/db     (postgres:// too; postgresql:/// uses the libpq
                                        environment: PGHOST, PGUSER, PGPASSWORD, ...)

The tables (``{prefix}_manifest``, ``_chunks``, ``_objects``, ``_gc``, ...) are
listed in :mod:`agck.stores.pgschema`, which creates and migrates them; the
binary COPY streams are framed and parsed in :mod:`agck.stores.pgcopy`; the
shared objects, and how writers and the collector exclude each other (one
advisory lock per store), are :mod:`agck.stores.pgobjects`.

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

from .. import codec, failpoints
from ..checkpoint import Checkpoint
from ..errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                      DurabilityError, SchemaUninitializedError, StoreConnectionError, StoreError, UsageError)
from ..memory import new_buffer
from . import content, pgschema
from .base import MIN_CHUNKED, CheckpointInfo, Store, check_identity, check_last, check_run, check_step
from .dsn import dsn_secrets, dsn_without_password, redact_dsn
from .objchunks import REQUESTS, ObjectChunks
from .objclient import parse_url
from .pgcopy import COPY_IO_SIZE, CopyIn, CopyOut
from .pgasync import AsyncConnections, AsyncMethods
from .pglog import JournalLogs
from .pgobjects import Refused, SharedObjects
from .pgpool import DEFAULT_POOL_SIZE, DEFAULT_POOL_TIMEOUT, ConnectionPool
from .pgschema import SCHEMA_VERSION, XACT_LOCK, XACT_LOCK_SHARED, Names
from .sqlrows import (batch_ref, decode_read, DEFAULT_CHUNK_SIZE, PreparedPut, TransactionalPuts, check_chunk_size, check_checksum,
                      check_identifier, chunk_plan, nchunks_for, parts_prefix, sql_row)

# How often a put starts over when the database refused its objects (a collector
# deleted one it relies on, or a deadlock with a collector); then DurabilityError.
PUT_RETRIES = 1

SMALL_READ_MAX = 256 << 10   # a standalone container up to this size is read in one statement
SMALL_PUT_MAX = 256 << 10    # standalone containers up to this size in all are written in one statement
_LARGE = object()            # a read's first statement did not bring the container: stream it

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


def _commit_unknown(e: psycopg2.Error, cur) -> bool:
    """Whether a write ended without the server's verdict on it (the connection lost,
    no SQLSTATE), so its COMMIT may have happened. An error the server sent (a lock
    or statement timeout, a deadlock, a full disk) rolled the transaction back."""
    return e.pgcode is None or bool(cur.connection.closed)


# --- reading ---------------------------------------------------------------------------

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


# --- the store ------------------------------------------------------------------------

class PostgresStore(TransactionalPuts, SharedObjects, AsyncMethods, JournalLogs, Store):
    """Checkpoints in Postgres, through a pool of connections shared by the threads of a process.

    ``prefix`` names the tables, ``schema`` the Postgres schema holding them (the
    search path when None), ``chunk_size`` the bytes per chunk row (bytea holds at
    most 1 GiB), ``init=True`` creates a missing schema instead of refusing,
    ``check_schema=False`` opens without looking at the schema (``agck db``),
    ``incremental=False`` writes standalone containers instead of chunk listings,
    ``full_every=K`` one in every K puts of a run, ``min_chunked`` a container of fewer
    bytes (:meth:`Store._set_policy`). ``pool`` bounds the connections open at once
    (``agck_pool=N`` in the URL; :mod:`.pgpool`), ``pool_timeout`` how long an
    operation waits for one when all are busy."""

    def __init__(self, url: str, *, prefix: str = "agck", schema: str | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, init: bool = False, check_schema: bool = True,
                 connect_timeout: int = 10, incremental: bool = True,
                 full_every: int | None = None, min_chunked: int = MIN_CHUNKED,
                 verify_reused: str = content.DEFAULT_VERIFY_REUSED, objects: "str | ObjectChunks | None" = None,
                 pool: "int | str" = DEFAULT_POOL_SIZE, pool_timeout: float = DEFAULT_POOL_TIMEOUT):
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
        self._known_lock = threading.Lock()
        self._forget_objects()
        self._claims: dict[bytes, threading.Event] = {}    # objects a thread of this store object is sending
        self._claimed = threading.local()                   # this thread's claims (pgobjects)
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
            self._objects: ObjectChunks | None = None
            if init:
                self.init_schema()
            elif check_schema:
                self._check_schema()
            if init or check_schema:
                self._objects = self._object_store(objects)
        except BaseException:
            self._pool.close()     # refused (no schema, another bucket): its connection closed now, not at a GC
            raise

    # what the asyncio methods (pgasync.AsyncMethods) and the journal logs (pglog) share with the sync ones
    _put_retries = PUT_RETRIES
    _refused = Refused
    _large = _LARGE
    _commit_unknown = staticmethod(_commit_unknown)

    @property
    def where(self) -> str:
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

    def _read_retrying(self, attempt: Callable[[Any], T], error: Callable[[psycopg2.Error, Any], AgckError]) -> T:
        """``attempt(cur)`` on a pooled connection; a database error is raised as ``error(e, cur)``.
        A pooled connection can die while it idles (the server restarted, a standby was
        promoted): a read that finds its connection gone is made again, once, on a new one
        (reading twice changes nothing). Not inside a transaction this thread holds."""
        again = not self._pool.holding()
        while True:
            with self._cursor() as cur:
                try:
                    return attempt(cur)
                except psycopg2.Error as e:
                    if again and isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError)) \
                            and cur.connection.closed:
                        again = False
                        continue
                    raise error(e, cur) from None

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
        if isinstance(e, (psycopg2.OperationalError, psycopg2.InterfaceError)) and conn is not None and conn.closed:
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
        (``{prefix}_gc.objects``), or ``given``, bound to it now (:mod:`.objchunks`)."""
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
                                 **self._policy())
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

    # -- schema (its tables and steps: pgschema) ---------------------------------------------
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
                sized = content.checks_size(self.verify_reused)
                # verify_reused "size" and "full": every address the put relies on is looked at (its
                # stored size), not only those this store object did not commit itself
                unknown = addresses if sized else [a for a in addresses if a not in self._known_objects]
                cur.execute(begin + "; " + XACT_LOCK_SHARED + "; SELECT (SELECT generation FROM "
                            f"{n.gc}), ARRAY(SELECT address FROM {n.objects} WHERE address = ANY(%s::bytea[]) "
                            "ORDER BY address), ARRAY(SELECT octet_length(data) FROM "
                            f"{n.objects} WHERE address = ANY(%s::bytea[]) ORDER BY address)",
                            (*args, n.store_lock, unknown, unknown if sized else []))
                generation, found, lengths = cur.fetchone()
                found = [bytes(a) for a in found]
                sizes = dict(zip(found, lengths)) if sized else {}
                if self._objects is not None and sized:    # a row without data: the stored size is the object's
                    heads = self._objects.sizes([a for a, k in sizes.items() if k is None])
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

    # -- reading -----------------------------------------------------------------------------
    def _query(self, query: str, args=()) -> list:
        def attempt(cur):
            cur.execute(query, args)
            return cur.fetchall()
        return self._read_retrying(attempt, lambda e, cur: self._db_error(e, "query failed", self.names.where,
                                                                          conn=cur.connection))

    def runs(self) -> list[str]:
        return [r for (r,) in self._query(f"SELECT DISTINCT run FROM {self.names.manifest} ORDER BY run")]

    def steps(self, run: str, *, last: int | None = None) -> list[int]:
        return [s for (s,) in reversed(self._query(*self._steps_sql(check_run(run), check_last(last))))]

    def _steps_sql(self, run: str, last: int | None) -> tuple[str, tuple]:
        return (f"SELECT step FROM {self.names.manifest} WHERE run = %s ORDER BY step DESC LIMIT %s",   # NULL: all
                (run, last))

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
        return self._read(check_run(run), step, verify=verify, map_location=map_location)

    def read_newest(self, run: str, *, verify: bool = True, map_location=None) -> Checkpoint | None:
        """The newest step's checkpoint (see :meth:`Store.read_newest`): a small one in one
        statement, its step found by the same index scan that reads it."""
        check_run(run)
        for tries in range(8):
            try:
                return self._read(run, None, verify=verify, map_location=map_location)
            except CheckpointNotFoundError:    # a large one, deleted between its two statements
                if tries == 7:
                    raise
        return None

    def _read(self, run: str, step: int | None, *, verify, map_location) -> Checkpoint | None:
        """(run, step), or with ``step=None`` the run's newest step (None if it has none)."""
        map_location = codec.check_map_location(map_location)
        sql, params = self._read_sql(run, step)

        def attempt(cur):
            cur.execute(sql, params)
            return cur.fetchone()

        def error(e, cur):
            self._abort(cur)
            return self._read_error(e, run, step, cur.connection)
        row = self._read_retrying(attempt, error)
        got = self._read_row(row, run, step, verify, map_location)
        return self._read_streamed(run, row[0], verify, map_location) if got is _LARGE else got

    def _read_sql(self, run: str, step: int | None) -> tuple[str, tuple]:
        """The statement that reads (run, step), or the run's newest step: a small
        standalone container comes with its manifest row, in one statement (one
        snapshot, no transaction to end): one round trip. Anything else, or a listing
        found there, is read by :meth:`_read_streamed`."""
        return (self._layout_sql(", c.data", ", string_agg(data, ''::bytea ORDER BY idx) FILTER "
                                             "(WHERE m.size <= %s AND m.listing IS NOT TRUE) AS data")
                + ("WHERE m.run = %s AND m.step = %s" if step is not None
                   else "WHERE m.run = %s ORDER BY m.step DESC LIMIT 1"),
                (SMALL_READ_MAX, run) + ((step,) if step is not None else ()))

    def _layout_sql(self, data: str = "", agg: str = "") -> str:
        n = self.names
        return (f"SELECT m.step, m.size, m.checksum, m.nchunks, c.idxs, c.lens{data} FROM {n.manifest} m "
                f"LEFT JOIN LATERAL (SELECT array_agg(idx ORDER BY idx) AS idxs, "
                f"array_agg(octet_length(data) ORDER BY idx) AS lens{agg} FROM {n.chunks} "
                f"WHERE run = m.run AND step = m.step) c ON true ")

    def _read_error(self, e: psycopg2.Error, run: str, step: int | None, conn) -> AgckError:
        return self._db_error(e, "read failed", self.ref(run, step) if step is not None else self.names.where,
                              conn=conn)

    def _read_row(self, row, run: str, step: int | None, verify, map_location) -> "Checkpoint | None | object":
        """The checkpoint :meth:`_read_sql`'s row holds; None when the run has no step
        (``step=None``); ``_LARGE`` when it must be read by :meth:`_read_streamed`."""
        if row is None:
            if step is None:
                return None
            raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=self.ref(run, step),
                                          hint=f"store.steps({run!r}) lists the steps")
        step, size, checksum, nchunks, idxs, lens, data = row
        ref = self.ref(run, step)
        chunk_plan(size, nchunks, idxs or [], lens or [], manifest_ref=ref,
                   chunk_ref=lambda i: self._chunk_ref(run, step, i))
        if data is None:
            return _LARGE
        if len(data) != size:   # chunk_plan has checked each row's length in this snapshot
            raise CorruptCheckpointError(f"the chunks hold {len(data)} bytes, not the manifest's {size}",
                                         ref=ref, section="chunks")
        buf = new_buffer(size)
        memoryview(buf).cast("B")[:] = memoryview(data).cast("B")
        check_checksum(buf, checksum, ref)
        if content.listed_addresses(buf, verify=verify, ref=ref) is not None:
            return _LARGE
        ck = content.decode(buf, content.fetcher({}, []), verify=verify, map_location=map_location, ref=ref)
        check_identity(ck, run, step, ref)
        return ck

    def _read_streamed(self, run: str, step: int, verify, map_location) -> Checkpoint:
        """(run, step) in one transaction: its manifest row, its chunks streamed by a COPY
        and, for a listing, the objects it names."""
        n = self.names
        ref = self.ref(run, step)
        chunk_ref = lambda i: self._chunk_ref(run, step, i)  # noqa: E731

        def streamed(cur):
            row = cur.fetchone()
            if row is None:
                raise CheckpointNotFoundError(f"no checkpoint at step {step}", ref=ref,
                                              hint=f"store.steps({run!r}) lists the steps")
            _, size, checksum, nchunks, idxs, lens = row
            expected = chunk_plan(size, nchunks, idxs or [], lens or [], manifest_ref=ref, chunk_ref=chunk_ref)
            # Populate the buffer's pages on another core while the server starts the COPY.
            pending = _Background(new_buffer, size)
            sink = CopyOut(pending.result, expected, chunk_ref)
            query = cur.mogrify(f"COPY (SELECT data FROM {n.chunks} WHERE run = %s AND step = %s ORDER BY idx) "
                                f"TO STDOUT (FORMAT binary)", (run, step)).decode("utf-8")
            cur.copy_expert(query, sink, size=COPY_IO_SIZE)
            sink.finish()
            buf = pending.result()
            check_checksum(buf, checksum, ref)
            addresses = content.listed_addresses(buf, verify=verify, ref=ref)
            return buf, addresses, self._read_objects(cur, addresses, external=False) if addresses is not None else {}

        # One snapshot for the manifest, the chunk layout, the data and the objects held in the
        # database; objects in an object store are read after, each straight into its place.
        buf, addresses, found = self._transaction(
            "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; " + self._layout_sql()
            + "WHERE m.run = %s AND m.step = %s", (run, step),
            streamed, "read failed", ref)
        outside = {} if self._objects is None or addresses is None else \
            {"fetch_into": self._fetch_into(found), "fetch_threads": REQUESTS}
        return decode_read(self, buf, found, addresses, run=run, step=step, verify=verify,
                           map_location=map_location, ref=ref, **outside)

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
