"""The agck command and the recovery scanner, on the file store."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import agck
from agck.cli import main
from agck.recovery import recover_run
from agck.stores.file import FileStore


@pytest.fixture
def store(tmp_path):
    s = FileStore(tmp_path / "ckpts")
    for step in range(0, 60, 10):
        s.put("r", step, {"w": torch.full((16,), float(step)), "a": np.arange(step + 1)}, meta={"step": step},
              parent=step - 10 if step else None)
    s.put("other", 1, {"x": 1})
    return s


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def flip(path, pos=-100):
    data = bytearray(open(path, "rb").read())
    data[pos] ^= 0x10
    open(path, "wb").write(data)


def test_recover_clean_store_exit_0(store, capsys):
    code, out, _ = run_cli(capsys, "recover", store.root, "--json")
    assert code == 0
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert runs["r"]["step"] == 50 and runs["other"]["step"] == 1 and not runs["r"]["rejected"]


def test_recover_walks_back_and_names_every_rejection(store, capsys):
    flip(store.path("r", 50))
    os.truncate(store.path("r", 40), 100)
    os.replace(store.path("r", 10), store.path("r", 30))  # another step's file in its place
    code, out, _ = run_cli(capsys, "recover", store.root, "--run", "r", "--json")
    assert code == 1
    rep = json.loads(out)["runs"][0]
    assert rep["step"] == 20
    assert [(r["step"], os.path.basename(r["ref"])) for r in rep["rejected"]] == [
        (50, "000000000050.agck"), (40, "000000000040.agck"), (30, "000000000030.agck")]
    reasons = " | ".join(r["reason"] for r in rep["rejected"])
    assert "checksum mismatch" in reasons and "truncated" in reasons and "step 10" in reasons


def test_recover_text_restore_to_and_clean(store, capsys, tmp_path):
    flip(store.path("r", 50))
    tmp = os.path.join(store.root, "r", ".000000000060.agck.tmp.123.abcd")
    open(tmp, "wb").write(b"partial")
    out_file = tmp_path / "restored.agck"
    code, out, _ = run_cli(capsys, "recover", store.root, "--run", "r", "--restore-to", out_file, "--clean")
    assert code == 1
    assert "last valid step 40" in out and "rejected step 50" in out and "(removed)" in out
    assert not os.path.exists(tmp)
    ck = agck.load(out_file)
    assert ck.step == 40 and torch.equal(ck.state["w"], torch.full((16,), 40.0))


def test_recover_nothing_valid_exit_3(tmp_path, capsys):
    s = FileStore(tmp_path)
    s.put("r", 1, {"x": 1})
    flip(s.path("r", 1), 70)
    code, out, _ = run_cli(capsys, "recover", tmp_path)
    assert code == 3 and "NOTHING VALID" in out
    with pytest.raises(agck.NoValidCheckpointError) as e:
        recover_run(s, "r", strict=True)
    assert e.value.report.rejected[0].step == 1


def test_verify_ls_show_prune_export(store, capsys, tmp_path):
    code, out, _ = run_cli(capsys, "verify", store.root)
    assert code == 0 and "7 ok, 0 corrupt" in out
    flip(store.path("r", 30))
    code, out, _ = run_cli(capsys, "verify", store.root, "--json")
    assert code == 1 and json.loads(out)["corrupt"] == 1
    code, out, _ = run_cli(capsys, "verify", store.path("r", 30))
    assert code == 1 and "CORRUPT" in out

    code, out, _ = run_cli(capsys, "ls", store.root, "--run", "r", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["step"] for r in rows] == [0, 10, 20, 30, 40, 50] and rows[2]["meta"] == {"step": 20}

    code, out, _ = run_cli(capsys, "show", store.path("r", 20), "--json")
    info = json.loads(out)
    assert code == 0 and info["step"] == 20 and {t["path"] for t in info["tensors"]} == {"state['w']", "state['a']"}
    code, out, _ = run_cli(capsys, "show", store.root, "--run", "r", "--step", "20")
    assert code == 0 and "state['w']" in out and "float32" in out

    code, out, _ = run_cli(capsys, "prune", store.root, "--run", "r", "--keep-last", "2", "--json")
    assert code == 0 and json.loads(out)["kept"] == [40, 50]

    for ext in (".safetensors", ".pt", ".npz"):
        target = tmp_path / f"out{ext}"
        code, out, _ = run_cli(capsys, "export", store.root, "--run", "r", "--to", target)
        assert code == 0 and target.exists()
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["w"], torch.full((16,), 50.0))
    assert np.array_equal(np.load(tmp_path / "out.npz")["a"], np.arange(51))


@pytest.mark.parametrize("argv, code, needle", [
    (["show", "/no/such/file"], 4, "no such file"),
    (["recover", "/no/such/dir"], 4, "no such"),
    (["show", "STORE", "--run", "r", "--step", "x"], 2, "step must be"),
    (["show", "STORE", "--run", "nope"], 4, ""),
    (["show", "STORE", "--run", "r", "--step", "7"], 4, "no checkpoint at step 7"),
    (["recover", "STORE", "--run", "nope"], 4, "no run 'nope'"),
    (["show", "NOTAGCK"], 4, "not an AGCK container"),
    (["recover", "postgresql://postgres:s3cret@127.0.0.1:1/none"], 4, "agck:"),
])
def test_bad_input_is_one_line_without_traceback(store, tmp_path, argv, code, needle):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint at all" * 3)
    argv = [str(store.root) if a == "STORE" else str(junk) if a == "NOTAGCK" else a for a in argv]
    p = subprocess.run([sys.executable, "-m", "agck.cli", *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == code, p.stderr
    assert "Traceback" not in p.stderr and "s3cret" not in p.stderr + p.stdout
    assert needle in p.stderr + p.stdout


def test_recover_is_fast_on_10000_checkpoints_with_100_corrupt(tmp_path):
    s = FileStore(tmp_path)
    payload = agck.dumps({"x": np.zeros(16)}, run="big", step=0)
    # lay the files down directly: this tests the scan, not 10,000 fsyncs
    os.makedirs(os.path.join(s.root, "big"))
    for step in range(10_000):
        w = agck.checkpoint.encode({"x": np.full(16, step)}, run="big", step=step)
        data = b"".join(bytes(p) for p in w.parts())
        if step >= 9_900:
            data = data[:-1] + bytes([data[-1] ^ 1])
        with open(s.path("big", step), "wb") as f:
            f.write(data)
    assert payload
    t0 = time.perf_counter()
    rec = recover_run(s, "big")
    elapsed = time.perf_counter() - t0
    assert rec.step == 9_899 and len(rec.rejected) == 100
    assert elapsed < 10, elapsed


@pytest.mark.postgres
def test_cli_reaches_postgres_tables_by_prefix_and_schema(pg_dsn, pg_schema, capsys):
    from agck.stores import open_store
    with open_store(pg_dsn, prefix="cli_pfx", schema=pg_schema, init=True) as s:
        s.put("r", 3, {"x": np.arange(3)})
    sep = "&" if "?" in pg_dsn else "?"
    url = f"{pg_dsn}{sep}agck_prefix=cli_pfx&agck_schema={pg_schema}"
    code, out, _ = run_cli(capsys, "recover", url, "--json")
    assert code == 0 and json.loads(out)["runs"][0]["step"] == 3
    code, out, _ = run_cli(capsys, "ls", url, "--run", "r", "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [3]
