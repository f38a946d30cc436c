"""Tiers under misuse: one store given as both tiers, options that would be ignored, a
plain durable tier under an encrypted local one, a flush while the durable tier stalls,
a put after close, two processes on one local tier with a byte limit, a damaged local
epoch (STORAGE.md, tiers rules T1-T3). Each was a defect once; the invariant is the
crash campaign's: nothing acknowledged is lost."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import agck
from agck.errors import StoreConnectionError, UsageError
from agck.stores import open_store
from agck.stores.tiered import TieredStore

KEY = "correct horse battery staple"


def state(i: int, n: int = 50_000) -> dict:
    return {"w": np.full(n, i, np.float32), "i": i}


def test_one_store_given_as_both_tiers_is_refused_however_it_is_spelled(tmp_path, monkeypatch, pg_dsn):
    d = tmp_path / "d"
    d.mkdir()
    monkeypatch.chdir(tmp_path)
    for local, durable in ((str(d), str(d) + "/"), ("d", str(d)), (str(d), f"file://{d}"),
                           (f"sqlite:///{tmp_path}/x.db", f"sqlite:///{tmp_path}/x.db"),
                           (f"sqlite:///{tmp_path}/x.db", "sqlite:///x.db")):
        with pytest.raises(UsageError, match="one store"):
            TieredStore(local, durable, keep_local=1)
    with pytest.raises(UsageError, match="inside"):
        TieredStore(str(d / "local"), str(d), keep_local=1)
    prefix = f"tier_{os.getpid()}"
    a = open_store(pg_dsn, prefix=prefix, init=True)
    b = open_store(pg_dsn.replace("127.0.0.1", "localhost"), prefix=prefix)
    with pytest.raises(UsageError, match="one store"):
        TieredStore(a, b)
    # side by side, and the same server with another prefix, are two places
    TieredStore(str(tmp_path / "l"), str(tmp_path / "r")).close()
    TieredStore(str(tmp_path / "l2"), open_store(pg_dsn, prefix=prefix + "_d", init=True)).close()


def test_the_same_directory_as_both_tiers_lost_steps_once_and_is_refused_now(tmp_path):
    """The defect: TieredStore(d, d, keep_local=1) reported 5 steps durable and kept only step 5."""
    with pytest.raises(UsageError):
        TieredStore(str(tmp_path), str(tmp_path) + "/", keep_local=1)


def test_options_with_store_objects_and_a_plain_durable_tier_under_an_encrypted_one_are_refused(tmp_path):
    a, b = open_store(str(tmp_path / "a")), open_store(str(tmp_path / "b"))
    with pytest.raises(UsageError, match="options"):
        TieredStore(a, b, key=KEY)
    with pytest.raises(UsageError, match="options"):
        TieredStore(a, str(tmp_path / "c"), bogus=1)
    enc = open_store(str(tmp_path / "e"), key=KEY)
    with pytest.raises(UsageError, match="in the clear"):
        TieredStore(enc, b)
    t = TieredStore(str(tmp_path / "l"), str(tmp_path / "r"), key=KEY)     # URLs: both encrypted
    t.put("r", 1, state(1))
    assert t.flush(timeout=30)
    assert open_store(str(tmp_path / "r"), key=KEY).get("r").state["i"] == 1
    t.close()


def test_flush_checks_its_timeout_and_returns_within_it_while_the_durable_tier_stalls(tmp_path):
    t = TieredStore(str(tmp_path / "l"), str(tmp_path / "r"))
    for bad in ("1", [1], float("nan"), True, -1, float("inf")):
        with pytest.raises(UsageError, match="timeout"):
            t.flush(timeout=bad)
    stall = threading.Event()

    def stalled(*a, **k):          # a server that holds the request until its read timeout
        stall.wait(20)
        raise StoreConnectionError("read timed out")
    t.durable.put = stalled
    t.durable.steps = stalled
    t.put("r", 1, state(1))
    started = time.monotonic()
    assert t.flush(timeout=1) is False
    assert time.monotonic() - started < 3
    stall.set()
    t.close()


def test_durable_error_says_so_while_one_copy_stalls(tmp_path, monkeypatch):
    monkeypatch.setattr("agck.stores.tiered.STALL_NOTICE", 0.5)
    t = TieredStore(str(tmp_path / "l"), str(tmp_path / "r"))
    stall = threading.Event()
    real = t.durable.put

    def stalled(*a, **k):           # a server that accepted the request and does not answer
        stall.wait(20)
        return real(*a, **k)
    t.durable.put = stalled
    t.put("r", 1, state(1))
    time.sleep(1.5)
    assert "has taken" in (t.durable_error or "")
    stall.set()
    assert t.flush(timeout=30) and t.durable_error is None
    t.close()


def test_an_outage_backlog_is_copied_newest_first_and_the_local_tier_stays_within_its_limits(tmp_path):
    t = TieredStore(str(tmp_path / "l"), str(tmp_path / "r"), keep_local=2)
    real = t.durable.put
    down = threading.Event()
    down.set()

    def put(*a, **k):
        if down.is_set():
            raise StoreConnectionError("connection refused")
        return real(*a, **k)
    t.durable.put = put
    peak = 0
    for i in range(1, 31):
        t.put("r", i, state(i))
        time.sleep(0.02)
        peak = max(peak, len(t.local.steps("r")))
    time.sleep(0.5)
    # keep_local=2, plus the one being written and what the copier has not pruned yet on a
    # busy machine; without rule T5 all 30 stay
    assert len(t.local.steps("r")) <= 3 and peak <= 8, (t.local.steps("r"), peak)
    assert t.local.steps("r")[-1] == 30
    down.clear()
    assert t.flush(timeout=60)
    assert open_store(str(tmp_path / "r")).steps("r")[-1] == 30
    t.close()


def test_a_put_after_close_is_refused(tmp_path):
    t = TieredStore(str(tmp_path / "l"), str(tmp_path / "r"))
    t.put("r", 1, state(1))
    t.close()
    with pytest.raises(UsageError, match="closed"):
        t.put("r", 2, state(2))


def test_two_stores_on_one_local_tier_never_drop_each_others_uncopied_steps(tmp_path):
    local, durable_a, durable_b = (str(tmp_path / n) for n in ("local", "da", "db"))
    a = TieredStore(local, durable_a, keep_local=None)
    a.put("a", 1, state(1))
    assert a.flush(timeout=30)

    def down(*args, **kwargs):
        raise StoreConnectionError("connection refused")
    a.durable.put = down                    # a's durable tier goes down: its next steps stay local
    for i in range(2, 6):
        a.put("a", i, state(i))
    b = TieredStore(local, durable_b, keep_local_bytes=1, keep_local=None)
    for i in range(1, 8):
        b.put("b", i, state(i))
    assert b.flush(timeout=30)
    time.sleep(0.5)                          # b's copier prunes after its copies
    assert a.local.steps("a") == [1, 2, 3, 4, 5]     # none of a's uncopied steps dropped
    assert len(b.local.steps("b")) < 7               # b pruned its own
    for i in range(2, 6):
        assert open_store(local).get("a", i).state["i"] == i
    b.close()
    a.close()


def test_a_damaged_local_epoch_falls_back_to_the_durable_tier(tmp_path):
    t = TieredStore(str(tmp_path / "l"), str(tmp_path / "r"))
    e1 = t.begin_epoch("r")
    t.put("r", 1, state(1), epoch=e1)
    assert t.flush(timeout=30)
    t.close()
    path = tmp_path / "l" / "r" / ".epoch"
    data = bytearray(path.read_bytes())
    data[0] ^= 0x40                          # one flipped byte
    path.write_bytes(bytes(data))
    t = TieredStore(str(tmp_path / "l"), str(tmp_path / "r"))
    e2 = t.begin_epoch("r")                  # what Snapshotter.restore does
    assert e2 > e1 and t.local.epoch("r") == e2
    t.put("r", 2, state(2), epoch=e2)
    assert t.get("r").state["i"] == 2
    t.close()


def test_a_stream_whose_function_returns_no_iterable_is_a_usage_error(tmp_path):
    with agck.Journal(str(tmp_path / "j"), "run") as j:
        with pytest.raises(UsageError, match="not an iterable"):
            list(j.stream("x", lambda: None))


def test_a_pipeline_restarts_from_its_local_tier_while_the_durable_tier_is_down(tmp_path, pg_dsn):
    """Rule T4: a TieredStore opens, restores, puts and reads on its local tier alone
    while the durable tier refuses connections; its epoch, begun locally, is carried to
    the durable tier when it is back, and the incarnation before it commits no more."""
    from crashtests.faultproxy import FaultProxy
    from agck.errors import StaleEpochError
    proxy = FaultProxy("127.0.0.1", 5432)
    prefix = f"outage_{os.getpid()}"
    dsn = pg_dsn.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    open_store(dsn, prefix=prefix, init=True).close()
    durable = dsn + ("&" if "?" in dsn else "?") + f"agck_prefix={prefix}"
    local = str(tmp_path / "local")

    def run_to(stop: int, store):
        with agck.Snapshotter(store, "job", every=5, handle_signals=False) as snap:
            st = snap.restore({"acc": np.zeros(4), "seen": []})
            for i in snap.steps(stop):
                st["acc"] += i
                st["seen"].append(i)
        return st

    old = TieredStore(local, durable)
    run_to(20, old)
    assert old.flush(timeout=60)
    e_old = old.epoch("job")
    proxy.cut_for(25)                          # the durable tier refuses every connection for 25 s
    started = time.monotonic()
    new = TieredStore(local, durable)          # the pipeline restarted (the host stayed)
    final = run_to(30, new)                    # restore, steps, puts: the local tier alone
    took = time.monotonic() - started
    assert took < 12, took
    assert new.epoch("job") > e_old and new.durable_error is not None or new._durable is None
    whole = run_to(30, open_store(str(tmp_path / "alone")))
    assert np.array_equal(final["acc"], whole["acc"]) and final["seen"] == whole["seen"]
    with pytest.raises(StaleEpochError):         # the incarnation before it: fenced in the local tier
        old.put("job", 99, state(99), epoch=e_old)
    assert new.flush(timeout=90)                 # back: the copier caught up
    d = open_store(pg_dsn, prefix=prefix)
    assert d.steps("job")[-1] == new.last_local_step("job") and d.epoch("job") == new.epoch("job")
    new.close()
    from_durable = run_to(30, TieredStore(str(tmp_path / "empty-local"), open_store(pg_dsn, prefix=prefix)))
    assert np.array_equal(from_durable["acc"], whole["acc"]) and from_durable["seen"] == whole["seen"]
    old.close()
    proxy.close()
