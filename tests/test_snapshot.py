"""checkpoint_every / Snapshotter: capture, async persist, failures, bit-exact resume under SIGKILL."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import OrderedDict, defaultdict

import numpy as np
import pytest
import torch

import agck
from agck import Snapshotter, checkpoint_every
from agck.errors import DurabilityError, EncodeError, InvalidRunNameError, SnapshotError, UsageError
from agck.snapshot import FingerprintWarning
from agck.stores.file.store import FileStore

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
    def run(steps, crash_at=None):
        state = fresh_state()
        torch.manual_seed(7)
        np.random.seed(7)

        @checkpoint_every(2, store=str(tmp_path), run="train", mode=mode, handle_signals=False)
        def step(state, i):
            state = train_step(state, i)
            if i == crash_at:
                raise RuntimeError("crash")  # mid-step: the state is already past the boundary
            return state

        try:
            for i in range(steps):
                state = step(state, i)
        except RuntimeError:
            pass
        finally:
            step.close()  # after a failed call: no final checkpoint of the half-stepped state
        return state, step

    uninterrupted_dir = tmp_path
    full, _ = run(9)
    expected = [p.detach().clone() for p in full["model"].parameters()]
    expected_losses = list(full["losses"])

    # a second run in a new store: crash in step 4 (checkpoint at 4), then resume
    tmp_path = uninterrupted_dir / "again"
    first, _ = run(9, crash_at=4)
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
    step.snapshotter.flush()  # a crash here: step 5 is the last checkpoint
    assert FileStore(tmp_path).steps("skip") == [5]
    step.snapshotter.close()
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
    """Fails the nth put the way a full disk would. ``gates`` (step -> threading.Event):
    the put of that step waits until the test sets its event, so what the test does
    before setting it comes before the write, however the threads are scheduled."""

    def __init__(self, root, fail_on, delay=0.0, gates=None):
        super().__init__(root)
        self.fail_on, self.delay, self.puts, self.gates = fail_on, delay, 0, gates or {}

    def put(self, run, step, state, **kw):
        self.puts += 1
        time.sleep(self.delay)
        gate = self.gates.get(step)
        if gate is not None and not gate.wait(120):
            raise AssertionError(f"the put of step {step} was never let through")
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
    mutated = threading.Event()
    store = FailingStore(tmp_path, fail_on=-1, gates={1: mutated})
    snap = Snapshotter(store, "iso", every=1, mode="async", handle_signals=False)
    t = torch.zeros(1000)
    a = np.zeros(5)
    snap.restore({"t": t, "a": a, "l": [1]})
    snap.snapshot(1, {"t": t, "a": a, "l": [1]})
    t += 5
    a += 5  # mutated while the write is in flight: it waits for this
    mutated.set()
    snap.close()
    st = store.get("iso", 1).state["state"]
    assert torch.equal(st["t"], torch.zeros(1000)) and np.array_equal(st["a"], np.zeros(5))


def every_mutable_kind(tmp_path):
    """A state holding each mutable value type the codec accepts, and a step that
    mutates each of them in place."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    mm = np.memmap(tmp_path / "mm.bin", dtype=np.float32, mode="w+", shape=(4,))
    state = {
        "seen": set(), "buf": bytearray(b"x"), "mv": memoryview(bytearray(4)),
        "mv_np": memoryview(np.zeros(3)), "od": OrderedDict(a=[0]), "dd": defaultdict(list),
        "arr": np.zeros(3), "mm": mm, "t": torch.zeros(3), "p": torch.nn.Parameter(torch.zeros(2)),
        "tup": ([0], {0}, np.zeros(2), bytearray(b"t")), "fz": frozenset({torch.zeros(2)}), "tk": {torch.zeros(2): "v"},
        "model": model, "opt": torch.optim.AdamW(model.parameters(), lr=0.1),
        "g": np.random.default_rng(1), "r": random.Random(1), "tg": torch.Generator().manual_seed(1),
    }

    def step(s, i):
        s["seen"].add(i)
        s["buf"] += bytes([i])
        s["mv"][i % 4] += 1
        s["mv_np"].obj[i % 3] += 1
        s["od"]["a"].append(i)
        s["dd"][i].append(i)
        s["arr"] += 1
        s["mm"] += 1
        s["t"] += 1
        with torch.no_grad():
            s["p"] += 1
        s["tup"][0].append(i)
        s["tup"][1].add(i)
        s["tup"][2][:] += 1
        s["tup"][3].append(i)
        for t in (*s["fz"], *s["tk"]):
            t += 1
        s["model"](torch.ones(1, 3)).sum().backward()
        s["opt"].step()  # mutates the optimizer's state tensors and dicts in place
        s["g"].random(), s["r"].random(), torch.rand(1, generator=s["tg"])
        return s

    return state, step


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and len(a) == len(b)
                and all(same(ka, kb) and same(a[ka], b[kb]) for ka, kb in zip(a, b)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset)) and any(isinstance(x, torch.Tensor) for x in a):
        return type(a) is type(b) and same(sorted(x.tolist() for x in a), sorted(x.tolist() for x in b))
    return type(a) is type(b) and a == b


def test_async_snapshot_captures_every_mutable_kind_by_value(tmp_path):
    """Checkpoint k holds the state at boundary k, though step k+1 mutates it while k is being written."""
    trees = {}
    for mode in ("sync", "async"):
        d = tmp_path / mode
        d.mkdir()
        # async: the write of step k waits until step k+1 has mutated the state
        gates = {1: threading.Event(), 2: threading.Event()} if mode == "async" else {}
        store = FailingStore(d, fail_on=-1, gates=gates)
        state, step = every_mutable_kind(d)
        np.random.seed(0), random.seed(0), torch.manual_seed(0)
        with Snapshotter(store, "iso", every=1, mode=mode, handle_signals=False) as snap:
            state = snap.restore(state)
            for i in snap.steps(3):
                state = step(state, i)
                if i in gates:
                    gates[i].set()
        trees[mode] = {k: store.get("iso", k).state for k in (1, 2, 3)}
    first = trees["async"][1]["state"]
    assert first["seen"] == {0} and first["buf"] == b"x\x00" and first["tup"][1] == {0}
    assert first["opt"]["state"]["state"][0]["step"] == 1
    for k in (1, 2, 3):
        assert same(trees["sync"][k], trees["async"][k]), k


def test_async_staging_refuses_what_sync_refuses(tmp_path):
    # copying a masked array or a sparse tensor into a plain buffer would save what the codec refuses
    snap = Snapshotter(tmp_path, "refuse", every=1, mode="async", handle_signals=False)
    snap.restore({})
    snap.snapshot(1, {"m": np.ma.masked_array([1.0, 2.0], mask=[0, 1])})
    with pytest.raises(SnapshotError, match="subclass"):
        snap.flush()
    snap.snapshot(2, {"s": torch.eye(2).to_sparse()})
    with pytest.raises(SnapshotError, match="sparse"):
        snap.close()
    assert FileStore(tmp_path).steps("refuse") == []


def test_meta_is_copied_at_construction(tmp_path):
    meta = {"tags": ["a"]}
    with Snapshotter(tmp_path, "m", every=1, meta=meta, handle_signals=False) as snap:
        snap.restore({})
        meta["tags"].append("later")
        snap.snapshot(1, {})
    assert FileStore(tmp_path).get("m", 1).meta["user"] == {"tags": ["a"]}


@pytest.mark.parametrize("meta", [{"k": object()}, {"k": {(1, 2): 3}}])
def test_meta_that_cannot_round_trip_is_refused_at_construction(tmp_path, meta):
    with pytest.raises(EncodeError, match="meta"):
        Snapshotter(tmp_path, "m", every=1, mode="async", meta=meta, handle_signals=False)
    assert not (tmp_path / "m").exists()


def test_meta_is_checked_as_the_snapshot_nests_it(tmp_path):
    deep = []
    for _ in range(agck.codec.MAX_DEPTH - 2):
        deep = [deep]
    agck.codec.encode_plain(deep)  # fine as the meta of a plain save; one level too deep as meta['user']
    with pytest.raises(EncodeError, match=r"meta\['user'\].*nesting deeper"):
        Snapshotter(tmp_path, "m", every=1, mode="async", meta=deep, handle_signals=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_closed_snapshotter_refuses_use(tmp_path, mode):
    snap = Snapshotter(tmp_path, "c", every=1, mode=mode, handle_signals=False)
    state = snap.restore({"x": np.zeros(2)})
    snap.completed(1, state)
    snap.close()
    snap.close()  # idempotent
    snap.flush()  # nothing pending
    for use in (lambda: snap.update(state), lambda: snap.completed(2, state), lambda: snap.snapshot(2, state),
                lambda: snap.restore(state), lambda: snap.steps(3)):
        with pytest.raises(UsageError, match="closed"):
            use()
    assert FileStore(tmp_path).steps("c") == [1]


def test_closed_decorator_refuses_use(tmp_path):
    @checkpoint_every(1, store=str(tmp_path), run="c", handle_signals=False)
    def step(state, i):
        return state

    step({}, 0)
    step.close()
    with pytest.raises(UsageError, match="closed"):
        step({}, 1)

    @checkpoint_every(5, store=str(tmp_path), run="c", handle_signals=False)
    def again(state, i):
        return state

    again({}, 0)  # resumes at step 1
    again.snapshotter.close()
    with pytest.raises(UsageError, match="closed"):
        again({}, 0)  # even a step the checkpoint covers


def test_closed_async_snapshotter_exits_cleanly(tmp_path):
    # Used after close, an async snapshotter once started a new writer thread that
    # was still inside torch at interpreter exit: the process aborted (SIGABRT).
    script = textwrap.dedent(f"""
        import numpy as np, torch
        from agck import Snapshotter, UsageError
        snap = Snapshotter({str(tmp_path)!r}, "r", every=1, mode="async", handle_signals=False)
        state = {{"t": torch.zeros(1 << 22), "a": np.zeros(1 << 20)}}
        snap.restore(state)
        snap.completed(1, state)
        snap.close()
        try:
            snap.completed(2, state)
        except UsageError:
            print("refused")
        """)
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stdout.strip(), p.stderr) == (0, "refused", "")
    assert FileStore(tmp_path).steps("r") == [1]


def test_pending_async_write_at_exit_completes_cleanly(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from agck import Snapshotter
        snap = Snapshotter({str(tmp_path)!r}, "r", every=1, mode="async", handle_signals=False)
        state = {{"t": torch.ones(1 << 22)}}
        snap.restore(state)
        snap.completed(1, state)
        """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr) == (0, "")
    assert torch.equal(FileStore(tmp_path).get("r", 1).state["state"]["t"], torch.ones(1 << 22))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_numpy_integer_steps(tmp_path, mode):
    with Snapshotter(tmp_path, "np", every=2, mode=mode, handle_signals=False) as snap:
        snap.restore({})
        snap.snapshot(np.int64(3), {"v": 3})
        snap.completed(np.uint8(4), {"v": 4})
    with Snapshotter(tmp_path, "np", every=2, mode=mode, handle_signals=False) as snap:
        snap.restore({})
        assert snap.start_step == 4
        for i in snap.steps(np.int32(7)):
            snap.update({"v": i + 1})
    assert FileStore(tmp_path).steps("np") == [3, 4, 6, 7]

    @checkpoint_every(2, store=str(tmp_path), run="np-deco", mode=mode, handle_signals=False)
    def step(state, i):
        return state + [int(i)]

    s = []
    for i in np.arange(5):
        s = step(s, i)
    step.close()
    assert s == [0, 1, 2, 3, 4] and FileStore(tmp_path).steps("np-deco") == [2, 4, 5]


@pytest.mark.parametrize("bad", [np.float64(1.0), True, -1, "3"])
def test_bad_steps_are_refused(tmp_path, bad):
    with Snapshotter(tmp_path, "bad", every=1, handle_signals=False) as snap:
        snap.restore({})
        with pytest.raises(UsageError, match="step"):
            snap.snapshot(bad, {})
        with pytest.raises(UsageError, match="steps_done"):
            snap.completed(bad, {})
        with pytest.raises(UsageError, match="total"):
            snap.steps(bad)

    @checkpoint_every(1, store=str(tmp_path), run="bad-deco", handle_signals=False)
    def step(state, i):
        return state

    with pytest.raises(UsageError, match="step index"):
        step({}, bad)
    step.close()
    assert FileStore(tmp_path).steps("bad") == []


@pytest.mark.parametrize("arg, value", [
    ("every", "2"), ("every", 0), ("every", True), ("every", 2.0),
    ("mode", "fast"), ("mode", ["async"]),
    ("max_in_flight", "2"), ("max_in_flight", 0), ("max_in_flight", None),
    ("resume", "yes"), ("handle_signals", None), ("capture_rng", 1), ("on_durable", 5),
])
def test_constructor_arguments_are_checked_up_front(tmp_path, arg, value):
    with pytest.raises(UsageError, match=arg):
        Snapshotter(tmp_path / "s", "r", **{arg: value})
    if arg == "every":
        with pytest.raises(UsageError, match="n must"):
            checkpoint_every(value)
    else:
        with pytest.raises(UsageError, match=arg):  # at decoration, not at the first call
            checkpoint_every(1, **{arg: value})
    assert not (tmp_path / "s").exists()  # nothing opened


def test_run_and_options_are_checked_up_front(tmp_path):
    for run in ("../x", 5, None):
        with pytest.raises(InvalidRunNameError):
            Snapshotter(tmp_path / "s", run)
    with pytest.raises(InvalidRunNameError):
        checkpoint_every(1, run="a/b")(lambda s, i: s)
    with pytest.raises(UsageError, match="evry"):
        checkpoint_every(1, evry=2)
    with pytest.raises(UsageError, match="total"):
        checkpoint_every(1, total=-1)
    assert not (tmp_path / "s").exists()


def test_numpy_integer_arguments_are_accepted(tmp_path):
    with Snapshotter(tmp_path, "r", every=np.int64(2), max_in_flight=np.int32(2), handle_signals=False) as snap:
        assert (type(snap.every), type(snap.max_in_flight)) == (int, int)


def test_restore_refuses_a_run_whose_newest_checkpoint_is_not_a_snapshot(tmp_path):
    with Snapshotter(tmp_path, "mixed", every=1, handle_signals=False) as snap:
        snap.restore({"x": 0})
        for i in snap.steps(2):
            snap.update({"x": i + 1})
    store = FileStore(tmp_path)
    store.put("mixed", 5, {"x": 99})
    store.put("plain", 3, {"x": 1})
    for run in ("mixed", "plain"):
        with Snapshotter(tmp_path, run, every=1, handle_signals=False) as snap:
            with pytest.raises(UsageError, match="not written by a snapshotter") as e:
                snap.restore({"x": 0})
            assert e.value.ref == store.path(run, store.steps(run)[-1])
            assert snap.start_step == 0 and snap.last_durable_step is None
    assert store.steps("mixed") == [1, 2, 5] and store.steps("plain") == [3]
    with Snapshotter(tmp_path, "plain", every=1, resume=False, handle_signals=False) as snap:
        assert snap.restore({"x": 0}) == {"x": 0}
    assert store.steps("plain") == []


@pytest.mark.parametrize("how", ["total", "close"])
def test_decorator_checkpoints_the_end_of_the_loop(tmp_path, how):
    calls = []

    def make():
        extra = {"total": 25} if how == "total" else {}

        @checkpoint_every(10, store=str(tmp_path), run="end", mode="async", handle_signals=False, **extra)
        def step(state, i):
            calls.append(i)
            return state + 1
        return step

    step = make()
    s = 0
    for i in range(25):
        s = step(s, i)
    if how == "total":
        step.snapshotter.flush()
        assert step.snapshotter.last_durable_step == 25  # before close
    step.close()
    assert step.snapshotter.last_durable_step == 25
    assert FileStore(tmp_path).steps("end") == [10, 20, 25]
    calls.clear()
    step = make()
    s = 0
    for i in range(25):
        s = step(s, i)
    step.close()
    assert calls == [] and s == 25
    assert FileStore(tmp_path).steps("end") == [10, 20, 25]


def test_readme_decorator_example_runs_and_resumes(tmp_path, monkeypatch, capsys):
    readme = open(os.path.join(ROOT, "README.md")).read()
    [example] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "total=len(docs)" in b and "init_process_group" not in b]
    monkeypatch.chdir(tmp_path)
    first, second = {}, {}
    exec(example, first)
    exec(example, second)
    assert capsys.readouterr().out.split() == ["25", "25"]
    assert first["step"].snapshotter.start_step == 0 and second["step"].snapshotter.start_step == 25
    assert second["state"]["out"] == first["state"]["out"] == [len(f"doc-{i}") for i in range(25)]
    assert FileStore(tmp_path / "ckpts").steps("doc-pipeline") == [10, 20, 25]


def test_decorator_refuses_steps_past_total(tmp_path):
    @checkpoint_every(10, store=str(tmp_path), run="past", total=2, handle_signals=False)
    def step(state, i):
        return state

    step({}, 0), step({}, 1)
    with pytest.raises(UsageError, match="past total"):
        step({}, 2)
    step.close()


def test_resume_false_without_restore_still_deletes_old_checkpoints(tmp_path):
    with Snapshotter(tmp_path, "old", every=1, handle_signals=False) as snap:
        snap.restore({})
        for _ in snap.steps(5):
            pass
    with Snapshotter(tmp_path, "old", every=1, resume=False, handle_signals=False) as snap:
        snap.completed(1, {})
        snap.completed(2, {})
    assert FileStore(tmp_path).steps("old") == [1, 2]


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


def _signal_in_step(cmds, sig):
    """Run ``cmds`` (one process, or the ranks of one job), each of which prints
    'paused ...' inside a step and then reads its stdin to the end; send ``sig`` to
    each there, wait until every snapshotter says it got it, then close the stdins to
    let the step end. The signal so lands in that step, however slow the machine.
    Returns, per command, (exit status, stdout after the 'paused' line, stderr)."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd in cmds]
    errs, noted = [[] for _ in procs], [threading.Event() for _ in procs]

    def read_stderr(k):
        for line in procs[k].stderr:
            errs[k].append(line)
            if f"{sig.name} received" in line:
                noted[k].set()
    readers = [threading.Thread(target=read_stderr, args=(k,), daemon=True) for k in range(len(procs))]
    outs = []
    try:
        for r in readers:
            r.start()
        for k, p in enumerate(procs):
            assert p.stdout.readline().startswith("paused"), "".join(errs[k])
        for p in procs:
            p.send_signal(sig)
        for k, n in enumerate(noted):
            assert n.wait(120), "".join(errs[k])
        for p in procs:
            p.stdin.close()
        for p in procs:
            outs.append(p.stdout.read())
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in readers:
        r.join(30)
    return [(p.returncode, out, "".join(err)) for p, out, err in zip(procs, outs, errs)]


def test_sigterm_takes_a_final_checkpoint(tmp_path):
    acks = tmp_path / "acks"
    cmd = [sys.executable, "-m", "crashtests.workload", "--store", str(tmp_path / "store"), "--steps", "120",
           "--every", "50", "--ack-log", str(acks), "--pause-at", "73"]
    [(rc, _, err)] = _signal_in_step([cmd], signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err
    assert FileStore(tmp_path / "store").steps("pipeline") == [50, 73]   # 73: the signal's, not the schedule's
    assert [int(x) for x in acks.read_text().split()] == [50, 73]          # acknowledged before exit
    assert "SIGTERM: run 'pipeline' is checkpointed at step 73; exiting with status 143" in err
    assert "Traceback" not in err


_PAUSING_LOOP = """
import signal, sys
from agck import checkpoint_every
{before}
@checkpoint_every(4, store={store!r}, run="loop", total=100)
def step(state, i):
    state["n"] += i
    if i + 1 == 6:
        print("paused 6", flush=True)
        sys.stdin.read()
    return state

state = {{"n": 0}}
for i in range(100):
    state = step(state, i)
step.close()
"""


def test_ctrl_c_checkpoints_and_exits_130_without_a_traceback(tmp_path):
    script = _PAUSING_LOOP.format(before="", store=str(tmp_path))
    [(rc, _, err)] = _signal_in_step([[sys.executable, "-c", script]], signal.SIGINT)
    assert rc == 128 + signal.SIGINT, err
    assert FileStore(tmp_path).steps("loop") == [4, 6]
    assert FileStore(tmp_path).get("loop", 6).state["state"] == {"n": 15}
    assert "SIGINT: run 'loop' is checkpointed at step 6; exiting with status 130" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_a_signal_handler_of_the_program_gets_the_signal_after_the_checkpoint(tmp_path):
    own = """
def own(signum, frame):
    print("own handler", flush=True)
    sys.exit(3)
signal.signal(signal.SIGINT, own)
"""
    script = _PAUSING_LOOP.format(before=own, store=str(tmp_path))
    [(rc, out, err)] = _signal_in_step([[sys.executable, "-c", script]], signal.SIGINT)
    assert (rc, out) == (3, "own handler\n"), err
    assert FileStore(tmp_path).steps("loop") == [4, 6]
    assert "Traceback" not in err


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_sigterm_under_torch_distributed_flushes_and_every_rank_exits_143(tmp_path):
    """No out-of-cadence checkpoint (the ranks would not agree on its step): every
    rank exits at the signal's step, naming the last committed one, without a traceback."""
    cmds = [[sys.executable, "-m", "crashtests.workload", "--store", str(tmp_path / "store"), "--steps", "20",
             "--every", "4", "--world", "2", "--rank", str(r), "--rendezvous", str(tmp_path / "rdv"),
             "--pause-at", "6"] for r in range(2)]
    for rc, _, err in _signal_in_step(cmds, signal.SIGTERM):
        assert rc == 128 + signal.SIGTERM, err
        assert "SIGTERM: run 'pipeline' is checkpointed at step 4; exiting with status 143" in err
        assert "Traceback" not in err
    assert FileStore(tmp_path / "store").steps("pipeline") == [4]


# --- async snapshots take a large tensor that did not change uncopied, and the store confirms it ---

_BIG = 1 << 21     # float32 elements: 8 MiB, a chunked piece of its own


def _frozen_run(store, steps, every, on_step=None):
    """An async run over a frozen 8 MiB tensor and a small part changing every step;
    returns the snapshotter and, per step, the state's bytes at that step."""
    torch.manual_seed(0)
    base = torch.randn(_BIG)
    part = torch.zeros(1000)
    at: dict = {}
    with Snapshotter(store, "f", every=every, mode="async", resume=False, capture_rng=False) as snap:
        for i in snap.steps(steps):
            part += 1
            if on_step is not None:
                on_step(i, base)
            at[i + 1] = (base.clone(), part.clone())
            snap.update({"base": base, "part": part})
        snap.flush()
    return snap, at


def _assert_each_checkpoint_holds_its_step(store, at):
    for step in store.steps("f"):
        st = store.get("f", step).state["state"]
        assert torch.equal(st["base"], at[step][0]) and torch.equal(st["part"], at[step][1]), step


def test_async_snapshots_take_an_unchanged_large_tensor_uncopied(store):
    snap, at = _frozen_run(store, 30, 5)
    referenced = [w["referenced_bytes"] for w in snap.write_stats]
    assert referenced[0] == 0 and all(r == _BIG * 4 for r in referenced[1:]), referenced
    assert snap.dropped_steps == []
    _assert_each_checkpoint_holds_its_step(store, at)


def test_a_change_the_version_counter_misses_drops_that_snapshot_only(store):
    """Written through a numpy view, the tensor's version counter does not move: the
    store finds its bytes differ from the last checkpoint's, the snapshot is not
    written, and the next one copies it again."""
    def touch(i, base):
        if i == 12:
            # after step 10's write is done (on a slow store it may still be in flight, and
            # then it is step 10 that is caught differing, rightly, as in the test below)
            deadline = time.monotonic() + 60
            while 10 not in store.steps("f") and time.monotonic() < deadline:
                time.sleep(0.01)
            base.numpy()[7] += 1.0
    snap, at = _frozen_run(store, 30, 5, touch)
    assert snap.dropped_steps == [15]
    assert 15 not in store.steps("f") and {20, 25, 30} <= set(store.steps("f"))
    _assert_each_checkpoint_holds_its_step(store, at)


def test_a_tensor_edited_behind_its_version_counter_costs_one_snapshot_not_every_other(store, caplog):
    """EMA weights and hand-written optimizers edit a tensor through ``.numpy()`` or
    ``.data`` at every step: the first snapshot that takes it uncopied is dropped, and
    the tensor is copied at every snapshot after, so no other is (it was every other
    one, for the whole run)."""
    def ema(i, base):
        base.numpy()[i % 1000] += 0.5          # the version counter does not move
    with caplog.at_level("WARNING", logger="agck"):
        snap, at = _frozen_run(store, 60, 5, ema)
    assert len(snap.dropped_steps) == 1, snap.dropped_steps
    assert len(store.steps("f")) == 11
    referenced = [w["referenced_bytes"] for w in snap.write_stats]
    assert not any(referenced), referenced     # the one write that took it uncopied was the one dropped
    _assert_each_checkpoint_holds_its_step(store, at)
    assert "copied at every snapshot" in caplog.text and "1 snapshot(s) were not written" in caplog.text


def test_a_change_while_the_snapshot_is_written_is_caught(store, monkeypatch):
    """The pipeline changes the uncopied tensor right after the step boundary, before
    the writer reads it: the checkpoint would hold the next step's bytes, so it is
    not written."""
    from agck import snapshot as snapshot_mod
    hits = []

    def after_stage(name):
        if name == "snapshot.after_stage":
            hits.append(name)
            if len(hits) == 3:
                holder["base"].add_(1.0)        # in place, version counter and all: after staging
    holder: dict = {}
    monkeypatch.setattr(snapshot_mod.failpoints, "hit", after_stage)
    snap, at = _frozen_run(store, 30, 5, lambda i, base: holder.setdefault("base", base))
    assert snap.dropped_steps == [15]
    _assert_each_checkpoint_holds_its_step(store, at)     # (``at`` saw the change from step 16 on)


def test_a_put_refuses_unchanged_tensors_it_cannot_confirm(store):
    big = torch.randn(_BIG)
    ptr = {big.data_ptr()}
    with pytest.raises(agck.ContentChangedError, match="no earlier checkpoint"):
        store.put("p", 1, {"big": big}, expect_unchanged=ptr)
    store.put("p", 1, {"big": big})
    store.put("p", 2, {"big": big}, expect_unchanged=ptr)
    big[5] += 1
    with pytest.raises(agck.ContentChangedError, match="differs from the run's last checkpoint"):
        store.put("p", 3, {"big": big}, expect_unchanged=ptr)
    assert store.steps("p") == [1, 2]
    assert torch.equal(store.get("p", 2).state["big"][:5], big[:5])


def test_a_restarted_run_fences_the_snapshotter_it_replaced(store):
    """Two snapshotters of one run: the second begins a new epoch, after which the
    first one's snapshots fail (SnapshotError caused by StaleEpochError) and commit
    nothing, while the second one's land."""
    old = Snapshotter(store, "f", every=1, mode="sync", handle_signals=False, capture_rng=False)
    old.restore({"x": 0})
    old.completed(1, {"x": 1})
    new = Snapshotter(store, "f", every=1, mode="sync", handle_signals=False, capture_rng=False)
    assert new.restore({"x": 0}) == {"x": 1} and new.start_step == 1
    assert new.epoch == old.epoch + 1
    with pytest.raises(agck.StaleEpochError):
        old.completed(2, {"x": "zombie"})
    new.completed(2, {"x": 2})
    assert store.get("f", 2).state["state"] == {"x": 2}
    new.close()
    try:
        old.close()          # whatever it still tries to write is refused the same way
    except agck.StaleEpochError:
        pass
    assert store.get("f", 2).state["state"] == {"x": 2} and store.steps("f") == [1, 2]
