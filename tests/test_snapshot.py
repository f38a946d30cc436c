"""checkpoint_every / Snapshotter: capture, async persist, failures, bit-exact resume under SIGKILL."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from agck import Snapshotter, checkpoint_every
from agck.errors import DurabilityError, SnapshotError
from agck.snapshot import FingerprintWarning
from agck.stores.file import FileStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workload(tmp_path, *extra, check=True):
    cmd = [sys.executable, "-m", "crashtests.workload", "--store", str(tmp_path / "store"), "--steps", "18",
           "--every", "4", "--ack-log", str(tmp_path / "acks"), "--out", str(tmp_path / "out.json"), *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(p.stderr)
    return p


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    _workload(d)
    return json.load(open(d / "out.json"))["final_hash"]


def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(state, i):
    model, opt, sched = state["model"], state["opt"], state["sched"]
    x = torch.randn(4, 8)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    state["losses"].append(loss.item())
    state["noise"] = np.random.rand(3)
    return state


def fresh_state():
    model, opt, sched = make_model()
    return {"model": model, "opt": opt, "sched": sched, "losses": [], "noise": None}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_loop_form_checkpoints_every_n_and_at_the_end(tmp_path, mode):
    acked = []
    with Snapshotter(tmp_path, "r", every=3, mode=mode, on_durable=lambda s, ref: acked.append(s)) as snap:
        state = snap.restore({"x": np.zeros(4)})
        for i in snap.steps(10):
            state["x"] = state["x"] + i
    assert acked == [3, 6, 9, 10]
    assert snap.last_durable_step == 10
    assert FileStore(tmp_path).steps("r") == [3, 6, 9, 10]
    ck = FileStore(tmp_path).get("r", 6)
    assert np.array_equal(ck.state["state"]["x"], np.full(4, 0 + 1 + 2 + 3 + 4 + 5, dtype=float))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_restores_modules_optimizers_and_rng_in_place(tmp_path, mode):
    def run(steps, crash_after=None):
        state = fresh_state()
        torch.manual_seed(7)
        np.random.seed(7)

        @checkpoint_every(2, store=str(tmp_path), run="train", mode=mode, handle_signals=False)
        def step(state, i):
            return train_step(state, i)

        for i in range(steps):
            state = step(state, i)
            if crash_after is not None and i + 1 == crash_after:
                step.close()
                return state, step
        step.close()
        return state, step

    uninterrupted_dir = tmp_path
    full, _ = run(9)
    expected = [p.detach().clone() for p in full["model"].parameters()]
    expected_losses = list(full["losses"])

    # a second run in a new store: stop after 5 steps (checkpoint at 4), then resume
    tmp_path = uninterrupted_dir / "again"
    first, _ = run(9, crash_after=5)
    model_before = first["model"]
    resumed, step = run(9)
    assert step.snapshotter.start_step == 4
    assert resumed["model"] is not model_before  # a fresh process would have fresh objects
    for p, e in zip(resumed["model"].parameters(), expected):
        assert torch.equal(p, e)
    assert resumed["losses"] == expected_losses
    assert resumed["opt"].state_dict()["state"][0]["step"] == full["opt"].state_dict()["state"][0]["step"]
    assert resumed["sched"].last_epoch == full["sched"].last_epoch


def test_decorator_skips_covered_steps_and_returns_restored_state(tmp_path):
    calls = []

    def make():
        @checkpoint_every(5, store=str(tmp_path), run="skip", handle_signals=False)
        def step(state, i):
            calls.append(i)
            state["n"] += 1
            return state
        return step

    step = make()
    s = {"n": 0}
    for i in range(7):
        s = step(s, i)
    step.close()
    calls.clear()
    step = make()
    s = {"n": 0}
    for i in range(12):
        s = step(s, i)
    step.close()
    assert calls == list(range(5, 12))
    assert s["n"] == 12


def test_generators_in_state_are_restored(tmp_path):
    g = np.random.default_rng(3)
    r = random.Random(5)
    tg = torch.Generator().manual_seed(9)
    with Snapshotter(tmp_path, "g", every=1, handle_signals=False) as snap:
        state = snap.restore({"g": g, "r": r, "tg": tg})
        for i in snap.steps(2):
            g.random(), r.random(), torch.rand(1, generator=tg)
    want = (g.random(), r.random(), torch.rand(1, generator=tg))
    g2, r2, tg2 = np.random.default_rng(0), random.Random(0), torch.Generator().manual_seed(0)
    with Snapshotter(tmp_path, "g", every=1, handle_signals=False) as snap:
        state = snap.restore({"g": g2, "r": r2, "tg": tg2})
    assert state["g"] is g2
    assert (g2.random(), r2.random(), torch.rand(1, generator=tg2)) == want


def test_global_rng_is_restored(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with Snapshotter(tmp_path, "rng", every=1, handle_signals=False) as snap:
        snap.restore({})
        for _ in snap.steps(1):
            pass
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    with Snapshotter(tmp_path, "rng", every=1, handle_signals=False) as snap:
        snap.restore({})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


class FailingStore(FileStore):
    """Fails the nth put the way a full disk would."""

    def __init__(self, root, fail_on, delay=0.0):
        super().__init__(root)
        self.fail_on, self.delay, self.puts = fail_on, delay, 0

    def put(self, run, step, state, **kw):
        self.puts += 1
        time.sleep(self.delay)
        if self.puts == self.fail_on:
            raise DurabilityError("write failed: disk full", ref=self.path(run, step))
        return super().put(run, step, state, **kw)


def test_async_failure_surfaces_on_next_step_and_keeps_previous(tmp_path):
    store = FailingStore(tmp_path, fail_on=2)
    snap = Snapshotter(store, "f", every=1, mode="async", handle_signals=False)
    snap.restore({"x": np.ones(3)})
    with pytest.raises(SnapshotError, match="disk full"):
        for i in snap.steps(10):
            time.sleep(0.05)
    snap.close()
    assert store.steps("f") == [1]
    assert np.array_equal(store.get("f").state["state"]["x"], np.ones(3))


def test_async_failure_surfaces_at_close(tmp_path):
    store = FailingStore(tmp_path, fail_on=1, delay=0.1)
    snap = Snapshotter(store, "f", every=1, mode="async", handle_signals=False)
    snap.restore({"x": 1})
    snap.snapshot(1, {"x": 1})
    with pytest.raises(SnapshotError):
        snap.close()


def test_backpressure_bounds_in_flight(tmp_path):
    store = FailingStore(tmp_path, fail_on=-1, delay=0.2)
    seen = []
    snap = Snapshotter(store, "b", every=1, mode="async", max_in_flight=1, handle_signals=False)
    snap.restore({"x": np.zeros(10)})
    t0 = time.perf_counter()
    for i in snap.steps(4):
        seen.append(snap._pending)
    snap.close()
    assert max(seen) <= 1
    assert time.perf_counter() - t0 >= 0.6  # the writer's pace, not unbounded queueing
    assert store.steps("b") == [1, 2, 3, 4]


def test_async_snapshot_is_isolated_from_later_mutation(tmp_path):
    store = FailingStore(tmp_path, fail_on=-1, delay=0.2)
    snap = Snapshotter(store, "iso", every=1, mode="async", handle_signals=False)
    t = torch.zeros(1000)
    a = np.zeros(5)
    snap.restore({"t": t, "a": a, "l": [1]})
    snap.snapshot(1, {"t": t, "a": a, "l": [1]})
    t += 5
    a += 5  # mutated while the write is in flight
    snap.close()
    st = store.get("iso", 1).state["state"]
    assert torch.equal(st["t"], torch.zeros(1000)) and np.array_equal(st["a"], np.zeros(5))


def test_resume_false_deletes_old_checkpoints(tmp_path):
    with Snapshotter(tmp_path, "old", every=1, handle_signals=False) as snap:
        snap.restore({})
        for _ in snap.steps(3):
            pass
    with Snapshotter(tmp_path, "old", every=2, resume=False, handle_signals=False) as snap:
        snap.restore({})
        assert snap.start_step == 0
        for _ in snap.steps(2):
            pass
    assert FileStore(tmp_path).steps("old") == [2]


def test_fingerprint_change_warns(tmp_path, monkeypatch):
    with Snapshotter(tmp_path, "fp", every=1, handle_signals=False) as snap:
        snap.restore({})
        for _ in snap.steps(1):
            pass
    import agck.snapshot as snapmod
    real = snapmod.fingerprint
    monkeypatch.setattr(snapmod, "fingerprint", lambda: {**real(), "torch": "0.0.0"})
    with pytest.warns(FingerprintWarning, match="torch"):
        with Snapshotter(tmp_path, "fp", every=1, handle_signals=False) as snap:
            snap.restore({})


def test_corrupt_newest_is_skipped_on_resume(tmp_path):
    with Snapshotter(tmp_path, "c", every=1, handle_signals=False) as snap:
        snap.restore({"v": 0})
        for i in snap.steps(3):
            snap.update({"v": i + 1})
    p = FileStore(tmp_path).path("c", 3)
    data = bytearray(open(p, "rb").read())
    data[100] ^= 0xFF
    open(p, "wb").write(data)
    with Snapshotter(tmp_path, "c", every=1, handle_signals=False) as snap:
        state = snap.restore({"v": 0})
        assert snap.start_step == 2 and state == {"v": 2}
        assert [r.step for r in snap.recovery.rejected] == [3]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bit_exact_resume_after_sigkill_at_random_steps(tmp_path, reference, mode):
    rng = random.Random(42 if mode == "sync" else 43)
    kills = sorted(rng.sample(range(1, 18), 2))
    for k in kills:
        p = _workload(tmp_path, "--mode", mode, "--die-at", str(k), check=False)
        assert p.returncode == -signal.SIGKILL, p.stderr
        acks = [int(x) for x in open(tmp_path / "acks").read().split()]
        assert max(acks, default=0) <= k  # nothing acknowledged that was not reached
        if mode == "sync":  # sync acknowledges before the next step starts
            assert max(acks, default=0) == k - k % 4
    _workload(tmp_path, "--mode", mode)
    out = json.load(open(tmp_path / "out.json"))
    assert out["resumed_from"] > 0
    assert out["final_hash"] == reference


@pytest.mark.slow
def test_bit_exact_resume_after_external_sigkill(tmp_path, reference):
    """Kill at a random instant (not a step boundary the workload chose)."""
    rng = random.Random(7)
    for _ in range(2):
        cmd = [sys.executable, "-m", "crashtests.workload", "--store", str(tmp_path / "store"), "--steps", "18",
               "--every", "4", "--ack-log", str(tmp_path / "acks"), "--step-sleep", "0.05", "--mode", "async"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(2.0, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _workload(tmp_path)
    assert json.load(open(tmp_path / "out.json"))["final_hash"] == reference


def test_sigterm_takes_a_final_checkpoint(tmp_path):
    acks = tmp_path / "acks"
    cmd = [sys.executable, "-m", "crashtests.workload", "--store", str(tmp_path / "store"), "--steps", "400",
           "--every", "50", "--ack-log", str(acks), "--step-sleep", "0.05", "--hashes", str(tmp_path / "h")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (acks.exists() and acks.read_text().split()):
        time.sleep(0.1)  # the first scheduled checkpoint: handlers are installed by now
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    steps = FileStore(tmp_path / "store").steps("pipeline")
    acked = [int(x) for x in acks.read_text().split()]
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), proc.stderr.read()
    assert steps[-1] < 400 and steps[-1] % 50 != 0  # taken because of the signal, not the schedule
    assert acked[-1] == steps[-1]  # and acknowledged before exit
