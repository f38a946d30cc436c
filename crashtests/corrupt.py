"""Storage corruption injectors: damage one stored checkpoint the way disks and people do.

Each injector changes the stored bytes of exactly one (run, step) and returns a
short label of what it did (the "crash point" of a corruption trial). It never
returns without changing something: a change that happens to leave the bytes
as they were (zeroing zeros) is re-drawn.

File store: bit flips (aimed at the header, metadata, payload or footer),
truncation, zeroed ranges, trailing garbage, and a container from another run
or step copied in. SQL stores: the same on the chunk rows, plus deleted chunk
rows and a whole (manifest, chunks) pair from another run or step swapped in.
With ``fix`` the manifest's size, chunk count and checksum are recomputed over
the damaged bytes, so that only the container's own checks can catch it.

Fault kind ``corrupt`` of the campaign (:func:`trials`): per store, a trial puts
the first three checkpoint steps of the pipeline (in-process) under its own run,
damages one or more of them (the newest most often; sometimes an older one only,
or all) and recovers: every damaged step must be rejected, and recovery must walk
back to the newest intact one, bit-identical to the reference (``expected``).
SQL stores are used with their default chunk size and with 64 KiB chunks (a
container over several rows). A trial not started before the time limit is
skipped; a harness failure is an error on its trial.
"""

from __future__ import annotations

import os
import random
import struct

import xxhash

from . import checker
from .checker import Trial
from .trialkit import TrialKit, log


class Unchanged(RuntimeError):
    """The chosen damage would leave the stored bytes as they were."""


FILE_KINDS = ("bitflip", "truncate", "zero", "garbage", "swap_step", "swap_run")
SQL_KINDS = ("bitflip", "truncate", "zero", "garbage", "delete_chunk", "swap_step", "swap_run")


def region(buf: bytes, off: int) -> str:
    """Which part of a container the byte at ``off`` belongs to (FORMAT.md section 1)."""
    if off < 64 or len(buf) < 64:
        return "header"
    try:
        _, _, _, _, _, payload_offset, payload_len = struct.unpack_from("<4sHHIIQQ", buf, 0)[:7]
    except struct.error:
        return "header"
    if off < payload_offset:
        return "metadata"
    if off < payload_offset + payload_len:
        return "payload"
    return "footer"


def _aimed_offset(buf: bytes, rng: random.Random) -> int:
    """Half uniform, half aimed at the small regions a uniform draw would rarely hit."""
    n = len(buf)
    r = rng.random()
    if r < 0.5 or n < 200:
        return rng.randrange(n)
    if r < 0.65:
        return rng.randrange(min(64, n))
    if r < 0.8:
        try:
            po = struct.unpack_from("<Q", buf, 24)[0]
            if 64 < po <= n:
                return rng.randrange(64, po)
        except struct.error:
            pass
        return rng.randrange(n)
    return rng.randrange(max(0, n - 64), n)


def mutate(buf: bytes, kind: str, rng: random.Random) -> tuple[bytes, str]:
    """Damage a whole container's bytes; (new bytes, label)."""
    n = len(buf)
    for _ in range(20):
        if kind == "bitflip":
            off = _aimed_offset(buf, rng)
            out = bytearray(buf)
            out[off] ^= 1 << rng.randrange(8)
            label = f"bitflip:{region(buf, off)}"
        elif kind == "truncate":
            cut = rng.choice([0, rng.randrange(64), rng.randrange(n), n - rng.randint(1, min(64, n))])
            out = bytearray(buf[:cut])
            label = f"truncate:{region(buf, cut) if cut < n else 'footer'}"
        elif kind == "zero":
            off = _aimed_offset(buf, rng)
            ln = rng.choice([1, 8, 64, 512, 4096, rng.randint(1, n)])
            out = bytearray(buf)
            out[off:off + ln] = bytes(len(out[off:off + ln]))
            label = f"zero:{region(buf, off)}"
        elif kind == "garbage":
            out = bytearray(buf) + rng.randbytes(rng.randint(1, 4096))
            label = "garbage:tail"
        else:
            raise ValueError(kind)
        if bytes(out) != buf:
            return bytes(out), label
    raise RuntimeError(f"could not damage the container with {kind}")


# --- file store --------------------------------------------------------------------

def corrupt_file(store, run: str, step: int, kind: str, rng: random.Random, *, donor_run: str | None = None,
                 donor_step: int | None = None) -> str:
    path = store.path(run, step)
    with open(path, "rb") as f:
        buf = f.read()
    if kind in ("swap_step", "swap_run"):
        src = store.path(donor_run if kind == "swap_run" else run, donor_step if donor_step is not None else step)
        with open(src, "rb") as f:
            new = f.read()
        label = kind
    else:
        new, label = mutate(buf, kind, rng)
    if new == buf:
        raise Unchanged(f"{kind} would leave {path} unchanged")
    with open(path, "wb") as f:
        f.write(new)
    return label


# --- SQL stores ------------------------------------------------------------------------

class _SqlAccess:
    """Raw row access to a SQL store's tables, behind the store's back."""

    def __init__(self, store):
        self.store = store
        if type(store).__name__ == "SqliteStore":
            import sqlite3
            self.kind = "sqlite"
            self.conn = sqlite3.connect(store.path, timeout=30, isolation_level=None)
            self.manifest, self.chunks, self.ph = store._t_manifest, store._t_chunks, "?"
        else:
            import psycopg2
            self.kind = "postgres"
            self.conn = psycopg2.connect(store._dsn)
            self.manifest, self.chunks, self.ph = store.names.manifest, store.names.chunks, "%s"

    def q(self, sql: str, args=()) -> list:
        cur = self.conn.cursor()
        cur.execute(sql.replace("?", self.ph), args)
        try:
            return cur.fetchall()
        except Exception:
            return []

    def begin(self):
        if self.kind == "sqlite":
            self.conn.execute("BEGIN IMMEDIATE")

    def commit(self):
        if self.kind == "sqlite":
            self.conn.execute("COMMIT")
        else:
            self.conn.commit()

    def close(self):
        self.conn.close()

    def rows(self, run: str, step: int) -> tuple[tuple, list[tuple[int, bytes]]]:
        man = self.q(f"SELECT size, checksum, nchunks FROM {self.manifest} WHERE run = ? AND step = ?", (run, step))
        chunks = self.q(f"SELECT idx, data FROM {self.chunks} WHERE run = ? AND step = ? ORDER BY idx", (run, step))
        return man[0], [(i, bytes(d)) for i, d in chunks]

    def write(self, run: str, step: int, chunks: list[tuple[int, bytes]], manifest: tuple | None) -> None:
        blob = (lambda b: b) if self.kind == "sqlite" else __import__("psycopg2").Binary
        self.begin()
        self.q(f"DELETE FROM {self.chunks} WHERE run = ? AND step = ?", (run, step))
        for idx, data in chunks:
            self.q(f"INSERT INTO {self.chunks} (run, step, idx, data) VALUES (?, ?, ?, ?)",
                   (run, step, idx, blob(data)))
        if manifest is not None:
            size, checksum, nchunks = manifest
            self.q(f"UPDATE {self.manifest} SET size = ?, checksum = ?, nchunks = ? WHERE run = ? AND step = ?",
                   (size, checksum, nchunks, run, step))
        self.commit()


def corrupt_sql(store, run: str, step: int, kind: str, rng: random.Random, *, donor_run: str | None = None,
                donor_step: int | None = None, fix: bool | None = None) -> str:
    db = _SqlAccess(store)
    try:
        (size, checksum, nchunks), chunks = db.rows(run, step)
        whole = b"".join(d for _, d in chunks)
        fix = rng.random() < 0.5 if fix is None else fix
        if kind in ("swap_step", "swap_run"):
            src = (donor_run if kind == "swap_run" else run, donor_step if donor_step is not None else step)
            man, new_chunks = db.rows(*src)
            if new_chunks == chunks:
                raise Unchanged(f"{kind} would leave ({run}, {step}) unchanged")
            db.write(run, step, new_chunks, man)      # a consistent pair: only the identity check can tell
            return kind
        if kind == "delete_chunk":
            j = rng.randrange(len(chunks))
            new_chunks = [c for c in chunks if c[0] != j]
            label = f"delete_chunk:{'only' if len(chunks) == 1 else ('last' if j == len(chunks) - 1 else 'mid')}"
            if fix:
                new_chunks = [(i, d) for i, (_, d) in enumerate(new_chunks)]
        else:
            # damage the container's bytes, then cut them back into the original chunk boundaries
            new, label = mutate(whole, kind, rng)
            bounds, pos = [], 0
            for _, d in chunks:
                bounds.append((pos, pos + len(d)))
                pos += len(d)
            new_chunks = []
            for i, (a, b) in enumerate(bounds):
                piece = new[a:b] if i < len(bounds) - 1 else new[a:]
                if piece or i == 0:
                    new_chunks.append((i, piece))
        manifest = None
        if fix:
            data = b"".join(d for _, d in new_chunks)
            manifest = (len(data), _manifest_checksum(data), len(new_chunks))
        db.write(run, step, new_chunks, manifest)
        return label + ("+fix" if fix else "")
    finally:
        db.close()


def _manifest_checksum(data: bytes) -> str:
    """The checksum the store would record for ``data``, so that a "fixed" manifest agrees with it."""
    try:
        from agck.stores.sqlrows import manifest_checksum   # XXH3-64 of the container's footer
    except ImportError:
        return xxhash.xxh3_64_hexdigest(data)
    try:
        footer_len = 8 * struct.unpack_from("<I", data, 12)[0] + 32
    except struct.error:
        footer_len = len(data)
    return manifest_checksum(data[max(0, len(data) - footer_len):])


# --- object store ----------------------------------------------------------------------

def corrupt_s3(store, run: str, step: int, kind: str, rng: random.Random, *, donor_run: str | None = None,
               donor_step: int | None = None, fix: bool | None = None) -> str:
    """Damage the stored container of (run, step): its data object, or the bytes that
    follow the record holding it inline. ``fix``: also rewrite the record's size and
    XXH3-64 (and its own checksum) to match the damage, as a tamperer who knows the
    format would, so that only the container's own checksums can tell."""
    from agck.stores.s3 import log as s3log
    fix = rng.random() < 0.5 if fix is None else fix

    def stored(r, k):
        e = store._state(r).steps[k]
        if e.key is not None:
            return e, bytes(store.c.get(e.key))
        return e, bytes(s3log.record_inline(store.c.get(store._log_key(r, e.seq)), ""))

    e, buf = stored(run, step)
    if kind in ("swap_step", "swap_run"):
        _, new = stored(donor_run if kind == "swap_run" else run, donor_step if donor_step is not None else step)
        label, fix = kind, True      # a consistent record: only the identity check can tell
    else:
        new, label = mutate(buf, kind, rng)
    if new == buf:
        raise Unchanged(f"{kind} would leave ({run}, {step}) unchanged")
    log_key = store._log_key(run, e.seq)
    record = s3log.decode_record(store.c.get(log_key), log_key)
    record.pop("inline", None)
    if fix:
        record.update(size=len(new), xxh3=xxhash.xxh3_64_intdigest(new))
    if e.key is not None:
        store.c.put(e.key, new)
        if fix:
            store.c.put(log_key, s3log.encode_record(record))
    else:
        store.c.put(log_key, s3log.encode_record(record, new) if new else s3log.encode_record(record))
    return label + ("+fix" if fix and kind not in ("swap_step", "swap_run") else "")


def corrupt(store, run: str, step: int, kind: str, rng: random.Random, **kw) -> str:
    if type(store).__name__ == "S3Store":
        return corrupt_s3(store, run, step, kind, rng, **kw)
    if type(store).__name__ == "FileStore":
        kw.pop("fix", None)
        return corrupt_file(store, run, step, kind, rng, **kw)
    return corrupt_sql(store, run, step, kind, rng, **kw)


def kinds_for(store) -> tuple[str, ...]:
    return FILE_KINDS if type(store).__name__ in ("FileStore", "S3Store") else SQL_KINDS


# --- the campaign's trials -----------------------------------------------------------------

def trials(c: TrialKit) -> None:
    from agck.stores.file.store import FileStore
    from agck.stores.sqlite.store import SqliteStore
    cfg = c.cfg
    if not c.starts("corrupt"):
        return
    trees = c.trees()
    steps = sorted(trees)[:3]
    opened = []
    targets = {}
    for s in cfg.stores:
        if s == "file":
            url = os.path.join(c.work, "corrupt-file")
            stores = [FileStore(url)]
        elif s == "sqlite":
            url = f"sqlite:///{c.work}/corrupt.db"
            stores = [SqliteStore(url), SqliteStore(url, chunk_size=65536)]
        elif s == "s3":
            from agck.stores.s3.store import S3Store
            url = c.s3_url("corrupt")
            stores = [S3Store(url)]
        elif s == "pgs3":      # the listings are rows as on Postgres; the chunks are in the object store
            from agck.stores import open_store
            url = c.catalog_url("corrupt", "catcorrupt", "corrupt-catalog")
            stores = [open_store(url, init=True)]
        else:
            from agck.stores.postgres.store import PostgresStore
            url = c.cluster.dsn("corrupt")
            stores = [PostgresStore(url), PostgresStore(url, chunk_size=65536)]
        opened += stores
        targets[s] = (url, stores)
    try:
        for s, (url, stores) in targets.items():
            n = cfg.n(s, "corrupt")
            log(cfg, f"corruption trials on {s}: {n}")
            for st in stores[:1]:
                for k in steps:
                    st.put("donor", k, trees[k], meta={"snapshot": True})
            for i in range(n):
                if not c.time_left():
                    c.skip_rest(s, "corrupt", n - i)
                    break
                t = c.new_trial(s, "corrupt", "c", url)
                try:
                    trial(c, t, c.rng.choice(stores), steps, trees)
                except Exception as e:
                    t.reasons.append(f"harness error: {type(e).__name__}: {e}")
                    t.recovered = "raised"
    finally:
        for st in opened:
            st.close()


def trial(c: TrialKit, t: Trial, store, steps: list[int], trees: dict) -> None:
    rng = c.rng
    parent = None
    for k in steps:
        store.put(t.run, k, trees[k], meta={"snapshot": True}, parent=parent)
        parent = k
    t.acked = list(steps)
    r = rng.random()
    if r < 0.65:
        damaged = steps[-1:]
    elif r < 0.85:
        damaged = steps[-2:]
    elif r < 0.93:
        damaged = steps[1:2]         # an older one: the newest must still be chosen
    else:
        damaged = list(steps)
    labels = []
    for k in damaged:
        for attempt in range(5):
            kind = rng.choice(kinds_for(store))
            donor_step = rng.choice([s for s in steps if s != k]) if kind == "swap_step" else k
            try:
                labels.append(corrupt(store, t.run, k, kind, rng, donor_run="donor", donor_step=donor_step))
                break
            except Unchanged:   # e.g. swapping in a step that was already swapped for this one
                continue
        else:
            raise RuntimeError(f"could not damage step {k}")
    t.damaged = list(damaged)
    intact = [k for k in steps if k not in damaged]
    t.expected = max(intact) if intact else None
    t.reached = True
    t.point = ",".join(sorted(set(labels)))
    checker.check_library(store, t, c.full)
    missed = [k for k in damaged if k not in t.rejected and k > (t.recovered or -1)]
    if missed:
        t.reasons.append(f"damaged steps {missed} not reported as rejected")
        t.hash_ok = False
