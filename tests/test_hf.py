"""agck.integrations.hf: manifests written on every Trainer save, resume from the
newest checkpoint that verifies (walking back past damaged ones, where Trainer's
own choice would take the damaged one), and a run SIGKILLed during a save that
resumes and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from safetensors.torch import load_file  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import agck  # noqa: E402
from agck.errors import AgckError, NoValidCheckpointError, UsageError  # noqa: E402
from agck.integrations import hf  # noqa: E402
from agck.integrations.hf import (MANIFEST_NAME, AgckCallback, AgckTrainer, newest_valid_checkpoint,  # noqa: E402
                                  scan_checkpoints, verify_checkpoint, write_manifest)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One definition of the run, used in this process and in the subprocesses.
SETUP = textwrap.dedent("""
    import os, torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    def make(out, cls, **extra):
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
        g = torch.Generator().manual_seed(1)
        ds = [{"input_ids": r, "labels": r} for r in torch.randint(0, 64, (32, 16), generator=g)]
        args = TrainingArguments(output_dir=out, max_steps=6, save_steps=2, report_to=[], use_cpu=True,
                                 per_device_train_batch_size=4, logging_steps=1, seed=0, disable_tqdm=True,
                                 dataloader_num_workers=0)
        return cls(model=model, args=args, train_dataset=ds, **extra)
""")
_ns: dict = {}
exec(SETUP, _ns)
make = _ns["make"]

RUN = SETUP + textwrap.dedent("""
    import sys
    from safetensors.torch import save_file
    from transformers import Trainer
    from agck.integrations.hf import AgckCallback, newest_valid_checkpoint

    out, result = sys.argv[1], sys.argv[2]
    trainer = make(out, Trainer, callbacks=[AgckCallback()])
    start = newest_valid_checkpoint(out)
    print("RESUME FROM", start, flush=True)
    trainer.train(resume_from_checkpoint=start)
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"}, result)
""")


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               CUDA_VISIBLE_DEVICES="")
    env.pop("AGCK_FAILPOINTS", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One run of 6 steps with the callback: checkpoints at steps 2, 4 and 6."""
    from transformers import Trainer

    out = str(tmp_path_factory.mktemp("hf") / "run")
    make(out, Trainer, callbacks=[AgckCallback()]).train()
    return out


@pytest.fixture
def run_copy(trained, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    return out


def _ck(out, step):
    return os.path.join(out, f"checkpoint-{step}")


def test_manifests_written_and_newest_is_chosen(trained):
    for step in (2, 4, 6):
        d = _ck(trained, step)
        ck = agck.load(os.path.join(d, MANIFEST_NAME))
        names = {row[0] for row in ck.state["files"]}
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                "training_args.bin", "config.json"} <= names
        assert ck.step == step and ck.state["step"] == step
        assert verify_checkpoint(d) == len(names)
    assert newest_valid_checkpoint(trained) == _ck(trained, 6)
    scan = scan_checkpoints(trained)
    assert (scan.step, scan.candidates, scan.rejected) == (6, 3, [])


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


DAMAGE = {
    "truncate-optimizer": (lambda d: _truncate(os.path.join(d, "optimizer.pt")), "truncated"),
    "flip-weights": (lambda d: _flip(os.path.join(d, "model.safetensors")), "checksum mismatch"),
    "flip-rng": (lambda d: _flip(os.path.join(d, "rng_state.pth")), "checksum mismatch"),
    "no-manifest": (lambda d: os.unlink(os.path.join(d, MANIFEST_NAME)), "no manifest"),
    "damaged-manifest": (lambda d: _flip(os.path.join(d, MANIFEST_NAME)), "checksum"),
    "missing-file": (lambda d: os.unlink(os.path.join(d, "scheduler.pt")), "missing"),
    "extra-file": (lambda d: open(os.path.join(d, "pytorch_model.bin"), "wb").close(), "not in the manifest"),
    "manifest-of-another-step": (lambda d: shutil.copy(os.path.join(os.path.dirname(d), "checkpoint-4",
                                                                     MANIFEST_NAME), d), "for step 4"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_walks_back_past_damaged_newest(run_copy, kind, caplog):
    damage, why = DAMAGE[kind]
    damage(_ck(run_copy, 6))
    # Trainer's own resume_from_checkpoint=True would take the damaged directory
    assert get_last_checkpoint(run_copy) == _ck(run_copy, 6)
    with caplog.at_level(logging.WARNING, logger="agck.integrations.hf"):
        assert newest_valid_checkpoint(run_copy) == _ck(run_copy, 4)
    scan = scan_checkpoints(run_copy)
    assert scan.step == 4 and [r.step for r in scan.rejected] == [6]
    assert why in scan.rejected[0].reason
    assert any(why in r.getMessage() and "checkpoint-6" in r.getMessage() for r in caplog.records)


def test_walks_back_several_and_refuses_when_none_verifies(run_copy):
    os.unlink(os.path.join(_ck(run_copy, 6), MANIFEST_NAME))
    _truncate(os.path.join(_ck(run_copy, 4), "model.safetensors"))
    assert newest_valid_checkpoint(run_copy) == _ck(run_copy, 2)
    _flip(os.path.join(_ck(run_copy, 2), "trainer_state.json"))
    with pytest.raises(NoValidCheckpointError) as ei:
        newest_valid_checkpoint(run_copy)
    assert [r.step for r in ei.value.report.rejected] == [6, 4, 2]
    assert ei.value.hint and "step 6" in str(ei.value)
    assert newest_valid_checkpoint(run_copy, strict=False) is None


def test_fresh_run_and_usage_errors(tmp_path):
    assert newest_valid_checkpoint(tmp_path / "nothing-yet") is None
    assert newest_valid_checkpoint(tmp_path) is None
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError):
        newest_valid_checkpoint(tmp_path / "file")
    with pytest.raises(UsageError) as ei:
        write_manifest(tmp_path / "checkpoint-3")
    assert isinstance(ei.value, AgckError) and ei.value.hint
    (tmp_path / "odd").mkdir()
    with pytest.raises(UsageError):
        write_manifest(tmp_path / "odd")
    assert write_manifest(tmp_path / "odd", step=3).endswith(MANIFEST_NAME)
    (tmp_path / "checkpoint-6").mkdir()
    with pytest.raises(UsageError, match="named for step 6"):     # verify_checkpoint would never pass it
        write_manifest(tmp_path / "checkpoint-6", step=4)
    for bad in (None, 6):
        with pytest.raises(UsageError, match="must be a path"):
            newest_valid_checkpoint(bad)
        with pytest.raises(UsageError, match="must be a path"):
            verify_checkpoint(bad)
    with pytest.raises(agck.CorruptCheckpointError, match="not there"):   # a verdict: rotation may race a scan
        verify_checkpoint(tmp_path / "checkpoint-8")


def test_callback_refuses_what_it_does_not_cover_and_warns(tmp_path, caplog):
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState
    cb = AgckCallback()

    def args(**kw):
        return SimpleNamespace(**{"world_size": 1, "output_dir": str(tmp_path), "save_total_limit": None,
                                  "load_best_model_at_end": False, **kw})
    with pytest.raises(UsageError, match="2 processes"):    # at Trainer(...), before a resume loads anything
        cb.on_init_end(args(world_size=2), TrainerState(), TrainerControl())
    with pytest.raises(UsageError, match="hyperparameter search"):
        cb.on_train_begin(args(), TrainerState(trial_name="run-0", trial_params={"lr": 1e-3}), TrainerControl())
    for limit, best, warned in ((1, False, True), (2, True, True), (2, False, False), (3, True, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="agck.integrations.hf"):
            cb.on_train_begin(args(save_total_limit=limit, load_best_model_at_end=best), TrainerState(),
                              TrainerControl())
        assert ("save_total_limit" in caplog.text) == warned, (limit, best)


def test_adopt_with_write_manifest(run_copy):
    os.unlink(os.path.join(_ck(run_copy, 6), MANIFEST_NAME))
    assert newest_valid_checkpoint(run_copy) == _ck(run_copy, 4)
    write_manifest(_ck(run_copy, 6))
    assert newest_valid_checkpoint(run_copy) == _ck(run_copy, 6)


def test_trainer_subclass_resume_true_goes_through_the_check(run_copy, monkeypatch):
    _flip(os.path.join(_ck(run_copy, 6), "optimizer.pt"))    # damaged, its (now stale) manifest still there
    trainer = make(run_copy, AgckTrainer)
    assert sum(isinstance(cb, AgckCallback) for cb in trainer.callback_handler.callbacks) == 1
    seen = []
    orig = hf.newest_valid_checkpoint
    monkeypatch.setattr(hf, "newest_valid_checkpoint", lambda out, **kw: seen.append(orig(out, **kw)) or seen[-1])
    trainer.train(resume_from_checkpoint=True)
    monkeypatch.undo()
    assert seen == [_ck(run_copy, 4)]
    assert trainer.state.global_step == 6
    assert newest_valid_checkpoint(run_copy) == _ck(run_copy, 6)     # rewritten, with a new manifest
    with pytest.raises(NoValidCheckpointError):
        make(str(run_copy) + "-empty", AgckTrainer).train(resume_from_checkpoint=True)


def test_sigkill_during_save_then_resume_is_bit_exact(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN)
    ref_out, ref_w = str(tmp_path / "ref"), str(tmp_path / "ref.safetensors")
    out, w = str(tmp_path / "run"), str(tmp_path / "run.safetensors")
    # the uninterrupted reference runs alongside the one that is killed
    ref = subprocess.Popen([sys.executable, str(script), ref_out, ref_w], env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    # the second durable write agck makes is the manifest of checkpoint-4: SIGKILL before its rename
    killed = subprocess.run([sys.executable, str(script), out, w], capture_output=True, text=True, timeout=240,
                            env=_env(AGCK_FAILPOINTS="file.before_rename=kill@2"))
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert not os.path.exists(w) and not os.path.exists(_ck(out, 6))
    assert get_last_checkpoint(out) == _ck(out, 4)           # what Trainer would resume from
    assert not os.path.exists(os.path.join(_ck(out, 4), MANIFEST_NAME))
    scan = scan_checkpoints(out)
    assert scan.step == 2 and "no manifest" in scan.rejected[0].reason

    resumed = subprocess.run([sys.executable, str(script), out, w], capture_output=True, text=True, timeout=240,
                             env=_env())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"RESUME FROM {_ck(out, 2)}" in resumed.stdout
    ref_log, _ = ref.communicate(timeout=240)
    assert ref.returncode == 0, ref_log
    assert "RESUME FROM None" in ref_log
    assert newest_valid_checkpoint(out) == _ck(out, 6)

    a, b = load_file(ref_w), load_file(w)
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the checkpoint the resumed run wrote at step 6 matches the reference byte for byte
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        with open(os.path.join(_ck(ref_out, 6), name), "rb") as f1, open(os.path.join(_ck(out, 6), name), "rb") as f2:
            assert f1.read() == f2.read(), name


def test_failed_manifest_write_leaves_no_stale_manifest(run_copy):
    from agck import failpoints
    from agck.errors import DurabilityError

    _flip(os.path.join(_ck(run_copy, 6), "optimizer.pt"))
    trainer = make(run_copy, AgckTrainer)
    failpoints.configure("file.before_rename=raise")   # the disk fails while the new manifest is written
    try:
        with pytest.raises(DurabilityError) as ei:
            trainer.train(resume_from_checkpoint=True)
    finally:
        failpoints.configure("")
    assert ei.value.ref.endswith(MANIFEST_NAME) and ei.value.hint
    # the old step-6 manifest was removed before Trainer rewrote the directory, so it cannot vouch for it
    assert not os.path.exists(os.path.join(_ck(run_copy, 6), MANIFEST_NAME))
    assert not [n for n in os.listdir(_ck(run_copy, 6)) if n.startswith(".")]
    assert newest_valid_checkpoint(run_copy) == _ck(run_copy, 4)


def test_readme_example_trains_then_resumes_with_nothing_left(tmp_path):
    """The README's example, run twice as a user would: the second run resumes from
    the last verified checkpoint and has no step left to take."""
    from readme_examples import run_as_script
    assert run_as_script("AgckCallback()", tmp_path) == ["8", "8"]
    assert sorted(os.listdir(tmp_path / "ckpts-hf")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6",
                                                          "checkpoint-8"]


def test_write_manifest_removes_a_dead_writers_manifest_temp(tmp_path):
    d = tmp_path / "checkpoint-3"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"weights")
    dead = d / ".agck_manifest.agck.tmp.999999.ab12cd34"
    dead.write_bytes(b"half a manifest")
    write_manifest(str(d))
    assert not dead.exists()
