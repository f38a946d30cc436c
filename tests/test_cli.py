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
from agck.stores.file.store import FileStore


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


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def test_recover_text_restore_to_and_clean(store, capsys, tmp_path):
    flip(store.path("r", 50))
    tmp = os.path.join(store.root, "r", f".000000000060.agck.tmp.{_dead_pid()}.abcd")     # its writer is gone
    open(tmp, "wb").write(b"partial")
    live = os.path.join(store.root, "r", f".000000000070.agck.tmp.{os.getpid()}.abcd")   # a put in flight
    open(live, "wb").write(b"being written")
    out_file = tmp_path / "restored.agck"
    code, out, _ = run_cli(capsys, "recover", store.root, "--run", "r", "--restore-to", out_file, "--clean")
    assert code == 1
    assert "last valid step 40" in out and "rejected step 50" in out and "(removed)" in out
    assert not os.path.exists(tmp) and os.path.exists(live) and "000000000070" not in out
    ck = agck.load(out_file)
    assert ck.step == 40 and torch.equal(ck.state["w"], torch.full((16,), 40.0))


def test_verify_of_a_file_judges_a_damaged_magic_as_damage(store, capsys):
    data = bytearray(open(store.path("r", 10), "rb").read())
    data[0] ^= 0xFF
    open(store.path("r", 10), "wb").write(data)
    code, out, _ = run_cli(capsys, "verify", store.path("r", 10), "--json")
    assert code == 1 and json.loads(out)["corrupt"] == 1


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


# --- hostile or odd input: one line, the right code, nothing written that was not asked for -----------

def forge(path, state, mutate):
    """A container whose tensor descriptors ``mutate`` rewrote, with valid checksums."""
    from agck import codec, format
    enc = codec.encode_state(state)
    mutate(enc.tensors)
    m = {"run": None, "step": None, "parent": None, "meta": None, "tensors": enc.tensors, "state": enc.tree}
    w = format.ContainerWriter(m, enc.blobs)
    with open(path, "wb") as f:
        for part in w.parts():
            f.write(part)
    return str(path)


def broadcast(shape):
    def mutate(tensors):
        tensors[0]["shape"], tensors[0]["strides"] = list(shape), [0] * len(shape)
    return mutate


def assert_one_line(err):
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("ext", [".npz", ".safetensors", ".pt"])
def test_export_refuses_to_expand_a_broadcast_view(tmp_path, capsys, ext):
    huge = forge(tmp_path / "huge.agck", {"a": np.ones(1, np.float32)}, broadcast([1 << 17, 1 << 17]))
    assert agck.load(huge).state["a"].nbytes == 64 << 30 and os.path.getsize(huge) < 1000
    code, out, err = run_cli(capsys, "export", huge, "--to", tmp_path / f"o{ext}")
    assert code == 2 and "--max-bytes" in err and "68719476736" in err
    assert_one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["huge.agck"]

    small = forge(tmp_path / "small.agck", {"a": np.full(1, 7, np.float32)}, broadcast([64, 64]))
    code, _, err = run_cli(capsys, "export", small, "--to", tmp_path / f"s{ext}")
    assert code == 2 and "16384" in err
    code, out, _ = run_cli(capsys, "export", small, "--to", tmp_path / f"s{ext}", "--max-bytes", "16K")
    assert code == 0 and "wrote 1 tensor to" in out
    if ext == ".npz":
        assert np.array_equal(np.load(tmp_path / "s.npz")["a"], np.full((64, 64), 7, np.float32))


def test_export_max_bytes_bounds_plain_checkpoints_too(tmp_path, capsys):
    src = tmp_path / "c.agck"
    agck.save(src, {"w": np.zeros(1000, np.float32)})
    code, _, err = run_cli(capsys, "export", src, "--to", tmp_path / "o.npz", "--max-bytes", "100")
    assert code == 2 and "4000 bytes" in err
    assert not (tmp_path / "o.npz").exists()
    assert run_cli(capsys, "export", src, "--to", tmp_path / "o.npz")[0] == 0
    code, _, err = run_cli(capsys, "export", src, "--to", tmp_path / "o.npz", "--max-bytes", "lots")
    assert code == 2 and "byte count" in err
    assert_one_line(err)


def test_export_names_both_paths_of_a_key_collision(tmp_path, capsys):
    src = tmp_path / "c.agck"
    agck.save(src, {"a.b": np.ones(1), "a": {"b": np.zeros(1)}, "x": [np.ones(2)], "x.0": np.zeros(2)})
    for ext in (".npz", ".safetensors"):
        code, _, err = run_cli(capsys, "export", src, "--to", tmp_path / f"o{ext}")
        assert code == 2 and "state['a.b']" in err and "state['a']['b']" in err and "'a.b'" in err
        assert_one_line(err)
        assert not (tmp_path / f"o{ext}").exists()
    code, _, _ = run_cli(capsys, "export", src, "--to", tmp_path / "o.pt")     # .pt keeps the structure
    assert code == 0 and torch.load(tmp_path / "o.pt", weights_only=False)["x.0"].tolist() == [0, 0]


def test_export_npz_takes_any_tensor_name(tmp_path, capsys):
    src = tmp_path / "c.agck"
    agck.save(src, {"file": np.arange(3), "allow_pickle": np.ones(2), "kwds": {"args": torch.arange(2)}})
    code, out, _ = run_cli(capsys, "export", src, "--to", tmp_path / "O.NPZ")
    assert code == 0 and "wrote 3 tensors" in out
    got = np.load(tmp_path / "O.NPZ")
    assert sorted(got.files) == ["allow_pickle", "file", "kwds.args"] and got["file"].tolist() == [0, 1, 2]


def test_export_to_a_missing_directory_is_exit_4(tmp_path, capsys):
    src = tmp_path / "c.agck"
    agck.save(src, {"w": np.zeros(4)})
    for ext in (".npz", ".safetensors", ".pt"):
        code, _, err = run_cli(capsys, "export", src, "--to", tmp_path / "nodir" / f"o{ext}")
        assert code == 4 and f"nodir/o{ext}: No such file or directory" in err
        assert_one_line(err)
    code, _, err = run_cli(capsys, "recover", str(tmp_path / "nodir"))
    assert code == 4


def test_show_survives_a_malformed_descriptor(tmp_path, capsys):
    bad = forge(tmp_path / "bad.agck", {"a": np.zeros(3)}, lambda ts: ts[0].__setitem__("shape", 5))
    code, out, err = run_cli(capsys, "show", bad)
    assert code == 0 and "state['a']" in out and not err
    code, out, _ = run_cli(capsys, "show", bad, "--json")
    assert code == 0 and json.loads(out)["tensors"][0]["shape"] == 5
    code, _, err = run_cli(capsys, "verify", bad)
    assert code in (1, 3) and err.count("\n") <= 1


def strict_json(text):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


ODD_META = {b"k": 1, 2: "int key", None: "none key", 1.5: "float key", True: "bool key",
            "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "b": b"\x00\x01", "ok": [1, "x"]}
ODD_META_JSON = {"b'k'": 1, "2": "int key", "None": "none key", "1.5": "float key", "True": "bool key",
                 "nan": {"$float": "nan"}, "inf": {"$float": "inf"}, "ninf": {"$float": "-inf"},
                 "b": {"$bytes": "AAE="}, "ok": [1, "x"]}


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_any_meta_lists_and_shows_as_strict_json(tmp_path, capsys, kind):
    url = str(tmp_path / "st") if kind == "file" else f"sqlite:///{tmp_path}/st.db"
    with agck.open_store(url) as s:
        s.put("r", 1, {"x": np.arange(2)}, meta=ODD_META)
        s.put("r", 2, {"x": np.arange(2)}, meta={"plain": 1})
    code, out, err = run_cli(capsys, "ls", url, "--json")
    assert code == 0 and not err
    assert strict_json(out)[0]["meta"] == ODD_META_JSON        # the same on every backend
    code, out, _ = run_cli(capsys, "ls", url)
    assert code == 0 and '"nan": {"$float": "nan"}' in out and "NaN" not in out
    code, out, _ = run_cli(capsys, "show", url, "--run", "r", "--step", "1", "--json")
    assert code == 0 and strict_json(out)["meta"] == ODD_META_JSON
    code, out, _ = run_cli(capsys, "show", url, "--run", "r", "--step", "1")
    assert code == 0 and "Infinity" not in out and '{"$float": "-inf"}' in out


@pytest.mark.parametrize("argv", [
    ["ls", "SQL"], ["show", "SQL", "--run", "r"], ["verify", "SQL"], ["recover", "SQL"],
    ["export", "SQL", "--run", "r", "--to", "o.npz"], ["prune", "SQL", "--run", "r", "--keep-last", "1"],
    ["ls", "DIR"], ["verify", "DIR"], ["prune", "DIR", "--run", "r", "--keep-last", "1"],
])
def test_commands_never_create_a_missing_store(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    argv = ["sqlite:///typo.db" if a == "SQL" else str(tmp_path / "typo") if a == "DIR" else a for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 4 and "typo" in err
    assert_one_line(err)
    assert list(tmp_path.iterdir()) == []


def test_sqlite_url_is_relative_to_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with agck.open_store("sqlite:///rel.db") as s:
        s.put("r", 1, {"x": 1})
    assert (tmp_path / "rel.db").exists()
    code, out, _ = run_cli(capsys, "ls", "sqlite:///rel.db", "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [1]
    code, out, _ = run_cli(capsys, "ls", f"sqlite:///{tmp_path}/rel.db", "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [1]


def test_stray_step_files_do_not_break_or_duplicate(store, capsys):
    run_dir = os.path.join(store.root, "r")
    good = open(store.path("r", 10), "rb").read()
    for stray in ("\u00b2.agck", "\u0661.agck", "10.agck", "0000000000010.agck"):
        with open(os.path.join(run_dir, stray), "wb") as f:
            f.write(good)
    code, out, err = run_cli(capsys, "recover", store.root, "--json")
    assert code == 0 and not err
    code, out, _ = run_cli(capsys, "ls", store.root, "--run", "r", "--json")
    assert [r["step"] for r in json.loads(out)] == [0, 10, 20, 30, 40, 50]


def test_unknown_run_is_exit_4_and_bad_run_name_exit_2(store, capsys):
    for argv in (["prune", store.root, "--run", "nope", "--keep-last", "1"], ["verify", store.root, "--run", "nope"],
                 ["recover", store.root, "--run", "nope"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 4 and "'nope'" in err
    for argv in (["prune", store.root, "--run", "../x", "--keep-last", "1"], ["ls", store.root, "--run", "a/b"],
                 ["recover", store.root, "--run", "../r"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and "invalid run name" in err
    code, _, err = run_cli(capsys, "show", store.path("r", 10), "--step", "3")
    assert code == 2 and "is a file" in err


@pytest.mark.parametrize("argv, code, needle", [
    (["ls", "postgresql://postgres:s3cret@127.0.0.1:1/test"], 4, "Is the server running"),
    (["ls", "host=127.0.0.1 port=1 user=postgres password=s3cret dbname=test"], 4, "port 1 failed"),
    (["ls", "host=127.0.0.1 port=1 password='s3cret and more'"], 4, "password=***"),
    (["ls", "postgresql://u:s3cret@[::1"], 4, "invalid Postgres URL"),
    (["db", "status", "postgresql://u:s3cret@[::1/test?agck_prefix=p"], 4, "invalid Postgres URL"),
    (["ls", "STORE", "password=s3cret"], 2, "unrecognized arguments"),
    (["db", "status", "sqlite:///x.db"], 2, "postgresql://"),
    (["show", "STORE", "--run", "r", "--step", "99999999999999999999"], 2, "invalid step"),
    (["export", "STORE", "--run", "r", "--to", "out.txt"], 2, "unknown export format"),
    (["ls", "sqlite://host/x.db"], 4, "sqlite:////abs/path.db"),
])
def test_more_bad_input_is_one_line_without_traceback(store, tmp_path, argv, code, needle):
    argv = [str(store.root) if a == "STORE" else a for a in argv]
    p = subprocess.run([sys.executable, "-m", "agck.cli", *argv], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(
                           os.path.abspath(agck.__file__)))))
    assert p.returncode == code, p.stderr
    assert_one_line(p.stderr)
    assert "s3cret" not in p.stderr + p.stdout
    assert needle in p.stderr


@pytest.mark.postgres
def test_db_takes_the_prefix_in_the_url_and_its_hints_run_verbatim(pg_dsn, pg_schema, capsys):
    import shlex
    from conftest import pg_prefix
    prefix = pg_prefix()
    sep = "&" if "?" in pg_dsn else "?"
    url = f"{pg_dsn}{sep}agck_prefix={prefix}&agck_schema={pg_schema}"
    code, out, err = run_cli(capsys, "db", "status", url, "--json")
    assert code == 0 and json.loads(out)["state"] == "uninitialized" and json.loads(out)["prefix"] == prefix
    code, _, err = run_cli(capsys, "ls", url)
    assert code == 4 and "agck db init" in err
    assert_one_line(err)
    command = shlex.split(err.split("`")[1])
    assert command[:3] == ["agck", "db", "init"]
    assert run_cli(capsys, *command[1:])[0] == 0
    code, out, _ = run_cli(capsys, "ls", url, "--json")
    assert code == 0 and json.loads(out) == []
    code, _, err = run_cli(capsys, "db", "status", url, "--prefix", "other")
    assert code == 2 and "disagrees" in err


def test_gc_and_scrub_of_a_directory_that_is_no_store_create_nothing_and_exit_4(tmp_path, capsys):
    """As verify and recover do: nothing to judge is not a success (they exited 0)."""
    d = tmp_path / "Documents"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    for command in ("gc", "scrub"):
        code, _, err = run_cli(capsys, command, d)
        assert code == 4 and "holds no checkpoints" in err, (command, err)
        assert sorted(os.listdir(d)) == ["notes.txt"]


# --- what a new user meets first ----------------------------------------------------------------

def test_export_pt_loads_with_torch_load_defaults(tmp_path, capsys):
    """torch.load(path) with its default weights_only=True refuses numpy objects: .pt converts them."""
    src = tmp_path / "c.agck"
    tied = np.arange(6, dtype=np.float32).reshape(2, 3)
    state = {"w": torch.ones(3), "a": np.arange(4), "tied": [tied, tied], "t": (np.float64(2.5), np.int64(7)),
             "s": {np.int64(1), 2}, "flag": np.bool_(True), "name": "doc", "ints": np.arange(8, dtype=np.uint8)[::-1],
             "nested": {"m": {"v": np.zeros((2, 2), np.float16)}}}
    agck.save(src, state)
    code, out, _ = run_cli(capsys, "export", src, "--to", tmp_path / "o.pt")
    assert code == 0, out
    assert "wrote 6 tensors" in out     # the tied array is one tensor, written twice by name
    assert "converted 4 numpy arrays to torch tensors and 4 numpy scalars to Python numbers" in out
    assert "weights_only=True" in out
    got = torch.load(tmp_path / "o.pt")          # torch's defaults: weights_only=True
    assert torch.equal(got["w"], torch.ones(3)) and torch.equal(got["a"], torch.arange(4))
    assert torch.equal(got["tied"][0], torch.from_numpy(tied)) and got["tied"][0] is got["tied"][1]
    assert got["t"] == (2.5, 7) and type(got["t"]) is tuple and type(got["t"][1]) is int
    assert got["s"] == {1, 2} and got["flag"] is True and got["name"] == "doc"
    assert got["ints"].tolist() == list(range(7, -1, -1)) and got["ints"].dtype == torch.uint8
    assert got["nested"]["m"]["v"].dtype == torch.float16
    code, out, _ = run_cli(capsys, "export", src, "--to", tmp_path / "o2.pt", "--json")
    assert json.loads(out)["converted"] == {"arrays": 4, "scalars": 4}


def test_export_pt_refuses_what_torch_load_cannot_read_by_path(tmp_path, capsys):
    src = tmp_path / "c.agck"
    agck.save(src, {"ok": np.zeros(2), "when": {"t": np.array(["2024-01-01"], "datetime64[D]")}})
    code, _, err = run_cli(capsys, "export", src, "--to", tmp_path / "o.pt")
    assert code == 2 and "state['when']['t']" in err and "datetime64" in err and ".npz" in err
    assert_one_line(err)
    assert not (tmp_path / "o.pt").exists()


def test_verify_and_recover_of_a_directory_with_no_checkpoints_exit_4(tmp_path, capsys):
    hf = tmp_path / "hf-output"                  # a Hugging Face checkpoint directory: files, no agck runs
    (hf / "checkpoint-500").mkdir(parents=True)
    (hf / "checkpoint-500" / "model.safetensors").write_bytes(b"x")
    (hf / "config.json").write_text("{}")
    empty = tmp_path / "empty"
    agck.open_store(empty).close()               # an agck store just made: legitimately empty
    for d in (hf, empty):
        for command in ("verify", "recover"):
            code, out, err = run_cli(capsys, command, d)
            assert code == 4 and not out and f"{d} holds no checkpoints" in err and f"nothing to {command}" in err
            assert_one_line(err)
            assert run_cli(capsys, command, d, "--json")[0] == 4
    code, out, err = run_cli(capsys, "ls", empty)
    assert code == 0 and out.strip() == "(no checkpoints)" and not err
    assert json.loads(run_cli(capsys, "ls", empty, "--json")[1]) == []
    assert sorted(os.listdir(hf)) == ["checkpoint-500", "config.json"] and os.listdir(empty) == []


def test_ls_of_an_unknown_run_is_exit_4_naming_the_runs(store, capsys):
    code, out, err = run_cli(capsys, "ls", store.root, "--run", "rr")
    assert code == 4 and not out and "no run 'rr'" in err and "runs: other, r" in err
    assert_one_line(err)
    code, out, _ = run_cli(capsys, "ls", store.root, "--run", "other")
    assert code == 0 and "other" in out


def test_every_option_and_argument_has_help():
    from agck.cli import build_parser
    parser = build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, sp in sub.choices.items() for a in sp._actions if not a.help]
    missing += [a.dest for a in parser._actions if not a.help]
    assert missing == []


def test_counts_are_singular_or_plural_as_they_need(tmp_path, capsys):
    src = tmp_path / "c.agck"
    agck.save(src, {"w": np.zeros(4)})
    code, out, _ = run_cli(capsys, "export", src, "--to", tmp_path / "o.npz")
    assert code == 0 and "wrote 1 tensor to" in out
    code, out, _ = run_cli(capsys, "export", src, "--to", tmp_path / "o.pt")
    assert "wrote 1 tensor to" in out and "converted 1 numpy array to a torch tensor," in out
    s = FileStore(tmp_path / "s")
    s.put("r", 1, {"x": 1})
    s.put("r", 2, {"x": 2})
    code, out, _ = run_cli(capsys, "prune", s.root, "--run", "r", "--keep-last", "1")
    assert code == 0 and "deleted 1 checkpoint of r" in out
    code, out, _ = run_cli(capsys, "gc", s.root)
    assert code == 0 and "deleted 0 chunks" in out and "1 standalone checkpoint, which shares no chunks" in out
    flip(s.path("r", 2), 70)
    code, out, _ = run_cli(capsys, "recover", s.root)
    assert code == 3 and "NOTHING VALID among 1 checkpoint" in out and "1 checkpoints" not in out


def test_show_caps_column_widths_in_text_only(tmp_path, capsys):
    """A Lightning checkpoint's callback keys run to hundreds of characters."""
    key = "ModelCheckpoint{'monitor': 'train_loss', 'mode': 'min', 'every_n_train_steps': 0, " \
          "'every_n_epochs': 1, 'train_time_interval': None}"
    src = tmp_path / "c.agck"
    agck.save(src, {"callbacks": {key: {"best_model_score": torch.tensor(0.5)}}, "w": torch.zeros(2)})
    code, out, _ = run_cli(capsys, "show", src)
    table = [line for line in out.splitlines() if "state[" in line or line.strip().startswith("path")]
    assert code == 0 and len(table) == 3
    assert max(len(line) for line in table) < 160, out
    long_row = [line for line in table if "callbacks" in line][0]
    assert "\u2026" in long_row and "['best_model_score']  torch  float32" in long_row    # start and end kept
    # the columns after the clipped one line up
    assert len({line.index("torch") for line in table if "state[" in line}) == 1
    code, out, _ = run_cli(capsys, "show", src, "--json")
    assert code == 0 and f"state['callbacks'][{key!r}]['best_model_score']" in \
        {t["path"] for t in json.loads(out)["tensors"]}


def test_gc_of_standalone_checkpoints_says_they_share_no_chunks(store, capsys):
    code, out, _ = run_cli(capsys, "gc", store.root)
    assert code == 0
    assert "0 chunks kept for 0 chunked checkpoints; 7 standalone checkpoints, which share no chunks" in out
    code, out, _ = run_cli(capsys, "gc", store.root, "--json")
    assert code == 0 and json.loads(out)["standalone"] == 7 and json.loads(out)["listings"] == 0


def test_ls_aligns_its_columns(store, capsys):
    store.put("a-much-longer-run-name", 123456, {"x": np.zeros(10_000)}, meta={"k": 1})
    code, out, _ = run_cli(capsys, "ls", store.root)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["run", "step", "parent", "size", "created", "meta"]
    # every row's creation time starts where the header's column does; numbers end where their header ends
    created = lines[0].index("created")
    assert all(line[created:created + 2] == "20" for line in lines[1:]), out
    step_end = lines[0].index("step") + len("step")
    assert all(line[step_end - 1].isdigit() and line[step_end] == " " for line in lines[1:]), out


@pytest.mark.postgres
def test_db_prints_readable_lines_and_json(pg_dsn, pg_schema, capsys):
    from conftest import pg_prefix
    prefix = pg_prefix()
    sep = "&" if "?" in pg_dsn else "?"
    url = f"{pg_dsn}{sep}agck_prefix={prefix}&agck_schema={pg_schema}"
    code, out, _ = run_cli(capsys, "db", "status", url)
    assert code == 0 and "{" not in out and "'state'" not in out
    fields = dict(line.strip().split(None, 1) for line in out.splitlines()[1:] if line.strip())
    assert fields["state"].startswith("uninitialized") and fields["prefix"] == prefix
    assert fields["schema"] == pg_schema and f"{prefix}_manifest" in out and "missing tables" in out
    code, out, _ = run_cli(capsys, "db", "init", url)
    assert code == 0 and "state           current" in out and "missing tables  none" in out
    assert "version         4 (this agck uses 4)" in out
    code, out, _ = run_cli(capsys, "db", "migrate", url)
    assert code == 0 and "migrated        nothing to do" in out
    code, out, _ = run_cli(capsys, "db", "status", url, "--json")
    assert json.loads(out)["state"] == "current" and json.loads(out)["missing_tables"] == []
    assert json.loads(out)["pool"] == 4 and json.loads(out)["objects"] is None
    code, out, _ = run_cli(capsys, "db", "status", url + "&agck_pool=9")
    assert "chunks in       the database" in out and "pool            at most 9 connections" in out


@pytest.mark.postgres
def test_ls_of_a_database_without_the_schema_says_agck_once(pg_dsn, pg_schema, capsys):
    sep = "&" if "?" in pg_dsn else "?"
    url = f"{pg_dsn}{sep}agck_schema={pg_schema}"          # the default prefix, agck, in an empty schema
    code, _, err = run_cli(capsys, "ls", url)
    assert code == 4 and "agck db init" in err
    assert err.startswith("agck: ") and not err.startswith("agck: agck") and "agck: agck:" not in err, err
    assert f"tables {pg_schema}.agck_*" in err
    assert_one_line(err)


@pytest.mark.parametrize("kind", ["s3", "postgres-s3"])
def test_every_command_on_object_storage(tmp_path, capsys, kind, request):
    """ls, show, verify, recover (--restore-to), prune, gc and export with the store's URL
    alone: an s3:// URL, or a Postgres URL naming its bucket (agck_objects)."""
    from urllib.parse import quote

    from conftest import make_spec
    _, url, opts = make_spec(kind, request, tmp_path)
    with agck.open_store(url, **opts) as s:
        for step in range(1, 5):
            s.put("r", step, {"w": np.arange(100_000) * step, "step": step})
    if kind == "postgres-s3":
        url += ("&" if "?" in url else "?") + f"agck_prefix={opts['prefix']}&agck_schema={opts['schema']}" \
               f"&agck_objects={quote(opts['objects'], safe=':/')}"
    code, out, _ = run_cli(capsys, "ls", url, "--json")
    assert code == 0 and [c["step"] for c in json.loads(out)] == [1, 2, 3, 4]
    code, out, _ = run_cli(capsys, "show", url, "--run", "r", "--step", "2", "--json")
    assert code == 0 and json.loads(out)["step"] == 2
    code, out, err = run_cli(capsys, "verify", url)
    assert code == 0, err
    code, out, _ = run_cli(capsys, "recover", url, "--json", "--run", "r", "--restore-to", tmp_path / "r.agck")
    assert code == 0 and json.loads(out)["runs"][0]["step"] == 4
    np.testing.assert_array_equal(agck.load(tmp_path / "r.agck").state["w"], np.arange(100_000) * 4)
    code, out, _ = run_cli(capsys, "prune", url, "--run", "r", "--keep-last", "1")
    assert code == 0
    code, out, _ = run_cli(capsys, "ls", url, "--json")
    assert [c["step"] for c in json.loads(out)] == [4]
    code, out, _ = run_cli(capsys, "gc", url, "--json")      # prune collected already: nothing left to delete
    assert code == 0 and json.loads(out)["deleted_chunks"] == 0 and json.loads(out)["live_chunks"] > 0
    code, out, _ = run_cli(capsys, "export", url, "--run", "r", "--to", tmp_path / "o.npz")
    assert code == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npz")["w"], np.arange(100_000) * 4)


def test_recover_clean_refuses_a_directory_that_is_not_an_agck_store(tmp_path, capsys):
    """A directory holding no checkpoint and no journal (an output directory of another
    tool) is not a store: `recover --clean` exits 4 and removes nothing, even files
    named as a dead writer's temp files are."""
    d = tmp_path / "outputs"
    (d / "run1").mkdir(parents=True)
    mine = [d / ".model.bin.tmp.999999.ab12", d / "run1" / ".epoch=0-step=6.ckpt.tmp.999998.cd34"]
    for p in mine:
        p.write_bytes(b"someone else's")
    for args in (["recover", str(d), "--clean"], ["recover", str(d), "--clean", "--run", "run1"]):
        assert main(args) == 4
        assert "checkpoints" in capsys.readouterr().err
        assert all(p.exists() for p in mine)


def test_python_dash_m_agck_is_the_command():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "agck", "journal", "/nonexistent", "--run", "../x"],
                       capture_output=True, text=True)
    assert r.returncode in (2, 4) and "Traceback" not in r.stderr, r
    r = subprocess.run([sys.executable, "-m", "agck", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip(), r


def test_journal_with_a_run_name_that_is_not_one_is_a_usage_error(tmp_path, capsys):
    from agck.journal import Journal
    with Journal(str(tmp_path / "s"), "r") as j:
        j.step("f", lambda x: x, 1)
    code, _, err = run_cli(capsys, "journal", tmp_path / "s", "--run", "../x")
    assert code == 2 and "invalid run name" in err, err


def test_names_from_a_store_reach_the_terminal_escaped_and_capped(tmp_path, capsys):
    """Step and AppendLog names are the user's strings: terminal escapes, CR, NUL,
    newlines and bidi overrides reached the terminal raw, and a 1 MiB name printed a
    line of a million characters. Every text command escapes and caps them."""
    from agck.journal import Journal
    url = str(tmp_path / "s")
    evil = "\x1b]0;owned\x07\x1b[2J\r\x00\n\u202e" + "x" * (1 << 20)
    with Journal(url, "r") as j:
        j.step(evil, lambda x: x, 1)
    for argv in (["journal", url], ["ls", url], ["recover", url]):
        capsys.readouterr()
        main(argv)
        out, err = capsys.readouterr()
        for text in (out, err):
            assert not any(c in text for c in "\x1b\x07\r\x00\u202e"), (argv, text[:200])
            assert max(map(len, text.splitlines() or [""])) < 1000, argv
