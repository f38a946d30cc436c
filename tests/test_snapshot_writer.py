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

import agck  # noqa: E402
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


# --- failures of the background write, and signal handlers ---------------------------------

def _failing_puts(snap, fail_from: int, gate: threading.Event | None = None):
    """Make the store's puts of steps >= fail_from fail; with ``gate``, only once the
    test has set it (what it queued before is queued behind the failure)."""
    put = snap.store.put

    def failing(run, step, *a, **kw):
        if step >= fail_from:
            if gate is not None:
                assert gate.wait(120), "the failing put was never let through"
            raise OSError(28, "No space left on device")
        return put(run, step, *a, **kw)
    snap.store.put = failing


def test_a_failed_background_write_neither_deadlocks_nor_hides_its_step(tmp_path):
    """The failure is raised at the next snapshot, naming its step; that snapshot gives
    its staging slot back, so the ones after it (and close) do not wait forever."""
    state = {"w": torch.zeros(1000)}
    snap = Snapshotter(str(tmp_path), "run", every=1, mode="async", handle_signals=False)
    snap.restore(state)
    snap.snapshot(1, state)
    snap.flush()
    _failing_puts(snap, 2)
    snap.snapshot(2, state)
    with pytest.raises(agck.SnapshotError, match=r"step 2 of run 'run' failed: .*No space left"):
        snap.snapshot(3, state)         # waits for step 2's write, then reports it
    errors = []

    def next_snapshot():
        try:
            snap.snapshot(4, state)
            snap.flush()
        except agck.SnapshotError as e:
            errors.append(e)
    t = threading.Thread(target=next_snapshot, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive()     # it used to wait forever for the slot the failed snapshot kept
    assert len(errors) == 1 and "step 4" in str(errors[0])
    del snap.store.put          # the store's own again
    snap.close()
    assert snap.last_durable_step == 1


def test_writes_queued_behind_a_failure_are_named(tmp_path):
    state = {"w": torch.zeros(1000)}
    snap = Snapshotter(str(tmp_path), "run", every=1, mode="async", max_in_flight=3, handle_signals=False)
    snap.restore(state)
    queued = threading.Event()
    _failing_puts(snap, 1, queued)
    for step in (1, 2, 3):
        snap.snapshot(step, state)
    queued.set()
    with pytest.raises(agck.SnapshotError, match=r"step 1 .*steps \[2, 3\] queued behind it were not written"):
        snap.flush()
    snap.close()


def test_staging_failure_is_a_snapshot_error_and_frees_the_slot(tmp_path, monkeypatch):
    state = {"w": torch.zeros(10)}
    snap = Snapshotter(str(tmp_path), "run", every=1, mode="async", handle_signals=False)
    snap.restore(state)
    real = snapshot_mod._Stager.stage
    monkeypatch.setattr(snapshot_mod._Stager, "stage", lambda self, tree, seen, untrusted=frozenset(): (_ for _ in ()).throw(
        RuntimeError("cannot allocate pinned memory")))
    with pytest.raises(agck.SnapshotError, match="staging step 1 of run 'run' failed: RuntimeError"):
        snap.snapshot(1, state)
    monkeypatch.setattr(snapshot_mod._Stager, "stage", real)
    snap.snapshot(2, state)             # the slot came back: no wait
    snap.close()
    assert snap.last_durable_step == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_on_durable_error_says_the_checkpoint_is_durable(tmp_path, mode):
    def boom(step, ref):
        raise ValueError("callback bug")
    state = {"w": np.arange(4)}
    snap = Snapshotter(str(tmp_path), "run", every=1, mode=mode, handle_signals=False, on_durable=boom)
    snap.restore(state)
    with pytest.raises(agck.SnapshotError, match="on_durable raised for step 1 .*ValueError") as ei:
        snap.snapshot(1, state)
        snap.flush()
    assert "durable" in ei.value.hint and snap.last_durable_step == 1
    snap.on_durable = None
    snap.close()


def test_max_in_flight_is_bounded(tmp_path):
    with pytest.raises(agck.UsageError, match="at most 64"):
        Snapshotter(str(tmp_path), "run", every=1, max_in_flight=10 ** 12)


def test_signal_handlers_go_back_whatever_order_snapshotters_close_in(tmp_path):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    a = Snapshotter(str(tmp_path / "a"), "a", every=1, mode="sync")
    b = Snapshotter(str(tmp_path / "b"), "b", every=1, mode="sync")
    a.close()                                             # not in reverse order of opening
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    assert b._stop_signal == signal.SIGTERM and a._stop_signal is None     # the open one has it
    b._stop_signal = None
    b.close()
    assert signal.getsignal(signal.SIGTERM) is before
