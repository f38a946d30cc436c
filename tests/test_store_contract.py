"""The contract every store backend keeps, run on each of them.

Every test here takes the ``store`` fixture (or ``store_spec``, the same backend's
``(kind, url, options)``, for tests that open it again, in other threads or
processes) from tests/conftest.py, which is parametrized over ``BACKENDS``: put,
read and get, list, runs and steps, delete, overwrite, prune, fencing with epochs,
run names and steps refused, errors and their refs, and writers in threads and
processes sharing one store. ``Store.put_many`` is held to it in test_put_many.py
and recovery in test_recovery.py, on the same fixture. What only some backends have
is in test_store_file.py, test_store_sql.py (SQLite and Postgres),
test_store_sqlite.py and test_store_postgres.py.

To add a backend: add its name to ``BACKENDS`` in tests/conftest.py and, in
``make_spec`` there, how to open a fresh one; every test here then runs on it.
``storehelpers.corrupt_payload`` must also learn how to damage one of its stored
checkpoints (one test here damages one); it fails, naming the backend, until it does.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import numpy as np
import pytest

import agck

from agck.errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError,
                         InvalidRunNameError, UsageError)

from conftest import CONTRACT_BACKENDS, make_spec
from storehelpers import assert_state, corrupt_payload, process_writer, state_for

torch = pytest.importorskip("torch")


@pytest.fixture(params=CONTRACT_BACKENDS)
def store_spec(request, tmp_path):
    return make_spec(request.param, request, tmp_path)


BAD_RUNS = ["../../etc", "/abs", "a\x00b", "", ".hidden", "-x", "a/b", "r'; DROP TABLE x; --", "a" * 201, None, 7]


# --- put, read, list, delete, prune ---------------------------------------------------------------

def test_round_trip(store):
    state = {
        "model": {"w": torch.randn(16, 8), "b": torch.zeros(8, dtype=torch.float16), "i": torch.arange(5)},
        "np": np.random.default_rng(0).standard_normal((7, 3)),
        "mask": np.array([True, False, True]),
        "nested": [1, "two", (3.0, None), {"k": b"bytes"}],
    }
    meta = {"lr": 3e-4, "tags": ["a", "b"], "blob": b"\x00\x01", 5: "int key"}
    ref = store.put("run-1", 42, state, meta=meta, parent=41)
    assert isinstance(ref, str) and ref == store.ref("run-1", 42)
    ck = store.read("run-1", 42)
    for k, v in state["model"].items():
        assert torch.equal(ck.state["model"][k], v) and ck.state["model"][k].dtype == v.dtype
    np.testing.assert_array_equal(ck.state["np"], state["np"])
    np.testing.assert_array_equal(ck.state["mask"], state["mask"])
    assert ck.state["nested"] == state["nested"]
    assert ck.meta == meta
    assert (ck.run, ck.step, ck.parent) == ("run-1", 42, 41)
    assert store.get("run-1", 42, verify=False).state["nested"] == state["nested"]


def test_list_runs_steps_order(store):
    for run, step in [("b", 10), ("a", 7), ("b", 2), ("a", 100), ("b", 7), ("A", 1)]:
        store.put(run, step, state_for(step), meta={"s": step}, parent=step - 1 if step else None)
    assert store.runs() == ["A", "a", "b"]
    assert store.steps("b") == [2, 7, 10]
    assert store.steps("a") == [7, 100]
    assert store.steps("nope") == []
    # the newest few only, still ascending
    assert store.steps("b", last=1) == [10] and store.steps("b", last=2) == [7, 10]
    assert store.steps("b", last=5) == [2, 7, 10] and store.steps("nope", last=1) == []
    for bad in (0, -1, True, 1.5, "1"):
        with pytest.raises(UsageError, match="last must be a positive integer"):
            store.steps("b", last=bad)
    infos = store.list()
    assert [(i.run, i.step) for i in infos] == [("A", 1), ("a", 7), ("a", 100), ("b", 2), ("b", 7), ("b", 10)]
    for i in infos:
        assert i.size and i.size > 0 and i.ref and i.created_at and i.parent == i.step - 1
        assert i.meta == {"s": i.step}
    assert [i.step for i in store.list("b")] == [2, 7, 10]


def test_get_newest(store):
    pytest.importorskip("agck.recovery", reason="recovery not available")
    for s in (3, 1, 2):
        store.put("r", s, state_for(s))
    ck = store.get("r")
    assert ck.step == 3
    assert_state(ck, 3)
    assert store.get("r", 1).step == 1


def test_read_newest(store_spec, store):
    """The newest step read as read() reads it: no walking back (that is get's), None for
    an empty run, a large checkpoint as whole as a small one."""
    assert store.read_newest("r") is None
    for s in (3, 1, 2):
        store.put("r", s, state_for(s), meta={"s": s}, parent=s - 1)
    ck = store.read_newest("r")
    assert (ck.step, ck.parent, ck.meta) == (3, 2, {"s": 3}) and ck.ref == store.ref("r", 3)
    assert_state(ck, 3)
    big = {"x": np.random.default_rng(0).standard_normal(1 << 19)}     # 4 MiB: past the one-statement read
    store.put("r", 9, big)
    assert np.array_equal(store.read_newest("r").state["x"], big["x"])
    store.delete("r", 9)
    assert store.read_newest("r").step == 3
    corrupt_payload(store_spec, store, "r", 3)
    with pytest.raises(CorruptCheckpointError) as e:
        store.read_newest("r")
    assert e.value.ref       # where the damage is (on the object stores, the object holding it)
    with pytest.raises(InvalidRunNameError):
        store.read_newest("../x")


def test_overwrite(store):
    store.put("r", 5, state_for(1))
    store.put("r", 5, state_for(2))
    assert_state(store.read("r", 5), 2)
    with pytest.raises(CheckpointExistsError) as e:
        store.put("r", 5, state_for(3), overwrite=False)
    # what the README says: a put replaces by default; overwrite=False is what refused
    assert "a checkpoint already exists at step 5, and overwrite=False refuses to replace it" in str(e.value)
    assert "immutable" not in str(e.value) and e.value.ref == store.ref("r", 5)
    with pytest.raises(CheckpointExistsError, match="at step 5, and overwrite=False"):
        store.put("r", 5, {"big": np.ones(1 << 17)}, overwrite=False)      # chunked where the store chunks
    assert_state(store.read("r", 5), 2)
    assert store.steps("r") == [5]
    store.put("r", 6, state_for(6), overwrite=False)
    assert store.steps("r") == [5, 6]


def test_delete(store):
    store.put("r", 1, state_for(1))
    store.put("r", 2, state_for(2))
    store.delete("r", 1)
    assert store.steps("r") == [2]
    with pytest.raises(CheckpointNotFoundError):
        store.read("r", 1)
    with pytest.raises(CheckpointNotFoundError):
        store.delete("r", 1)
    assert_state(store.read("r", 2), 2)


def test_prune(store):
    for s in range(10):
        store.put("r", s, state_for(s, n=4))
    assert store.prune("r", keep_last=2, before=3) == [0, 1, 2]
    assert store.steps("r") == list(range(3, 10))
    assert store.prune("r", keep_every=3) == [4, 5, 7, 8]
    assert store.steps("r") == [3, 6, 9]
    assert store.prune("r", keep_last=0) == [3, 6]      # the newest valid checkpoint always stays
    assert store.steps("r") == [9]
    assert store.prune("nope", keep_last=1) == []


def test_prune_keeps_newest_valid(store_spec, store):
    for s in range(4):
        store.put("r", s, state_for(s, n=4096))
    corrupt_payload(store_spec, store, "r", 3)
    with pytest.raises(CorruptCheckpointError):
        store.read("r", 3)
    deleted = store.prune("r", keep_last=1)
    assert deleted == [0, 1]
    assert store.steps("r") == [2, 3]


# --- run names, steps and errors ------------------------------------------------------------------

@pytest.mark.parametrize("run", BAD_RUNS, ids=repr)
def test_invalid_run_names(store, run):
    for call in (lambda: store.put(run, 1, {"x": 1}), lambda: store.read(run, 1), lambda: store.steps(run),
                 lambda: store.delete(run, 1), lambda: store.ref(run, 1),
                 lambda: store.list(run if run is not None else "")):
        with pytest.raises(InvalidRunNameError):
            call()
    assert store.runs() == []


@pytest.mark.parametrize("step", ["1", 1.0, -1, True, None, 1 << 63])
def test_invalid_steps(store, step):
    with pytest.raises(AgckError):
        store.put("r", step, {"x": 1})
    with pytest.raises(AgckError):
        store.read("r", step)
    assert store.runs() == []


def test_numpy_integer_steps_are_plain_ints(store):
    ref = store.put("r", np.int64(3), state_for(3), parent=np.int32(2))
    assert ref == store.ref("r", 3) == store.ref("r", np.uint8(3))
    assert store.steps("r") == [3] and type(store.steps("r")[0]) is int
    ck = store.read("r", np.int64(3))
    assert type(ck.step) is int and ck.step == 3 and ck.parent == 2 and type(ck.parent) is int
    assert_state(ck, 3)
    assert store.get("r", np.int16(3)).step == 3
    info = store.list("r")[0]
    assert type(info.step) is int and info.parent == 2
    store.delete("r", np.int64(3))
    assert store.steps("r") == []


def test_not_found(store):
    with pytest.raises(CheckpointNotFoundError) as e:
        store.read("r", 1)
    assert e.value.ref and "1" in str(e.value)
    store.put("r", 2, state_for(2))
    with pytest.raises(CheckpointNotFoundError):
        store.read("r", 1)
    with pytest.raises(CheckpointNotFoundError):
        store.get("r", 3)


def test_meta_is_data_not_sql(store):
    evil = {"x": "'); DROP TABLE agck_manifest; --", "y": "$$; DELETE FROM pg_class; $$", "\\": "\x00\u2603"}
    store.put("r", 1, state_for(1), meta=evil)
    store.put("r", 2, state_for(2), meta=["'", '"', "\\x00"])
    assert store.read("r", 1).meta == evil
    assert store.read("r", 2).meta == ["'", '"', "\\x00"]
    assert store.steps("r") == [1, 2]
    assert store.list("r")[1].meta == ["'", '"', "\\x00"]


# --- threads and processes sharing a store --------------------------------------------------------

def test_threads_share_a_store(store):
    errors = []

    def worker(t):
        try:
            for i in range(5):
                step = t * 100 + i
                store.put("r", step, state_for(step))
                assert_state(store.read("r", step), step)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.steps("r") == sorted(t * 100 + i for t in range(6) for i in range(5))
    assert store.orphans() == []


def test_processes_write_one_run(store_spec, store):
    _, url, opts = store_spec
    ctx = multiprocessing.get_context("spawn")
    plan = {w: [s for s in range(16) if s % 2 == w] + [100, 101] for w in range(2)}  # 100, 101: both write
    procs = [ctx.Process(target=process_writer, args=(url, opts, w, steps)) for w, steps in plan.items()]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert store.steps("shared") == list(range(16)) + [100, 101]
    assert len(store.list("shared")) == 18
    for step in store.steps("shared"):
        ck = store.read("shared", step)
        assert_state(ck, step)
        if step < 100:
            assert ck.meta == {"by": step % 2}
    assert store.orphans() == []


# --- fencing: a writer of an older incarnation of a run cannot commit -----------------------------

def test_a_stale_epoch_cannot_commit(store):
    assert store.epoch("r") is None
    old = store.begin_epoch("r")
    store.put("r", 1, {"x": 1}, epoch=old)
    new = store.begin_epoch("r")
    assert new == old + 1 and store.epoch("r") == new
    with pytest.raises(agck.StaleEpochError, match=f"epoch {new}, this writer's epoch is {old}"):
        store.put("r", 2, {"x": 2}, epoch=old)
    assert store.steps("r") == [1]
    store.put("r", 2, {"x": 2}, epoch=new)
    store.put("r", 3, {"x": 3})                      # unfenced puts are not checked
    assert store.steps("r") == [1, 2, 3]
    other = store.begin_epoch("other")               # epochs are per run
    assert other == 1 and store.epoch("r") == new


def test_an_epoch_before_any_begin_epoch_is_stale(store):
    with pytest.raises(agck.StaleEpochError):
        store.put("r", 1, state_for(1), epoch=1)
    store.put("r", 1, state_for(1))        # the store goes on working


def _zombie(spec, epoch, steps, out):
    """A writer of the run's first incarnation that keeps going."""
    from agck.stores import open_store
    _, url, opts = spec
    opts = {k: v for k, v in opts.items() if k != "init"}
    s = open_store(url, **opts)
    results = []
    for step in steps:
        try:
            s.put("r", step, {"who": "zombie", "step": step}, epoch=epoch)
            results.append((step, "ok"))
        except agck.StaleEpochError:
            results.append((step, "stale"))
        time.sleep(0.02)
    s.close()
    out.put(results)


def test_two_processes_that_both_believe_they_own_the_run(store_spec, store):
    """The first incarnation keeps writing from another process while a second one
    begins: once begin_epoch has returned, no commit of the first lands."""
    import multiprocessing as mp
    first = store.begin_epoch("r")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_zombie, args=(store_spec, first, range(1, 200), out))
    p.start()
    while not store.steps("r"):
        time.sleep(0.01)
    second = store.begin_epoch("r")
    taken_over = max(store.steps("r"))               # every zombie commit is at or before this step
    store.put("r", 1000, {"who": "new"}, epoch=second)
    results = out.get(timeout=120)
    p.join(timeout=60)
    ok = [s for s, r in results if r == "ok"]
    stale = [s for s, r in results if r == "stale"]
    assert ok and stale and max(ok) < min(stale)
    assert max(ok) <= taken_over                     # begin_epoch waited for the commit in flight
    assert [s for s in store.steps("r") if s < 1000] == ok
    assert store.get("r", 1000).state == {"who": "new"}


def test_a_stale_epoch_cannot_delete_or_prune(store):
    old = store.begin_epoch("r")
    for step in (1, 2, 3):
        store.put("r", step, {"x": step}, epoch=old)
    new = store.begin_epoch("r")
    with pytest.raises(agck.StaleEpochError):
        store.delete("r", 3, epoch=old)
    with pytest.raises(agck.StaleEpochError):
        store.prune("r", keep_last=1, epoch=old)
    assert store.steps("r") == [1, 2, 3]
    store.delete("r", 1, epoch=new)
    assert store.prune("r", keep_last=1, epoch=new) == [2]
    assert store.steps("r") == [3]


def test_bad_arguments_are_one_usage_error_line(store_spec):
    """Raw Python errors from argument checks (TypeError, ValueError, AttributeError,
    OverflowError) are one UsageError naming the argument, on every store; the awaitable
    methods exist on every store."""
    import asyncio
    from agck.stores import PutEntry, open_store
    kind, url, opts = store_spec
    with pytest.raises(UsageError, match="takes no option 'no_such_option'"):
        open_store(url, no_such_option=1, **opts)
    s = open_store(url, **opts)
    try:
        for bad in ("ab" * 32, None, 5, [b"short"], ["ab" * 32]):
            with pytest.raises(UsageError, match="chunk address"):
                s.quarantine(bad)
        with pytest.raises(UsageError, match="progress must be callable"):
            s.scrub(progress="x")
        for bad in (None, 5, "x"):
            with pytest.raises(UsageError, match="put_many"):
                s.put_many(bad)
            with pytest.raises(UsageError, match="put_many"):
                asyncio.run(s.aput_many(bad))
        asyncio.run(s.aput_many([PutEntry("r", 1, {"x": np.arange(3)})]))
        assert asyncio.run(s.asteps("r")) == [1]
        assert asyncio.run(s.aread("r", 1)).state["x"].tolist() == [0, 1, 2]
        assert asyncio.run(s.aread_newest("r")).step == 1
    finally:
        s.close()
