"""What only the object store has: its URL, its commit log, its locks (the shared
behaviour is in test_store_contract.py and the other store suites, run on SeaweedFS
and, for the contract, on moto too)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import agck
from agck.errors import CheckpointExistsError, StaleEpochError, StoreConnectionError, UsageError

pytest.importorskip("obstore")

from conftest import s3_url  # noqa: E402


@pytest.fixture
def url(seaweed):
    return s3_url(seaweed)


def test_url_parameters_are_checked_and_credentials_never_shown(url, monkeypatch):
    from agck.stores.objclient import parse_url
    assert parse_url("s3://b/a/b/?region=eu-west-1") == ("b", "a/b", {"region": "eu-west-1"})
    with pytest.raises(UsageError, match="unknown parameter.*secret"):
        parse_url("s3://b/p?secret=x")
    with pytest.raises(UsageError, match="no bucket"):
        parse_url("s3:///p")
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    with agck.open_store(url) as s:
        assert secret not in s.url and secret not in repr(s)
    base, _, query = url.partition("?")
    with pytest.raises(StoreConnectionError, match="no agck store"):
        agck.open_store(f"{base}-absent?{query}", create=False)
    with pytest.raises(UsageError, match="not an endpoint URL"):
        agck.open_store(url + "-x")                       # the port runs into other text


def test_a_reader_with_nothing_remembered_folds_many_runs(url):
    """A fresh store object folds every run in parallel, each run's records in parallel:
    more runs than the request pool has threads (this once waited on itself)."""
    with agck.open_store(url) as s:
        for r in range(40):
            s.put(f"r{r}", 1, {"x": np.arange(3) + r})
            s.put(f"r{r}", 2, {"x": np.arange(3) + r})
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("runs", agck.open_store(url).runs()))
    t.start()
    t.join(120)
    assert not t.is_alive(), "runs() did not return"
    assert result["runs"] == sorted(f"r{r}" for r in range(40))


def test_the_fence_holds_across_store_objects(url):
    old, new = agck.open_store(url), agck.open_store(url)
    try:
        e1 = old.begin_epoch("run")
        old.put("run", 1, {"x": 1}, epoch=e1)
        e2 = new.begin_epoch("run")        # another process took the run over
        assert e2 == e1 + 1
        # the old writer's fold still says e1: its record's number is taken, it reads on, refuses
        with pytest.raises(StaleEpochError):
            old.put("run", 2, {"x": 2}, epoch=e1)
        with pytest.raises(StaleEpochError):
            old.delete("run", 1, epoch=e1)
        new.put("run", 2, {"x": 2}, epoch=e2)
        assert new.steps("run") == [1, 2] and agck.open_store(url).epoch("run") == e2
    finally:
        old.close()
        new.close()


def test_racing_creators_of_one_step_one_wins(url):
    """Many store objects put the same step with overwrite=False at once: exactly one commits."""
    stores = [agck.open_store(url) for _ in range(6)]
    won, refused, errors = [], [], []
    barrier = threading.Barrier(len(stores))

    def go(i, s):
        barrier.wait()
        try:
            s.put("race", 7, {"who": i}, overwrite=False)
            won.append(i)
        except CheckpointExistsError:
            refused.append(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(won) == 1 and len(refused) == len(stores) - 1
    assert agck.open_store(url).get("race", 7).state["who"] == won[0]
    for s in stores:
        s.close()


def test_a_killed_writers_lock_does_not_hold_up_a_collection(url):
    """A writer SIGKILLed while it holds its lock: on the same host its lock stops counting
    at once (its pid is gone), so a collection goes ahead instead of waiting minutes."""
    code = f"""
import numpy as np
import agck
s = agck.open_store({url!r})
s.put("k", 1, {{"x": np.random.default_rng(0).standard_normal(1 << 20)}})
"""
    env = {**os.environ, "AGCK_FAILPOINTS": "s3.before_record=kill"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    s = agck.open_store(url)
    try:
        assert [o.key for o in s.c.list("locks/") if o.key.startswith("locks/w-")], "the lock should be left"
        got = s.collect_garbage()       # would wait for the lock to go stale (600 s) if it counted
        assert got.deleted_chunks > 0   # the killed put's chunks: no record lists them
        assert s.steps("k") == []
    finally:
        s.close()


def test_large_tensors_are_cut_on_the_stores_grid(url):
    """Every 8 MiB by default (each chunk is a request), or the grid asked for; a tensor
    changed in one place uploads one grid chunk again."""
    t = np.random.default_rng(1).standard_normal((32 << 20) // 8)      # 32 MiB
    with agck.open_store(url) as s:
        s.put("g", 1, {"t": t})
        assert sorted(set(s.last_put.sizes))[-1] == 8 << 20 and s.last_put.sizes.count(8 << 20) == 4
        t[10] += 1
        s.put("g", 2, {"t": t})
        assert (8 << 20) <= s.last_put.new_bytes < (9 << 20)
        np.testing.assert_array_equal(s.get("g").state["t"], t)
    with agck.open_store(url, chunk_grid=1 << 20) as s:
        s.put("g1", 1, {"t": t})
        assert s.last_put.sizes.count(1 << 20) == 32
    for bad in (3 << 20, 1 << 10, 128 << 20, "8M"):
        with pytest.raises(UsageError, match="power of two"):
            agck.open_store(url, chunk_grid=bad)


@pytest.mark.parametrize("kind", ["s3", "catalog"])
def test_connections_cut_mid_request_lose_nothing_acknowledged(seaweed, kind, request):
    """A proxy between the client and the server resets every connection at random
    instants while checkpoints are put: each put either returns, and reads back
    bit-exact through a clean connection, or raises an AgckError; no step is ever
    half there."""
    from urllib.parse import urlsplit

    from agck.errors import AgckError
    from crashtests.faultproxy import FaultProxy
    from conftest import pg_prefix

    direct = s3_url(seaweed)
    proxy = FaultProxy("127.0.0.1", urlsplit(seaweed.endpoint).port)
    cut = direct.replace(seaweed.endpoint, proxy.endpoint)
    if kind == "s3":
        def opener(url): return agck.open_store(url)
    else:
        dsn, schema = request.getfixturevalue("pg_dsn"), request.getfixturevalue("pg_schema")
        prefix = pg_prefix()
        agck.open_store(dsn, prefix=prefix, schema=schema, init=True, objects=direct).close()

        def opener(url):    # the catalog as it was bound, its chunks reached through ``url``
            s = agck.open_store(dsn, prefix=prefix, schema=schema)
            s._objects = __import__("agck.stores.objchunks", fromlist=["x"]).ObjectChunks(url)
            return s
    rng = np.random.default_rng(5)
    base = rng.standard_normal((24 << 20) // 8)
    stop = threading.Event()

    def cutter():
        r = np.random.default_rng(6)
        while not stop.wait(float(r.uniform(0.01, 0.15))):
            proxy.cut()

    acked, failed = [], []
    store = opener(cut)
    t = threading.Thread(target=cutter)
    t.start()
    try:
        for step in range(1, 13):
            try:
                store.put("r", step, {"w": base + step, "step": step})
                acked.append(step)
            except AgckError as e:
                failed.append((step, type(e).__name__))
    finally:
        stop.set()
        t.join()
        store.close()
        proxy.close()
    assert proxy.reset > 0, "the proxy cut no connection"
    with opener(direct) as clean:
        present = clean.steps("r")
        assert set(acked) <= set(present), (acked, present, failed)
        for step in present:
            ck = clean.get("r", step)
            np.testing.assert_array_equal(ck.state["w"], base + step)


def test_a_collection_keeps_the_newest_fold_snapshots_and_readers_still_fold_every_step(url):
    from agck.stores import s3, s3log
    with agck.open_store(url) as s:
        n = 3 * s3log.snapshot_every(0) + 5
        for step in range(n):
            s.put("many", step, {"i": step})
        snaps = lambda: [o.key for o in s.c.list("runs/many/snap/")]     # noqa: E731
        assert len(snaps()) == 3
        s.collect_garbage()
        assert len(snaps()) == s3.KEEP_SNAPSHOTS
    with agck.open_store(url) as fresh:
        assert fresh.steps("many") == list(range(n))
        assert fresh.get("many").state["i"] == n - 1


def test_a_request_without_an_answer_is_sent_again_and_an_answer_is_not(url, monkeypatch):
    from agck.errors import DurabilityError, StoreError
    from agck.stores import objclient
    monkeypatch.setattr(objclient.time, "sleep", lambda s: None)
    c = objclient.ObjectClient(url)
    real = c._ob.put
    fails = {"n": 2, "text": "Generic S3 error: error sending request: connection reset by peer"}

    def flaky(*args, **kwargs):
        if fails["n"]:
            fails["n"] -= 1
            raise RuntimeError(fails["text"])
        return real(*args, **kwargs)

    monkeypatch.setattr(c, "_ob", type("Ob", (), {"put": staticmethod(flaky), "get": c._ob.get,
                                                  "exceptions": c._ob.exceptions})())
    c.put("k", b"abc")                                       # two resets, then through
    assert c.requests["retry"] == 2 and bytes(c.get("k")) == b"abc"
    fails.update(n=objclient.TRANSPORT_RETRIES + 1)
    with pytest.raises(DurabilityError, match="may or may not"):
        c.put("k", b"abc")                                   # never through: raised, not hung
    fails.update(n=1, text="Client error with status 400 Bad Request: no")
    before = c.requests["retry"]
    with pytest.raises(StoreError):
        c.put("k", b"abc")                                   # the server answered: not sent again
    assert c.requests["retry"] == before


def test_a_writer_killed_mid_multipart_upload_leaves_nothing_listed(url):
    """A standalone checkpoint of 48 MiB goes up as a multipart data object; the writer
    is SIGKILLed at instants spread over its upload: the step is never listed, the one
    before reads back, and a collection (grace 0) deletes what the killed put left."""
    import time
    code = f"""
import sys, numpy as np, agck
s = agck.open_store({url!r}, incremental=False)
print("ready", flush=True)
s.put("m", 2, {{"w": np.random.default_rng(2).standard_normal((48 << 20) // 8)}})
print("done", flush=True)
"""
    with agck.open_store(url, incremental=False) as s:
        s.put("m", 1, {"w": np.arange(10)})
    outcomes = []
    for delay in (0.05, 0.2, 0.4, 0.8):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(delay)
        p.kill()
        out, _ = p.communicate(timeout=60)
        outcomes.append("done" in out)
        with agck.open_store(url, incremental=False) as s:
            assert s.steps("m") == ([1, 2] if "done" in out else [1])
            np.testing.assert_array_equal(s.get("m", 1).state["w"], np.arange(10))
            if "done" in out:
                s.delete("m", 2)
    assert not all(outcomes), "every put finished before its kill: nothing was cut mid-upload"
    with agck.open_store(url, grace=0) as s:
        s.collect_garbage()
        assert [o.key for o in s.c.list("runs/m/data/")] == []
