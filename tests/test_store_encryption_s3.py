"""Encryption at rest on the s3 store (FORMAT.md section 18, rule 18.7).

Chunk objects are keyed by keyed names and sealed, listings sealed in their commit
records or data objects, key slots are ``keys/<id>.json`` objects created only if
absent: a marker planted in a state is in no object of the bucket; every byte of a
sealed chunk object and of a sealed listing flipped in turn is caught; a chunk object
swapped for another does not open; keys rotate without rewriting any object; the
journal's records are sealed there too.
"""

from __future__ import annotations

import os

import pytest

import agck
from agck.errors import CorruptCheckpointError, DamagedChunkError, EncryptionKeyError, UsageError
from agck.recovery import verify_store
from agck.stores import open_store

from conftest import make_spec

from test_store_encryption_sql import KEY, MARK, same, state  # the same state and marker as there


@pytest.fixture
def url(request, tmp_path):
    return make_spec("s3", request, tmp_path)[1]


def objects(store) -> dict[str, bytes]:
    return {o.key: bytes(store.c.get(o.key)) for o in store.c.list("")}


def chunk_keys(store) -> list[str]:
    return sorted(k for k in objects(store) if k.startswith("chunks/"))


@pytest.mark.parametrize("compress", ["none", "zstd"])
def test_a_planted_marker_is_in_no_object_and_everything_reads_back(url, compress):
    s = open_store(url, key=KEY, compress=compress)
    for i in (1, 2):
        s.put("run", i, state(i), meta={"step": i})
    s.put("run", 3, {"note": MARK.decode(), "i": 3})                   # tiny: its listing inline in the record
    with agck.Journal(s, "run") as j:
        j.step("f", lambda: {"text": MARK.decode() * 20})
    for key, data in objects(s).items():
        assert MARK not in data, key
    addresses = set(s.last_put.addresses)
    assert not any(k.replace("/", "")[len("chunks"):] in {a.hex() for a in addresses} for k in chunk_keys(s))
    f = open_store(url, key=KEY)
    for i in (1, 2):
        assert same(f.get("run", i).state, state(i))
    assert f.get("run", 3).state["i"] == 3 and f.list("run")[0].meta == {"step": 1}
    assert f.scrub().ok and len(verify_store(f).ok) == 3
    with agck.Journal(f, "run") as j:
        assert j.step("f", lambda: 1 / 0)["text"] == MARK.decode() * 20          # replayed
    f.delete("run", 1)
    assert not f.collect_garbage().unreadable
    assert same(open_store(url, key=KEY).get("run", 2).state, state(2))


def test_flipped_swapped_and_replayed_objects_do_not_open(url):
    raw = os.urandom(32)
    s = open_store(url, key=raw)
    s.put("run", 1, {"text": MARK.decode() * 40, "i": 1})
    s.put("run", 2, {"text": MARK.decode() * 40, "i": 2})
    smallest = min(chunk_keys(s), key=lambda k: len(s.c.get(k)))
    good = bytes(s.c.get(smallest))
    judge = open_store(url, key=raw)
    for i in sorted(set(range(48)) | set(range(0, len(good), 5)) | {len(good) - 1}):
        bad = bytearray(good)
        bad[i] ^= 1 << (i % 8)
        s.c.put(smallest, bytes(bad))
        assert judge.scrub(quarantine=False).damaged, i
    s.c.put(smallest, good)
    big = open_store(url, key=raw)
    big.put("big", 1, state(1))
    victim, other = [k for k in chunk_keys(s) if len(s.c.get(k)) > 64 << 10][:2]
    saved = bytes(s.c.get(victim))
    s.c.put(victim, bytes(s.c.get(other)))              # a valid sealed chunk, under another name
    with pytest.raises(DamagedChunkError):
        open_store(url, key=raw).get("big", 1)
    assert open_store(url, key=raw).quarantined()
    s.c.put(victim, saved)
    # a listing (inline in its commit record) flipped: its record's XXH3-64, or its tag, refuses it
    st = s._state("run").steps[2]
    log_key = s._log_key("run", st.seq)
    record = bytes(s.c.get(log_key))
    for i in range(len(record) - 200, len(record)):     # the inline sealed listing is the record's tail
        bad = bytearray(record)
        bad[i] ^= 1
        s.c.put(log_key, bytes(bad))
        with pytest.raises(CorruptCheckpointError):
            open_store(url, key=raw).get("run", 2)
    s.c.put(log_key, record)
    assert open_store(url, key=raw).get("run", 2).state["i"] == 2


def test_keys_rotate_without_rewriting_objects_and_a_wrong_key_is_refused(url):
    s = open_store(url, key=KEY)
    s.put("run", 1, state(1))
    before = {k: v for k, v in objects(s).items() if not k.startswith(("keys/", "locks/"))}
    new = os.urandom(32)
    slot = s.add_key(new)
    s.remove_key("00000000")
    assert [x["id"] for x in s.key_slots()] == [slot["id"]]
    after = {k: v for k, v in objects(s).items() if not k.startswith(("keys/", "locks/"))}
    assert after == before
    assert same(open_store(url, key=new).get("run", 1).state, state(1))
    with pytest.raises(EncryptionKeyError):
        open_store(url, key=KEY)
    with pytest.raises(EncryptionKeyError, match="no key was given"):
        open_store(url)
    with pytest.raises(UsageError, match="in the clear"):
        open_store(url, key=new).log_append("run", [b"raw"])
    parts = open_store(url, key=new).parts_store()
    parts.put("run", 1, {"note": MARK.decode()})
    assert open_store(url, key=new).parts_store(create=False).get("run", 1).state["note"] == MARK.decode()
    assert all(MARK not in v for v in objects(s).values())


def test_the_postgres_catalog_over_a_bucket_seals_its_chunks_there(request, tmp_path):
    _, dsn, opts = make_spec("postgres-s3", request, tmp_path)
    s = open_store(dsn, **opts, key=KEY)
    s.put("run", 1, state(1), meta={"step": 1})
    s.put("run", 2, state(2))
    with agck.Journal(s, "run") as j:
        j.step("f", lambda: {"text": MARK.decode()})
    bucket = s._objects.c
    for o in bucket.list(""):
        assert MARK not in bytes(bucket.get(o.key)), o.key
    stored = s._objects.stored()
    assert stored and not set(stored) & set(s.last_put.addresses)     # under keyed names
    reopened = {k: v for k, v in opts.items() if k != "init"}
    f = open_store(dsn, **reopened, key=KEY)
    assert same(f.get("run", 1).state, state(1)) and same(f.get("run", 2).state, state(2))
    assert f.scrub().ok
    name = max(stored, key=stored.get)
    good = bytes(bucket.get(f"chunks/{name.hex()[:2]}/{name.hex()[2:]}"))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 1
    bucket.put(f"chunks/{name.hex()[:2]}/{name.hex()[2:]}", bytes(bad))
    with pytest.raises(DamagedChunkError):
        for step in (1, 2):
            open_store(dsn, **reopened, key=KEY).get("run", step)
    assert open_store(dsn, **reopened, key=KEY).quarantined()
    g = open_store(dsn, **reopened, key=KEY)
    g.put("run", 3, state(1) | {"i": 3})
    g.put("run", 4, state(2) | {"i": 4})                     # both contents uploaded afresh: healed
    assert same(g.get("run", 1).state, state(1)) and same(g.get("run", 2).state, state(2))
    g.delete("run", 1)
    assert not g.collect_garbage().unreadable
    assert same(open_store(dsn, **reopened, key=KEY).get("run", 2).state, state(2))
    with pytest.raises(EncryptionKeyError):
        open_store(dsn, **reopened, key="wrong")
