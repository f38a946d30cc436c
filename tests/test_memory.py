"""Fresh output memory and the parallel fill behind dumps: same bytes as the serial path, always."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agck
from agck import checkpoint, format, memory

from test_codec import states

H = xxhash.xxh3_64_intdigest


@pytest.fixture
def tiny_tasks(monkeypatch):
    """Force the threaded path on small inputs, with tasks a few hundred bytes long,
    so every split (inside a blob, across blobs, across padding) is exercised."""
    monkeypatch.setattr(memory, "PARALLEL_MIN", 0)
    monkeypatch.setattr(memory, "_TASK", 256)
    monkeypatch.setattr(memory, "_SLICE", 64)
    monkeypatch.setattr(memory, "threads", lambda: 3)


def serial_bytes(state, **kw):
    return b"".join(bytes(p) for p in checkpoint.encode(state, created_at_ns=7, **kw).parts())


def parallel_bytes(state, **kw):
    w = checkpoint.encode(state, created_at_ns=7, **kw)
    made = memory.new_bytes(w.total_len)
    assert made is not None
    out, view = made
    view[:] = 0xEE  # garbage first: every byte must be written by the fill, padding included
    digests = memory.fill(view, w.layout(), format.new_hasher)
    footer = w.finish(digests)
    view[w.total_len - len(footer):] = np.frombuffer(footer, np.uint8)
    return out


def test_layout_covers_every_byte_before_the_footer():
    w = checkpoint.encode({"a": np.arange(5, dtype=np.int8), "b": torch.ones(3, 3), "e": np.zeros(0)},
                          created_at_ns=1)
    pos = 0
    for off, buf, _ in w.layout():
        assert off == pos
        pos += buf.nbytes
    assert pos == w.header.footer_offset


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states)
def test_parallel_fill_equals_serial_stream(state):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "PARALLEL_MIN", 0)
        mp.setattr(memory, "_TASK", 256)
        mp.setattr(memory, "_SLICE", 64)
        mp.setattr(memory, "threads", lambda: 3)
        assert parallel_bytes(state, run="r", step=1) == serial_bytes(state, run="r", step=1)


def test_parallel_fill_of_many_blobs_and_one_big_one(tiny_tasks):
    rng = np.random.default_rng(1)
    state = {"big": rng.random(5000), "many": [rng.integers(0, 255, n, dtype=np.uint8) for n in range(0, 300, 7)],
             "t": torch.randn(17, 3).t(), "empty": torch.zeros(0)}
    data = parallel_bytes(state)
    assert data == serial_bytes(state)
    c = agck.loads(data)
    assert np.array_equal(c.state["big"], state["big"]) and torch.equal(c.state["t"], state["t"])


@pytest.mark.parametrize("parallel", [False, True])
def test_fill_digests_match_in_order(monkeypatch, parallel):
    if parallel:
        monkeypatch.setattr(memory, "PARALLEL_MIN", 0)
        monkeypatch.setattr(memory, "threads", lambda: 3)
    monkeypatch.setattr(memory, "_TASK", 256)
    monkeypatch.setattr(memory, "_SLICE", 64)
    rng = np.random.default_rng(5)
    # One piece big enough to be hashed in its own pass (> total / (2 * threads)), many small.
    bufs = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            for n in (0, 1, 255, 256, 257, 5000, 3, 63, 64, 65, 1000)]
    dest = np.full(sum(b.nbytes for b in bufs), 0xEE, np.uint8)
    pieces, off = [], 0
    for i, b in enumerate(bufs):
        pieces.append((off, b, i % 3 != 1))
        off += b.nbytes
    got = memory.fill(dest, pieces, xxhash.xxh3_64)
    assert got == [H(b) for i, b in enumerate(bufs) if i % 3 != 1]
    assert dest.tobytes() == b"".join(bytes(b) for b in bufs)


def test_fill_propagates_errors(tiny_tasks):
    class Boom:
        def update(self, b):
            raise ValueError("digest failed")
    with pytest.raises(ValueError, match="digest failed"):
        memory.fill(np.zeros(600, np.uint8), [(0, memoryview(bytes(600)), True)], Boom)


def test_dumps_of_a_large_state_takes_the_parallel_path_and_matches():
    # Just above PARALLEL_MIN, with the real task size and thread count.
    rng = np.random.default_rng(2)
    state = {"w": torch.from_numpy(rng.random((memory.PARALLEL_MIN // 8 // 1024 + 3, 1024))),
             "small": [np.arange(i) for i in range(50)]}
    w = checkpoint.encode(state, created_at_ns=3)
    assert w.total_len >= memory.PARALLEL_MIN
    fast = checkpoint._to_bytes(w)
    assert type(fast) is bytes
    assert fast == b"".join(bytes(p) for p in checkpoint.encode(state, created_at_ns=3).parts())
    back = agck.loads(fast)
    assert torch.equal(back.state["w"], state["w"])
    assert hash(fast) == hash(bytes(fast))  # a normal, hashable bytes object


def test_new_buffer_is_writable_and_sized():
    for n in (0, 10, memory.POPULATE_MIN, 5 << 20, (5 << 20) + 123):
        b = memory.new_buffer(n)
        assert b.dtype == np.uint8 and b.shape == (n,) and b.flags.writeable
        b[:] = 7
        assert n == 0 or (b[0] == 7 and b[-1] == 7)


def test_huge_page_probe_is_harmless():
    free = memory.huge_pages_free()
    assert isinstance(free, int) and free >= 0
    assert memory.huge_pages_ready(1 << 62) is False      # never more than the machine has
    assert memory.advise_huge(0, 4096) is False            # too small to ask for
    assert 1 <= memory.threads() <= memory.MAX_THREADS


@pytest.mark.parametrize("big", [False, True])
def test_stream_hashes_aside_and_yields_the_same_bytes(monkeypatch, big):
    if big:  # the threaded path, on a small state
        monkeypatch.setattr(memory, "PARALLEL_MIN", 0)
        monkeypatch.setattr(memory, "threads", lambda: 2)
        monkeypatch.setattr(checkpoint, "_WRITE_SLICE", 100)
    state = {"w": torch.randn(300, 7), "v": [np.arange(i, dtype=np.int16) for i in range(40)], "s": "x"}
    expected = b"".join(bytes(p) for p in checkpoint.encode(state, created_at_ns=5).parts())
    w = checkpoint.encode(state, created_at_ns=5)
    pieces = list(checkpoint.stream(w))
    assert b"".join(bytes(p) for p in pieces) == expected
    assert w.footer == expected[-len(w.footer):]
    if big:
        assert max(len(p) for p in pieces) <= 100 or len(pieces[-1]) > 100  # slices, then the footer


def test_parallel_verify_reports_the_first_bad_blob(tiny_tasks):
    state = {f"t{i}": np.full(50 + i, i, dtype=np.int32) for i in range(12)}
    data = bytearray(serial_bytes(state))
    c = format.open_container(bytes(data), verify=True)          # clean: verifies on the threaded path
    base = c.header.payload_offset
    for bad in ([3], [7, 2], [11]):
        d = bytearray(data)
        for i in bad:
            d[base + c.blobs[i][0]] ^= 0x01
        with pytest.raises(agck.CorruptCheckpointError) as e:
            agck.loads(bytes(d))
        first = min(bad)
        assert e.value.section == "payload" and f"state['t{first}']" in e.value.tensor, e.value
    assert memory.digests([memoryview(bytes(range(i))) for i in range(30)], H) == [H(bytes(range(i))) for i in range(30)]


def _run_script(script: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_large_writes_still_work_at_interpreter_exit(tmp_path):
    # At exit concurrent.futures refuses new threads before atexit handlers run; the
    # snapshotter's last flush and any save from an atexit handler must not depend on them.
    script = f"""
import atexit, numpy as np, agck
from agck import checkpoint
big = {{"w": np.ones(80 << 20, np.uint8)}}
atexit.register(lambda: checkpoint.save({str(tmp_path / 'atexit.agck')!r}, big))
atexit.register(lambda: open({str(tmp_path / 'dumps.len')!r}, 'w').write(str(len(agck.dumps(big)))))
snap = agck.Snapshotter({str(tmp_path / 'store')!r}, "r", every=1, mode="async", handle_signals=False,
                        capture_rng=False)
state = {{"w": np.full(96 << 20, 7, np.uint8)}}
snap.restore(state)
snap.completed(1, state)
"""
    r = _run_script(script, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "failed" not in r.stderr, r.stderr
    assert agck.load(tmp_path / "atexit.agck").state["w"].nbytes == 80 << 20
    assert int((tmp_path / "dumps.len").read_text()) > 80 << 20
    ck = agck.open_store(str(tmp_path / "store")).get("r", 1)
    assert ck.state["step"] == 1 and ck.state["state"]["w"].nbytes == 96 << 20 and ck.state["state"]["w"][-1] == 7


def test_buffers_stay_mapped_while_daemon_threads_read_them_at_exit(tmp_path):
    # load(mmap=False) returns memory.new_buffer memory: it must not be unmapped at
    # interpreter exit while a daemon thread (or an atexit handler) still reads it.
    agck.save(tmp_path / "c.agck", {"a": np.ones(4 << 20, np.float32)})
    script = f"""
import atexit, threading, numpy as np
from agck import checkpoint
ck = checkpoint.load({str(tmp_path / 'c.agck')!r}, mmap=False)
atexit.register(lambda: ck.state["a"].sum())
def spin():
    while True:
        ck.state["a"].sum()
threading.Thread(target=spin, daemon=True).start()
"""
    for _ in range(3):
        r = _run_script(script, tmp_path)
        assert r.returncode == 0, (r.returncode, r.stderr)


def test_new_bytes_view_keeps_the_object_alive():
    made = memory.new_bytes(1 << 20)
    assert made is not None
    out, view = made
    assert view.base._owner is out   # the view holds the bytes object, so its memory stays valid
    del out, made
    view[:] = 3
    assert int(view.sum()) == 3 << 20
