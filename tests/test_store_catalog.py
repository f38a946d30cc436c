"""A Postgres catalog over object-stored chunks (``?agck_objects=s3://...``): what only it
has. The shared behaviour runs on it as the ``postgres-s3`` backend of the other suites."""

from __future__ import annotations

import numpy as np
import pytest

import agck
from agck import failpoints
from agck.errors import DurabilityError, UsageError
from agck.stores.s3.chunks import ObjectChunks

pytest.importorskip("obstore")
psycopg2 = pytest.importorskip("psycopg2")

from conftest import pg_prefix, s3_url  # noqa: E402


@pytest.fixture
def spec(pg_dsn, pg_schema, seaweed):
    return pg_dsn, {"prefix": pg_prefix(), "schema": pg_schema, "init": True}, s3_url(seaweed)


def _open(spec, **extra):
    dsn, opts, objects = spec
    return agck.open_store(dsn, **{**opts, "objects": objects, **extra})


def _rows(store) -> tuple[int, int]:
    """(objects held in the database, objects whose bytes are in the object store)."""
    (inside, outside), = store._query(f"SELECT count(data), count(*) - count(data) FROM {store.names.objects}")
    return inside, outside


def _wal(store) -> int:
    return int(store._query("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")[0][0])


def test_chunk_bytes_go_to_the_object_store_and_the_wal_carries_the_catalog(spec):
    big = np.random.default_rng(1).standard_normal(2 << 20).astype(np.float32)     # 8 MiB
    with _open(spec) as s:
        before = _wal(s)
        s.put("r", 1, {"w": big, "step": 1})
        wal = _wal(s) - before
        inside, outside = _rows(s)
        chunks = ObjectChunks(spec[2]).stored()
        assert inside == 0 and outside == len(chunks) > 0
        assert sum(chunks.values()) >= big.nbytes
        assert wal < big.nbytes // 20, f"{wal} bytes of WAL for an {big.nbytes}-byte put"
        np.testing.assert_array_equal(s.get("r").state["w"], big)


def test_the_catalog_remembers_its_object_store_and_refuses_another(spec, seaweed):
    dsn, opts, objects = spec
    with _open(spec) as s:
        s.put("r", 1, {"x": np.arange(100_000)})
    # opened without it (the CLI, another process): the one it was bound to
    with agck.open_store(dsn, **{**opts, "init": False}) as s:
        np.testing.assert_array_equal(s.get("r", 1).state["x"], np.arange(100_000))
    # in the URL, as agck_objects
    url = dsn + ("&" if "?" in dsn else "?") + f"agck_prefix={opts['prefix']}&agck_schema={opts['schema']}"
    with agck.open_store(url + "&agck_objects=" + objects.replace("?", "%3F").replace("&", "%26")) as s:
        assert s.steps("r") == [1]
    with pytest.raises(UsageError, match="keeps its chunks at"):
        agck.open_store(dsn, **{**opts, "objects": s3_url(seaweed)})
    # one prefix, one catalog: a second catalog, or an s3 store, would collect the first one's chunks
    with pytest.raises(UsageError, match="another catalog"):
        agck.open_store(dsn, **{**opts, "prefix": pg_prefix(), "objects": objects})
    with pytest.raises(UsageError, match="chunks of a database catalog"):
        agck.open_store(objects)
    other = s3_url(seaweed)
    agck.open_store(other).close()
    with pytest.raises(UsageError, match="holds an s3 store"):
        agck.open_store(dsn, **{**opts, "prefix": pg_prefix(), "objects": other})


def test_uploads_of_a_put_that_failed_are_collected(spec):
    with _open(spec) as s:
        s.put("r", 1, {"x": np.arange(200_000)})
        failpoints.configure("pgobj.after_upload=raise")
        try:
            with pytest.raises(DurabilityError):
                s.put("r", 2, {"x": np.arange(200_000) * 3})
        finally:
            failpoints.configure("")
        assert s.steps("r") == [1]
        stored = ObjectChunks(spec[2]).stored()
        assert len(stored) > _rows(s)[1]              # uploaded, no row names them
        got = s.collect_garbage()
        assert got.deleted_chunks == len(stored) - _rows(s)[1] > 0
        assert len(ObjectChunks(spec[2]).stored()) == _rows(s)[1]
        np.testing.assert_array_equal(s.get("r", 1).state["x"], np.arange(200_000))


def test_a_doomed_chunk_needed_again_before_its_deletion_is_kept(spec):
    """The collector's first transaction dooms the chunks of a pruned checkpoint; a put
    holding the same content commits before the second one deletes them: kept."""
    a, b = np.arange(300_000), np.arange(300_000) * 7
    with _open(spec) as s:
        s.put("r", 1, {"x": a})
        s.put("r", 2, {"x": b})
        s.delete("r", 1)
        failpoints.configure("gc.pg_doomed=raise")
        try:
            with pytest.raises(OSError):
                s.collect_garbage()        # killed between its two transactions
        finally:
            failpoints.configure("")
        doomed = s._query(f"SELECT count(*) FROM {s.names.doomed}")[0][0]
        assert doomed > 0
        s.put("r", 3, {"x": a})           # the doomed content, needed again
        s.collect_garbage()
        assert s._query(f"SELECT count(*) FROM {s.names.doomed}")[0][0] == 0
        np.testing.assert_array_equal(s.get("r", 3).state["x"], a)
        np.testing.assert_array_equal(s.get("r", 2).state["x"], b)
        assert len(ObjectChunks(spec[2]).stored()) == _rows(s)[1]
        s.delete("r", 3)
        s.delete("r", 2)
        s.collect_garbage()
        assert ObjectChunks(spec[2]).stored() == {} and _rows(s) == (0, 0)


def test_objects_held_in_the_database_before_the_binding_stay_readable(spec):
    dsn, opts, objects = spec
    with agck.open_store(dsn, **opts) as s:
        s.put("r", 1, {"x": np.arange(200_000)})
        inside_before = _rows(s)[0]
    with _open(spec) as s:
        s.put("r", 2, {"x": np.arange(200_000), "y": np.arange(200_000) * 2})
        inside, outside = _rows(s)
        assert inside == inside_before and outside > 0
        np.testing.assert_array_equal(s.get("r", 2).state["y"], np.arange(200_000) * 2)
        assert s.scrub().ok


@pytest.mark.parametrize("detect", ["read", "put-size"])
def test_a_chunk_the_bucket_lost_is_uploaded_again_by_the_next_put(spec, detect):
    """The bucket loses a chunk whose row stays: once a read or a put (``size``) sees it
    gone, the next put holding its content uploads it again and heals every step."""
    from agck.errors import DamagedChunkError
    frozen = np.random.default_rng(3).standard_normal(300_000)
    with _open(spec, verify_reused="size" if detect == "put-size" else "none") as s:
        s.put("r", 1, {"f": frozen, "i": 1})
        victim = max(s.last_put.addresses, key=lambda a: s.last_put.sizes[s.last_put.addresses.index(a)])
        ObjectChunks(spec[2]).delete([victim])
        if detect == "read":
            with pytest.raises(DamagedChunkError, match="missing"):
                s.get("r", 1)
        s.put("r", 2, {"f": frozen, "i": 2})
        assert victim in ObjectChunks(spec[2]).stored()
        for step in (1, 2):
            np.testing.assert_array_equal(s.get("r", step).state["f"], frozen)


def test_agck_db_init_binds_the_bucket_agck_objects_names(pg_dsn, pg_schema, seaweed, capsys):
    """`agck db init 'postgresql://...?agck_objects=s3://...'` ignored agck_objects and said
    no bucket was bound; status and migrate refuse it (a catalog keeps the bucket it has)."""
    from urllib.parse import quote
    from agck.cli import main
    prefix = pg_prefix()
    bucket = s3_url(seaweed)
    sep = "&" if "?" in pg_dsn else "?"
    url = f"{pg_dsn}{sep}agck_prefix={prefix}&agck_schema={pg_schema}&agck_objects={quote(bucket, safe='')}"
    capsys.readouterr()
    assert main(["db", "init", url, "--json"]) == 0
    import json
    status = json.loads(capsys.readouterr().out)
    assert status["objects"] and bucket.partition("?")[0] in status["objects"], status
    assert main(["db", "status", url]) == 2
    assert "binds a bucket at init" in capsys.readouterr().err


def test_agck_ls_on_a_catalogs_prefix_sends_the_user_to_the_catalog(spec, capsys):
    """It suggested agck.open_store(url), which refuses that prefix."""
    from agck.cli import main
    with _open(spec) as s:
        s.put("r", 1, {"w": np.ones(1 << 20, np.float32)})
    capsys.readouterr()
    assert main(["ls", spec[2]]) == 4
    err = capsys.readouterr().err
    assert "Postgres catalog" in err and "open_store" not in err, err
