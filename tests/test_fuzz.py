"""The fuzz targets (fuzz/targets.py): the kept corpus replays clean, resealing gets a
mutated container past its checksums to the decoders, and a short coverage-guided run
(atheris) finds nothing; scripts/fuzz makes the long ones."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import agck
from agck import format
from agck.errors import AgckError, DamagedChunkError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fuzz import targets  # noqa: E402

CORPUS = os.path.join(ROOT, "fuzz", "corpus")


@pytest.mark.parametrize("name", sorted(targets.TARGETS))
def test_the_kept_corpus_replays_clean(name):
    d = os.path.join(CORPUS, name)
    files = sorted(os.listdir(d))
    assert files, f"no corpus for {name}"
    for f in files:
        with open(os.path.join(d, f), "rb") as fh:
            targets.TARGETS[name](fh.read())       # raises only what is not an AgckError


def test_resealing_gets_a_mutated_container_past_its_checksums():
    data = bytearray(agck.dumps({"state": [1, 2, 3], "w": b"x" * 100}))
    meta_len = int.from_bytes(data[16:24], "little")
    for off in range(64, 64 + meta_len, 7):
        bad = bytearray(data)
        bad[off] ^= 0x20
        with pytest.raises(AgckError, match="checksum|digest"):
            agck.loads(bytes(bad))
        try:
            format.open_container(targets.reseal(bytes(bad)), verify=False)
        except AgckError as e:      # what the metadata decoder says, never a checksum
            assert "checksum" not in str(e) and "digest" not in str(e), (off, e)


def test_the_seeds_of_the_direct_targets_are_read_whole():
    """What chunk_listing and commit_part start from is what agck's writers make and its
    readers take: every listing decodes from its chunks, every commit record binds its parts."""
    from agck import sharded
    from agck.stores import content

    from fuzz import seeds
    chunks = targets.MemoryObjects(targets.listed_checkpoints()[0])
    steps = set()
    for meta in seeds.listing_seeds():
        ck = content.decode(targets.frame(meta, chunked=True), chunks.get, verify=True, map_location=None,
                            ref="seed")
        assert ck.run == targets.LISTED_RUN and sorted(ck.state) == ["b", "l", "s", "w"]
        steps.add(ck.step)
    assert steps == {3, 4}
    kinds = []
    for data in seeds.commit_seeds():
        found = targets.sections(data)
        state = agck.codec.decode_state(found[0], [], targets.no_blob, 0)
        commit = sharded.as_commit(agck.Checkpoint(state=state, meta=None, run=targets.COMMIT_RUN,
                                                   step=targets.COMMIT_STEP, parent=None, created_at=0.0,
                                                   version="1.0"))
        assert commit is not None and len(found) == 1 + commit.world_size
        for rank in range(commit.world_size):
            sharded.read_part(targets.MemoryParts(found[1:]), commit, rank)
        if commit.kind == "dcp":
            targets.dcp_module().metadata_from_plain(commit.extra)
        kinds.append((commit.kind, commit.world_size))
    assert kinds[:2] == [("snapshot", 2), ("snapshot", 1)]


def test_a_listing_claiming_more_than_memory_is_judged_not_allocated():
    """A listing of a few hundred bytes can claim terabytes: its first chunk is looked for
    before the buffer is mapped, and a buffer the machine cannot give is an AgckError."""
    import resource

    import numpy as np

    from agck.stores import content
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    three_gib = format.dumps_chunked(run="r", step=1, parent=None, meta=None, addresses=[bytes(32)],
                                     sizes=[3 << 30])
    with pytest.raises(DamagedChunkError, match="missing"):
        content.decode(three_gib, lambda address, size: None, verify=True, map_location=None, ref="x")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 << 10     # KiB: nothing mapped
    n = 40_000      # chunks of 4 GiB: 160 TiB, past any address space
    size = (1 << 32) - 1
    huge = format.dumps_chunked(run="r", step=1, parent=None, meta=None, addresses=[bytes(32)] * n,
                                sizes=[size] * n)
    first = np.broadcast_to(np.zeros(1, np.uint8), (size,))     # 4 GiB that take no memory
    with pytest.raises(AgckError, match="cannot allocate"):
        content.decode(huge, lambda address, want: first, verify=True, map_location=None, ref="x")


def test_a_short_coverage_guided_run_finds_nothing(tmp_path):
    pytest.importorskip("atheris")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fuzz"), "--seconds", os.environ.get("AGCK_FUZZ_SECONDS", "2"), "--jobs", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| target")}
    assert sorted(rows) == sorted(targets.TARGETS), done.stdout
    assert all(int(runs.replace(",", "")) > 0 for runs in rows.values()), done.stdout
