"""Encryption at rest on the SQLite and Postgres stores (FORMAT.md section 18, rule 18.7: where they keep it).

The same promises as the file store's (tests/test_store_encryption.py), where the
chunks are rows: a marker planted in a state is in no byte of the database (every
row of every table of the store, as the server returns it, and SQLite's files);
chunk rows are keyed by keyed names; every byte of a sealed chunk row and of a
sealed listing flipped in turn is caught; a row swapped for another valid one does
not open; keys are added and removed without rewriting rows; ``seal_meta`` keeps
``meta`` out of the manifest too; the catalog over a bucket refuses a key.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import torch

import agck
from agck.errors import CorruptCheckpointError, DamagedChunkError, EncryptionKeyError, UsageError
from agck.recovery import verify_store
from agck.stores import open_store

from conftest import make_spec, open_spec, pg_prefix, reopen_spec

MARK = b"AGCK-PLANTED-MARKER-5e1d"
KEY = "correct horse battery staple"
MiB = 1 << 20


def state(i: int, nbytes: int = 3 * MiB) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(nbytes // 4, generator=g) * 0.02, "note": MARK.decode() * 50 + str(i),
            "raw": np.frombuffer(MARK * 2000, np.uint8).copy(), "turns": [{"text": MARK.decode(), "i": i}] * 20,
            "i": i}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["w"], b["w"]) and a["note"] == b["note"] and np.array_equal(a["raw"], b["raw"])
            and a["turns"] == b["turns"] and a["i"] == b["i"])


@pytest.fixture(params=["sqlite", "postgres"])
def spec(request, tmp_path):
    return make_spec(request.param, request, tmp_path)


opened, fresh = open_spec, reopen_spec


# -- the raw rows ---------------------------------------------------------------------------

def _pg(spec):
    import psycopg2
    c = psycopg2.connect(spec[1])
    c.autocommit = True
    return c


def _table(spec, name: str) -> str:
    _, _, opts = spec
    if spec[0] == "sqlite":
        return f"agck_{name}"
    return f'"{opts["schema"]}"."{opts["prefix"]}_{name}"'


def everything_stored(spec) -> list[bytes]:
    """Every byte the store keeps: SQLite's files; every row of every table of the
    store's prefix, as the Postgres server returns it (decompressed, detoasted)."""
    if spec[0] == "sqlite":
        path = spec[1][len("sqlite:///"):]
        return [open(p, "rb").read() for p in glob.glob(path + "*")]
    _, _, opts = spec
    out = []
    with _pg(spec) as c, c.cursor() as cur:
        cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename LIKE %s",
                    (opts["schema"], opts["prefix"] + "\\_%"))
        tables = [t for (t,) in cur.fetchall()]
        assert any(t.endswith("_objects") for t in tables) and any(t.endswith("_keys") for t in tables)
        for t in tables:
            import io
            sink = io.BytesIO()
            cur.copy_expert(f'COPY (SELECT * FROM "{opts["schema"]}"."{t}") TO STDOUT', sink)
            out.append(sink.getvalue())
            sink = io.BytesIO()
            cur.copy_expert(f'COPY (SELECT * FROM "{opts["schema"]}"."{t}") TO STDOUT (FORMAT binary)', sink)
            out.append(sink.getvalue())
    return out


def rows(spec, sql: str, args=()):
    if spec[0] == "sqlite":
        import sqlite3
        c = sqlite3.connect(spec[1][len("sqlite:///"):])
        try:
            return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r)
                    for r in c.execute(sql.replace("%s", "?"), args).fetchall()]
        finally:
            c.close()
    with _pg(spec) as c, c.cursor() as cur:
        cur.execute(sql, args)
        return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in cur.fetchall()]


def write(spec, sql: str, args) -> None:
    if spec[0] == "sqlite":
        import sqlite3
        c = sqlite3.connect(spec[1][len("sqlite:///"):], isolation_level=None)
        try:
            c.execute(sql.replace("%s", "?"), args)
        finally:
            c.close()
        return
    import psycopg2
    with _pg(spec) as c, c.cursor() as cur:
        cur.execute(sql, tuple(psycopg2.Binary(a) if isinstance(a, (bytes, bytearray)) else a for a in args))


# -- the promises ---------------------------------------------------------------------------

@pytest.mark.parametrize("compress, nbytes", [("none", 3 * MiB), ("zstd", 3 * MiB), ("zstd", 70 * MiB)],
                         ids=["none-3MiB", "zstd-3MiB", "zstd-70MiB"])
def test_a_planted_marker_is_in_no_row_and_everything_reads_back_on_a_fresh_store(spec, compress, nbytes):
    s = opened(spec, key=KEY, compress=compress)
    for i in (1, 2):
        s.put("run", i, state(i, nbytes), meta={"step": i})
    s.put("run", 3, {"note": MARK.decode(), "i": 3}, meta={"step": 3})    # a tiny one: chunked too
    s.close()
    for data in everything_stored(spec):
        assert MARK not in data
    f = fresh(spec, key=KEY)
    for i in (1, 2):
        assert same(f.get("run", i).state, state(i, nbytes))
    assert f.get("run", 3).state == {"note": MARK.decode(), "i": 3}
    assert [c.step for c in f.list("run")] == [1, 2, 3] and f.list("run")[0].meta == {"step": 1}
    assert f.scrub().ok
    verified = verify_store(f)
    assert len(verified.ok) == 3 and not verified.rejected
    assert agck.recover(f, "run").step == 3
    f.delete("run", 1)
    got = f.collect_garbage()
    assert got.listings == 2 and not got.unreadable and got.deleted_chunks > 0     # step 1's own weights
    g = fresh(spec, key=KEY)
    assert same(g.get("run", 2).state, state(2, nbytes)) and g.get("run", 3).state["i"] == 3
    assert g.scrub().ok


def test_rows_are_keyed_by_keyed_names_and_content_still_deduplicates(spec, tmp_path, request):
    s = opened(spec, key=KEY)
    s.put("run", 1, state(1))
    names = {a for (a,) in rows(spec, f"SELECT address FROM {_table(spec, 'objects')}")}
    addresses = set(s.last_put.addresses)
    assert names and not names & addresses
    assert names == {s.sealer.name(a) for a in addresses}
    s.put("run", 2, state(1) | {"i": 2})
    assert s.last_put.new_bytes < 64 << 10            # the weights found stored under their names
    other = make_spec(spec[0], request, tmp_path / "other")
    os.makedirs(tmp_path / "other", exist_ok=True)
    o = opened(other, key=os.urandom(32))
    o.put("run", 1, state(1))
    assert not names & {a for (a,) in rows(other, f"SELECT address FROM {_table(other, 'objects')}")}


def test_every_byte_of_a_sealed_chunk_row_and_of_a_sealed_listing_flipped_is_caught(spec):
    raw = os.urandom(32)
    s = opened(spec, key=raw)
    s.put("run", 1, {"text": MARK.decode() * 40, "i": 1})
    s.put("run", 2, {"text": MARK.decode() * 40, "i": 2})
    t = _table(spec, "objects")
    name, good = min(rows(spec, f"SELECT address, data FROM {t}"), key=lambda r: len(r[1]))
    assert len(good) < 4096
    judge = fresh(spec, key=raw)
    # every byte on SQLite; on Postgres the header, the tag and every 5th byte between
    every = range(len(good)) if spec[0] == "sqlite" else \
        sorted(set(range(48)) | set(range(len(good) - 16, len(good))) | set(range(0, len(good), 5)))
    for i in every:
        bad = bytearray(good)
        bad[i] ^= 1 << (i % 8)
        write(spec, f"UPDATE {t} SET data = %s WHERE address = %s", (bytes(bad), name))
        report = judge.scrub(quarantine=False)
        assert report.damaged, i
    write(spec, f"UPDATE {t} SET data = %s WHERE address = %s", (good, name))
    assert judge.scrub().ok
    c = _table(spec, "chunks")
    (listing,) = rows(spec, f"SELECT data FROM {c} WHERE run = 'run' AND step = 2")[0]
    for i in range(len(listing)):
        bad = bytearray(listing)
        bad[i] ^= 1 << (i % 8)
        write(spec, f"UPDATE {c} SET data = %s WHERE run = 'run' AND step = 2", (bytes(bad),))
        with pytest.raises(CorruptCheckpointError):
            judge.get("run", 2)
    assert agck.recover(judge, "run").step == 1        # walked back past it
    write(spec, f"UPDATE {c} SET data = %s WHERE run = 'run' AND step = 2", (listing,))
    assert judge.get("run", 2).state["i"] == 2


def test_a_swapped_row_does_not_open_is_quarantined_and_healed_by_the_next_put(spec):
    s = opened(spec, key=KEY)
    s.put("run", 1, state(1))
    t = _table(spec, "objects")
    (victim, _), (_, other) = rows(spec, f"SELECT address, data FROM {t} ORDER BY size DESC LIMIT 2")
    write(spec, f"UPDATE {t} SET data = %s WHERE address = %s", (other, victim))   # a valid ciphertext, moved
    f = fresh(spec, key=KEY)
    with pytest.raises(DamagedChunkError):
        f.get("run", 1)
    q = f.quarantined()
    assert len(q) == 1 and q[0].address == victim.hex()          # kept, by its keyed name
    f.put("run", 2, state(1) | {"i": 2})                           # writes the chunk afresh
    assert same(fresh(spec, key=KEY).get("run", 1).state, state(1))
    assert fresh(spec, key=KEY).scrub().ok
    (listing,) = rows(spec, f"SELECT data FROM {_table(spec, 'chunks')} WHERE run = 'run' AND step = 1")[0]
    write(spec, f"UPDATE {_table(spec, 'chunks')} SET data = %s WHERE run = 'run' AND step = 2", (listing,))
    write(spec, f"UPDATE {_table(spec, 'manifest')} SET checksum = (SELECT checksum FROM {_table(spec, 'manifest')}"
                f" WHERE run = 'run' AND step = 1), size = (SELECT size FROM {_table(spec, 'manifest')} "
                f"WHERE run = 'run' AND step = 1) WHERE run = 'run' AND step = 2", ())
    with pytest.raises(CorruptCheckpointError):                     # step 1's listing replayed as step 2
        fresh(spec, key=KEY).get("run", 2)


def test_keys_are_added_and_removed_without_rewriting_rows(spec):
    s = opened(spec, key=KEY)
    s.put("run", 1, state(1))
    before = rows(spec, f"SELECT address, data FROM {_table(spec, 'objects')} ORDER BY address")
    new = os.urandom(32)
    slot = s.add_key(new)
    s.remove_key("00000000")
    assert [x["id"] for x in s.key_slots()] == [slot["id"]]
    assert rows(spec, f"SELECT address, data FROM {_table(spec, 'objects')} ORDER BY address") == before
    assert same(fresh(spec, key=new).get("run", 1).state, state(1))
    with pytest.raises(EncryptionKeyError, match="opens none"):
        fresh(spec, key=KEY)                                   # removed: it opens nothing now
    with pytest.raises(EncryptionKeyError, match="no key was given"):
        fresh(spec)
    with pytest.raises(UsageError, match="last"):
        fresh(spec, key=new).remove_key(slot["id"])


def test_seal_meta_keeps_meta_out_of_the_manifest(spec):
    s = opened(spec, key=KEY, seal_meta=True)
    s.put("run", 1, state(1), meta={"secret": MARK.decode()})
    s.close()
    for data in everything_stored(spec):
        assert MARK not in data
    f = fresh(spec, key=KEY, seal_meta=True)
    assert f.list("run")[0].meta is None                         # not queryable: said in the README
    assert f.get("run", 1).meta == {"secret": MARK.decode()}   # exact from the sealed listing
    p = opened(spec, key=KEY)            # without seal_meta the column holds meta's JSON: the default, stated
    p.put("run", 2, {"i": 2}, meta={"visible": "yes"})
    assert p.list("run")[-1].meta == {"visible": "yes"}


def test_what_an_encrypted_sql_store_refuses(spec):
    s = opened(spec, key=KEY)
    with pytest.raises(UsageError, match="in the clear"):     # the journal seals its records; raw ones are refused
        s.log_append("run", [b"x"])
    with pytest.raises(UsageError, match="incremental=False"):
        fresh(spec, key=KEY, incremental=False)
    with pytest.raises(UsageError, match="seal_meta"):
        fresh(spec, key=KEY, seal_meta="yes")
    other = (spec[0], spec[1], {**spec[2], "prefix": pg_prefix()})
    opened(other).put("run", 1, {"i": 1})
    with pytest.raises(UsageError, match="in the clear"):
        fresh(other, key=KEY)


def test_multi_rank_parts_are_sealed_with_the_store_s_data_key(spec):
    s = opened(spec, key=KEY)
    parts = s.parts_store()
    assert parts.sealer is not None and parts.sealer.raw == s.sealer.raw
    parts.put("run", 1, {"note": MARK.decode() * 100})
    assert fresh(spec, key=KEY).parts_store(create=False).get("run", 1).state["note"] == MARK.decode() * 100
    for data in everything_stored(spec):
        assert MARK not in data



def test_the_key_command_and_verify_take_the_key_the_same_way_on_sqlite(tmp_path, monkeypatch, capsys):
    from agck.cli import main as cli_main
    url = f"sqlite:///{tmp_path}/k.db"
    k1, k2 = tmp_path / "k1", tmp_path / "k2"
    k1.write_text(os.urandom(32).hex())
    k2.write_text(os.urandom(32).hex())
    assert cli_main(["key", "init", url, "--new-key-file", str(k1)]) == 0
    monkeypatch.setenv("AGCK_KEY_FILE", str(k1))
    open_store(url).put("run", 1, state(1))
    assert cli_main(["verify", url]) == 0
    assert cli_main(["key", "rotate", url, "--new-key-file", str(k2)]) == 0     # k1's slot goes
    assert cli_main(["verify", url]) != 0                                       # k1 opens nothing now
    monkeypatch.setenv("AGCK_KEY_FILE", str(k2))
    assert cli_main(["verify", url]) == 0 and cli_main(["scrub", url]) == 0
    capsys.readouterr()
    assert cli_main(["key", "list", url, "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1
    assert cli_main(["key", "init", url, "--new-key-file", str(k2)]) != 0      # encrypted already: refused
    assert "encrypted already" in capsys.readouterr().err
