"""Shared fixtures: a store of every backend, and the Postgres server the tests use.

Postgres tests use ``AGCK_TEST_DSN`` (default ``postgresql://postgres@127.0.0.1:5432/test``)
and are skipped when it cannot be reached. Each test session works in its own
Postgres schema, dropped at the end; each test gets its own table prefix.
"""

from __future__ import annotations

import itertools
import os
import secrets

import pytest

try:  # the codec binds torch once the process has it; test modules read its dtype tables at import
    import torch  # noqa: F401
except ImportError:
    pass

PG_DSN_DEFAULT = "postgresql://postgres@127.0.0.1:5432/test"
# no test asks a cloud's instance metadata service for credentials: every request goes to loopback
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ.setdefault("AWS_ENDPOINT_URL", "http://127.0.0.1:9")     # an s3:// URL without an endpoint: loopback
# a new backend: here and in make_spec (see test_store_contract.py). "s3": SeaweedFS, a real
# object store started for the session; "s3-moto": moto's server, a second S3 implementation;
# "postgres-s3": a Postgres catalog whose chunks are in the SeaweedFS server (agck_objects)
BACKENDS = ("file", "sqlite", "postgres", "s3", "postgres-s3")
# AGCK_FULL=1 (scripts/full_suite) runs every combination of the multi-process matrices; CI runs
# each store once in each, the crash campaign's dist trials covering the rest on every store
FULL = os.environ.get("AGCK_FULL") == "1"


def ci_subset(combination: tuple, chosen: set) -> None:
    """Skip ``combination`` of a multi-process matrix unless it is ``chosen`` or AGCK_FULL=1."""
    if not FULL and combination not in chosen:
        pytest.skip("one of the full matrix's combinations: AGCK_FULL=1 (scripts/full_suite) runs it")
# the contract suite (test_store_contract.py) also runs on a second S3 implementation, so no
# SeaweedFS quirk becomes an assumption
CONTRACT_BACKENDS = BACKENDS + ("s3-moto",)
_prefixes = itertools.count()


@pytest.fixture(scope="session")
def pg_dsn() -> str:
    psycopg2 = pytest.importorskip("psycopg2")
    dsn = os.environ.get("AGCK_TEST_DSN", PG_DSN_DEFAULT)
    try:
        psycopg2.connect(dsn, connect_timeout=3).close()
    except psycopg2.Error as e:
        pytest.skip(f"Postgres not reachable at AGCK_TEST_DSN: {str(e).strip().splitlines()[0]}")
    return dsn


@pytest.fixture(scope="session")
def pg_schema(pg_dsn):
    """A schema private to this test session; everything in it is dropped at the end."""
    import psycopg2

    name = f"agck_test_{secrets.token_hex(4)}"
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    conn.cursor().execute(f"CREATE SCHEMA {name}")
    try:
        yield name
    finally:
        # A whole session's tables in one DROP SCHEMA take more locks than one transaction
        # may hold (max_locks_per_transaction): dropped 50 at a time first.
        cur = conn.cursor()
        cur.execute("SELECT quote_ident(tablename) FROM pg_tables WHERE schemaname = %s", (name,))
        tables = [t for (t,) in cur.fetchall()]
        for i in range(0, len(tables), 50):
            cur.execute("DROP TABLE IF EXISTS " + ", ".join(f"{name}.{t}" for t in tables[i:i + 50]) + " CASCADE")
        cur.execute(f"DROP SCHEMA {name} CASCADE")
        conn.close()


def _s3_server(kind: str):
    from crashtests import s3server

    if kind == "s3":
        why = s3server.seaweed_available()
        if why is not None:
            pytest.skip(f"no SeaweedFS: {why}")
        server = s3server.Seaweed()
    else:
        pytest.importorskip("moto", reason="moto not installed")
        server = s3server.Moto()
    os.environ.update({k: v for k, v in s3server.CREDENTIALS.items() if k not in os.environ})
    server.start()
    server.bucket("agck-test")
    return server


def _serve(kind: str):
    pytest.importorskip("obstore", reason="s3:// stores need obstore")
    server = _s3_server(kind)
    yield server
    server.close()


@pytest.fixture(scope="session")
def seaweed():
    """A SeaweedFS server private to this test session (``weed mini``), bucket ``agck-test``."""
    yield from _serve("s3")


@pytest.fixture(scope="session")
def moto_server():
    """moto's S3 server, private to this test session, bucket ``agck-test``."""
    yield from _serve("s3-moto")


def s3_url(server) -> str:
    """A fresh prefix in the session's bucket: a store of its own."""
    return server.url("agck-test", f"t{next(_prefixes)}-{secrets.token_hex(3)}")


def pg_prefix() -> str:
    return f"t{next(_prefixes)}_{secrets.token_hex(2)}"


def make_spec(kind: str, request, tmp_path) -> tuple[str, str, dict]:
    """(kind, url, options) for ``agck.stores.open_store``: picklable, so other processes can open it too."""
    if kind == "file":
        pytest.importorskip("agck.stores.file.store", reason="FileStore not available")
        return kind, str(tmp_path / "store"), {}
    if kind == "sqlite":
        return kind, f"sqlite:///{tmp_path}/store.db", {}
    if kind in ("s3", "s3-moto"):
        server = request.getfixturevalue("seaweed" if kind == "s3" else "moto_server")
        return kind, s3_url(server), {}
    dsn = request.getfixturevalue("pg_dsn")
    schema = request.getfixturevalue("pg_schema")
    opts = {"prefix": pg_prefix(), "schema": schema, "init": True}
    if kind == "postgres-s3":      # the catalog in Postgres, the chunks in an object store
        opts["objects"] = s3_url(request.getfixturevalue("seaweed"))
    return kind, dsn, opts


def worker_url(kind: str, request, tmp_path) -> str:
    """The URL another process opens the store by, alone (the store made once here)."""
    import agck
    _, url, opts = make_spec(kind, request, tmp_path)
    agck.open_store(url, **opts).close()
    if kind == "postgres":
        url += ("&" if "?" in url else "?") + f"agck_prefix={opts['prefix']}&agck_schema={opts['schema']}"
    return url


@pytest.fixture(params=BACKENDS)
def store_spec(request, tmp_path):
    return make_spec(request.param, request, tmp_path)


@pytest.fixture
def store(store_spec):
    from agck.stores import open_store

    _, url, opts = store_spec
    s = open_store(url, **opts)
    yield s
    s.close()


def open_spec(spec, **extra):
    """The store of ``make_spec``'s (kind, url, options), with ``extra`` options."""
    from agck.stores import open_store
    _, url, opts = spec
    return open_store(url, **{**opts, **extra})


def reopen_spec(spec, **extra):
    """Another store object on the store ``open_spec`` made (its tables not made again)."""
    from agck.stores import open_store
    _, url, opts = spec
    return open_store(url, **{**{k: v for k, v in opts.items() if k != "init"}, **extra})
