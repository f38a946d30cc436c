"""Chunks of content in object storage, for a SQL catalog that keeps everything else.

    <prefix>/agck-catalog                 which catalog's chunks these are (written once)
    <prefix>/chunks/<2 hex>/<62 hex>      one object per chunk, named by its BLAKE3 address
    <prefix>/quarantine/<64 hex>.<ns>     chunks found damaged (and ``.why`` beside each)

The key layout of chunks is the s3 store's (:func:`chunk_key`). A Postgres store
opened with ``?agck_objects=s3://bucket/prefix`` keeps its manifest, listings,
epochs and the row of every object in the database, and each object's bytes
here (its ``data`` is NULL): a put uploads the chunks the catalog lacks, then
commits their rows and its listing in one transaction. Nothing here decides
what is live; the catalog does, under its own lock (:mod:`agck.stores.postgres.objects`).

A prefix belongs to one catalog: :meth:`ObjectChunks.bind` writes its id into
``agck-catalog`` with a create-only PUT, and refuses a prefix that holds
another catalog's id or an s3 store (whose collector knows nothing of the
catalog's listings, and would delete its chunks).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from ...errors import UsageError
from .client import ObjectClient, ObjectExists

CATALOG_MARKER = "agck-catalog"
STORE_MARKER = "agck-store"       # an s3 store's (s3.MARKER)
REQUESTS = 16                     # requests in flight for one put or read


def chunk_key(address: bytes) -> str:
    h = address.hex()
    return f"chunks/{h[:2]}/{h[2:]}"


def address_of(key: str) -> bytes | None:
    """The address a chunk key names; None for any other key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "chunks" or len(parts[1]) != 2 or len(parts[2]) != 62:
        return None
    try:
        return bytes.fromhex(parts[1] + parts[2])
    except ValueError:
        return None


class ObjectChunks:
    """The chunks of one catalog under one bucket prefix. Safe to share between threads."""

    def __init__(self, url: str, client: ObjectClient | None = None):
        self.c = client or ObjectClient(url)
        self.url = self.c.url
        self._given = url
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def child(self, sub: str) -> "ObjectChunks":
        """The chunks of another catalog (multi-rank parts) under ``<prefix>/<sub>``."""
        c = self.c.child(sub)
        return ObjectChunks(c.url, client=c)

    def map(self, fn: Callable, items: Iterable) -> list:
        items = list(items)
        if len(items) <= 1:
            return [fn(i) for i in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(REQUESTS, thread_name_prefix="agck-objects")
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None

    # -- the catalog this prefix belongs to -------------------------------------------
    def bound_to(self) -> str | None:
        """The catalog id written here, None if none."""
        data = self.c.get(CATALOG_MARKER)
        if data is None:
            return None
        try:
            return str(json.loads(bytes(data))["catalog"])
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{self.c.ref(CATALOG_MARKER)} is not an agck catalog marker",
                             hint="point agck_objects at a prefix of its own") from None

    def bind(self, catalog: str, tables: str) -> None:
        """Claim this prefix for ``catalog`` (an id the database keeps); refuse one that
        holds another catalog's chunks or an s3 store."""
        if self.c.get(STORE_MARKER) is not None:
            raise UsageError(f"{self.url} holds an s3 store; its collector would delete the catalog's chunks",
                             hint="give agck_objects a prefix of its own (e.g. s3://bucket/catalog-objects)")
        try:
            self.c.put(CATALOG_MARKER, json.dumps({"catalog": catalog, "tables": tables}).encode(), create=True)
            return
        except ObjectExists:
            pass
        self.check_bound(catalog)

    def check_bound(self, catalog: str) -> None:
        """Refuse a prefix whose marker names another catalog (or none: never bound)."""
        found = self.bound_to()
        if found != catalog:
            raise UsageError(
                f"{self.url} holds the chunks of " + (f"another catalog (id {found})" if found else "no catalog"),
                hint="two catalogs sharing one prefix would delete each other's chunks: give each its own; "
                     f"a marker left by a catalog that no longer exists can be deleted ({self.c.ref(CATALOG_MARKER)})")

    # -- chunks -----------------------------------------------------------------------
    def sizes(self, addresses: list[bytes]) -> dict[bytes, int | None]:
        """Each chunk's stored size, None where absent (one HEAD each, in parallel)."""
        found = self.map(lambda a: self.c.head(chunk_key(a)), addresses)
        return {a: (h.size if h is not None else None) for a, h in zip(addresses, found)}

    def upload(self, items: list[tuple[bytes, memoryview]],
               encode: Callable[[bytes, memoryview], object] | None = None) -> None:
        """Store each (address, bytes), as ``encode(address, bytes)`` gives them to store
        (compressed, on the uploading threads); durable when this returns. A chunk
        already there is written again: the same chunk (and good bytes over a damaged copy)."""
        self.map(lambda item: self.c.put(chunk_key(item[0]), item[1] if encode is None else encode(*item)), items)

    def fetch(self, addresses: list[bytes]) -> dict[bytes, memoryview]:
        """The chunks found (address -> bytes); an absent one is left out."""
        addresses = list(dict.fromkeys(addresses))
        got = self.map(lambda a: self.c.get(chunk_key(a)), addresses)
        return {a: d for a, d in zip(addresses, got) if d is not None}

    def fetch_into(self, address: bytes, view: memoryview) -> int | None:
        return self.c.get_into(chunk_key(address), view)

    def delete(self, addresses: list[bytes]) -> None:
        self.map(lambda a: self.c.delete(chunk_key(a)), addresses)

    def stored(self) -> dict[bytes, int]:
        """Every chunk under the prefix: address -> size (a listing, 1,000 keys a request)."""
        out = {}
        for o in self.c.list("chunks/"):
            a = address_of(o.key)
            if a is not None:
                out[a] = o.size
        return out

    def set_aside(self, address: bytes, why: str) -> str | None:
        """Move a damaged chunk's bytes to quarantine/; the key it went to, None if absent."""
        data = self.c.get(chunk_key(address))
        if data is None:
            return None
        key = f"quarantine/{address.hex()}.{time.time_ns()}"
        self.c.put(key, data)
        self.c.put(key + ".why", why.encode())
        self.c.delete(chunk_key(address))
        return self.c.ref(key)
