"""The private SeaweedFS server the tests, campaigns and benchmarks start: it listens
only on the ports it was given, so two of them (a test session's and a benchmark's,
or a user's own) never collide on a port chosen by the server itself."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def _listening(pid: int) -> set[int]:
    out = subprocess.run(["ss", "-ltnupH"], capture_output=True, text=True, check=True).stdout
    return {int(line.split()[4].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list sockets")
def test_seaweed_opens_only_the_ports_it_was_given(seaweed):
    ports = set(seaweed.ports.values())
    given = ports | {p + 10000 for p in ports}       # each port's gRPC twin
    listening = _listening(seaweed.proc.pid)
    assert seaweed.ports["s3"] in listening
    assert listening <= given, f"ports it chose itself: {sorted(listening - given)}"
