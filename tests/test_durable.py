"""Durable writes that bypass the page cache (O_DIRECT): same bytes, same crash
guarantees, clean fallback where the file system refuses direct I/O."""

from __future__ import annotations

import errno
import mmap
import os
import random
import threading

import numpy as np
import pytest
import xxhash

from agck import checkpoint, durable, failpoints, format
from agck.errors import CheckpointExistsError, DurabilityError, UsageError
from crashtests.simfs import MODES, SimFS, crash_at_every_operation

O_DIRECT = getattr(os, "O_DIRECT", 0)


@pytest.fixture
def small_chunks(monkeypatch):
    """Direct writes of 64 KiB so that small test files take every path."""
    monkeypatch.setattr(durable, "DIRECT_CHUNK", 64 << 10)
    monkeypatch.setattr(durable, "DIRECT_MIN", 1)
    monkeypatch.setattr(durable, "_no_direct_devices", set())
    monkeypatch.setattr(durable, "DIRECT_IO", "always")     # these tests are about the direct path itself


class Spy(durable.FileSystem):
    """Records each write as (O_DIRECT on?, bytes)."""

    def __init__(self):
        self.writes: list[tuple[bool, int]] = []

    def write(self, fd, data):
        import fcntl
        on = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT) if O_DIRECT else False
        n = super().write(fd, data)
        self.writes.append((on, n))
        return n


def _aligned(n: int, offset: int = 0) -> memoryview:
    a = np.frombuffer(mmap.mmap(-1, n + offset + 4096), dtype=np.uint8)
    a[offset:offset + n] = np.frombuffer(os.urandom(n), dtype=np.uint8)
    return memoryview(a[offset:offset + n])


def _random_parts(rng: random.Random) -> list:
    parts = []
    for _ in range(rng.randint(0, 10)):
        n = rng.choice([0, 1, 63, 64, 511, 512, 4096, 5000, 65536, 70000, 300_000])
        kind = rng.randrange(3)
        if kind == 0:
            parts.append(os.urandom(n))
        elif kind == 1:     # page-aligned memory at various offsets: the copy-free path when it lines up
            parts.append(_aligned(n, rng.choice([0, 64, 512, 4096])))
        else:
            parts.append(np.frombuffer(os.urandom(n), dtype=np.uint8).reshape(-1, 1) if n else b"")
    return parts


def _joined(parts) -> bytes:
    return b"".join(bytes(memoryview(p).cast("B")) if memoryview(p).ndim else bytes(p) for p in parts)


def test_direct_writes_the_same_bytes(tmp_path, small_chunks):
    rng = random.Random(7)
    saw_direct = False
    for trial in range(80):
        parts = _random_parts(rng)
        want = _joined(parts)
        spy = Spy()
        path = str(tmp_path / f"f{trial}")
        durable.write_atomic(path, parts, size=len(want), fs=spy, direct=rng.choice([True, None]))
        with open(path, "rb") as f:
            assert f.read() == want, trial
        saw_direct |= any(on for on, _ in spy.writes)
    assert sorted(os.listdir(tmp_path)) == sorted(f"f{i}" for i in range(80))   # no temp files
    assert saw_direct == _supports_direct(tmp_path)


def _supports_direct(d) -> bool:
    fd = os.open(str(d / ".probe"), os.O_WRONLY | os.O_CREAT)
    try:
        return durable.REAL.set_direct(fd, True)
    finally:
        os.close(fd)
        os.unlink(str(d / ".probe"))


def test_direct_write_from_aligned_memory_copies_nothing(tmp_path, small_chunks):
    data = _aligned(1 << 20)
    spy = Spy()
    path = str(tmp_path / "f")
    durable.write_atomic(path, [data, b"tail"], size=data.nbytes + 4, fs=spy)
    with open(path, "rb") as f:
        assert f.read() == bytes(data) + b"tail"
    if any(on for on, _ in spy.writes):
        # all of the aligned run went straight out in DIRECT_CHUNK writes; only the tail is buffered
        assert [n for on, n in spy.writes if on] == [64 << 10] * 16
        assert [n for on, n in spy.writes if not on] == [4]


def test_small_or_unsized_writes_stay_buffered(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "_no_direct_devices", set())
    spy = Spy()
    durable.write_atomic(str(tmp_path / "a"), [bytes(100_000)], size=100_000, fs=spy)
    durable.write_atomic(str(tmp_path / "b"), [bytes(100_000)], fs=spy)
    durable.write_atomic(str(tmp_path / "c"), [bytes(100_000)], size=1 << 40, fs=spy, direct=False)
    assert spy.writes and not any(on for on, _ in spy.writes)


def test_refused_direct_io_falls_back(tmp_path, small_chunks):
    """A file system that refuses the flag, or refuses the writes (EINVAL): buffered
    writes, same bytes, and the file system is not asked again."""
    want = os.urandom(300_000)

    class NoFlag(durable.FileSystem):
        def set_direct(self, fd, on):
            return False

    durable.write_atomic(str(tmp_path / "a"), [want], size=len(want), fs=NoFlag())
    assert open(tmp_path / "a", "rb").read() == want

    class Refuses(Spy):
        def write(self, fd, data):
            import fcntl
            if O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().write(fd, data)

    fs = Refuses()
    durable.write_atomic(str(tmp_path / "b"), [want[:1000], want[1000:]], size=len(want), fs=fs)
    assert open(tmp_path / "b", "rb").read() == want
    assert fs.writes and not any(on for on, _ in fs.writes)
    if _supports_direct(tmp_path):
        assert durable._no_direct_devices   # remembered: the next file is buffered from the start
        fs2 = Spy()
        durable.write_atomic(str(tmp_path / "c"), [want], size=len(want), fs=fs2)
        assert not any(on for on, _ in fs2.writes)


def test_short_direct_write_is_resumed(tmp_path, small_chunks):
    want = os.urandom(500_000)

    class Short(Spy):
        def write(self, fd, data):
            view = memoryview(data)
            return super().write(fd, view[:max(1, view.nbytes // 2 - 100)])   # unaligned, partial

    fs = Short()
    durable.write_atomic(str(tmp_path / "f"), [want], size=len(want), fs=fs)
    assert open(tmp_path / "f", "rb").read() == want


def test_direct_write_power_loss_at_every_operation(tmp_path, small_chunks):
    """Simulated power loss at every system call of a direct write: the old file
    or the new one, never a torn one; afterwards the new one whole."""
    old, new = os.urandom(3000), os.urandom(200_000)
    mid = np.frombuffer(mmap.mmap(-1, 150_000), dtype=np.uint8)
    mid[:] = np.frombuffer(new[100:150_100], dtype=np.uint8)
    parts = [new[:100], memoryview(mid), new[150_100:]]
    assert _joined(parts) == new
    ops = crash_at_every_operation(
        str(tmp_path / "cut"), {"ckpt": old},
        lambda root, fs: durable.write_atomic(os.path.join(root, "ckpt"), parts, size=len(new), fs=fs),
        lambda tree: tree.get("ckpt") in (old, new))
    assert ops > 6
    sim = SimFS(str(tmp_path / "done"))
    durable.write_atomic(os.path.join(sim.root, "ckpt"), parts, size=len(new), fs=sim)
    sim.crash()
    for mode in MODES:
        assert sim.image_tree(sim.choose(random.Random(0), mode)[1])["ckpt"] == new


def test_direct_write_fail_points_and_errors(tmp_path, small_chunks, monkeypatch):
    hits = []
    monkeypatch.setattr(failpoints, "hit", hits.append)
    want = os.urandom(300_000)
    durable.write_atomic(str(tmp_path / "f"), [want], size=len(want))
    assert hits == ["file.before_write", "file.mid_write", "file.before_fsync", "file.after_fsync",
                    "file.before_rename", "file.after_rename", "file.after_dir_fsync"]
    with pytest.raises(CheckpointExistsError):
        durable.write_atomic(str(tmp_path / "f"), [want], size=len(want), overwrite=False)

    class Full(durable.FileSystem):
        def write(self, fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DurabilityError, match="disk full"):
        durable.write_atomic(str(tmp_path / "g"), [want], size=len(want), fs=Full())
    assert sorted(os.listdir(tmp_path)) == ["f"]       # no temp file left behind


def test_hashed_write_is_the_container(tmp_path, small_chunks):
    """write_atomic_hashed of a container's layout writes exactly what dumps returns."""
    state = {"a": np.arange(100_000, dtype=np.float32), "b": [np.ones((300, 7)), b"xyz"], "c": "text"}
    w = checkpoint.encode(state, run="r", step=3, created_at_ns=12345)
    ref = checkpoint.encode(state, run="r", step=3, created_at_ns=12345)
    want = b"".join(bytes(p) for p in ref.parts())
    path = str(tmp_path / "c.agck")
    digests = durable.write_atomic_hashed(path, [(buf, blob) for _, buf, blob in w.layout()], w.finish,
                                          format.new_hasher, size=w.total_len)
    assert open(path, "rb").read() == want
    assert digests == ref.digests
    ck = checkpoint.load(path, verify=True)
    assert np.array_equal(ck.state["a"], state["a"])


def test_hashed_write_digests(tmp_path, small_chunks):
    rng = random.Random(3)
    for trial in range(30):
        parts = _random_parts(rng)
        pieces = [(p, rng.random() < 0.5) for p in parts]
        direct = rng.choice([True, False])
        path = str(tmp_path / f"h{trial}")
        digests = durable.write_atomic_hashed(
            path, pieces, lambda ds: b"".join(d.to_bytes(8, "little") for d in ds), xxhash.xxh3_64,
            size=sum(memoryview(p).nbytes for p in parts), direct=direct)
        want = [xxhash.xxh3_64_intdigest(_joined([p])) for p, h in pieces if h]
        assert digests == want
        assert open(path, "rb").read() == _joined(parts) + b"".join(d.to_bytes(8, "little") for d in want)


def test_write_parts_to_an_open_file(tmp_path, small_chunks):
    """For writers that manage their own temp file: same bytes, direct or not, and the exact count."""
    rng = random.Random(11)
    for trial in range(20):
        parts = _random_parts(rng)
        want = _joined(parts)
        for direct in (False, True):
            spy = Spy()
            path = str(tmp_path / f"p{trial}{direct}")
            fd = spy.open_new(path)
            try:
                assert durable.write_parts(spy, fd, parts, direct=direct) == len(want)
                spy.fsync(fd)
            finally:
                spy.close(fd)
            assert open(path, "rb").read() == want
            if not direct:
                assert not any(on for on, _ in spy.writes)


def test_make_dir_of_an_existing_directory_makes_its_entry_durable_once(tmp_path):
    """Another process may have made the directory and been killed before fsync'ing its
    parent: the first use here fsyncs the parent all the same, later ones do not."""
    synced = []

    class Recording(durable.FileSystem):
        def fsync_dir(self, path):
            synced.append(path)
            super().fsync_dir(path)

    fs = Recording()
    d = tmp_path / "run"
    d.mkdir()                                   # made by someone else, entry not fsync'd
    durable.make_dir(fs, str(d), str(tmp_path))
    durable.make_dir(fs, str(d), str(tmp_path))
    assert synced == [str(tmp_path)]
    d.rmdir()                                   # gone (a delete of the run's last step): made again
    durable.make_dir(fs, str(d), str(tmp_path))
    assert d.is_dir() and synced == [str(tmp_path)] * 2


def test_temp_writer_alive_reads_the_pid_in_the_name():
    import subprocess
    import sys
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)
    assert durable.temp_writer_alive(os.path.basename(durable.temp_name_for("/x/000000000001.agck")))
    assert not durable.temp_writer_alive(f".000000000001.agck.tmp.{dead}.abcd")
    assert not durable.temp_writer_alive(".junk.tmp.notapid.x") and not durable.temp_writer_alive(".a.tmp.0.x")


def test_save_into_a_missing_directory_says_so(tmp_path):
    """Not "the previous checkpoint is untouched; fix the storage": there is none, the directory is missing."""
    import agck
    with pytest.raises(DurabilityError) as e:
        agck.save(tmp_path / "nodir" / "x.agck", {"a": 1})
    text = str(e.value)
    assert f"directory {tmp_path / 'nodir'} does not exist" in text and "create the directory" in text
    assert "previous checkpoint" not in text and "fix the storage" not in text
    assert not (tmp_path / "nodir").exists()


def test_save_with_overwrite_false_names_what_refused(tmp_path):
    import agck
    agck.save(tmp_path / "x.agck", {"a": 1})
    with pytest.raises(CheckpointExistsError) as e:
        agck.save(tmp_path / "x.agck", {"a": 2}, overwrite=False)
    assert "overwrite=False refuses to replace it" in str(e.value) and "immutable" not in str(e.value)
    assert agck.load(tmp_path / "x.agck").state == {"a": 1}


# --- whether to bypass the page cache: measured, per file system ---------------------

def test_direct_choice_learns_both_modes_then_keeps_the_faster():
    c = durable.DirectChoice()
    dev = 7
    modes = []
    for _ in range(2 * c.WARMUP):
        m = c.choose(dev)
        modes.append(m)
        c.record(dev, m, 100 << 20, 0.1 if m else 0.3)     # direct 3x faster here
    assert modes == [True, False, True, False]             # alternates, direct first
    later = [c.choose(dev) for _ in range(2 * c.PROBE_EVERY)]
    assert later.count(False) == 2 and later.count(True) == 2 * c.PROBE_EVERY - 2   # one probe in PROBE_EVERY
    assert c.state()[dev]["choice"] == "direct"


def test_direct_choice_follows_a_device_whose_speed_changed():
    c = durable.DirectChoice()
    dev = 3
    for _ in range(2 * c.WARMUP):
        m = c.choose(dev)
        c.record(dev, m, 1 << 20, 0.01 if m else 0.02)
    assert c.choose(dev) is True
    # buffered writes become 4x faster than direct (another tenant, a changed device): the
    # probes and the writes taken directly carry the news; the choice flips within KEEP probes
    flipped_after = None
    for i in range(c.PROBE_EVERY * (c.KEEP + 1)):
        m = c.choose(dev)
        c.record(dev, m, 1 << 20, 0.04 if m else 0.01)
        if flipped_after is None and c.state()[dev]["choice"] == "buffered":
            flipped_after = i
    assert flipped_after is not None and c.choose(dev) is False


def test_direct_choice_is_per_file_system():
    c = durable.DirectChoice()
    for _ in range(2 * c.WARMUP):
        for dev, fast_direct in ((1, True), (2, False)):
            m = c.choose(dev)
            c.record(dev, m, 1 << 20, 0.01 if m == fast_direct else 0.05)
    assert c.choose(1) is True and c.choose(2) is False


@pytest.fixture
def fresh_choice(monkeypatch):
    """DIRECT_IO "auto" with nothing learned yet, and no file system known to refuse O_DIRECT."""
    monkeypatch.setattr(durable, "_no_direct_devices", set())
    monkeypatch.setattr(durable, "DIRECT_CHOICE", durable.DirectChoice())
    monkeypatch.setattr(durable, "DIRECT_IO", "auto")


def test_auto_times_real_large_writes_and_pins_override_it(tmp_path, monkeypatch, fresh_choice):
    monkeypatch.setattr(durable, "DIRECT_MIN", 1 << 16)
    data = os.urandom(1 << 18)
    for i in range(4):
        durable.write_atomic(str(tmp_path / f"a{i}"), [data], size=len(data))
        assert open(tmp_path / f"a{i}", "rb").read() == data
    dev = os.stat(tmp_path).st_dev
    st = durable.DIRECT_CHOICE.state()
    if _supports_direct(tmp_path):
        assert st[dev]["samples"] == (2, 2) and st[dev]["choice"] in ("direct", "buffered")
    else:
        assert dev not in st                      # nothing to choose between: always buffered
    for mode, want in (("always", True), ("never", False)):
        monkeypatch.setattr(durable, "DIRECT_IO", mode)
        spy = Spy()
        durable.write_atomic(str(tmp_path / mode), [data], size=len(data), fs=spy)
        assert any(on for on, _ in spy.writes) == (want and _supports_direct(tmp_path))
    monkeypatch.setattr(durable, "DIRECT_IO", "sometimes")
    with pytest.raises(UsageError, match="AGCK_DIRECT_IO"):
        durable.write_atomic(str(tmp_path / "bad"), [data], size=len(data))
    assert not os.path.exists(tmp_path / "bad")


def test_a_background_writer_thread_bypasses_the_page_cache_without_timing(tmp_path, monkeypatch, fresh_choice):
    monkeypatch.setattr(durable, "DIRECT_MIN", 1 << 16)
    data = os.urandom(1 << 18)
    spies = []

    def writer():
        durable.writes_in_background()
        for i in range(3):
            spy = Spy()
            durable.write_atomic(str(tmp_path / f"bg{i}"), [data], size=len(data), fs=spy)
            spies.append(spy)

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    direct = _supports_direct(tmp_path)
    assert [any(on for on, _ in s.writes) for s in spies] == [direct] * 3
    assert durable.DIRECT_CHOICE.state() == {}          # not timed: nothing learned from them
    assert all(open(tmp_path / f"bg{i}", "rb").read() == data for i in range(3))
    # the mark is the thread's own: this thread still has a choice to learn
    assert not getattr(durable._THREAD, "background", False)


def test_chunk_files_follow_the_same_choice_and_a_background_put_writes_them_direct(tmp_path, monkeypatch,
                                                                                     fresh_choice):
    """A chunked put's chunk files of DIRECT_CHUNK_MIN bytes or more: direct from a
    snapshot writer thread (written by the store's pool threads on its behalf),
    timed as their own kind otherwise, pinned by DIRECT_IO; the bytes read back
    the same every way."""
    import torch

    from agck import open_store
    from agck.stores.file import objects as objectdir
    calls = []
    real = durable.write_parts

    def spy(fs, fd, parts, *, direct=False):
        parts = list(parts)
        calls.append((sum(memoryview(p).nbytes for p in parts), direct))
        return real(fs, fd, parts, direct=direct)

    monkeypatch.setattr(durable, "write_parts", spy)
    store = open_store(str(tmp_path / "s"))
    gen = torch.Generator().manual_seed(1)

    def state():
        return {"w": torch.randn(1 << 20, generator=gen)}       # 4 MiB of new content: chunks of ~1 MiB

    def big(c):        # how the chunks of DIRECT_CHUNK_MIN bytes or more were written; smaller ones never direct
        assert not any(d for n, d in c if n < objectdir.DIRECT_CHUNK_MIN)
        return [d for n, d in c if n >= objectdir.DIRECT_CHUNK_MIN]

    def put_in_background(step, s):
        def run():
            durable.writes_in_background()
            store.put("r", step, s)
        t = threading.Thread(target=run, name="snapshot-writer")
        t.start()
        t.join()

    s1 = state()
    put_in_background(1, s1)
    assert big(calls) and all(big(calls)) == _supports_direct(tmp_path)
    assert torch.equal(store.get("r", 1).state["w"], s1["w"])
    assert durable.DIRECT_CHOICE.state() == {}                       # background: nothing timed

    calls.clear()
    s2 = state()
    store.put("r", 2, s2)                                            # a plain put: timed, as chunks
    assert torch.equal(store.get("r", 2).state["w"], s2["w"])
    if _supports_direct(tmp_path) and durable._O_DIRECT:
        st = durable.DIRECT_CHOICE.state()
        key = (os.stat(store.objects.dir).st_dev, "chunk")
        assert list(st) == [key] and sum(st[key]["samples"]) >= 2

    calls.clear()
    monkeypatch.setattr(durable, "DIRECT_IO", "never")
    s3 = state()
    put_in_background(3, s3)
    assert big(calls) and not any(big(calls))
    assert torch.equal(store.get("r", 3).state["w"], s3["w"])
    assert objectdir.DIRECT_CHUNK_MIN <= 1 << 20


@pytest.mark.parametrize("point", ["file.chunk_before_fsync", "file.chunks_before_dir_fsync"])
def test_sigkill_mid_background_put_with_direct_chunks(tmp_path, point):
    """A real SIGKILL while a snapshot writer's chunk files are being written direct:
    the previous checkpoint reads back, recovery finds it, and the leftovers collect."""
    import subprocess
    import sys

    from agck import open_store, recover
    root = str(tmp_path / "s")
    store = open_store(root)
    store.put("r", 1, {"x": np.arange(100)})
    code = f"""
import threading, numpy as np
from agck import durable
from agck.stores import open_store
from agck.stores.file import objects as objectdir
objectdir.DIRECT_CHUNK_MIN = 16 << 10
def put():
    durable.writes_in_background()
    open_store({root!r}).put("r", 2, {{"x": np.random.default_rng(0).random(1_000_000)}})
t = threading.Thread(target=put); t.start(); t.join()
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "AGCK_FAILPOINTS": f"{point}=kill", "AGCK_DIRECT_IO": "auto"})
    assert p.returncode == -9, p.stderr
    assert store.steps("r") == [1]
    assert recover(root, "r").step == 1
    store.collect_garbage()
    np.testing.assert_array_equal(store.get("r", 1).state["x"], np.arange(100))
