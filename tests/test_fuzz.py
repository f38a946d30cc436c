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
from agck.errors import AgckError

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


def test_a_short_coverage_guided_run_finds_nothing(tmp_path):
    pytest.importorskip("atheris")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "fuzz"), "--seconds", "8", "--jobs", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "| container_resealed |" in done.stdout
