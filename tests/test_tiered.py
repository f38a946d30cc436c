"""Tiered checkpoints (agck/stores/tiered.py): a local tier in front of a durable one.

A put is acknowledged local at once and durable once the background copier has
committed it in the durable tier (read back there by a fresh store object); a durable
tier that is down blocks nothing and is caught up when it is back; a process killed
between a local put and its copy leaves the copy to the next store opened on the
tiers; a lost or damaged local tier is read past, to the durable one, and
``checkpoint_every`` resumes from it bit-exactly; the local tier keeps its newest
checkpoints and never deletes the only copy of a state.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import time

import pytest

import agck
from agck.errors import DurabilityError, UsageError
from agck.stores import open_store
from agck.stores.tiered import TieredStore

from readme_examples import ROOT


def state(i: int) -> dict:
    return {"w": np.random.default_rng(i).standard_normal(300_000).astype(np.float32), "i": i}


def same(a: dict, b: dict) -> bool:
    return np.array_equal(a["w"], b["w"]) and a["i"] == b["i"]


@pytest.fixture
def tiers(tmp_path):
    return str(tmp_path / "local"), f"sqlite:///{tmp_path}/durable.db"


def test_a_put_is_local_at_once_and_durable_after_the_copier(tiers):
    local, durable = tiers
    s = TieredStore(local, durable, keep_local=None)
    for i in (1, 2, 3):
        s.put("run", i, state(i), meta={"i": i})
        assert s.last_local_step("run") == i
    assert s.flush(timeout=60)
    assert s.last_durable_step("run") == 3 and not s.pending and s.copied == 3
    s.close()
    d = open_store(durable)
    assert d.steps("run") == [1, 2, 3]
    for i in (1, 2, 3):
        ck = d.get("run", i)
        assert same(ck.state, state(i)) and ck.meta == {"i": i}


def test_every_kth_is_copied_and_flush_copies_the_newest(tiers):
    local, durable = tiers
    s = TieredStore(local, durable, durable_every=3, keep_local=None)
    for i in range(1, 8):
        s.put("run", i, state(i))
    assert s.flush(timeout=60)
    s.close()
    assert open_store(durable).steps("run") == [3, 6, 7]     # every third, and the newest at the flush


class _Down(Exception):
    pass


def test_a_durable_tier_that_is_down_blocks_nothing_and_is_caught_up(tiers, monkeypatch):
    local, durable = tiers
    d = open_store(durable)
    real = d.put
    down = {"on": True}

    def put(*a, **k):
        if down["on"]:
            raise DurabilityError("the durable tier is down (a test)")
        return real(*a, **k)
    monkeypatch.setattr(d, "put", put)
    monkeypatch.setattr("agck.stores.tiered.RETRY_FIRST", 0.05)
    s = TieredStore(local, d, keep_local=2)
    for i in range(1, 6):
        s.put("run", i, state(i))        # acknowledged local: the pipeline goes on
    assert not s.flush(timeout=0.5)
    assert s.durable_error and "down" in s.durable_error
    time.sleep(0.3)
    # nothing durable, and the local tier within keep_local all the same: the backlog's older
    # states are dropped, the newest (the durable candidate) kept (STORAGE.md, rule T5)
    assert s.local.steps("run") == [4, 5]
    down["on"] = False
    assert s.flush(timeout=60)
    assert s.durable_error is None and open_store(durable).steps("run") == [4, 5]     # the newest first
    s.put("run", 6, state(6))
    assert s.flush(timeout=60)
    s.close()
    assert open_store(local).steps("run") == [5, 6]     # keep_local=2, once the durable tier holds the rest


def test_a_process_killed_after_its_local_put_leaves_the_copy_to_the_next_store(tiers):
    local, durable = tiers
    code = f"""
import os, numpy as np
from agck.stores.tiered import TieredStore
s = TieredStore({local!r}, {durable!r}, durable_every=1000)     # nothing copied before the kill
for i in (1, 2):
    s.put("run", i, {{"w": np.random.default_rng(i).standard_normal(300_000).astype(np.float32), "i": i}})
print("acknowledged", flush=True)
os.kill(os.getpid(), 9)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == -9 and "acknowledged" in done.stdout, done.stderr
    assert open_store(durable).steps("run") == []
    s = TieredStore(local, durable)
    assert s.pending == [("run", 2)]                   # the newest step the durable tier lacks
    assert s.flush(timeout=60)
    s.close()
    assert same(open_store(durable).get("run", 2).state, state(2))


def test_a_lost_or_damaged_local_tier_is_read_past_to_the_durable_one(tiers):
    local, durable = tiers
    s = TieredStore(local, durable, keep_local=None)
    for i in (1, 2):
        s.put("run", i, state(i))
    assert s.flush(timeout=60)
    s.close()
    s = TieredStore(local, durable, durable_every=1000, keep_local=None)
    s.put("run", 3, state(3))                          # local only: not queued, and close() copies nothing
    s.close()
    assert open_store(durable).steps("run") == [1, 2]
    # the local copy of step 2 damaged: read from the durable tier, verified
    path = open_store(local).path("run", 2)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
    t = TieredStore(local, durable, durable_every=1000, keep_local=None)
    assert same(t.get("run", 2).state, state(2))
    assert agck.recover(t, "run").step == 3
    assert t.flush(timeout=60)                          # step 3, queued when t opened: durable now
    t.close()
    shutil.rmtree(local)                                # the host lost: its local tier with it
    u = TieredStore(local, durable, durable_every=1000)
    assert u.last_local_step("run") is None and u.last_durable_step("run") == 3
    assert agck.recover(u, "run").step == 3 and same(u.get("run").state, state(3))
    u.close()


def test_checkpoint_every_resumes_from_the_durable_tier_after_the_host_is_lost(tiers):
    local, durable = tiers

    def run_to(stop: int, store) -> list:
        out = []
        with agck.Snapshotter(store, "job", every=5) as snap:
            st = snap.restore({"acc": np.zeros(4), "seen": []})
            for i in snap.steps(stop):
                st["acc"] += i
                st["seen"].append(i)
            out = st
        return out

    s = TieredStore(local, durable, keep_local=2)
    run_to(20, s)
    assert s.flush(timeout=60)
    s.close()
    shutil.rmtree(local)
    t = TieredStore(local, durable)
    final = run_to(30, t)
    t.close()
    whole = run_to(30, open_store(os.path.dirname(local) + "/alone"))
    assert np.array_equal(final["acc"], whole["acc"]) and final["seen"] == whole["seen"]


def test_bad_settings_and_what_a_tiered_store_refuses(tiers):
    local, durable = tiers
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(UsageError):
            TieredStore(local, durable, durable_every=bad)
        with pytest.raises(UsageError):
            TieredStore(local, durable, keep_local=bad)
        with pytest.raises(UsageError):
            TieredStore(local, durable, keep_local_bytes=bad)
    for bad in (-1, 1.5, True, "2", None):
        with pytest.raises(UsageError):
            TieredStore(local, durable, replicas=bad)
    s = TieredStore(local, durable)
    assert s.parts_store(create=False) is None      # no multi-rank part written in either tier
    s.close()


def test_a_multi_rank_commit_record_found_after_a_crash_is_not_copied_nor_counted_durable(tiers):
    """The scan at open queues the local tier's newest step the durable tier lacks; a
    multi-rank commit record (its parts not known to be durable) is left to its job,
    and the older local steps are not pruned as if it were durable."""
    local, durable = tiers
    loc = open_store(local)
    for i in (1, 2, 3):
        loc.put("run", i, state(i))
    loc.put("run", 4, {"agck.commit": {"version": 1, "kind": "snapshot", "epoch": 1, "world_size": 1,
                                       "parts": [["run.e1.r0", "00"]]}})
    loc.close()
    s = TieredStore(local, durable, keep_local=1)
    assert s.flush(timeout=60)
    s.close()
    assert open_store(durable).steps("run") == []
    assert open_store(local).steps("run") == [1, 2, 3, 4]
