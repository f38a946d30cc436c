"""Recovery's judgement on every backend: only a verdict on a checkpoint's bytes is
walked past; anything else (a missing torch, an argument this machine cannot
honour, a newer format) is raised, and retention never deletes because of it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import agck
from agck import errors, recovery
from agck.recovery import prune, recover_run

from storehelpers import corrupt_payload, state_for

torch = pytest.importorskip("torch")


def _fill(store, steps=(1, 2, 3), corrupt=(), spec=None):
    for s in steps:
        store.put("r", s, state_for(s, n=4096))
    for s in corrupt:
        corrupt_payload(spec, store, "r", s)


@pytest.mark.parametrize("cls,verdict", [
    (errors.CorruptCheckpointError, True), (errors.MalformedCheckpointError, True), (errors.FormatError, True),
    (errors.UnsupportedVersionError, False), (errors.DependencyError, False), (errors.UsageError, False),
    (errors.StoreConnectionError, False), (errors.StoreError, False), (errors.DurabilityError, False),
    (errors.SchemaMismatchError, False), (errors.CheckpointNotFoundError, False), (errors.AgckError, False),
])
def test_only_verdicts_on_bytes_are_verdicts(cls, verdict):
    assert cls("x").verdict is verdict and cls.verdict is verdict     # a property of the class


@pytest.mark.parametrize("cls", [errors.DependencyError, errors.UsageError, errors.StoreError,
                                 errors.UnsupportedVersionError, errors.AgckError])
def test_recovery_and_prune_never_walk_past_an_unjudged_checkpoint(store_spec, store, monkeypatch, cls):
    _fill(store)
    real = store.read

    def read(run, step, **kw):
        if step >= 2:
            raise cls(f"cannot judge step {step} here")
        return real(run, step, **kw)

    monkeypatch.setattr(store, "read", read)
    with pytest.raises(cls):
        recover_run(store, "r")
    with pytest.raises(cls):
        store.get("r")
    with pytest.raises(cls):
        store.prune("r", keep_last=1)
    with pytest.raises(cls):
        recovery.verify_store(store, "r")
    assert store.steps("r") == [1, 2, 3]


def test_prune_deletes_nothing_when_nothing_verifies(store_spec, store):
    _fill(store, corrupt=(1, 2, 3), spec=store_spec)
    with pytest.raises(errors.NoValidCheckpointError):
        prune(store, "r", keep_last=1)
    assert store.steps("r") == [1, 2, 3]


def test_prune_keeps_the_newest_valid_and_every_newer_one_even_outside_the_policy(store_spec, store):
    _fill(store, steps=(1, 2, 3, 4), corrupt=(3, 4), spec=store_spec)
    assert store.prune("r", keep_last=1) == [1]
    assert store.steps("r") == [2, 3, 4]
    assert recover_run(store, "r").step == 2
    assert store.prune("r", keep_last=1, drop_unverified=True) == [3, 4]     # asked for: then they go
    assert store.steps("r") == [2]
    with pytest.raises(errors.UsageError, match="drop_unverified"):
        store.prune("r", keep_last=1, drop_unverified="yes")


@pytest.mark.parametrize("verdict", [errors.DamagedChunkError, errors.CorruptCheckpointError])
def test_prune_and_gc_under_reads_that_fail_delete_nothing_a_healthy_read_keeps(store_spec, store, monkeypatch,
                                                                                verdict):
    """Reads that judge intact checkpoints damaged (as a wrong read of every checkpoint
    over 64 MiB once did) make prune and gc delete nothing a healthy read would keep:
    prune keeps every checkpoint newer than the newest one that verifies, and gc
    every chunk a listing names, whatever its verdict."""
    base = np.arange(300_000, dtype=np.int64)           # shared by every step: chunks in common
    states = {s: {"base": base, "own": np.full(70_000, s, dtype=np.int64)} for s in (1, 2, 3, 4)}
    for s, st in states.items():
        store.put("r", s, st)
    real_read = store.read

    def read(run, step, **kw):
        if step >= 3:
            raise verdict(f"step {step} misjudged on purpose", ref=store.ref(run, step))
        return real_read(run, step, **kw)

    monkeypatch.setattr(store, "read", read)
    monkeypatch.setattr(agck.recovery.POLICIES, "prune",     # prune alone: its collection comes next
                        lambda st, run, **kw: recovery.prune(st, run, **kw))
    assert store.prune("r", keep_last=1) == [1]          # 3 and 4 "fail", 2 verifies: only 1 goes
    monkeypatch.undo()

    def misjudged(buf, *, verify, ref):
        raise verdict("misjudged on purpose", ref=ref)

    monkeypatch.setattr(agck.stores.content, "listed_addresses", misjudged)
    got = store.collect_garbage()
    monkeypatch.undo()
    if got is not None:                                  # a store that shares chunks: every listing misjudged
        assert sorted(got.damaged + got.unreadable) == sorted(store.ref("r", s) for s in (2, 3, 4)), got
    assert store.steps("r") == [2, 3, 4]
    _, url, opts = store_spec
    with agck.open_store(url, **{k: v for k, v in opts.items() if k != "init"}) as fresh:
        for s in (2, 3, 4):
            ck = fresh.read("r", s)
            np.testing.assert_array_equal(ck.state["own"], states[s]["own"])
            np.testing.assert_array_equal(ck.state["base"], base)
        assert recovery.verify_store(fresh, "r").rejected == []


@pytest.mark.parametrize("kw", [{"keep_last": -1}, {"keep_every": 0}, {"keep_last": "2"}, {"before": -3},
                                {"keep_last": 1.5}, {"keep_every": True}])
def test_prune_refuses_bad_policies(store, kw):
    _fill(store, steps=(1, 2))
    with pytest.raises(errors.UsageError):
        store.prune("r", **kw)
    assert store.steps("r") == [1, 2]


def test_prune_with_no_torch_deletes_nothing(tmp_path):
    """Torch checkpoints, the newest corrupt, a process where `import torch` fails:
    prune cannot judge them, so it exits 4 and deletes nothing."""
    root = str(tmp_path / "store")
    store = agck.open_store(root)
    _fill(store, corrupt=(3,), spec=("file", root, {}))
    code = ("import sys; sys.modules['torch'] = None\n"
            "from agck.cli import main\n"
            f"sys.exit(main(['prune', {root!r}, '--run', 'r', '--keep-last', '1']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 4, p.stderr
    assert "torch" in p.stderr and "Traceback" not in p.stderr
    assert store.steps("r") == [1, 2, 3]
    assert recover_run(store, "r").step == 2


def test_map_location_this_machine_cannot_honour_is_not_a_walk_back(store):
    _fill(store, steps=(1, 2))
    if torch.cuda.is_available():
        bad = f"cuda:{torch.cuda.device_count()}"
    else:
        bad = "cuda"
    for loc in (bad, "banana", "cuda:7" if torch.cuda.device_count() < 8 else "banana"):
        with pytest.raises(errors.UsageError):
            recover_run(store, "r", map_location=loc)
        with pytest.raises(errors.UsageError):
            store.get("r", map_location=loc)
    assert recover_run(store, "r", map_location="cpu").step == 2


def test_newer_format_stops_the_walk(tmp_path):
    """A container with a required flag this reader does not know (a newer minor
    version's feature) is not damaged, so recovery must not resume from an older one."""
    import struct

    from agck import format as fmt
    store = agck.open_store(str(tmp_path / "store"))
    _fill(store, steps=(1, 2))
    path = store.ref("r", 2)
    data = bytearray(open(path, "rb").read())
    flags_at = 8  # magic[4] major:u16 minor:u16 flags:u32
    struct.pack_into("<I", data, flags_at, 1 << 15)
    struct.pack_into("<Q", data, 56, fmt.digest(bytes(data[:56])))
    open(path, "wb").write(data)
    with pytest.raises(errors.UnsupportedVersionError):
        recover_run(store, "r")
    with pytest.raises(errors.UnsupportedVersionError):
        store.prune("r", keep_last=1)
    assert store.steps("r") == [1, 2]


def test_deleted_while_walking_is_passed_over(store):
    _fill(store, steps=(1, 2, 3))
    real = store.read

    def read(run, step, **kw):
        if step == 3:
            store.delete(run, 3)
        return real(run, step, **kw)

    store.read = read
    rec = recover_run(store, "r")
    assert rec.step == 2 and [r.step for r in rec.rejected] == [3]


def test_numpy_integers_are_steps(store):
    store.put("r", np.int64(3), {"x": 1})
    assert store.steps("r") == [3] and type(store.steps("r")[0]) is int
    assert store.get("r", np.uint8(3)).state == {"x": 1}


_EIO_RUN = """
import errno, mmap, os, sys
import agck
from agck import checkpoint
root, bad = sys.argv[1], sys.argv[2]
real_mmap, real_open = mmap.mmap, os.open

class DyingDisk(real_mmap):
    # the disk fails under a mapping: its pages are gone (reading one is SIGBUS)
    def __new__(cls, fileno, length, *a, **kw):
        m = real_mmap.__new__(cls, fileno, length, *a, **kw)
        if os.path.realpath(f"/proc/self/fd/{fileno}") == bad:
            os.truncate(bad, 0)
        return m
checkpoint._mmap.mmap = DyingDisk

import builtins
real_builtin_open = builtins.open
class EIOFile:
    def __init__(self, f): self._f = f
    def __getattr__(self, k): return getattr(self._f, k)
    def __enter__(self): return self
    def __exit__(self, *e): self._f.close()
    def readinto(self, b): raise OSError(errno.EIO, os.strerror(errno.EIO))
    def read(self, *a): raise OSError(errno.EIO, os.strerror(errno.EIO))
def failing_open(path, mode="r", *a, **kw):
    f = real_builtin_open(path, mode, *a, **kw)
    return EIOFile(f) if os.path.realpath(str(path)) == bad and "b" in mode else f
checkpoint.open = failing_open

store = agck.open_store(root, incremental=False)
rec = agck.recover(store, "r")
print(rec.step, rec.rejected[0].reason if rec.rejected else None)
"""


def test_recovery_survives_a_disk_that_returns_eio(tmp_path):
    """A disk that fails under the newest checkpoint (its pages unreadable, its reads
    EIO): recovery reads rather than maps what it judges, so it walks back past the
    checkpoint with the I/O error as the reason instead of dying of SIGBUS."""
    import subprocess
    import sys
    root = tmp_path / "s"
    store = agck.open_store(str(root), incremental=False)
    for step in (1, 2):
        store.put("r", step, {"w": np.arange(1 << 20, dtype=np.float32) + step})
    bad = os.path.realpath(store.path("r", 2))
    store.close()
    script = tmp_path / "recover.py"
    script.write_text(_EIO_RUN)
    done = subprocess.run([sys.executable, str(script), str(root), bad], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    step, reason = done.stdout.split(" ", 1)
    assert step == "1" and "Input/output error" in reason, done.stdout
