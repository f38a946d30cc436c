"""Stores: where checkpoints live. ``open_store(url)`` picks the backend::

    ckpts/ or file:///abs/path        embedded default: a directory of .agck files
    sqlite:///relative/to.db          SQLite (WAL, synchronous=FULL), path relative to the
    sqlite:////abs/path/to.db         working directory; four slashes for an absolute path
    postgresql://user@host/db         Postgres (bytea chunks over binary COPY);
                                      ?agck_prefix=P&agck_schema=S pick the tables
    'host=h dbname=db ...'            Postgres, as a libpq key=value string (agck_prefix=P
                                      and agck_schema=S are taken here too)
    s3://bucket/prefix                an S3-compatible bucket (?endpoint=URL&region=R&profile=P;
                                      credentials from the environment, never the URL)

``create=False`` opens only an existing store (the file and SQLite stores
otherwise create a missing one; Postgres creates tables only with ``init=True``).
"""

from __future__ import annotations

import inspect
import os

from ..errors import DependencyError, StoreConnectionError, UsageError
from .base import CheckpointInfo, PutEntry, Store, check_run, check_step
from .dsn import dsn_secrets, dsn_without_password, is_kv_dsn, redact_dsn, split_agck_params

__all__ = ["open_store", "Store", "PutEntry", "CheckpointInfo", "check_run", "check_step", "redact_dsn",
           "dsn_secrets", "dsn_without_password", "is_kv_dsn", "split_agck_params"]

_KEY_ENV = ("AGCK_KEY", "AGCK_KEY_FILE")   # agck.stores.encryption's
_URL_HINT = ("use a directory path, sqlite:///relative.db, sqlite:////abs/path.db, postgresql://... or "
             "s3://bucket/prefix")


def open_store(url, *, create: bool = True, **options) -> Store:
    """Open a store by URL (or return ``url`` itself if it is already a Store).
    ``create=False``: a missing store is a StoreConnectionError, never created."""
    if isinstance(url, Store):
        return url
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise StoreConnectionError(f"not a store URL: {url!r}"[:200], hint=_URL_HINT)
    if "\x00" in url:
        raise StoreConnectionError(f"a store URL or path with a NUL character in it: {url!r}"[:200], hint=_URL_HINT)
    if url.startswith(("postgresql:", "postgres:")) or (not os.path.exists(url) and is_kv_dsn(url)):
        PostgresStore = postgres_store_class()
        url, own = split_agck_params(url)
        return _construct(PostgresStore, url, {**own, **options})
    if url.startswith("s3://"):
        from .s3.store import S3Store
        return _construct(S3Store, url, dict(options, create=create))
    if url.startswith("sqlite:"):
        from .sqlite.store import SqliteStore
        return _construct(SqliteStore, url, dict(options, create=create))
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url:
        raise StoreConnectionError(f"unknown store scheme {url.split('://')[0]!r}", hint=_URL_HINT)
    from .file.store import FileStore
    return _construct(FileStore, url, dict(options, create=create))


def _construct(cls, url: str, options: dict) -> Store:
    """``cls(url, **options)``; an option the store does not take is refused by name (it
    was Python's TypeError about ``__init__``)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]     # after self and the URL
    takes = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if "key" not in takes and (options.get("key") is not None or any(os.environ.get(v) for v in _KEY_ENV)):
        # a key that would be ignored is refused: the data would be written in the clear
        raise UsageError(f"{cls.__name__} does not encrypt yet: a key was given "
                         f"({'key=' if options.get('key') is not None else ' or '.join('$' + v for v in _KEY_ENV)})",
                         hint="unset the key for this store, or keep the checkpoints in an agck store that "
                              "encrypts (file, SQLite, Postgres, s3)")
    options = {k: v for k, v in options.items() if not (k == "key" and v is None and "key" not in takes)}
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise UsageError(f"{cls.__name__} takes no option {', '.join(map(repr, unknown))}",
                         hint=f"its options: {', '.join(takes)}")
    return cls(url, **options)


def postgres_store_class():
    """PostgresStore; a DependencyError when psycopg2 cannot be imported here."""
    try:
        from .postgres.store import PostgresStore
    except ImportError as e:
        raise DependencyError(f"Postgres stores need psycopg2, which cannot be imported here ({e})",
                              hint="pip install psycopg2-binary") from None
    return PostgresStore
