"""What only the file store has: its directory of runs (step file names, run
directories made and removed, a file in the way), opening it from several processes
at once or without creating it, puts and reads racing deletes and collections, and
I/O errors reading a checkpoint file."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import agck

from agck.errors import AgckError, CheckpointNotFoundError, DurabilityError, StoreConnectionError
from agck.stores import open_store
from agck.stores.file.store import FileStore

from storehelpers import assert_state, state_for


# --- opening --------------------------------------------------------------------------------------

def test_file_store_opened_by_processes_at_once(tmp_path, monkeypatch):
    """Ranks opening one new store: another one may make the directory between this
    one's look and its mkdir (test_four_ranks once failed so). Opening still succeeds."""
    import agck.stores.file.store as file_mod
    root = tmp_path / "store"
    real_isdir = os.path.isdir
    looks = []

    def isdir_then_made_by_another(path):
        found = real_isdir(path)
        if os.fspath(path) == str(root) and not looks:
            looks.append(path)
            os.mkdir(root)            # the other rank, right after this one looked
        return found

    monkeypatch.setattr(file_mod.os.path, "isdir", isdir_then_made_by_another)
    s = open_store(str(root))
    monkeypatch.undo()
    assert looks and s.runs() == []
    s.put("r", 1, {"x": 1})
    assert open_store(str(root), create=False).steps("r") == [1]


def test_file_store_refuses_a_file_in_the_way(tmp_path):
    (tmp_path / "f").write_text("not a store")
    with pytest.raises(StoreConnectionError, match="a file is in the way"):
        open_store(str(tmp_path / "f"))
    with pytest.raises(StoreConnectionError, match="no such store directory"):
        open_store(str(tmp_path / "missing"), create=False)
    assert not (tmp_path / "missing").exists()


def test_a_missing_store_directory_hints_at_what_exists(tmp_path, monkeypatch):
    """The hint names a real way on: no create=True, which agck.recover does not take."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreConnectionError) as e:
        agck.recover("nosuchdir/", "x")
    assert "nosuchdir" in str(e.value) and "create=True" not in str(e.value)
    assert "check the path" in e.value.hint and "agck.open_store(path)" in e.value.hint
    assert not (tmp_path / "nosuchdir").exists()
    with agck.open_store("nosuchdir/") as s:     # the way the hint names
        assert s.runs() == []


def test_file_store_opened_without_create_creates_nothing(tmp_path):
    for url in (str(tmp_path / "typo"), f"file://{tmp_path}/typo"):
        with pytest.raises(StoreConnectionError):
            open_store(url, create=False)
    assert list(tmp_path.iterdir()) == []


# --- runs and steps in the directory --------------------------------------------------------------

def test_file_store_lists_only_canonical_step_names(tmp_path):
    from agck.recovery import recover_run
    s = open_store(tmp_path / "st")
    s.put("r", 1, state_for(1))
    s.put("r", 12, state_for(12))
    run_dir = tmp_path / "st" / "r"
    good = (run_dir / "000000000001.agck").read_bytes()
    for stray in ("1.agck", "0000000000001.agck", "\u00b2.agck", "\u0661.agck", "000000000\u0662\u0663\u0664.agck",
                  "abc.agck", "000000000001.agck.bak", "-00000000001.agck", "000000000001.AGCK"):
        (run_dir / stray).write_bytes(good)
    (tmp_path / "st" / "a b").mkdir()                  # not a run name: not a run
    (tmp_path / "st" / ".git").mkdir()
    assert s.runs() == ["r"]
    assert s.steps("r") == [1, 12]
    assert [(i.run, i.step) for i in s.list()] == [("r", 1), ("r", 12)]
    assert recover_run(s, "r").step == 12
    assert s.orphans() == []                            # strays are not leftovers of writes: never cleaned
    big = (1 << 63) - 1
    s.put("r", big, state_for(0))
    assert s.steps("r") == [1, 12, big]


def test_file_store_delete_of_a_runs_last_step_removes_its_directory(tmp_path):
    s = open_store(str(tmp_path / "store"))
    s.put("a", 1, {"x": 1})
    s.put("a", 2, {"x": 2})
    s.put("b", 1, np.ones(100_000, dtype=np.float32))     # an incremental (chunked) one too
    s.delete("a", 1)
    assert s.runs() == ["a", "b"]
    s.delete("a", 2)
    s.delete("b", 1)
    assert s.runs() == [] and not (tmp_path / "store" / "a").exists()
    assert s.steps("a") == [] and s.list("a") == []
    s.put("a", 3, {"x": 3})                                # the run comes back with its next put
    assert s.steps("a") == [3] and s.read("a", 3).state == {"x": 3}
    # a fenced run's directory holds its epoch and lock: it stays, and so does the fencing
    e = s.begin_epoch("f")
    s.put("f", 1, {"x": 1}, epoch=e)
    s.delete("f", 1, epoch=e)
    assert s.epoch("f") == e and "f" in s.runs() and s.steps("f") == []


def test_file_store_put_survives_a_delete_removing_its_run_directory(tmp_path):
    """Another process deletes the run's last checkpoint between this put making sure
    the run directory is there and writing into it: the put makes it again."""
    from agck import durable
    root = tmp_path / "store"

    class DeletedMeanwhile(durable.FileSystem):
        times = 0

        def open_new(self, path):
            d = os.path.dirname(path)
            if os.path.basename(d) == "r" and self.times < 2:
                self.times += 1
                for name in os.listdir(d):
                    os.unlink(os.path.join(d, name))
                os.rmdir(d)                           # the other process's delete, just now
            return super().open_new(path)

    fs = DeletedMeanwhile()
    s = open_store(str(root), fs=fs)
    s.put("r", 1, {"x": 1})
    assert fs.times == 2 and s.steps("r") == [1] and s.read("r", 1).state == {"x": 1}
    fs.times = -10                                    # every try finds its directory gone: the error says so
    with pytest.raises(DurabilityError, match="store/r does not exist"):
        s.put("r", 2, {"x": 2})


def test_file_store_read_racing_a_prune_and_a_collection_is_not_found_not_corrupt(tmp_path):
    """A listing deleted while read, its chunks collected meanwhile: gone, not damaged;
    one replaced meanwhile is read again."""
    from agck.stores.file.store import FileStore
    s = FileStore(tmp_path / "s")
    s.put("r", 1, state_for(1, n=200_000))
    real = s.objects.read_into

    def racing(address, view):     # the first chunk read finds the checkpoint pruned and collected
        s.objects.read_into = real
        s.delete("r", 1)
        s.collect_garbage()
        return real(address, view)
    s.objects.read_into = racing
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was read"):
        s.read("r", 1)

    s.put("r", 2, state_for(2, n=200_000))

    def replacing(address, view):  # the checkpoint is rewritten with other content meanwhile
        s.objects.read_into = real
        s.put("r", 2, state_for(7, n=200_000))
        s.collect_garbage()
        return real(address, view)
    s.objects.read_into = replacing
    assert_state(s.read("r", 2), 7, n=200_000)


def test_an_io_error_reading_a_checkpoint_is_a_verdict_other_errors_are_not(tmp_path, monkeypatch):
    import builtins
    import errno
    from agck import checkpoint
    path = str(tmp_path / "x.agck")
    agck.save(path, {"x": 1})
    real_open = builtins.open
    for code, verdict in ((errno.EIO, True), (errno.EMFILE, False)):
        def failing(p, *a, code=code, **kw):
            if p == path:
                raise OSError(code, os.strerror(code), p)
            return real_open(p, *a, **kw)
        monkeypatch.setattr(builtins, "open", failing)
        with pytest.raises(AgckError) as ei:
            checkpoint.read_file(path)
        monkeypatch.setattr(builtins, "open", real_open)
        assert ei.value.verdict == verdict and os.strerror(code) in str(ei.value)


# --- the README example ---------------------------------------------------------------------------

def test_readme_fencing_example_runs(tmp_path, monkeypatch, capsys):
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    [example] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "StaleEpochError" in b]
    monkeypatch.chdir(tmp_path)
    exec(example, {"agck": agck})
    assert capsys.readouterr().out.startswith("refused: ")
    assert open_store(str(tmp_path / "ckpts")).steps("doc-pipeline") == [130]


@pytest.mark.parametrize("err", [errno.EACCES, errno.EIO, errno.EROFS])
def test_cleaning_and_collecting_on_a_refusing_disk_raise_agck_errors(tmp_path, err, monkeypatch):
    """A file system that refuses to delete (permissions, a read-only remount, a dying
    disk) makes clean_orphans and collect_garbage raise an AgckError naming the path,
    never a raw OSError."""
    import os as _os
    store = FileStore(tmp_path / "s")
    store.put("r", 1, {"w": np.arange(100_000)})
    store.put("r", 2, {"w": np.arange(100_000) + 1})
    store.delete("r", 1)                                      # its chunks are garbage now
    leftover = tmp_path / "s" / "r" / ".000000000003.agck.tmp.999999.ab12"
    leftover.write_bytes(b"half a checkpoint")

    def refuse(path):
        raise OSError(err, _os.strerror(err), path)
    monkeypatch.setattr(store.fs, "unlink", refuse)
    with pytest.raises(agck.AgckError) as e:
        store.clean_orphans()
    assert str(leftover) in str(e.value) and _os.strerror(err) in str(e.value)
    with pytest.raises(agck.AgckError) as e:
        store.collect_garbage()
    assert ".objects" in str(e.value) and _os.strerror(err) in str(e.value)
    monkeypatch.undo()
    assert store.clean_orphans() == [str(leftover)]
    assert store.collect_garbage().deleted_chunks > 0
    assert np.array_equal(store.get("r", 2).state["w"], np.arange(100_000) + 1)
