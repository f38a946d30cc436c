"""Helpers the store tests share: checkpoint states to write and check, writing from
another process, damaging a stored checkpoint, raw access to a SQL store's tables
(``Tamper``), and a checkpoint as SQL schema version 1 wrote it, checked after migration."""

from __future__ import annotations

import os
import sqlite3

import numpy as np
import pytest

from agck.stores import open_store

torch = pytest.importorskip("torch")


def state_for(step: int, n: int = 64) -> dict:
    return {"w": np.arange(n, dtype=np.float32) + step, "t": torch.full((4, 3), float(step)),
            "opt": {"lr": 0.1, "betas": (0.9, 0.99)}, "step": step}


def assert_state(ck, step: int, n: int = 64) -> None:
    np.testing.assert_array_equal(ck.state["w"], np.arange(n, dtype=np.float32) + step)
    assert torch.equal(ck.state["t"], torch.full((4, 3), float(step)))
    assert ck.state["opt"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert ck.state["step"] == step


# --- writing from another process -----------------------------------------------------------------

def process_writer(url: str, opts: dict, worker: int, steps: list[int]) -> None:
    s = open_store(url, **opts)
    try:
        for step in steps:
            s.put("shared", step, state_for(step), meta={"by": worker})
    finally:
        s.close()


# --- tampering with the stored bytes --------------------------------------------------------------

def corrupt_payload(spec, store, run, step):
    """Flip one byte inside the last tensor's data."""
    kind = spec[0]
    if kind == "file":
        path = store.ref(run, step)
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(size - 200)
            b = f.read(1)
            f.seek(size - 200)
            f.write(bytes([b[0] ^ 0xFF]))
    elif kind in ("sqlite", "postgres", "postgres-s3"):    # the container (or listing) is in the database
        Tamper(spec, store).flip(run, step, -200)
    elif kind in ("s3", "s3-moto"):
        flip_s3(store, run, step, -200)
    else:
        pytest.fail(f"corrupt_payload cannot damage a checkpoint of a {kind} store: add how here")


def flip_s3(store, run, step, offset: int) -> str:
    """Flip one byte of the stored container of (run, step) in an S3 store: in its data
    object, or in the bytes that follow the record that holds it inline (the end of
    that object). Returns the key damaged."""
    e = store._state(run).steps[step]
    key = e.key or store._log_key(run, e.seq)
    data = bytearray(store.c.get(key))
    data[offset] ^= 0xFF
    store.c.put(key, bytes(data))
    return key


class Tamper:
    """Direct changes to a database store's rows, as a buggy tool or a bad disk would make."""

    def __init__(self, spec, store):
        self.kind = "postgres" if spec[0] == "postgres-s3" else spec[0]    # its rows are a Postgres store's
        self.store = store
        if self.kind == "sqlite":
            self.conn = sqlite3.connect(store.path, isolation_level=None)     # foreign keys off, as by default
            self.chunks, self.manifest, self.p = f"{store.prefix}_chunks", f"{store.prefix}_manifest", "?"
            self.objects, self.refs = f"{store.prefix}_objects", None    # schema 3: no refs table
        else:
            import psycopg2
            self.conn = psycopg2.connect(spec[1])
            self.conn.autocommit = True
            self.chunks, self.manifest, self.p = store.names.chunks, store.names.manifest, "%s"
            self.objects, self.refs = store.names.objects, None     # schema 3: no refs table

    def sql(self, q, args=()):
        cur = self.conn.cursor()
        cur.execute(q.replace("?", self.p), args)
        try:
            return cur.fetchall()
        except Exception:
            return None

    def chunk(self, run, step, idx) -> bytes:
        return bytes(self.sql(f"SELECT data FROM {self.chunks} WHERE run = ? AND step = ? AND idx = ?",
                              (run, step, idx))[0][0])

    def nchunks(self, run, step) -> int:
        return self.sql(f"SELECT nchunks FROM {self.manifest} WHERE run = ? AND step = ?", (run, step))[0][0]

    def flip(self, run, step, offset, idx=None):
        """Flip a byte at ``offset`` of chunk ``idx`` (default: the last one; negative from the end)."""
        if idx is None:
            idx = self.nchunks(run, step) - 1
        if self.kind == "postgres":
            self.sql(f"UPDATE {self.chunks} SET data = set_byte(data, "
                     f"(CASE WHEN ? < 0 THEN length(data) + ? ELSE ? END)::int, "
                     f"get_byte(data, (CASE WHEN ? < 0 THEN length(data) + ? ELSE ? END)::int) # 255) "
                     f"WHERE run = ? AND step = ? AND idx = ?",
                     (offset, offset, offset, offset, offset, offset, run, step, idx))
        else:
            data = bytearray(self.chunk(run, step, idx))
            data[offset] ^= 0xFF
            self.set_chunk(run, step, idx, bytes(data))

    def set_chunk(self, run, step, idx, data: bytes):
        value = data if self.kind == "sqlite" else __import__("psycopg2").Binary(data)
        self.sql(f"UPDATE {self.chunks} SET data = ? WHERE run = ? AND step = ? AND idx = ?", (value, run, step, idx))

    def blob(self, data: bytes):
        return data if self.kind == "sqlite" else __import__("psycopg2").Binary(data)

    def objects_bytes(self) -> int:
        length = "length" if self.kind == "sqlite" else "octet_length"
        return int(self.sql(f"SELECT coalesce(sum({length}(data)), 0) FROM {self.objects}")[0][0])

    def object_addresses(self) -> set[bytes]:
        return {bytes(a) for (a,) in self.sql(f"SELECT address FROM {self.objects}")}

    def listed(self, run, step) -> list[bytes]:
        """The addresses a checkpoint's listing names, read from its chunk rows."""
        from agck import format
        rows = self.sql(f"SELECT data FROM {self.chunks} WHERE run = ? AND step = ? ORDER BY idx", (run, step))
        c = format.open_container(b"".join(bytes(d) for (d,) in rows))
        return format.open_chunked(c).addresses

    def close(self):
        self.conn.close()


# --- a SQL store as schema version 1 or 2 left it -------------------------------------------------

def write_v1(exec_sql, blob, p: str, run: str, step: int, state) -> bytes:
    """Write a checkpoint into tables of schema version 1 as that version did; returns its bytes."""
    import agck
    from agck import format
    from agck.stores.sqlrows import manifest_checksum
    data = agck.dumps(state, run=run, step=step, meta={"v": 1})
    h = format.parse_header(data)
    pieces = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    for idx, piece in enumerate(pieces):
        exec_sql(f"INSERT INTO {p}_chunks (run, step, idx, data) VALUES (?, ?, ?, ?)", (run, step, idx, blob(piece)))
    exec_sql(f"INSERT INTO {p}_manifest (run, step, parent, size, checksum, nchunks, created_at, meta) "
             f"VALUES (?, ?, NULL, ?, ?, ?, {'1700000000' if p.startswith('agck') else 'now()'}, '{{\"v\": 1}}')",
             (run, step, len(data), manifest_checksum(data[len(data) - h.footer_len:]), len(pieces)))
    return data


def check_migrated(s, t, old: bytes) -> None:
    from agck import format
    ck = s.read("r", 1)
    assert_state(ck, 1, n=50_000) and ck.version == "1.0" and ck.meta == {"v": 1}
    assert s.list("r")[0].size == len(old)
    s.put("r", 2, state_for(2, n=50_000))
    s.put("r", 3, state_for(2, n=50_000) | {"step": 3})
    assert format.is_chunked(format.parse_header(b"".join(
        bytes(d) for (d,) in t.sql(f"SELECT data FROM {t.chunks} WHERE run = 'r' AND step = 2 ORDER BY idx"))))
    assert s.last_put.new_bytes < 100_000 < t.objects_bytes()          # step 3 shares step 2's content
    assert [i.step for i in s.list("r")] == [1, 2, 3]
    assert s.collect_garbage().deleted_chunks == 0
    assert_state(s.read("r", 2), 2, n=50_000)
    s.delete("r", 1)
    assert_state(s.read("r", 2), 2, n=50_000)


def check_v2_listings_kept(s, t, listed: dict, model) -> None:
    """After migrating from schema 2: listings written under it keep their objects alive."""
    got = s.collect_garbage()
    assert got.listings == 2 and got.deleted_chunks == 0 and got.live_chunks == len(listed[1] | listed[2])
    s.delete("r", 1)
    s.collect_garbage()
    assert t.object_addresses() == listed[2]
    np.testing.assert_array_equal(s.read("r", 2).state["model"], model)
