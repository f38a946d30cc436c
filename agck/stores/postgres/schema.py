"""The Postgres store's schema: table names, DDL, versions and migrations.

Tables (``prefix`` defaults to ``agck``, optionally inside Postgres ``schema``)::

    {prefix}_schema_version(version int)
    {prefix}_manifest(run, step, parent, size, checksum, nchunks, created_at, meta jsonb, length, listing)
                                                                   PRIMARY KEY(run, step)
    {prefix}_chunks(run, step, idx, data bytea STORAGE EXTERNAL)   PRIMARY KEY(run, step, idx)
    {prefix}_objects(address bytea, size, data bytea STORAGE EXTERNAL)       PRIMARY KEY(address)
                                               data NULL: the bytes are in the object store
    {prefix}_gc(generation bigint, objects text, objects_id text)   one row; objects: the
                                               object store holding the chunks (agck_objects), if any
    {prefix}_doomed(address bytea)             objects the collector is deleting from that store
    {prefix}_epochs(run, epoch bigint)         PRIMARY KEY(run); made by the first begin_epoch (fencing)
    {prefix}_quarantine(address, size, data, detected_at, reason)   objects found damaged, moved out
                                               of objects; made by the first one found
    {prefix}_log(run, seq, data bytea), {prefix}_log_heads(run, seq)   step journals (agck.journal):
                                               records per run in order; made by the first append
    {prefix}_parts_*                           the same tables again: the parts of multi-rank
                                               checkpoints (FORMAT.md section 13), made by the first one

:class:`Names` spells each table for SQL text and for messages. The functions
taking a cursor neither begin nor commit: :func:`create_tables` and
:func:`migrate` run in a transaction the store opened under the advisory lock
``Names.schema_lock`` (two processes never build or migrate one schema at
once). Connections and the mapping of database errors stay with the store.
A schema that is missing, partial, older or newer than :data:`SCHEMA_VERSION`
is reported with SchemaUninitializedError or SchemaMismatchError, whose hint
comes from the caller's ``db_hint(action)`` (the ``agck db`` command for these
very tables). Versions 1 to 3 are moved forward by :data:`MIGRATIONS`.
"""

from __future__ import annotations

from typing import Any, Callable

from psycopg2 import sql

from ...errors import SchemaMismatchError, SchemaUninitializedError

SCHEMA_VERSION = 4

# Advisory locks held to the end of the transaction, keyed by text: a (run, step),
# Names.store_lock (shared by puts, exclusive for the collector), Names.schema_lock.
XACT_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
XACT_LOCK_SHARED = "SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 0))"


class Names:
    """Table names: SQL text for statements, plain text for refs and messages."""

    def __init__(self, conn, prefix: str, schema: str | None, url: str | None = None):
        def ident(name):
            return (sql.Identifier(schema, name) if schema else sql.Identifier(name)).as_string(conn)

        self.prefix = prefix
        self.schema = schema
        self.label = f"{schema}.{prefix}" if schema else prefix     # in lock keys: never changes
        dot = f"{schema}." if schema else ""
        # where, in errors: the tables (and their database), never a bare prefix that reads as the CLI's "agck:"
        self.where = f"{url} (tables {dot}{prefix}_*)" if url else f"tables {dot}{prefix}_*"
        self.version = ident(f"{prefix}_schema_version")
        self.manifest = ident(f"{prefix}_manifest")
        self.chunks = ident(f"{prefix}_chunks")
        self.objects = ident(f"{prefix}_objects")
        self.refs = ident(f"{prefix}_refs")          # schema 2 only (migrate drops it)
        self.gc = ident(f"{prefix}_gc")
        self.epochs = ident(f"{prefix}_epochs")      # made by the first begin_epoch
        self.quarantine = ident(f"{prefix}_quarantine")   # made by the first damaged object found
        self.doomed = ident(f"{prefix}_doomed")
        self.log = ident(f"{prefix}_log")              # made by the first log_append (agck.journal)
        self.log_heads = ident(f"{prefix}_log_heads")
        self.log_ref = f"{dot}{prefix}_log"
        self.keys = ident(f"{prefix}_keys")            # made by the first key slot (an encrypted store)
        self.keys_ref = f"{dot}{prefix}_keys"
        self.meta_index = sql.Identifier(f"{prefix}_manifest_meta").as_string(conn)
        self.schema_sql = sql.Identifier(schema).as_string(conn) if schema else None
        self.version_ref = f"{dot}{prefix}_schema_version"
        self.manifest_ref = f"{dot}{prefix}_manifest"
        self.chunks_ref = f"{dot}{prefix}_chunks"
        self.objects_ref = f"{dot}{prefix}_objects"
        self.gc_ref = f"{dot}{prefix}_gc"
        self.quarantine_ref = f"{dot}{prefix}_quarantine"
        self.doomed_ref = f"{dot}{prefix}_doomed"
        self.tables = (self.version, self.manifest, self.chunks, self.objects, self.gc, self.doomed)
        self.table_refs = (self.version_ref, self.manifest_ref, self.chunks_ref, self.objects_ref, self.gc_ref,
                           self.doomed_ref)
        self.store_lock = f"agck objects {self.label}"   # shared by puts, exclusive for the collector
        self.schema_lock = f"agck schema {self.label}"   # held by init_schema and migrate


def epochs_ddl(n: Names) -> str:
    """The fencing table, made by the first begin_epoch (schema_status does not look for it)."""
    return f"CREATE TABLE IF NOT EXISTS {n.epochs} (run text PRIMARY KEY, epoch bigint NOT NULL)"


def log_ddl(n: Names) -> str:
    """The journal logs, made by the first log_append (schema_status does not look for them):
    a run's batches of records in order (``seq`` from 1), and per run the last ``seq`` given,
    whose row lock makes a run's appends commit one after another, in the order of their numbers."""
    return (f"CREATE TABLE IF NOT EXISTS {n.log} (run text COLLATE \"C\" NOT NULL, seq bigint NOT NULL, "
            f"data bytea NOT NULL, PRIMARY KEY (run, seq)); "
            f"CREATE TABLE IF NOT EXISTS {n.log_heads} (run text COLLATE \"C\" PRIMARY KEY, seq bigint NOT NULL)")


def quarantine_ddl(n: Names) -> str:
    """The table of damaged objects, made by the first one found (schema_status does not look for it)."""
    return (f"CREATE TABLE IF NOT EXISTS {n.quarantine} (address bytea NOT NULL, size bigint NOT NULL, "
            "data bytea, detected_at timestamptz NOT NULL DEFAULT now(), reason text NOT NULL)")


def read_version(cur, n: Names) -> tuple[int | None, list[str]]:
    """(version, missing tables). version None: no version table or no row."""
    cur.execute("SELECT " + ", ".join(["to_regclass(%s) IS NULL"] * len(n.tables)), n.tables)
    flags = cur.fetchone()
    missing = [t for t, gone in zip(n.table_refs, flags) if gone]
    if flags[0]:
        return None, missing
    cur.execute(f"SELECT max(version) FROM {n.version}")
    return cur.fetchone()[0], missing


def state(version: int | None, missing: list[str], n: Names) -> str:
    """``current``, ``uninitialized``, ``incomplete``, ``outdated`` (run migrate) or
    ``newer`` (a newer agck made it), from what :func:`read_version` found."""
    if version is None:
        return "incomplete" if len(missing) < len(n.tables) else "uninitialized"
    if version > SCHEMA_VERSION:
        return "newer"
    if version < SCHEMA_VERSION:
        return "outdated"
    return "incomplete" if missing else "current"


def require_current(status: dict, n: Names, db_hint: Callable[..., str]) -> None:
    """Refuse a schema a store cannot use as it stands (``status``: the store's schema_status())."""
    where = n.where
    if status["state"] == "current":
        return
    if status["state"] in ("uninitialized", "incomplete"):
        detail = "" if status["state"] == "uninitialized" else f" (missing {', '.join(status['missing_tables'])})"
        raise SchemaUninitializedError(f"no agck schema in this database{detail}",
                                       ref=where,
                                       hint=db_hint("init", "or open with init=True"))
    if status["state"] == "outdated":
        raise SchemaMismatchError(f"schema version {status['version']}, this agck uses {SCHEMA_VERSION}", ref=where,
                                  hint=db_hint("migrate"))
    raise SchemaMismatchError(f"schema version {status['version']} is newer than this agck's {SCHEMA_VERSION}",
                              ref=where, hint="upgrade agck to the version that created this schema")


def create_tables(cur, n: Names, db_hint: Callable[..., str]) -> None:
    """Create the tables if missing, under the schema lock.

    A schema that is already complete is left alone: its DDL (CREATE INDEX IF
    NOT EXISTS, ALTER ... SET STORAGE) would still take table locks, and those
    deadlock against another process's put in flight."""
    version, missing = read_version(cur, n)
    if version == SCHEMA_VERSION and not missing:
        return
    if version is not None and version != SCHEMA_VERSION:
        raise SchemaMismatchError(
            f"schema version {version} exists, this agck uses {SCHEMA_VERSION}", ref=n.where,
            hint=db_hint("migrate") if version < SCHEMA_VERSION
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


def migrate(cur, n: Names, db_hint: Callable[..., str]) -> list[int]:
    """Bring the schema to :data:`SCHEMA_VERSION` under the schema lock; returns the versions applied."""
    applied: list[int] = []
    version, missing = read_version(cur, n)
    if version is None:
        raise SchemaUninitializedError("no agck schema to migrate",
                                       ref=n.where, hint=db_hint("init"))
    if version > SCHEMA_VERSION:
        raise SchemaMismatchError(f"schema version {version} is newer than this agck's "
                                  f"{SCHEMA_VERSION}", ref=n.where,
                                  hint="upgrade agck; schemas are never migrated backwards")
    for v in range(version, SCHEMA_VERSION):
        step_fn = MIGRATIONS.get(v)
        if step_fn is None:
            raise SchemaMismatchError(f"no migration from schema version {v}", ref=n.where,
                                      hint="migrate with the agck version that knows it")
        step_fn(cur, n)
        applied.append(v + 1)
    if applied:
        cur.execute(f"DELETE FROM {n.version}; INSERT INTO {n.version} (version) VALUES (%s)",
                    (SCHEMA_VERSION,))
    return applied


# --- the steps between versions ----------------------------------------------------------

def _objects_ddl(n: "Names") -> str:
    """The objects table as schema version 2 made it (version 4 lets ``data`` be NULL)."""
    return f"""
        CREATE TABLE IF NOT EXISTS {n.objects} (
            address bytea NOT NULL CHECK (octet_length(address) = 32), size bigint NOT NULL,
            data bytea NOT NULL, PRIMARY KEY (address));
        ALTER TABLE {n.objects} ALTER COLUMN data SET STORAGE EXTERNAL;"""


def _create_shared_tables(cur, n: "Names") -> None:
    """The content shared between checkpoints (schema version 3, then 4)."""
    cur.execute(_objects_ddl(n) + f"""
        ALTER TABLE {n.manifest} ADD COLUMN IF NOT EXISTS listing boolean NOT NULL DEFAULT false;
        CREATE TABLE IF NOT EXISTS {n.gc} (generation bigint NOT NULL);
        INSERT INTO {n.gc} (generation) SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM {n.gc});""")
    _migrate_3_to_4(cur, n)


def _migrate_1_to_2(cur, n: "Names") -> None:
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


def _migrate_2_to_3(cur, n: "Names") -> None:
    """Listings are flagged on the manifest (``listing``), ``refs`` is dropped and
    ``gc`` counts collections: writers and the collector exclude each other with
    the store's advisory lock instead of a row per listed object per checkpoint."""
    cur.execute(f"""
        ALTER TABLE {n.manifest} ADD COLUMN IF NOT EXISTS listing boolean NOT NULL DEFAULT false;
        UPDATE {n.manifest} m SET listing = true
            WHERE EXISTS (SELECT 1 FROM {n.refs} r WHERE r.run = m.run AND r.step = m.step);
        DROP TABLE {n.refs};""")
    _create_shared_tables(cur, n)


def _migrate_3_to_4(cur, n: "Names") -> None:
    """Chunks in an object store (``agck_objects``): an object's ``data`` may be NULL
    (its bytes are in that store), ``gc`` names the store, and ``doomed`` holds what
    the collector is deleting from it. Stores without one are unchanged."""
    cur.execute(f"""
        ALTER TABLE {n.objects} ALTER COLUMN data DROP NOT NULL;
        ALTER TABLE {n.gc} ADD COLUMN IF NOT EXISTS objects text, ADD COLUMN IF NOT EXISTS objects_id text;
        CREATE TABLE IF NOT EXISTS {n.doomed} (address bytea PRIMARY KEY);
        ALTER TABLE IF EXISTS {n.quarantine} ALTER COLUMN data DROP NOT NULL;""")


# Steps from version N to N+1, each run inside the migrate() transaction: {N: fn(cursor, names)}.
MIGRATIONS: dict[int, Callable[[Any, "Names"], None]] = {1: _migrate_1_to_2, 2: _migrate_2_to_3,
                                                        3: _migrate_3_to_4}

