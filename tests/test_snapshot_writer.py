"""The background writer: its priority, what each write cost, and staging buffers
made (and their pages touched) ahead of the first snapshot."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agck import Snapshotter  # noqa: E402
from agck import snapshot as snapshot_mod  # noqa: E402


@pytest.mark.parametrize("nice", [0, 5])
def test_writer_priority_and_per_write_figures(tmp_path, monkeypatch, nice):
    monkeypatch.setattr(snapshot_mod, "WRITER_NICE", nice)
    seen = {}

    def on_durable(step, ref):
        if sys.platform.startswith("linux"):
            seen[step] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    state = {"w": torch.randn(64, 64)}
    main_nice = os.getpriority(os.PRIO_PROCESS, 0) if sys.platform.startswith("linux") else 0
    with Snapshotter(str(tmp_path), "run", every=1, mode="async", handle_signals=False,
                     on_durable=on_durable) as snap:
        snap.restore(state)
        for i in snap.steps(3):
            state["w"].add_(1)
    assert [w["step"] for w in snap.write_stats] == [1, 2, 3]
    for w in snap.write_stats:
        assert w["end"] >= w["start"] and w["cpu_user_s"] >= 0
        assert w["thread"].startswith("agck-snapshot")
    if sys.platform.startswith("linux"):
        assert set(seen.values()) == {min(19, main_nice + snapshot_mod.WRITER_NICE)}
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice   # the pipeline's is untouched


def test_sync_mode_reports_writes_and_keeps_priority(tmp_path):
    state = {"w": np.arange(10)}
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform.startswith("linux") else 0
    with Snapshotter(str(tmp_path), "run", every=2, mode="sync", handle_signals=False) as snap:
        snap.restore(state)
        for i in snap.steps(4):
            state["w"] += 1
    assert [w["step"] for w in snap.write_stats] == [2, 4]
    assert all(w["thread"] == threading.current_thread().name for w in snap.write_stats)
    if sys.platform.startswith("linux"):
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.int8,
                                   torch.float8_e4m3fn])
def test_staging_buffers_made_ahead_round_trip(tmp_path, dtype):
    n = (snapshot_mod._TOUCH_MIN * 2) // torch.empty((), dtype=dtype).element_size()
    src = (torch.arange(n) % 7).to(torch.float32).to(dtype).reshape(-1, 16)
    arr = (np.arange(snapshot_mod._TOUCH_MIN) % 11).astype(np.int16).reshape(-1, 8)
    state = {"t": src.clone(), "a": arr.copy(), "p": torch.nn.Parameter(torch.ones(snapshot_mod._TOUCH_MIN // 4))}
    with Snapshotter(str(tmp_path), "run", every=2, mode="async", handle_signals=False) as snap:
        snap.restore(state)
        for i in snap.steps(4):   # made ahead at step 1, used at steps 2 and 4
            pass
    staged = [b for s in snap._stagers for b in s.pool.values()]
    assert any(isinstance(b, torch.Tensor) and b.dtype == dtype and b.shape == src.shape for b in staged)
    fresh = {"t": torch.zeros_like(src), "a": np.zeros_like(arr), "p": torch.nn.Parameter(torch.zeros(1))}
    with Snapshotter(str(tmp_path), "run", every=1, mode="async", handle_signals=False) as snap2:
        got = snap2.restore(fresh)
    assert torch.equal(got["t"].view(torch.uint8), src.view(torch.uint8)) and np.array_equal(got["a"], arr)
    assert isinstance(got["p"], torch.nn.Parameter) and torch.equal(got["p"].detach(), state["p"].detach())


def test_staging_buffers_are_made_before_the_first_snapshot(tmp_path):
    state = {"t": torch.randn(snapshot_mod._TOUCH_MIN // 2, 4), "small": torch.ones(3)}
    with Snapshotter(str(tmp_path), "run", every=5, mode="async", handle_signals=False) as snap:
        snap.restore(state)
        it = snap.steps(10)
        for i in it:
            state["t"].add_(1)
            if i == 2:      # two steps done, no snapshot yet: the writer has made the buffers
                stager = snap._stagers[0]
                deadline = time.monotonic() + 10
                while not stager.pool and time.monotonic() < deadline:
                    time.sleep(0.01)
                made = dict(stager.pool)
                assert any(isinstance(b, torch.Tensor) and b.shape == state["t"].shape for b in made.values())
    # the first snapshot used the very buffers made ahead
    assert any(b is made_b for b in snap._stagers[0].pool.values() for made_b in made.values())
    assert snap.last_durable_step == 10
    got = Snapshotter(str(tmp_path), "run", every=5, handle_signals=False)
    try:
        assert torch.equal(got.restore({"t": None, "small": None})["t"], state["t"])
    finally:
        got.close()
