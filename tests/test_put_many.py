"""``Store.put_many`` on every backend, and the standalone writing of small containers
on incremental stores (``min_chunked``)."""

from __future__ import annotations

import numpy as np
import pytest

from agck import failpoints
from agck.errors import CheckpointExistsError, DurabilityError, InvalidRunNameError, UsageError
from agck.stores import PutEntry, open_store

from conftest import make_spec

BIG = 200_000    # float32 elements: 800 KB, well over min_chunked


def _entry(run, step, value, **kw):
    return PutEntry(run, step, {"x": value, "step": step}, meta={"step": step}, **kw)


def test_put_many_writes_every_entry(store):
    a = np.arange(BIG, dtype=np.float32)
    refs = store.put_many([_entry("r", 1, a), _entry("r", 2, a + 1, parent=1), _entry("s", 7, np.ones(3))])
    assert refs == [store.ref("r", 1), store.ref("r", 2), store.ref("s", 7)]
    np.testing.assert_array_equal(store.read("r", 1).state["x"], a)
    ck = store.read("r", 2)
    np.testing.assert_array_equal(ck.state["x"], a + 1)
    assert (ck.parent, ck.meta) == (1, {"step": 2})
    np.testing.assert_array_equal(store.read("s", 7).state["x"], np.ones(3))
    assert store.put_many([]) == []


def test_put_many_entries_sharing_content_read_back_and_survive_collection(store):
    a = np.random.default_rng(0).random(BIG, dtype=np.float32)
    store.put_many([_entry("r", 1, a), _entry("q", 1, a)])
    store.collect_garbage()
    for run in ("r", "q"):
        np.testing.assert_array_equal(store.read(run, 1).state["x"], a)
    store.delete("r", 1)
    store.collect_garbage()
    np.testing.assert_array_equal(store.read("q", 1).state["x"], a)


def test_put_many_refuses_bad_entries(store):
    with pytest.raises(UsageError, match="appears twice"):
        store.put_many([_entry("r", 1, np.ones(2)), _entry("r", 1, np.zeros(2))])
    with pytest.raises(UsageError, match="not an agck.stores.PutEntry"):
        store.put_many([("r", 1, {})])
    with pytest.raises(InvalidRunNameError):
        store.put_many([_entry("../x", 1, np.ones(2))])
    with pytest.raises(UsageError):
        store.put_many([_entry("r", -1, np.ones(2))])
    assert store.runs() == []


def test_put_many_with_an_existing_entry_not_to_overwrite(store_spec, store):
    kind = store_spec[0]
    store.put("r", 2, {"x": np.zeros(2)})
    with pytest.raises(CheckpointExistsError) as e:
        store.put_many([_entry("r", 1, np.ones(2)), _entry("r", 2, np.ones(2), overwrite=False),
                        _entry("r", 3, np.ones(2))])
    assert e.value.ref == store.ref("r", 2)
    # one transaction on the SQL stores: nothing written; one by one on the file store: the entries before it
    assert store.steps("r") == ([1, 2] if kind in ("file", "s3", "s3-moto") else [2])
    np.testing.assert_array_equal(store.read("r", 2).state["x"], np.zeros(2))
    store.put_many([_entry("r", 2, np.ones(2)), _entry("r", 3, np.ones(2))])   # overwrite=True replaces
    np.testing.assert_array_equal(store.read("r", 2).state["x"], np.ones(2))


@pytest.mark.parametrize("kind,point", [("sqlite", "sqlite.before_commit"), ("sqlite", "sqlite.after_objects"),
                                        ("postgres", "pg.after_objects"), ("postgres", "pg.mid_copy"),
                                        ("postgres", "pg.before_commit")])
def test_put_many_is_one_transaction_on_sql_stores(request, tmp_path, kind, point):
    _, url, opts = make_spec(kind, request, tmp_path)
    s = open_store(url, **opts)
    try:
        a = np.arange(BIG, dtype=np.float32)
        s.put("r", 1, {"x": a})
        failpoints.configure(f"{point}=raise")
        try:
            with pytest.raises(DurabilityError):
                s.put_many([_entry("r", 1, a + 5), _entry("r", 2, a + 2), _entry("q", 1, a + 3)])
        finally:
            failpoints.configure("")
        assert s.runs() == ["r"] and s.steps("r") == [1]
        np.testing.assert_array_equal(s.read("r", 1).state["x"], a)
        assert s.orphans() == []
        s.put_many([_entry("r", 2, a + 2), _entry("q", 1, a + 3)])
        np.testing.assert_array_equal(s.read("q", 1).state["x"], a + 3)
    finally:
        s.close()


# --- small containers are written standalone -------------------------------------------------

def _chunked(store, run, step) -> bool:
    """Whether (run, step) is kept as a chunk listing, from the store's own bookkeeping."""
    kind = type(store).__name__
    if kind == "FileStore":
        with open(store.path(run, step), "rb") as f:
            from agck import format
            return format.parse_header(f.read(64)).minor == 1
    if kind == "SqliteStore":
        c = store._db()
        return bool(c.execute(f"SELECT listing FROM {store._t_manifest} WHERE run = ? AND step = ?",
                              (run, step)).fetchone()[0])
    if kind == "S3Store":
        from agck import format
        e = store._state(run).steps[step]
        return format.parse_header(bytes(store._head_bytes(run, e)[:64])).minor == 1
    return store._query(f"SELECT listing FROM {store.names.manifest} WHERE run = %s AND step = %s", (run, step))[0][0]


@pytest.mark.parametrize("min_chunked", [None, 0, 1 << 20])
def test_small_containers_are_written_standalone(request, tmp_path, store_spec, min_chunked):
    kind, url, opts = store_spec
    if min_chunked is not None:
        opts = {**opts, "min_chunked": min_chunked}
    s = open_store(url, **opts)
    try:
        threshold = s.min_chunked
        small = {"x": np.ones(100, dtype=np.float32)}
        big = {"x": np.arange(BIG, dtype=np.float32)}
        s.put("r", 1, small)
        s.put("r", 2, big)
        s.put_many([PutEntry("r", 3, small), PutEntry("r", 4, big)])
        assert [_chunked(s, "r", k) for k in (1, 2, 3, 4)] == [threshold == 0, 800_000 >= threshold,
                                                              threshold == 0, 800_000 >= threshold]
        for k, st in ((1, small), (2, big), (3, small), (4, big)):
            np.testing.assert_array_equal(s.read("r", k).state["x"], st["x"])
        s.collect_garbage()
        np.testing.assert_array_equal(s.read("r", 4).state["x"], big["x"])
    finally:
        s.close()


def test_min_chunked_is_checked(tmp_path):
    for bad in (-1, 1.5, True, "64k"):
        with pytest.raises(UsageError, match="min_chunked"):
            open_store(str(tmp_path / "s"), min_chunked=bad)


def test_readme_put_many_example_runs(tmp_path):
    from readme_examples import run_as_script
    assert run_as_script("store.put_many(", tmp_path, times=2) == ["{'values_at': 7}"] * 2
    s = open_store(f"sqlite:///{tmp_path}/ckpts.db")
    assert s.get("chat.values", 7).state == {"messages": ["hi", "hello"]}
    s.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_put_many_error_names_the_entry_that_failed_or_every_entry(kind, request, tmp_path):
    """An error while one entry is written names that entry, not the first; one about
    the whole transaction (its COMMIT) names every entry."""
    _, url, opts = make_spec(kind, request, tmp_path)
    store = open_store(url, **opts)
    entries = [_entry("r", s, np.arange(BIG, dtype=np.float32) + s) for s in (1, 2, 3)]
    refs = [store.ref("r", s) for s in (1, 2, 3)]
    point = "sqlite.after_objects" if kind == "sqlite" else "pg.before_commit"
    failpoints.configure(f"{point}=raise@{3 if kind == 'sqlite' else 1}")
    try:
        with pytest.raises(DurabilityError) as e:
            store.put_many(entries)
    finally:
        failpoints.configure("")
    if kind == "sqlite":       # the third entry's objects were being written
        assert e.value.ref == refs[2], e.value
    else:                      # the transaction's COMMIT: all three
        assert all(r in e.value.ref for r in refs) and e.value.ref.startswith("3 checkpoints"), e.value
    assert store.steps("r") == []                         # one transaction: nothing of it
    store.put("r", 2, {"x": 1})
    with pytest.raises(CheckpointExistsError) as e:       # a refused entry is named, whatever its place
        store.put_many([_entry("r", 1, np.ones(3)), _entry("r", 2, np.ones(3), overwrite=False)])
    assert e.value.ref == refs[1]
    store.close()
