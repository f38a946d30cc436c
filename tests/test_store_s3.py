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
    from agck.stores.s3.client import parse_url
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
            s._objects = __import__("agck.stores.s3.chunks", fromlist=["x"]).ObjectChunks(url)
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
    from agck.stores.s3 import log as s3log, store as s3
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
    from agck.stores.s3 import client as objclient
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
            steps = s.steps("m")
            # A kill between the commit and the "done" line leaves step 2 listed without the
            # acknowledgement: allowed, as long as what is listed reads back whole.
            assert (steps == [1, 2]) if "done" in out else (steps in ([1], [1, 2]))
            np.testing.assert_array_equal(s.get("m", 1).state["w"], np.arange(10))
            if 2 in steps:
                w = np.random.default_rng(2).standard_normal((48 << 20) // 8)
                np.testing.assert_array_equal(s.get("m", 2).state["w"], w)
                s.delete("m", 2)
            outcomes[-1] = 2 in steps
    assert not all(outcomes), "every put committed before its kill: nothing was cut mid-upload"
    with agck.open_store(url, grace=0) as s:
        s.collect_garbage()
        assert [o.key for o in s.c.list("runs/m/data/")] == []


# -- hostile inputs at the object store's surface ------------------------------------------

SECRET = "SECRETxyzzy42"


def _cli(argv, env_extra=None, timeout=120):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "agck.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("bad", [f"s3://AKIAQQ:{SECRET}@bucket/p?endpoint=http://127.0.0.1:9",
                                 f"s3://bucket/p?endpoint=http://AKIAQQ:{SECRET}@127.0.0.1:9",
                                 f"s3://bucket/p?endpoint=http%3A%2F%2FAKIAQQ%3A{SECRET}%40127.0.0.1%3A9"])
def test_credentials_in_a_url_are_refused_and_never_shown(bad):
    with pytest.raises(UsageError) as e:
        agck.open_store(bad)
    assert SECRET not in str(e.value) and "credentials" in str(e.value)
    r = _cli(["ls", bad])
    assert r.returncode == 2 and SECRET not in r.stdout + r.stderr, r
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    # nor through a catalog: refused before anything reaches the database
    dsn = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    from urllib.parse import quote
    with pytest.raises(UsageError) as e:
        agck.open_store(f"{dsn}{'&' if '?' in dsn else '?'}agck_objects={quote(bad, safe='')}")
    assert SECRET not in str(e.value)


@pytest.mark.parametrize("env, query", [({"AWS_REGION": "us-east-1\r"}, ""), ({}, "&region=us-east-1%0D"),
                                        ({"AWS_ACCESS_KEY_ID": "AKIA\r"}, ""),
                                        ({"AWS_SECRET_ACCESS_KEY": SECRET + "\r"}, ""),
                                        ({"AWS_SESSION_TOKEN": "tok\nen"}, "")])
def test_header_values_are_checked_before_the_client_sees_them(url, env, query):
    """Values that cannot go in an HTTP header made the client panic (a Rust panic and a
    traceback, exit 1): now one UsageError line naming where the value came from."""
    r = _cli(["ls", url + query], env)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr and "panicked" not in r.stderr and SECRET not in r.stderr, r.stderr
    assert ("region" in r.stderr.lower()) or any(k in r.stderr for k in env), r.stderr


def test_a_missing_profile_is_one_clear_error(url):
    r = _cli(["ls", url + "&profile=nope-no-such"])
    assert r.returncode == 2 and "no AWS profile named 'nope-no-such'" in r.stderr and "Traceback" not in r.stderr, r


@pytest.mark.parametrize("query, msg", [("?endpoint=", "empty endpoint"), ("&region=a&region=b", "more than once"),
                                        ("&allow_http=maybe", "neither true nor false"),
                                        ("&allow_http=false", "http:// endpoint with allow_http=false"),
                                        ("&read_timeout=0", "seconds"), ("&retry_for=inf", "seconds"),
                                        ("&connect_timeout=x", "seconds")])
def test_parameters_that_mean_nothing_are_refused(url, query, msg):
    with pytest.raises(UsageError, match=msg):
        agck.open_store(url.partition("?")[0] + query if query.startswith("?") else url + query)


def test_a_server_that_never_answers_fails_within_the_stated_bound():
    """A server that accepts connections and never answers: `agck ls` was silent for more
    than 900 s. Every request is bounded (TIMEOUTS; settable per URL): with 1 s read and
    2 s retry timeouts it fails in seconds, with one line; the defaults bound it under a minute."""
    import socket
    import time
    from agck.stores.s3.client import TIMEOUTS
    assert TIMEOUTS["retry_for"] + TIMEOUTS["read_timeout"] < 60
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass
    threading.Thread(target=accept, daemon=True).start()
    try:
        port = listener.getsockname()[1]
        t0 = time.monotonic()
        r = _cli(["ls", f"s3://bucket/p?endpoint=http://127.0.0.1:{port}&read_timeout=1&retry_for=2"
                        "&connect_timeout=1"], timeout=60)
        took = time.monotonic() - t0
        assert r.returncode not in (0, 1) and "Traceback" not in r.stderr, r
        assert len(r.stderr.strip().splitlines()) <= 2, r.stderr
        assert took < 20, took
    finally:
        stop.set()
        listener.close()
        for c in held:
            c.close()


def test_a_refusal_with_a_4xx_is_definite_and_names_its_code(seaweed):
    """A 400 is an answer: nothing was written. It was a DurabilityError ("may or may not
    have been written") with the S3 code cut off."""
    from agck.errors import DurabilityError, StoreError
    base = s3_url(seaweed)
    query = base.partition("?")[2]
    with pytest.raises(StoreError) as e:
        with agck.open_store(f"s3://Bad_Bucket/p?{query}") as s:
            s.put("r", 1, {"x": np.arange(3)})
    assert not isinstance(e.value, DurabilityError) and "400" in str(e.value), e.value


@pytest.mark.parametrize("option, value, msg", [("grace", "1h", "grace must be a number of seconds"),
                                                ("stale_after", -1, "stale_after=-1 is not"),
                                                ("grace", float("nan"), "grace=nan is not"),
                                                ("client", 5, "client must be")])
def test_s3_options_out_of_range_are_refused_by_name(url, option, value, msg):
    with pytest.raises(UsageError, match=msg):
        agck.open_store(url, **{option: value})


def test_no_credentials_at_all_says_so(url):
    """With no key, no profile and the metadata service off (AWS_EC2_METADATA_DISABLED, which
    the tests set), the error says that no credentials were found: it named the instance
    metadata address and a 403."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k in ("AWS_REGION",)}
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    r = subprocess.run([sys.executable, "-m", "agck", "ls", url], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "no AWS credentials" in r.stderr and "169.254" not in r.stderr, r


def test_a_prefix_that_is_not_utf8_is_refused_not_replaced():
    from agck.stores.s3.client import parse_url
    with pytest.raises(UsageError, match="not UTF-8"):
        parse_url("s3://b/a%FFb")
    assert parse_url("s3://b/caf%C3%A9")[1] == "café"


def test_a_lock_held_from_another_host_is_waited_for_out_loud(url, monkeypatch, caplog):
    """A collector's lock left by a process on another host blocks chunked puts until it
    goes stale (600 s): the wait was silent. It is now warned about, naming the lock."""
    import logging
    import time
    from agck.errors import StoreError
    from agck.stores.s3 import store as s3
    monkeypatch.setattr(s3, "LOCK_WAIT", 2.0)
    monkeypatch.setattr(s3, "LOCK_NOTICE", 0.3)
    with agck.open_store(url) as s:
        s.c.put(f"locks/gc-{time.time_ns():020d}-abcd.otherhost.4242", b"{}")
        caplog.set_level(logging.WARNING, logger="agck")
        with pytest.raises(StoreError, match="stayed locked"):
            s.put("r", 1, {"w": np.ones(1 << 20, np.float32)})
    assert "otherhost.4242" in caplog.text and "stops counting" in caplog.text, caplog.text
