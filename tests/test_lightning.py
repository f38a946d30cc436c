"""agck.integrations.lightning: real ``Trainer.fit`` runs saving through
AgckCheckpointIO (top-k, ``last.ckpt`` as copy and as symlink), hyperparameters
round-tripping, a bit-exact resume from the newest checkpoint that verifies, a
fit SIGKILLed mid-save and resumed, damaged files walked past, unencodable
entries refused by path, and the same round trip as Lightning's TorchCheckpointIO.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.utilities import AttributeDict  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import agck  # noqa: E402
from agck.integrations.lightning import (AgckCheckpointIO, load_from_checkpoint, newest_valid_checkpoint,  # noqa: E402
                                         scan_checkpoints)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 4


class Net(pl.LightningModule):
    """A 2-layer MLP; Adam and a StepLR so optimizer and scheduler state are in every checkpoint."""

    def __init__(self, hidden: int = 8, lr: float = 0.05, cfg=None, opts=None, act=None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)}


HPARAMS = dict(hidden=8, lr=0.05, cfg=AttributeDict(layers=[8, 8], betas=(0.9, 0.99), name="mlp"),
               opts=argparse.Namespace(seed=0, tag="x", data=pathlib.Path("/data/x")))


def _loader():
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(ds, batch_size=16, shuffle=False)   # the same batches in every epoch and run


def _fit(dirpath, max_epochs=EPOCHS, *, ckpt_path=None, top_k=2, save_last=True, plugin=True, **hp):
    """Fit from seed 0; returns (trainer, model, ModelCheckpoint)."""
    pl.seed_everything(0, verbose=False)
    model = Net(**{**HPARAMS, **hp})
    mc = ModelCheckpoint(dirpath=str(dirpath), save_top_k=top_k, save_last=save_last, monitor="val_loss")
    trainer = pl.Trainer(max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         accelerator="cpu", devices=1, callbacks=[mc],
                         plugins=[AgckCheckpointIO()] if plugin else [])
    trainer.fit(model, _loader(), _loader(), ckpt_path=ckpt_path)
    return trainer, model, mc


def _same(a, b, where="checkpoint"):
    """Same types, keys (in order) and values, tensors bit for bit."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{where}._metadata"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, argparse.Namespace):
        _same(vars(a), vars(b), where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), where
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted fit: its final weights and optimizer state."""
    trainer, model, _ = _fit(tmp_path_factory.mktemp("ref"))
    return _weights(model), trainer.optimizers[0].state_dict()


def _agck_files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".ckpt"))


# 1 + 5 ---------------------------------------------------------------------------------------

def test_fit_top_k_last_hparams_and_torch_round_trip(tmp_path):
    trainer, model, mc = _fit(tmp_path / "ck")
    d = tmp_path / "ck"
    top = {os.path.basename(p) for p in mc.best_k_models}
    assert len(top) == 2 and set(_agck_files(d)) == top | {"last.ckpt"}
    assert os.path.basename(mc.best_model_path) in top
    io = AgckCheckpointIO()
    for name in _agck_files(d):
        ck = agck.load(d / name)          # an AGCK container, every checksum verified
        assert ck.meta["lightning"]["version"] == pl.__version__
        c = io.load_checkpoint(d / name)
        assert ck.step == c["global_step"] == ck.meta["lightning"]["global_step"]
        hp = c["hyper_parameters"]
        assert type(hp) is dict and set(hp) == {"hidden", "lr", "cfg", "opts", "act"}
        assert (hp["hidden"], hp["lr"], hp["act"]) == (8, 0.05, None)
        assert type(hp["cfg"]) is AttributeDict and hp["cfg"] == HPARAMS["cfg"] and hp["cfg"].betas == (0.9, 0.99)
        assert type(hp["opts"]) is argparse.Namespace and hp["opts"] == HPARAMS["opts"]
        assert type(hp["opts"].data) is type(pathlib.Path())
        assert type(c["state_dict"]) is collections.OrderedDict and c["state_dict"]._metadata[""] == {"version": 1}
        cb = next(v for k, v in c["callbacks"].items() if k.startswith("ModelCheckpoint"))
        assert isinstance(cb["best_model_score"], torch.Tensor) and cb["dirpath"] == str(d)
    last = io.load_checkpoint(d / "last.ckpt")
    assert last["epoch"] == EPOCHS - 1 and last["global_step"] == EPOCHS * 4
    _same(last["state_dict"], model.state_dict())
    restored = load_from_checkpoint(Net, d / "last.ckpt")
    assert restored.hparams.cfg == HPARAMS["cfg"] and restored.hparams.opts == HPARAMS["opts"]
    _same(restored.state_dict(), model.state_dict())

    # Lightning's default plugin, same checkpoint dict: the same keys, types and values come back
    dump = trainer._checkpoint_connector.dump_checkpoint()
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters",
            "hparams_name", "pytorch-lightning_version", "epoch", "global_step"} <= set(dump)
    dump["extra"] = {"ids": {1, 2}, "pair": (1.5, float("inf")), "blob": b"\x00", "od": collections.OrderedDict(a=1)}
    TorchCheckpointIO().save_checkpoint(dump, tmp_path / "torch.ckpt")
    io.save_checkpoint(dump, tmp_path / "agck.ckpt")
    _same(io.load_checkpoint(tmp_path / "agck.ckpt"),
          TorchCheckpointIO().load_checkpoint(tmp_path / "torch.ckpt", weights_only=False))
    with pytest.raises(agck.FormatError, match="torch.save"):    # recognised, never unpickled
        io.load_checkpoint(tmp_path / "torch.ckpt")


def test_save_last_link(tmp_path, caplog):
    """save_last="link": Lightning symlinks last.ckpt to the newest top-k file itself."""
    d = tmp_path / "ck"
    _fit(d, 3, save_last="link", top_k=-1)
    assert os.path.islink(d / "last.ckpt")
    target = os.path.realpath(d / "last.ckpt")
    assert target == str(d / "epoch=2-step=12.ckpt")
    io = AgckCheckpointIO()
    assert io.load_checkpoint(d / "last.ckpt")["global_step"] == 12          # through the link, verified
    assert newest_valid_checkpoint(d) == target                               # the file before a link to it
    os.remove(target)                                                         # the link now dangles
    with caplog.at_level(logging.WARNING, logger="agck.integrations.lightning"):
        scan = scan_checkpoints(d)
    assert [os.path.basename(r.path) for r in scan.rejected] == ["last.ckpt"]
    assert "cannot be followed" in scan.rejected[0].reason and "last.ckpt" in caplog.text
    assert scan.path is not None and agck.load(scan.path).step == 8
    io.remove_checkpoint(d / "last.ckpt")                                     # the link, not a target
    io.remove_checkpoint(d / "last.ckpt")                                     # gone already: no error
    assert _agck_files(d) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]


# 2 -------------------------------------------------------------------------------------------

def test_resume_from_newest_valid_is_bit_exact(tmp_path, reference):
    d = tmp_path / "ck"
    assert newest_valid_checkpoint(d) is None                                 # first run: start fresh
    _fit(d, 2)
    path = newest_valid_checkpoint(d)
    assert AgckCheckpointIO().load_checkpoint(path)["global_step"] == 8
    trainer, model, _ = _fit(d, EPOCHS, ckpt_path=path)
    assert trainer.global_step == EPOCHS * 4
    _same(_weights(model), reference[0])
    _same(trainer.optimizers[0].state_dict(), reference[1])


# 3 -------------------------------------------------------------------------------------------

_KILLED = textwrap.dedent("""
    import sys
    sys.path[:0] = [{tests!r}, {root!r}]
    import test_lightning as t
    t._fit(sys.argv[1], t.EPOCHS, top_k=-1)
""")


def test_killed_mid_save_then_damaged_files_walked_past(tmp_path, reference, caplog):
    d = tmp_path / "ck"
    # top_k=-1, save_last=True: each epoch writes its own file, then last.ckpt. The 6th write is
    # the third epoch's last.ckpt: SIGKILLed inside agck.save's durable write.
    env = {**os.environ, "AGCK_FAILPOINTS": "file.mid_write=kill@6"}
    code = _KILLED.format(tests=os.path.join(ROOT, "tests"), root=ROOT)
    proc = subprocess.run([sys.executable, "-c", code, str(d)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    e0, e1, e2 = "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"
    assert _agck_files(d) == [e0, e1, e2, "last.ckpt"]
    io = AgckCheckpointIO()
    assert io.load_checkpoint(d / "last.ckpt")["global_step"] == 8            # the rewrite never landed
    scan = scan_checkpoints(d)
    assert len(scan.orphans) == 1 and ".last.ckpt" in scan.orphans[0]         # the killed write's temp file
    # Lightning's ckpt_path="last" would take last.ckpt (step 8); the newest that verifies is epoch 2
    assert scan.path == str(d / e2) and not scan.rejected

    # truncated: passed over with its reason; last.ckpt (step 8) is next
    _damage(d / e2, lambda b: b[: len(b) // 2])
    with pytest.raises(agck.CorruptCheckpointError) as ei:
        io.load_checkpoint(d / e2)
    assert str(d / e2) in str(ei.value)
    # one bit flipped in last.ckpt's payload: passed over too; epoch 1 is next
    _damage(d / "last.ckpt", lambda b: b[:-200] + bytes([b[-200] ^ 1]) + b[-199:])
    with caplog.at_level(logging.WARNING, logger="agck.integrations.lightning"):
        path = newest_valid_checkpoint(d)
    assert path == str(d / e1)
    scan = scan_checkpoints(d)
    assert [os.path.basename(r.path) for r in scan.rejected] == [e2, "last.ckpt"]
    assert all(r.reason for r in scan.rejected) and e2 in caplog.text and "last.ckpt" in caplog.text
    with pytest.raises(agck.CorruptCheckpointError):
        io.load_checkpoint(d / "last.ckpt")

    # a new fit resumes from it and ends where the uninterrupted run did
    trainer, model, _ = _fit(d, EPOCHS, ckpt_path=path, top_k=-1)
    assert trainer.global_step == EPOCHS * 4
    _same(_weights(model), reference[0])

    # nothing verifies: an error carrying the report (strict), or None
    for name in _agck_files(d):
        _damage(d / name, lambda b: b[:100])
    with pytest.raises(agck.NoValidCheckpointError) as ei:
        newest_valid_checkpoint(d)
    assert len(ei.value.report.rejected) == len(_agck_files(d))
    assert newest_valid_checkpoint(d, strict=False) is None


def _damage(path, change):
    st = os.stat(path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(change(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))   # keep its place in the newest-first order


# 4 -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Cfg:
    depth: int = 2


def test_unencodable_entries_are_refused_by_path(tmp_path):
    d = tmp_path / "ck"
    # a function: picklable by reference (Lightning keeps it in hparams; a lambda it drops itself)
    with pytest.raises(agck.EncodeError, match=r"checkpoint\['hyper_parameters'\]\['act'\]: cannot encode") as ei:
        _fit(d, 1, act=torch.nn.functional.relu)
    assert "ignore=['act']" in str(ei.value) and str(d) in str(ei.value)
    assert not os.path.exists(d) or not _agck_files(d)                        # nothing written

    io = AgckCheckpointIO()
    with pytest.raises(agck.EncodeError, match=r"checkpoint\['hyper_parameters'\]\['act'\]: cannot encode"):
        io.save_checkpoint({"hyper_parameters": {"act": lambda x: x}}, tmp_path / "x.ckpt")
    with pytest.raises(agck.EncodeError, match=r"checkpoint\['hyper_parameters'\]\['cfg'\]: .*dataclass Cfg") as ei:
        io.save_checkpoint({"hyper_parameters": {"cfg": Cfg()}}, tmp_path / "x.ckpt")
    assert "asdict" in str(ei.value)
    with pytest.raises(agck.EncodeError, match=r"checkpoint\['callbacks'\]\['cb'\]\[1\]"):
        io.save_checkpoint({"callbacks": {"cb": [1, object()]}}, tmp_path / "x.ckpt")
    with pytest.raises(agck.UsageError, match="storage_options"):
        io.save_checkpoint({"epoch": 0}, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(agck.UsageError, match="torch.load-style"):
        io.load_checkpoint(tmp_path / "x.ckpt", map_location=lambda storage, loc: storage)
    assert not os.path.exists(tmp_path / "x.ckpt")


def test_newest_is_the_time_written_in_the_container_not_the_files(tmp_path):
    """A directory copied without its file times (cp, aws s3 cp) keeps its order: the
    time each container's header says it was written decides."""
    io, d = AgckCheckpointIO(), tmp_path / "ck"
    for step in (10, 9):                      # step 9 written last: the branch resumed from earlier
        io.save_checkpoint({"epoch": 0, "global_step": step, "optimizer_states": [], "state_dict": {},
                            "pytorch-lightning_version": pl.__version__}, d / f"step={step}.ckpt")
    os.utime(d / "step=9.ckpt", ns=(1, 1))    # a copy gave the older file the later time
    assert newest_valid_checkpoint(d) == str(d / "step=9.ckpt")
    (d / "junk.ckpt").write_bytes(b"x" * 100)   # no header: its file time, then judged
    assert newest_valid_checkpoint(d) == str(d / "step=9.ckpt")
    assert [os.path.basename(r.path) for r in scan_checkpoints(d).rejected] == ["junk.ckpt"]


def test_malformed_and_odd_checkpoints_are_verdicts_or_usage_errors(tmp_path):
    io = AgckCheckpointIO()
    for i, restore in enumerate((5, [["odict", [[1]]]], [["odict", ["missing"]]])):
        agck.save(tmp_path / f"m{i}.ckpt", {"epoch": 0, "optimizer_states": [], "pytorch-lightning_version": "2"},
                  meta={"lightning": {"format": 1, "restore": restore}})
        with pytest.raises(agck.MalformedCheckpointError, match="conversion records"):
            io.load_checkpoint(tmp_path / f"m{i}.ckpt")
    scan = scan_checkpoints(tmp_path)                  # passed over, not raised
    assert scan.path is None and len(scan.rejected) == 3
    # a NaN key cannot be looked up again: what it holds is not recorded, so the file loads
    io.save_checkpoint({"h": {float("nan"): collections.OrderedDict(a=1)}}, tmp_path / "nan.ckpt")
    assert list(io.load_checkpoint(tmp_path / "nan.ckpt")["h"].values()) == [{"a": 1}]
    for bad in (None, 3):
        with pytest.raises(agck.UsageError, match="str or os.PathLike"):
            io.load_checkpoint(bad)
    agck.save(tmp_path / "plain.ckpt", {"state_dict": {}})
    with pytest.raises(agck.UsageError, match="neither"):
        load_from_checkpoint(Net(), tmp_path / "plain.ckpt")
    with pytest.raises(agck.UsageError, match="hparams_file"):
        load_from_checkpoint(Net, tmp_path / "plain.ckpt", hparams_file="h.yaml")
    with pytest.raises(agck.FormatError, match="not a Lightning checkpoint"):
        load_from_checkpoint(Net, tmp_path / "plain.ckpt", weights_only=True)


def test_readme_example_fits_then_resumes_at_its_last_step(tmp_path):
    from readme_examples import run_as_script
    assert run_as_script("AgckCheckpointIO()", tmp_path) == ["12", "12"]


def test_temp_files_of_saves_a_crash_cut_short_are_removed(tmp_path):
    """A SIGKILL during a save leaves a hidden temp file (a checkpoint's worth of disk
    per crash): the next run's first save into the directory removes it, and so does
    newest_valid_checkpoint; a temp file whose writer still runs is left alone."""
    d = tmp_path / "ckpts"
    d.mkdir()
    dead = d / ".epoch=0-step=6.ckpt.tmp.999999.ab12cd34"
    live = d / f".epoch=0-step=9.ckpt.tmp.{os.getpid()}.ab12cd34"
    for p in (dead, live):
        p.write_bytes(b"\0" * 4096)
    io = AgckCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "epoch": 0, "global_step": 7,
                        "pytorch-lightning_version": "2.5.0"}, str(d / "epoch=0-step=7.ckpt"))
    assert not dead.exists() and live.exists()
    dead.write_bytes(b"\0" * 4096)
    assert newest_valid_checkpoint(str(d), weights_only_ok=True) == str(d / "epoch=0-step=7.ckpt")
    assert not dead.exists() and live.exists()
