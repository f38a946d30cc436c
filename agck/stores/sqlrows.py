"""Containers as chunk rows in SQL tables: what the SQLite and Postgres stores share.

A put prepared before its transaction begins (:func:`prepare_put`: encoded,
split into chunks where the store is incremental), the chunk splitter (a
container streamed into rows of at most ``chunk_size``
bytes, hashed on the way), the manifest/chunk structure check run before any
payload is read, the whole-container checksum check, and row refs for messages.
The JSON form of ``meta`` (:mod:`.metajson`) and the text of Postgres DSNs
(:mod:`.dsn`) live in their own modules; their names are importable from here too.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Sequence

import xxhash

from .. import checkpoint, cipher, format, thresholds
from ..errors import AgckError, CorruptCheckpointError, DamagedChunkError, StoreError
from ..names import check_run, check_step
from . import content
from .base import PutEntry, Store, check_entries, check_identity
# Re-exported: these lived here before, and importers still name this module.
from .dsn import dsn_secrets, dsn_without_password, is_kv_dsn, redact_dsn, split_agck_params  # noqa: F401
from .metajson import meta_json_text, meta_to_json, utf8_ok  # noqa: F401

DEFAULT_CHUNK_SIZE = thresholds.SQL_CHUNK_ROW
# SQLite's default blob limit is 1e9 bytes; Postgres bytea's is 1 GiB
MAX_CHUNK_SIZE = 512 << 20        # not a threshold: the largest chunk_size accepted
_IDENT_RE = re.compile(r"[a-z_][a-z0-9_]{0,40}", re.ASCII)   # fullmatch: `$` also matches before a final newline


def check_identifier(value: Any, what: str) -> str:
    """Table prefixes and schema names go into SQL text, so only plain lowercase identifiers."""
    if not isinstance(value, str) or not _IDENT_RE.fullmatch(value):
        raise StoreError(f"invalid {what} {value!r}",
                         hint="use 1-41 characters of a-z, 0-9 and '_', not starting with a digit")
    return value


def parts_prefix(prefix: str) -> str:
    """The table prefix of a store's multi-rank parts: ``<prefix>_parts``, or for a
    prefix too long for that, its first 24 characters and a hash of the whole."""
    name = f"{prefix}_parts"
    if _IDENT_RE.fullmatch(name):
        return name
    return f"{prefix[:24]}_{hashlib.blake2b(prefix.encode(), digest_size=4).hexdigest()}_parts"


def check_chunk_size(chunk_size: Any) -> int:
    if type(chunk_size) is not int or not 1 <= chunk_size <= MAX_CHUNK_SIZE:
        raise StoreError(f"invalid chunk_size {chunk_size!r}",
                         hint=f"use an int between 1 and {MAX_CHUNK_SIZE} bytes")
    return chunk_size


def split_chunks(parts: Iterable, total: int, chunk_size: int, hasher=None) -> Iterator[tuple[int, int, memoryview]]:
    """Cut the container's buffers at chunk boundaries without copying.

    Yields ``(idx, chunk_len, piece)``: ``piece`` is a view lying wholly in chunk
    ``idx`` (of ``chunk_len`` bytes), in container order. Every part is fed to
    ``hasher`` on the way, when one is given."""
    idx, filled = 0, 0
    clen = min(chunk_size, total)
    done = 0
    for part in parts:
        mv = memoryview(part)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = mv.nbytes
        if not n:
            continue
        if done + n > total:
            raise AgckError(f"the container produced more than its announced {total} bytes")
        if hasher is not None:
            hasher.update(mv)
        done += n
        while mv.nbytes:
            take = min(clen - filled, mv.nbytes)
            yield idx, clen, mv[:take] if take < mv.nbytes else mv
            mv = mv[take:]
            filled += take
            if filled == clen:
                idx += 1
                filled = 0
                clen = min(chunk_size, total - idx * chunk_size)
    if done != total:
        raise AgckError(f"the container produced {done} bytes, not its announced {total}")


# A standalone container up to this size is assembled before its transaction begins:
# its footer (whose checksum the manifest row holds) is then known, so the manifest
# row can travel with the chunk rows instead of after them.
ASSEMBLED_MAX = thresholds.ASSEMBLED_MAX


@dataclass
class PreparedPut:
    """One checkpoint of a SQL write transaction, encoded (and split, when chunked)
    before the transaction begins: the database's locks are held only while bytes move."""

    run: str
    step: int
    parent: int | None
    meta_text: str | None              # None: meta sealed in the listing only (seal_meta)
    w: format.ContainerWriter
    plan: content.Plan | None           # None: a standalone container
    listing: bytes | None               # the chunk listing, when chunked
    ref: str
    overwrite: bool
    cache: content.WriteCache | None    # given back to the store once the put committed
    data: bytes | None = None           # a small standalone container, assembled

    def parts(self) -> Iterable:
        """The container the chunk rows hold: the checkpoint itself, or its listing."""
        if self.plan is not None:
            return [self.listing]
        return [self.data] if self.data is not None else checkpoint.stream(self.w)

    @property
    def ready(self) -> bool:
        """Whether :meth:`manifest_row` is known before the chunk rows are streamed."""
        return self.plan is not None or self.data is not None

    @property
    def total(self) -> int:
        return self.w.total_len if self.plan is None else len(self.listing)

    def manifest_row(self, nchunks: int) -> tuple:
        """(run, step, parent, size, checksum, nchunks, created_at, meta, length, listing)."""
        if self.plan is None:
            checksum, length = manifest_checksum(self.w.footer), self.total
        else:
            checksum, length = container_checksum(self.listing), self.plan.chunks.total
        return (self.run, self.step, self.parent, self.total, checksum, nchunks, self.w.header.created_at_ns / 1e9,
                self.meta_text, length, self.plan is not None)


def batch_ref(puts: list["PreparedPut"]) -> str:
    """Where a transaction of ``puts`` writes, for an error that concerns all of them
    (its BEGIN, its COMMIT): the one put's ref, or every put's (a put_many)."""
    if len(puts) == 1:
        return puts[0].ref
    refs = [p.ref for p in puts]
    shown = ", ".join(refs[:4]) + (f" and {len(refs) - 4} more" if len(refs) > 4 else "")
    return f"{len(refs)} checkpoints in one transaction ({shown})"


def prepare_put(store: "Store", run: str, step: int, state: Any, *, meta: Any, parent: int | None,
                overwrite: bool, expect_unchanged: Collection[int] = ()) -> PreparedPut:
    """Encode (run, step) for ``store`` and, if the store chunks it, split it."""
    check_run(run)
    step = check_step(step)
    if parent is not None:
        parent = check_step(parent, "parent")
    ref = store.ref(run, step)
    w, cache = store._encode(run, step, state, meta=meta, parent=parent, expect_unchanged=expect_unchanged, ref=ref)
    plan = listing = data = None
    if cache is not None:
        plan = content.plan_chunks(w, cache, expect_unchanged=expect_unchanged, ref=ref)
        listing = store._seal_listing(run, step, content.listing(w, plan.chunks, run=run, step=step, parent=parent,
                                                                 meta=meta, framed=store.compression.on))
    elif w.total_len <= ASSEMBLED_MAX:
        data = b"".join(w.parts())     # sets w.footer
        if len(data) != w.total_len:
            raise AgckError(f"the container produced {len(data)} bytes, not its announced {w.total_len}", ref=ref)
    meta_text = None if getattr(store, "seal_meta", False) and store.sealer is not None else meta_json_text(meta)
    return PreparedPut(run, step, parent, meta_text, w, plan, listing, ref, overwrite, cache, data)


class TransactionalPuts:
    """``put`` and ``put_many`` of a SQL store: each put encoded and split before the
    store's ``_write(puts, epoch)`` writes them in one transaction."""

    def put(self, run: str, step: int, state: Any, *, meta: Any = None, parent: int | None = None,
            overwrite: bool = True, expect_unchanged: Collection[int] = (), epoch: int | None = None) -> str:
        """Write a checkpoint in one transaction (see :meth:`Store.put`). The manifest's
        ``meta`` column is the JSON form of ``meta`` (:func:`meta_to_json`: bytes as
        ``{"$bytes": base64}``, non-string keys as strings); ``read().meta`` is always
        the exact value."""
        p = prepare_put(self, run, step, state, meta=meta, parent=parent, overwrite=overwrite,
                        expect_unchanged=expect_unchanged)   # splitting and hashing: before the transaction
        self._write([p], epoch)
        return p.ref

    def put_many(self, entries: Sequence[PutEntry]) -> list[str]:
        """Write several checkpoints in one transaction (see :meth:`Store.put_many`)."""
        puts = [prepare_put(self, e.run, e.step, e.state, meta=e.meta, parent=e.parent, overwrite=e.overwrite)
                for e in check_entries(entries)]
        if puts:
            self._write(puts, None)
        return [p.ref for p in puts]


def decode_read(store: "Store", buf, found: dict, addresses: list[bytes] | None, *, run: str, step: int, verify,
                map_location, ref: str, fetch_into=None, fetch_threads: int | None = None):
    """The checkpoint a SQL store read: its container ``buf`` and, for a listing, the
    objects found for ``addresses`` (or ``fetch_into``: :func:`content.decode`). Chunks
    found damaged or missing are quarantined before the error is raised."""
    if fetch_into is None:    # chunks copied into place, and decoded, on a few threads
        fetch_into = content.found_into(found)
    try:
        ck = content.decode(buf, content.fetcher(found, addresses or []), verify=verify, map_location=map_location,
                            ref=ref, fetch_into=fetch_into, fetch_threads=fetch_threads,
                            authenticated=store.sealer is not None)     # sealed chunks: opened, tags checked
    except DamagedChunkError as e:
        store._damage_found(e)
        raise
    check_identity(ck, run, step, ref)
    return ck


def nchunks_for(total: int, chunk_size: int) -> int:
    return max(1, -(-total // chunk_size))


def chunk_plan(size: Any, nchunks: Any, idxs: list, lengths: list, *,
               manifest_ref: str, chunk_ref: Callable[[int], str]) -> list[int]:
    """Check a manifest against its chunk rows before any payload is read; return
    the expected chunk lengths.

    Every chunk has the writer's chunk size but the last, which holds the rest;
    the chunk size itself is the most common length among the non-last chunks."""
    def corrupt(msg, ref):
        return CorruptCheckpointError(msg, ref=ref, section="chunks")

    if type(size) is not int or size <= 0 or type(nchunks) is not int or nchunks <= 0:
        raise corrupt(f"manifest row is invalid (size={size!r}, nchunks={nchunks!r})", manifest_ref)
    present = set(idxs)
    for i in range(nchunks):
        if i not in present:
            raise corrupt(f"missing chunk {i} (the manifest says {nchunks} chunks)", chunk_ref(i))
    extra = sorted(present - set(range(nchunks)))
    if extra:
        raise corrupt(f"unexpected chunk {extra[0]} (the manifest says {nchunks} chunks)", chunk_ref(extra[0]))
    by_idx = dict(zip(idxs, lengths))
    if nchunks == 1:
        expected = [size]
    else:
        counts: dict[int, int] = {}
        for i in range(nchunks - 1):
            counts[by_idx[i]] = counts.get(by_idx[i], 0) + 1
        c = max(counts, key=lambda k: (counts[k], k))
        last = size - (nchunks - 1) * c
        expected = [c] * (nchunks - 1) + [last]
        if c <= 0 or not 0 < last <= c:
            raise corrupt(f"chunk sizes do not add up to the manifest's {size} bytes "
                          f"({nchunks} chunks, chunk size {c})", manifest_ref)
    for i in range(nchunks):
        got = by_idx[i]
        if got is None:
            raise corrupt(f"chunk {i} is NULL", chunk_ref(i))
        if got != expected[i]:
            raise corrupt(f"chunk {i} is {got} bytes, expected {expected[i]}", chunk_ref(i))
    return expected


def manifest_checksum(footer: bytes) -> str:
    """The manifest's checksum: XXH3-64 (hex) of the container's footer.

    The footer holds the digest of every blob and of the header, whose own
    fields hold the metadata's digest, so this one value commits to every byte
    of the container; checking it costs no pass over the payload, and the
    container's verification (every blob against its digest) does the rest."""
    return xxhash.xxh3_64_hexdigest(footer)


def container_checksum(data) -> str:
    """The manifest checksum of a whole container held in memory (a chunk listing); of
    a sealed one (an encrypted store's, FORMAT.md 18.7), XXH3-64 of all its bytes."""
    if bytes(memoryview(data)[:4]) == cipher.MAGIC:
        return xxhash.xxh3_64_hexdigest(data)
    h = format.parse_header(data)
    return manifest_checksum(memoryview(data)[len(data) - h.footer_len:])


def batches(items: list, n: int) -> Iterator[list]:
    """``items`` in consecutive lists of at most ``n``."""
    for i in range(0, len(items), n):
        yield items[i:i + n]


def check_checksum(buf, stored: Any, ref: str, *, sealed: bool = False) -> None:
    """Does the container assembled from the chunks belong to this manifest row?
    ``sealed``: the store is encrypted, so the row holds a sealed listing (whatever its
    first bytes now say)."""
    if sealed:
        got = xxhash.xxh3_64_hexdigest(buf)
    else:
        h = format.parse_header(buf, ref=ref)
        got = manifest_checksum(memoryview(buf)[max(0, len(buf) - h.footer_len):])
    if got != stored:
        raise CorruptCheckpointError(f"checksum mismatch (manifest says {stored}, the container's footer "
                                     f"hashes to {got})", ref=ref, section="chunks")


def sql_row(table: str, run: str, step: int, idx: int | None = None) -> str:
    """The human-readable row ref. Run names are validated: they cannot hold quotes."""
    if idx is None:
        return f"{table}(run='{run}', step={step})"
    return f"{table}(run='{run}', step={step}, idx={idx})"
