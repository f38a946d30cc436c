"""CUDA behaviour; skipped without a CUDA device (scripts/gpu_check runs these)."""

import numpy as np
import pytest
import torch

import agck
from agck import Snapshotter
from agck.stores.file.store import FileStore

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_tensors_load_on_cpu_unless_mapped():
    t = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    data = agck.dumps({"t": t, "view": t[::2]})
    ck = agck.loads(data)
    assert ck.state["t"].device.type == "cpu"
    assert torch.equal(ck.state["t"], t.cpu())
    assert torch.equal(ck.state["view"], t[::2].cpu())
    on_gpu = agck.loads(data, map_location="cuda")
    assert on_gpu.state["t"].is_cuda and torch.equal(on_gpu.state["t"], t)


def test_async_is_default_for_gpu_state_and_isolated(tmp_path):
    t = torch.zeros(1 << 20, device="cuda")
    snap = Snapshotter(tmp_path, "g", every=1, handle_signals=False)
    snap.restore({"t": t})
    snap.snapshot(1, {"t": t})
    assert snap._async is True
    t += 1  # mutate after the boundary: the snapshot holds the staged copy
    snap.close()
    st = FileStore(tmp_path).get("g", 1).state["state"]
    assert torch.equal(st["t"], torch.zeros(1 << 20))


def test_resume_restores_to_the_live_device(tmp_path):
    model = torch.nn.Linear(8, 8).cuda()
    with Snapshotter(tmp_path, "m", every=1, handle_signals=False) as snap:
        snap.restore({"model": model, "buf": torch.ones(3, device="cuda")})
        for _ in snap.steps(1):
            pass
    model2 = torch.nn.Linear(8, 8).cuda()
    with Snapshotter(tmp_path, "m", every=1, handle_signals=False) as snap:
        st = snap.restore({"model": model2, "buf": torch.zeros(3, device="cuda")})
    assert st["buf"].is_cuda and torch.equal(st["buf"], torch.ones(3, device="cuda"))
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_cuda_rng_is_restored(tmp_path):
    torch.cuda.manual_seed_all(3)
    torch.rand(1, device="cuda")
    with Snapshotter(tmp_path, "rng", every=1, handle_signals=False) as snap:
        snap.restore({})
        for _ in snap.steps(1):
            pass
    want = torch.rand(4, device="cuda")
    torch.cuda.manual_seed_all(99)
    with Snapshotter(tmp_path, "rng", every=1, handle_signals=False) as snap:
        snap.restore({})
    assert torch.equal(torch.rand(4, device="cuda"), want)
    assert np.isfinite(want.cpu().numpy()).all()
