"""The Postgres store, and the catalog over a bucket: bytea chunk rows over binary COPY.

    store.py     PostgresStore: connecting, the writes, the commits, the collector
    reads.py     its reads: listings, checkpoints, one snapshot per read
    aio.py       its asyncio methods, on psycopg2's asynchronous connections
    copy.py      the binary COPY streams, framed and parsed
    objects.py   the shared chunks table, and how writers and the collector exclude each other
    log.py       the journal and AppendLog tables
    schema.py    the tables' names, creation and migration
    pool.py      the connection pool shared by the store's threads

``PostgresStore`` is importable from here; the modules (and psycopg2) load when first used.
"""


def __getattr__(name: str):
    if name == "PostgresStore":
        from .store import PostgresStore
        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
