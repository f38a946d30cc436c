"""Stores: where checkpoints live. ``open_store(url)`` picks the backend.

    ckpts/ or file:///abs/path        embedded default: a directory of .agck files
    sqlite:///path/to.db              SQLite (WAL, synchronous=FULL)
    postgresql://user@host/db         Postgres (bytea chunks over binary COPY);
                                      ?agck_prefix=P&agck_schema=S pick the tables
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import StoreConnectionError
from .base import CheckpointInfo, Rejection, Store, check_run, check_step

__all__ = ["open_store", "Store", "CheckpointInfo", "Rejection", "check_run", "check_step"]


def open_store(url, **options) -> Store:
    """Open a store by URL (or return ``url`` itself if it is already a Store)."""
    if isinstance(url, Store):
        return url
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise StoreConnectionError(f"not a store URL: {url!r}",
                                   hint="use a directory path, sqlite:///file.db or postgresql://...")
    if url.startswith(("postgresql:", "postgres:")):
        from .postgres import PostgresStore
        url, own = _split_agck_params(url)
        return PostgresStore(url, **{**own, **options})
    if url.startswith("sqlite:"):
        from .sqlite import SqliteStore
        return SqliteStore(url, **options)
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url:
        raise StoreConnectionError(f"unknown store scheme in {url.split('://')[0]!r}",
                                   hint="use a directory path, file://, sqlite:/// or postgresql://")
    from .file import FileStore
    return FileStore(url, **options)


def _split_agck_params(url: str) -> tuple[str, dict]:
    """``?agck_prefix=p&agck_schema=s`` in a Postgres URL choose the tables (so the
    CLI can reach them); they are removed before the URL reaches libpq."""
    parts = urlsplit(url)
    keep, own = [], {}
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k in ("agck_prefix", "agck_schema"):
            own[k[len("agck_"):]] = v
        else:
            keep.append((k, v))
    if not own:
        return url, {}
    return urlunsplit(parts._replace(query=urlencode(keep))), own
