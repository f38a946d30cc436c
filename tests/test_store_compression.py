"""Compressed chunks on every store (FORMAT.md rules 12.8-12.12, agck.stores.compression).

Checkpoints of float weights and text are put with ``compress="zstd"`` at sizes
on both sides of the chunking thresholds (a few MiB, past the object grid, and
past 64 MiB), read back bit-exactly by a fresh store object, scrubbed, and mixed
with raw puts of the same content; a compressor that corrupts its output never
gets a corrupt chunk committed; a damaged compressed chunk is damage like any
other; an older reader refuses a compressed checkpoint instead of judging it.
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch

import agck
from agck import chunkcodec, chunking, format
from agck.errors import DamagedChunkError, UnsupportedVersionError, UsageError  # noqa: F401
from agck.recovery import verify_store
from agck.stores import compression, open_store
from crashtests import chunkrot

from conftest import BACKENDS, make_spec

MiB = 1 << 20


def weights(nbytes: int, seed: int) -> dict:
    """Trained-looking weights (small normal values) in bf16 and fp32, an int table,
    and chat-like text: the content kinds a checkpoint holds."""
    g = torch.Generator().manual_seed(seed)
    half = nbytes // 2
    bf16 = (torch.randn(half // 2, generator=g) * 0.02).to(torch.bfloat16)
    fp32 = torch.randn(half // 4, generator=g) * 0.02
    turns = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i}: " + "the checkpoint is safe. " * 20}
             for i in range(200)]
    return {"bf16": bf16, "fp32": fp32, "ids": np.arange(4096, dtype=np.int64), "turns": turns, "seed": seed}


def same(a: dict, b: dict) -> bool:
    return (torch.equal(a["bf16"], b["bf16"]) and torch.equal(a["fp32"], b["fp32"])
            and np.array_equal(a["ids"], b["ids"]) and a["turns"] == b["turns"] and a["seed"] == b["seed"])


def open_spec(spec, **extra):
    _, url, opts = spec
    return open_store(url, **{**opts, **extra})


@pytest.fixture(params=BACKENDS)
def spec(request, tmp_path):
    return make_spec(request.param, request, tmp_path)


@pytest.mark.parametrize("nbytes", [3 * MiB, 9 * MiB, 70 * MiB], ids=["3MiB", "9MiB", "70MiB"])
def test_compressed_puts_read_back_bit_exact_on_a_fresh_store_object(spec, nbytes):
    s = open_spec(spec, compress="zstd", min_chunked=0)
    states = [weights(nbytes, 1), weights(nbytes, 1) | {"seed": 2}]
    for step, st in enumerate(states, 1):
        s.put("run", step, st)
    info = s.compression.as_dict()
    assert info["mode"] == "zstd" and info["mismatches"] == 0 and info["framed_chunks"] > 0
    # bf16 and fp32 weights (where a piece mixes them, zstd without planes) and text: smaller
    # (the ratios per content kind are measured by scripts/bench_compress.py)
    assert info["stored_bytes"] < 0.9 * info["raw_bytes"], info
    fresh = open_spec(spec)
    for step, st in enumerate(states, 1):
        assert same(fresh.get("run", step).state, st)
    report = fresh.scrub()
    assert report.ok and report.chunks > 0, report.as_dict()
    verified = verify_store(fresh)
    assert len(verified.ok) == 2 and not verified.rejected, verified.as_dict()
    # the second put shared the first's weights: only its small pieces were new
    assert s.last_put.new_bytes < nbytes // 4


def test_raw_and_compressed_copies_of_one_chunk_are_interchangeable(spec):
    """A chunk's address is that of its raw bytes (rule 12.9): a compressed put reuses the
    raw chunks a raw put stored, a raw put the compressed ones, and every checkpoint reads."""
    raw = open_spec(spec, compress="none", min_chunked=0)
    a = weights(6 * MiB, 3)
    raw.put("run", 1, a)
    assert raw.compression.framed_chunks == 0
    packed = open_spec(spec, compress="zstd", min_chunked=0)
    b = a | {"seed": 4}
    packed.put("run", 2, b)
    assert packed.last_put.new_bytes < MiB        # the weights were found stored raw, and reused
    c = weights(6 * MiB, 5)
    packed.put("run", 3, c)                       # new weights, stored compressed
    assert packed.compression.framed_chunks > 0
    raw2 = open_spec(spec, compress="none", min_chunked=0)
    raw2.put("run", 4, c | {"seed": 6})           # a raw put relying on compressed chunks
    assert raw2.last_put.new_bytes < MiB
    fresh = open_spec(spec)
    for step, st in ((1, a), (2, b), (3, c), (4, c | {"seed": 6})):
        assert same(fresh.get("run", step).state, st)
    assert fresh.scrub().ok


def _flip_one(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


@pytest.mark.parametrize("fault", ["flipped", "other content", "not zstd", "raises"])
def test_a_corrupting_compressor_never_gets_a_corrupt_chunk_committed(spec, fault, caplog):
    """The compressor's output is decoded again and checked against the chunk's address
    before it is written: a compressor that corrupts (restic#4523) costs space, never data."""
    rng = random.Random(fault)
    calls = []

    def bad(data, level):
        calls.append(len(data))
        if fault == "raises":
            raise RuntimeError("compressor crashed")
        out = chunkcodec.zstd_compress(data, level)
        if fault == "flipped":
            return out[:4] + _flip_one(out[4:], rng) if len(calls) % 2 else out
        if fault == "other content":          # a valid frame of the same size, of other bytes
            return chunkcodec.zstd_compress(bytes(reversed(bytes(data))), level)
        return b"\x00" * (len(out) // 2)

    s = open_spec(spec, compress="zstd", min_chunked=0)
    s.compression.compressor = bad
    st = weights(9 * MiB, 7)
    if fault == "raises":
        with pytest.raises(RuntimeError):
            s.put("run", 1, st)
        assert open_spec(spec).steps("run") == []
        return
    s.put("run", 1, st)
    assert calls
    info = s.compression.as_dict()
    assert info["mismatches"] > 0 or fault == "flipped" and info["framed_chunks"] > 0
    fresh = open_spec(spec)
    assert same(fresh.get("run", 1).state, st)
    assert fresh.scrub().ok
    if info["mismatches"]:
        assert "does not decode back to it" in caplog.text


def test_a_damaged_compressed_chunk_is_damage_found_by_read_and_scrub(spec):
    """Rule 12.11: a frame that fails a check is damage to its chunk (DamagedChunkError, the
    chunk named), found by a read and by scrub, and the next put holding it heals it."""
    s = open_spec(spec, compress="zstd", min_chunked=0)
    st = weights(4 * MiB, 8)
    s.put("run", 1, st)
    sizes = dict(zip(s.last_put.addresses, s.last_put.sizes))
    framed = [a for a in sizes if len(chunkrot._stored(s, a)) < sizes[a]]
    assert framed
    target = framed[len(framed) // 2]
    chunkrot.damage(s, target, "flip", random.Random(1))
    fresh = open_spec(spec)
    report = fresh.scrub(quarantine=False)
    assert [d.address for d in report.damaged] == [target.hex()]
    with pytest.raises(DamagedChunkError) as e:
        fresh.get("run", 1)
    assert target in e.value.damaged
    s2 = open_spec(spec, compress="zstd", min_chunked=0)
    s2.put("run", 2, st)                 # holds the damaged chunk's content: written afresh
    assert same(open_spec(spec).get("run", 1).state, st)


def test_a_frame_version_byte_flipped_is_damage_quarantined_and_healed_by_the_next_put(tmp_path):
    """Rule 12.11: a frame version (or method) this reader does not know is damage: the
    frame header has no checksum, so a flipped bit there must not read as a newer format,
    which would leave the chunk in place for every later put to rely on (the crash
    campaign's chunk damage found exactly that). Quarantined, never deleted; the next put
    holding the content writes it afresh."""
    import os
    root = str(tmp_path / "s")
    s = open_store(root, compress="zstd", min_chunked=0)
    st = weights(2 * MiB, 9)
    s.put("run", 1, st)
    listed = format.open_chunked(format.open_container(_listing(s, "run", 1)))
    sizes = dict(zip(listed.addresses, listed.sizes))
    a = next(a for a in listed.addresses if len(s.objects.read_whole(a)) < sizes[a])
    path = s.objects.path(a)
    data = bytearray(open(path, "rb").read())
    data[4] ^= 0x02                                   # version 1 reads as 3
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(DamagedChunkError) as e:
        open_store(root).get("run", 1)
    assert a in e.value.damaged
    [q] = open_store(root).quarantined()
    assert q.address == a.hex() and not os.path.exists(path)
    open_store(root, compress="zstd", min_chunked=0).put("run", 2, st)
    assert same(open_store(root).get("run", 1).state, st)


def test_an_older_reader_refuses_a_compressed_checkpoint_and_reads_a_raw_one(tmp_path, monkeypatch):
    """Rule 12.8: a compressing store's listings carry the required flag FRAMED; a reader
    that knows only CHUNKED (agck before compression) refuses them, and still reads the
    listings of a store that does not compress."""
    packed = open_store(str(tmp_path / "s"), compress="zstd", min_chunked=0)
    packed.put("run", 1, weights(2 * MiB, 10))
    raw = open_store(str(tmp_path / "s"), compress="none", min_chunked=0)
    st = weights(2 * MiB, 11)
    raw.put("run", 2, st)
    assert format.parse_header(_listing(packed, "run", 1)).flags == format.FLAG_CHUNKED | format.FLAG_FRAMED
    assert format.parse_header(_listing(raw, "run", 2)).flags == format.FLAG_CHUNKED
    monkeypatch.setattr(format, "KNOWN_REQUIRED_FLAGS", format.FLAG_CHUNKED)
    old = open_store(str(tmp_path / "s"))
    with pytest.raises(UnsupportedVersionError):
        old.get("run", 1)
    assert same(old.get("run", 2).state, st)
    assert old.quarantined() == []


def test_auto_is_raw_on_this_machine_and_compressed_over_a_network(tmp_path):
    """compress="auto": raw where the store's disk writes faster than zstd compresses
    (this machine), compressed over a network link; the choice is reported."""
    s = open_store(str(tmp_path / "s"))
    assert s.compression.requested == "auto" and not s.compression.on
    assert "on this machine" in s.compression.reason
    s.put("run", 1, weights(2 * MiB, 12))
    assert s.compression.framed_chunks == 0
    for host, local in [("localhost", True), ("127.0.0.1", True), ("::1", True), ("/var/run/postgresql", True),
                        ("", True), (None, True), ("db.example.com", False), ("10.0.0.5", False)]:
        assert compression.is_local_host(host) is local, host
    remote = compression.ChunkEncoding("auto", local=False, what="object store")
    assert remote.on and "network" in remote.reason
    from agck.stores.s3.client import ObjectClient
    assert ObjectClient("s3://b/p?endpoint=http://127.0.0.1:9").local
    assert not ObjectClient("s3://b/p?endpoint=https://s3.example.com").local


def test_options_are_checked_before_anything_is_opened(tmp_path):
    with pytest.raises(UsageError, match="compress="):
        open_store(str(tmp_path / "s"), compress="lz4")
    with pytest.raises(UsageError, match="level="):
        open_store(str(tmp_path / "s"), compress="zstd", level=99)
    with pytest.raises(UsageError, match="compress="):
        open_store("postgresql://nobody@127.0.0.1:1/none", compress="gzip")


def test_parts_stores_compress_as_their_store_does(tmp_path):
    s = open_store(str(tmp_path / "s"), compress="zstd", level=3)
    assert s._policy()["compress"] == "zstd" and s._policy()["level"] == 3


def test_rule_12_12_planes_are_cut_only_where_a_piece_holds_floats_of_one_size():
    w = agck.checkpoint.encode({"a": np.zeros(8, np.float32), "b": torch.zeros(4, dtype=torch.bfloat16),
                                "c": np.zeros(4, np.int64), "d": np.zeros(2, np.complex128)})
    assert w.blob_itemsizes == [4, 2, None, 8]
    from agck.stores import content
    big = {"w": torch.zeros(1 << 21, dtype=torch.float16)}     # 4 MiB: a piece of its own
    pieces = content.split_container(agck.checkpoint.encode(big))
    assert {p.itemsize for p in pieces} >= {2}
    mixed = {"a": np.zeros(100, np.float32), "b": np.zeros(100, np.float64)}
    assert all(p.itemsize is None for p in content.split_container(agck.checkpoint.encode(mixed)))


def _listing(store, run: str, step: int) -> bytes:
    """A file store's stored container of (run, step)."""
    with open(store.path(run, step), "rb") as f:
        return f.read()


def test_frames_hash_back_to_their_address_on_disk(tmp_path):
    """Rule 12.9 on disk: every chunk file shorter than its listed size is a frame whose
    decoded bytes hash to the file's name."""
    s = open_store(str(tmp_path / "s"), compress="zstd", min_chunked=0)
    s.put("run", 1, weights(3 * MiB, 13))
    listed = format.open_chunked(format.open_container(_listing(s, "run", 1)))
    seen = 0
    for a, n in zip(listed.addresses, listed.sizes):
        data = s.objects.read_whole(a)
        if len(data) < n:
            assert data[:4] == chunkcodec.MAGIC
            assert chunking.address(chunkcodec.decode(data, encoded=True, raw_size=n)) == a
            assert struct.unpack_from("<Q", data, 7)[0] == n
            seen += 1
    assert seen


# --- the journal and AppendLog segments (FORMAT.md 17.2, 17.3) -----------------------------

TEXT = "The assistant answered at length about checkpoints, chunks and recovery. " * 30


def _journal_size(path) -> int:
    import os
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs if f.endswith(".log")
               or "journal" in r)


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_journal_values_are_compressed_where_the_store_compresses_and_replay_bit_exact(request, tmp_path, kind):
    """Rule 17.3: a value tree of 512 bytes or more is kept as one zstd frame (enc "z") by a
    journal whose store compresses, checked to decode back before it is appended; a fresh
    journal replays every value, and a store that does not compress writes "t"."""
    from agck import journalrec as jr
    spec = make_spec(kind, request, tmp_path)
    for mode in ("zstd", "none"):
        run = f"j-{mode}"
        store = open_spec(spec, compress=mode)
        j = agck.Journal(store, run)
        values = [j.step("answer", lambda i: {"i": i, "text": TEXT, "short": "ok"}, i) for i in range(20)]
        values.append(j.step("tiny", lambda: {"x": 1}))
        j.close()
        data, _ = open_spec(spec).log_read(run)
        found = jr.scan(data)
        encs = [e.enc for _, e in found.entries]
        assert encs == (["z"] * 20 + ["t"] if mode == "zstd" else ["t"] * 21), encs
        again = agck.Journal(open_spec(spec), run)
        replayed = [again.step("answer", lambda i: 1 / 0, i) for i in range(20)] + [again.step("tiny", lambda: 1 / 0)]
        assert replayed == values and not again.damaged
        again.close()
        if mode == "zstd":
            z = sum(len(e.payload) for _, e in found.entries)
        else:
            t = sum(len(e.payload) for _, e in found.entries)
    assert z * 5 < t


def test_appendlog_segments_are_compressed_and_a_resume_reads_them(tmp_path):
    from agck import journalrec as jr
    store = open_store(str(tmp_path / "s"), compress="zstd")
    state = {"results": agck.AppendLog()}
    with agck.Snapshotter(store, "r", every=10, capture_rng=False) as snap:
        state = snap.restore(state)
        for i in snap.steps(50):
            state["results"].append({"i": i, "text": TEXT})
    data, _ = store.log_read("r")
    segs = [e for _, e in jr.scan(data).entries if e.kind == "s"]
    assert segs and {e.enc for e in segs} == {"z"}
    assert len(data) < 50 * len(TEXT) // 5
    back = agck.Snapshotter(open_store(str(tmp_path / "s")), "r", every=10)
    restored = back.restore({"results": agck.AppendLog()})
    assert back.start_step == 50 and list(restored["results"]) == [{"i": i, "text": TEXT} for i in range(50)]
    back.close()


def test_a_damaged_or_hostile_compressed_journal_value_is_damage_reported_not_raised(tmp_path):
    """Rule 17.3: a "z" value whose frame fails its checks (a flipped payload byte, a
    claim of more than MAX_TREE bytes, planes where a tree is one zstd frame) is a damaged
    record: reported, its step run again; nothing is allocated for what it claims."""
    from agck import journalrec as jr
    from agck.errors import MalformedCheckpointError
    tree = agck.codec.plain_packed({"text": TEXT})
    enc, frame = jr.compress_tree(tree, 1)
    assert enc == "z" and jr.decode_value(jr.Entry("r", "s", bytes(16), 0, "z", frame)) == {"text": TEXT}
    assert jr.compress_tree(tree[:100], 1) == ("t", tree[:100])      # below COMPRESS_MIN
    assert jr.compress_tree(tree, None) == ("t", tree)               # a store that does not compress
    flipped = bytearray(frame)
    flipped[len(frame) // 2] ^= 0x10
    huge = chunkcodec.HEADER.pack(chunkcodec.MAGIC, 1, 1, 0, jr.MAX_TREE + 1) + frame[15:]
    planes = chunkcodec.frame(tree + bytes(-len(tree) % 4), chunkcodec.Method.PLANES_ZSTD, itemsize=4)
    for bad in (bytes(flipped), huge, planes, b"AGCZ", b""):
        with pytest.raises((MalformedCheckpointError, agck.errors.CorruptCheckpointError)):
            jr.decode_value(jr.Entry("r", "s", bytes(16), 0, "z", bad))
    # in a log: the record is damaged (reported), and the step runs again
    store = open_store(str(tmp_path / "s"), compress="zstd")
    key = jr.fingerprint((), {})
    store.log_append("r", [jr.record("r", "step", key, 0, "z", bytes(flipped))], sync=True)
    j = agck.Journal(store, "r")
    assert j.step("step", lambda: "ran again") == "ran again"
    assert j.damaged
    j.close()


def test_compressing_a_journal_value_that_does_not_decode_back_keeps_it_whole(monkeypatch, caplog):
    from agck import journalrec as jr
    tree = agck.codec.plain_packed({"text": TEXT})
    real = chunkcodec.decode
    monkeypatch.setattr(chunkcodec, "decode", lambda *a, **k: bytes(reversed(bytes(real(*a, **k)))))
    assert jr.compress_tree(tree, 1) == ("t", tree)
    assert "does not decode back" in caplog.text


OLD_READER = "4e45dd7"     # the last agck before compressed chunks (format 1.1 listings only)


def test_the_agck_before_compression_refuses_a_compressed_checkpoint_and_reads_a_raw_one(tmp_path):
    """Rule 12.8 against the real older reader: agck as it was before compression, checked
    out from this repository's history, opens a store holding a compressed checkpoint and
    a raw one: UnsupportedVersionError for the first (no verdict, nothing quarantined), the
    second read bit-exact."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old = tmp_path / "old"
    made = subprocess.run(["git", "-C", root, "worktree", "add", "--detach", str(old), OLD_READER],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"no git history to check the older reader out of: {made.stderr.strip()[:200]}")
    try:
        store = str(tmp_path / "s")
        open_store(store, compress="zstd", min_chunked=0).put("run", 1, weights(2 * MiB, 20))
        open_store(store, compress="none", min_chunked=0).put("run", 2, {"x": list(range(1000)), "t": TEXT})
        script = ("import sys, agck\n"
                  "from agck.errors import UnsupportedVersionError\n"
                  "s = agck.open_store(sys.argv[1])\n"
                  "try:\n    s.get('run', 1)\n    print('READ')\n"
                  "except UnsupportedVersionError as e:\n    print('REFUSED', e.reason)\n"
                  "ck = s.get('run', 2)\n"
                  "assert ck.state == {'x': list(range(1000)), 't': sys.argv[2]}\n"
                  "print('RAW OK', agck.__file__, len(s.quarantined()))\n")
        env = dict(os.environ, PYTHONPATH=str(old))
        done = subprocess.run([sys.executable, "-c", script, store, TEXT], capture_output=True, text=True,
                              env=env, cwd=str(old), timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        lines = done.stdout.splitlines()
        assert lines[0].startswith("REFUSED") and "required flag" in lines[0], lines
        assert lines[1].startswith("RAW OK") and str(old) in lines[1] and lines[1].endswith(" 0"), lines
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", str(old)], capture_output=True)


# --- the two sizes compression adds, crossed on every backend -------------------------------

def _text_of(nbytes: int) -> dict:
    """A state whose container is about ``nbytes`` (text: it compresses)."""
    words = ("checkpoint chunk frame store journal value " * (nbytes // 40 + 1))[:max(0, nbytes - 200)]
    return {"t": words}


@pytest.mark.parametrize("side", ["below", "above"])
def test_min_chunked_compressed_is_crossed_on_every_store(spec, side):
    """thresholds.MIN_CHUNKED_COMPRESSED (4 KiB): a compressing store writes a container
    just below it standalone and one just above it as chunks; both read back bit-exact
    through a fresh store object."""
    from agck import thresholds
    target = thresholds.MIN_CHUNKED_COMPRESSED + (-256 if side == "below" else 256)
    st = _text_of(target)
    size = agck.checkpoint.encode(st).total_len
    assert (size < thresholds.MIN_CHUNKED_COMPRESSED) == (side == "below"), size
    s = open_spec(spec, compress="zstd")
    assert s.min_chunked == thresholds.MIN_CHUNKED_COMPRESSED
    s.put("run", 1, st)
    assert (s.last_put is None) == (side == "below")       # standalone: no chunks written
    assert open_spec(spec).get("run", 1).state == st
    assert open_spec(spec, compress="none").min_chunked == thresholds.MIN_CHUNKED


@pytest.mark.parametrize("kind", ["file", "sqlite", "postgres"])
def test_journal_compress_min_is_crossed(request, tmp_path, kind):
    """journalrec.COMPRESS_MIN (512 bytes of value tree): a journal on a compressing store
    keeps a value just below it as "t", one just above as "z"; a fresh journal replays both."""
    from agck import journalrec as jr
    spec = make_spec(kind, request, tmp_path)
    values = {}
    for side, n in (("below", jr.COMPRESS_MIN - 8), ("above", jr.COMPRESS_MIN + 8)):
        text = ("abc " * n)[:n - 3]          # a str packs with a 3-byte header: a tree of n bytes
        assert len(agck.codec.plain_packed(text)) == n
        values[side] = text
    j = agck.Journal(open_spec(spec, compress="zstd"), "run")
    for side, text in values.items():
        assert j.step(side, lambda t=text: t) == text
    j.close()
    data, _ = open_spec(spec).log_read("run")
    assert {e.name: e.enc for _, e in jr.scan(data).entries} == {"below": "t", "above": "z"}
    again = agck.Journal(open_spec(spec), "run")
    assert {side: again.step(side, lambda: 1 / 0) for side in values} == values
    again.close()
