"""torch.distributed.checkpoint through agck's stores (agck.dcp): real gloo process groups.

Children run in spawned processes, write what they saw to files with agck.save,
and the parent asserts on those files and on the store itself.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.distributed.checkpoint import metadata as dmd  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

import agck  # noqa: E402
from agck import sharded  # noqa: E402
from agck.dcp import StorageReader, StorageWriter, StoredItem, metadata_from_plain, metadata_to_plain  # noqa: E402
from agck.errors import (CheckpointNotFoundError, CorruptCheckpointError, DurabilityError, EncodeError,  # noqa: E402
                         MalformedCheckpointError, StaleEpochError, UsageError)
from agck.stores import open_store  # noqa: E402

from conftest import make_spec  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")   # DCP warns on every no_dist call

RUN = "r"
_rendezvous = itertools.count()


# --- running ranks -------------------------------------------------------------------------

def _rank_main(rank, world, rendezvous, fn, args):
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()      # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


def spawn(tmp_path, world, fn, *args):
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group."""
    rendezvous = tmp_path / f"rendezvous-{next(_rendezvous)}"
    mp.spawn(_rank_main, args=(world, str(rendezvous), fn, args), nprocs=world, join=True)


def _open(spec):
    _, url, opts = spec
    return open_store(url, **opts)


def _report(out, rank, state):
    agck.save(os.path.join(out, f"rank{rank}.agck"), state)


def _reports(out, world):
    return [agck.load(os.path.join(out, f"rank{r}.agck")).state for r in range(world)]


def _failures(e: CheckpointException) -> dict:
    """What each failing rank raised, as plain data."""
    return {rank: [type(exc).__name__, str(exc)] for rank, (exc, _) in e.failures.items()}


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world,))


def _dtensor(t, mesh, placement):
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(t, mesh, [placement])


def _shard(dim):
    from torch.distributed.tensor import Shard
    return Shard(dim)


# --- states ----------------------------------------------------------------------------------

def model_state(seed: int) -> dict:
    """A replicated state: plain tensors of several dtypes, non-tensor values, nesting."""
    g = torch.Generator().manual_seed(seed)
    odd = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, -1.5], dtype=torch.float32)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16),
                  "odd": odd, "mask": torch.rand(10, generator=g) > 0.5,
                  "idx": torch.randint(-2**40, 2**40, (16,), generator=g, dtype=torch.int64)},
        "step": seed, "name": f"run-{seed}", "cfg": {"lrs": [0.1, 0.01], "betas": (0.9, 0.999)},
        "layers": [{"w": torch.full((3, 3), float(seed))}, {"w": torch.arange(12, dtype=torch.int16).reshape(3, 4)}],
    }


def zeros_like_state(s):
    if isinstance(s, torch.Tensor):
        return torch.zeros_like(s)
    if isinstance(s, dict):
        return {k: zeros_like_state(v) for k, v in s.items()}
    if isinstance(s, list):
        return [zeros_like_state(v) for v in s]
    return None


def sharded_full(seed: int, rows=16, cols=6) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.5 + seed


def same_bits(a, b) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def assert_same_state(got, want, path="state"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_bits(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for k in want:
            assert_same_state(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


# --- 1. save with two ranks, load back ----------------------------------------------------------

def _child_round_trip(rank, world, spec, out):
    store = _open(spec)
    mesh = _mesh(world)
    sd = model_state(3)
    sd["dt"] = _dtensor(sharded_full(3), mesh, _shard(0))
    md = dcp.save(sd, storage_writer=StorageWriter(store, RUN), checkpoint_id=1)
    target = zeros_like_state(model_state(3))
    target["dt"] = _dtensor(torch.zeros(16, 6), mesh, _shard(0))
    reader = StorageReader(store, RUN)
    dcp.load(target, storage_reader=reader)
    local = target["dt"].to_local()
    target["dt"] = target["dt"].full_tensor()
    # replicated values only, all written by rank 0: rank 1 puts an empty part
    dcp.save(model_state(4), storage_writer=StorageWriter(store, RUN), checkpoint_id=2,
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    again = zeros_like_state(model_state(4))
    dcp.load(again, storage_reader=StorageReader(store, RUN, step=2))
    _report(out, rank, {"loaded": target, "local": local, "plain_md": metadata_to_plain(md),
                        "step": reader.commit.step, "again": again})


@pytest.mark.parametrize("backend", ["file", "sqlite", "postgres", "s3", "postgres-s3"])
def test_two_ranks_save_and_load_bit_exact(backend, request, tmp_path):
    spec = make_spec(backend, request, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    spawn(tmp_path, 2, _child_round_trip, spec, str(out))
    want = model_state(3)
    want["dt"] = sharded_full(3)
    for rank, rep in enumerate(_reports(out, 2)):
        assert rep["step"] == 1
        assert_same_state(rep["loaded"], want)
        assert same_bits(rep["local"], sharded_full(3)[8 * rank:8 * rank + 8])
        assert_same_state(rep["again"], model_state(4))
    with _open(spec) as store:
        assert store.steps(RUN) == [1, 2]
        assert sharded.read_part(store, sharded.as_commit(store.read(RUN, 2)), 1).state == {}
        commit = sharded.as_commit(store.read(RUN, 1))
        assert (commit.kind, commit.world_size) == ("dcp", 2)
        # the metadata in the record is the one dcp.save returned, kept as plain data
        md = metadata_from_plain(commit.extra)
        assert md == metadata_from_plain(rep["plain_md"])
        assert md.planner_data["layers.1.w"] == ("layers", 1, "w")
        for rank in range(2):   # every rank wrote its part, bound by the record's nonce
            part = sharded.read_part(store, commit, rank)
            assert all(isinstance(v, (torch.Tensor, bytes)) for v in part.state.values())
        assert {i.rank for i in md.storage_data.values()} == {0, 1}


# --- 2. resharding -------------------------------------------------------------------------------

def _child_save_sharded(rank, world, spec, seed):
    mesh = _mesh(world)
    sd = {"a": _dtensor(sharded_full(seed), mesh, _shard(0)), "c": _dtensor(sharded_full(seed + 1, 8, 12), mesh,
                                                                              _shard(1)),
          "rep": torch.arange(5.0) + seed}
    md = dcp.save(sd, storage_writer=StorageWriter(_open(spec), RUN), checkpoint_id=seed)
    assert metadata_from_plain(metadata_to_plain(md)) == md


def _child_load_resharded(rank, world, spec, out):
    mesh = _mesh(world)
    target = {"a": _dtensor(torch.zeros(16, 6), mesh, _shard(1)),      # 6 columns over 4 ranks: uneven
              "c": _dtensor(torch.zeros(8, 12), mesh, _shard(0)), "rep": torch.zeros(5)}
    dcp.load(target, storage_reader=StorageReader(_open(spec), RUN, step=5))
    _report(out, rank, {"a_local": target["a"].to_local(), "c_local": target["c"].to_local(),
                        "a": target["a"].full_tensor(), "c": target["c"].full_tensor(), "rep": target["rep"]})


def test_dtensor_saved_by_two_ranks_loads_on_four_and_on_one(request, tmp_path):
    spec = make_spec("file", request, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    spawn(tmp_path, 2, _child_save_sharded, spec, 5)
    spawn(tmp_path, 4, _child_load_resharded, spec, str(out))
    a, c = sharded_full(5), sharded_full(6, 8, 12)
    for rank, rep in enumerate(_reports(out, 4)):
        assert same_bits(rep["a"], a) and same_bits(rep["c"], c) and same_bits(rep["rep"], torch.arange(5.0) + 5)
        assert same_bits(rep["c_local"], c[2 * rank:2 * rank + 2])
        assert same_bits(rep["a_local"], a[:, 2 * rank:2 * rank + 2])   # rank 3 holds no column
    # one process, no process group: the chunks of both ranks' parts into plain tensors
    target = {"a": torch.zeros(16, 6), "c": torch.zeros(8, 12), "rep": torch.zeros(5)}
    dcp.load(target, storage_reader=StorageReader(spec[1], RUN), no_dist=True)
    assert same_bits(target["a"], a) and same_bits(target["c"], c)


# --- 3. a save that fails before its commit leaves no step -----------------------------------------

def _child_commit_fails(rank, world, spec, out):
    store = _open(spec)
    mesh = _mesh(world)
    writer = StorageWriter(store, RUN)
    dcp.save({"a": _dtensor(sharded_full(1), mesh, _shard(0))}, storage_writer=writer, checkpoint_id=1)
    real_put = store.put

    def put(run, step, state, **kw):    # the commit record's put, after every part is durable
        raise DurabilityError("injected: the disk failed", ref=store.ref(run, step))

    store.put = put
    try:
        dcp.save({"a": _dtensor(sharded_full(2), mesh, _shard(0))}, storage_writer=writer, checkpoint_id=2)
        failures = {}
    except CheckpointException as e:
        failures = _failures(e)
    finally:
        store.put = real_put
    _report(out, rank, {"failures": failures})


def test_no_step_is_visible_until_its_commit_record_is(request, tmp_path):
    spec = make_spec("file", request, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    spawn(tmp_path, 2, _child_commit_fails, spec, str(out))
    for rep in _reports(out, 2):    # every rank hears of the coordinator's failure
        assert list(rep["failures"]) == [0]
        assert rep["failures"][0][0] == "DurabilityError"
    with _open(spec) as store:
        assert store.steps(RUN) == [1]
        assert sorted((p.step, p.rank) for p in sharded.partial_parts(store, RUN)) == [(2, 0), (2, 1)]
        target = {"a": torch.zeros(16, 6)}
        reader = StorageReader(store, RUN)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert reader.commit.step == 1 and same_bits(target["a"], sharded_full(1))
        with pytest.raises(CheckpointNotFoundError):
            StorageReader(store, RUN, step=2).read_metadata()


# --- 4. a damaged part -----------------------------------------------------------------------------

def _child_two_steps(rank, world, spec):
    mesh = _mesh(world)
    writer = StorageWriter(_open(spec), RUN)
    for step in (1, 2):
        dcp.save({"a": _dtensor(sharded_full(step, 64, 32), mesh, _shard(0))}, storage_writer=writer,
                 checkpoint_id=step)


def _flip_byte(path, from_end=200):
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - from_end)
        b = f.read(1)
        f.seek(size - from_end)
        f.write(bytes([b[0] ^ 0xFF]))


def test_damaged_part_is_named_and_walked_back_from(request, tmp_path):
    kind, url, _ = make_spec("file", request, tmp_path)
    spec = (kind, url, {"incremental": False})    # one standalone file per part
    spawn(tmp_path, 2, _child_two_steps, spec)
    with _open(spec) as store:
        commit = sharded.as_commit(store.read(RUN, 2))
        path = store.parts_store().ref(commit.parts[1].run, 2)
        assert path.startswith(os.path.join(url, ".parts") + os.sep)
        _flip_byte(path)

        with pytest.raises(CheckpointException) as e:
            dcp.load({"a": torch.zeros(64, 32)}, storage_reader=StorageReader(store, RUN, step=2), no_dist=True)
        [(exc, _)] = e.value.failures.values()
        assert isinstance(exc, CorruptCheckpointError) and "rank 1's part" in str(exc) and path in str(exc)

        target = {"a": torch.zeros(64, 32)}
        reader = StorageReader(store, RUN)
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert reader.commit.step == 1 and same_bits(target["a"], sharded_full(1, 64, 32))
        assert [r.step for r in reader.rejected] == [2] and "rank 1" in reader.rejected[0].reason


def test_loading_a_run_or_step_that_is_not_there_fails_with_the_agck_error(tmp_path, request):
    """DCP turns an error of read_metadata into AssertionError("metadata is None ..."):
    a missing run, a missing step or a step that is not a DCP save reach the caller as
    the agck error, in CheckpointException.failures (a BaseException: caught by name)."""
    kind, url, opts = make_spec("file", request, tmp_path)
    with _open((kind, url, opts)) as store:
        store.put("plain", 1, {"a": 1})
        for reader, cls, text in ((StorageReader(store, "nope"), CheckpointNotFoundError, "has no checkpoints"),
                                  (StorageReader(store, "plain", step=5), CheckpointNotFoundError, "step 5"),
                                  (StorageReader(store, "plain", step=1), UsageError, "single-process")):
            with pytest.raises(CheckpointException) as e:
                dcp.load({"a": torch.zeros(2)}, storage_reader=reader, no_dist=True)
            [(exc, _)] = e.value.failures.values()
            assert isinstance(exc, cls) and text in str(exc), exc


# --- 5. fencing ------------------------------------------------------------------------------------

def _child_stale(rank, world, spec, epoch, out):
    mesh = _mesh(world)
    try:
        dcp.save({"a": _dtensor(sharded_full(9), mesh, _shard(0))},
                 storage_writer=StorageWriter(_open(spec), RUN, epoch=epoch), checkpoint_id=9)
        failures = {}
    except CheckpointException as e:
        failures = _failures(e)
    _report(out, rank, {"failures": failures})


def test_stale_writer_cannot_commit(request, tmp_path):
    spec = make_spec("file", request, tmp_path)
    store = _open(spec)
    state = {"x": torch.arange(4.0)}
    old = StorageWriter(store, RUN)
    dcp.save(state, storage_writer=old, checkpoint_id=1, no_dist=True)
    assert old.epoch == store.epoch(RUN)
    dcp.save(state, storage_writer=old, checkpoint_id=2, no_dist=True)   # one writer keeps its epoch
    assert old.epoch == store.epoch(RUN)

    new_epoch = store.begin_epoch(RUN)            # the run restarted elsewhere
    with pytest.raises(CheckpointException) as e:
        dcp.save(state, storage_writer=old, checkpoint_id=3, no_dist=True)
    [(exc, _)] = e.value.failures.values()
    assert isinstance(exc, StaleEpochError) and "step 3" in str(exc)
    assert store.steps(RUN) == [1, 2] and not sharded.partial_parts(store, RUN)   # refused before any part

    # the run is taken over while the parts are being written: the commit itself is refused
    writer = StorageWriter(store, RUN, epoch=new_epoch)
    write_data = writer.write_data

    def write_then_take_over(plan, planner):
        fut = write_data(plan, planner)
        store.begin_epoch(RUN)
        return fut

    writer.write_data = write_then_take_over
    with pytest.raises(CheckpointException) as e:
        dcp.save(state, storage_writer=writer, checkpoint_id=4, no_dist=True)
    [(exc, _)] = e.value.failures.values()
    assert isinstance(exc, StaleEpochError)
    assert store.steps(RUN) == [1, 2]

    # with two ranks, every rank hears of it
    out = tmp_path / "out"
    out.mkdir()
    spawn(tmp_path, 2, _child_stale, spec, new_epoch, str(out))
    for rep in _reports(out, 2):
        assert [f[0] for f in rep["failures"].values()] == ["StaleEpochError"]
    assert store.steps(RUN) == [1, 2]
    store.close()


def test_a_committed_step_is_never_broken_by_saving_it_again(tmp_path):
    store = open_store(str(tmp_path / "store"))
    writer = StorageWriter(store, RUN)
    dcp.save({"x": torch.ones(3)}, storage_writer=writer, checkpoint_id=1, no_dist=True)
    # the same incarnation would write its parts over step 1's: refused before any is written
    with pytest.raises(CheckpointException) as e:
        dcp.save({"x": torch.zeros(3)}, storage_writer=writer, checkpoint_id=1, no_dist=True)
    [(exc, _)] = e.value.failures.values()
    assert isinstance(exc, agck.CheckpointExistsError) and "epoch 1" in str(exc)

    # a new incarnation writes parts of its own: the commit record replaces step 1 atomically,
    # and a save that fails before its commit leaves the old step 1 whole
    def failing_put(run, step, state, **kw):
        raise DurabilityError("injected: the disk failed")

    real_put, store.put = store.put, failing_put
    with pytest.raises(CheckpointException):
        dcp.save({"x": torch.zeros(3)}, storage_writer=StorageWriter(store, RUN), checkpoint_id=1, no_dist=True)
    store.put = real_put
    target = {"x": torch.zeros(3)}
    dcp.load(target, storage_reader=StorageReader(store, RUN), no_dist=True)
    assert torch.equal(target["x"], torch.ones(3))
    dcp.save({"x": torch.full((3,), 2.0)}, storage_writer=StorageWriter(store, RUN), checkpoint_id=1, no_dist=True)
    dcp.load(target, storage_reader=StorageReader(store, RUN, step=1), no_dist=True)
    assert torch.equal(target["x"], torch.full((3,), 2.0))


# --- 6. metadata as plain data -------------------------------------------------------------------

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64]
_leaf = st.one_of(
    st.builds(lambda dt, shape: torch.ones(shape, dtype=dt),
              st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple)),
    st.integers(-2**63, 2**63 - 1), st.text(max_size=8), st.binary(max_size=8), st.none(),
    st.floats(allow_nan=False), st.tuples(st.integers(), st.text(max_size=3)))
_keys = st.text(alphabet="abcxyz_", min_size=1, max_size=6)
_states = st.dictionaries(_keys, st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, min_size=1, max_size=3), st.dictionaries(_keys, inner, min_size=1, max_size=3)),
    max_leaves=8), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=_states)
def test_metadata_of_real_saves_round_trips(tmp_path, state):
    step = next(_rendezvous)
    md = dcp.save(state, storage_writer=StorageWriter(str(tmp_path / "store"), RUN), checkpoint_id=step,
                  no_dist=True)
    plain = metadata_to_plain(md)
    assert metadata_from_plain(plain) == md
    assert agck.codec.encode_plain(plain) is plain          # no tuple, no object: plain data only
    read = StorageReader(str(tmp_path / "store"), RUN, step=step).read_metadata()
    read.storage_meta.load_id = None
    assert read == md


def test_metadata_of_every_field_round_trips():
    props = dmd.TensorProperties(dtype=torch.float8_e4m3fn, layout=torch.sparse_coo, requires_grad=True,
                                 memory_format=torch.channels_last, pin_memory=True)
    md = dmd.Metadata(
        state_dict_metadata={
            "w": dmd.TensorStorageMetadata(props, torch.Size([4, 6]), [
                dmd.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 6])),
                dmd.ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 6]))]),
            "o": dmd.BytesStorageMetadata()},
        planner_data={"w": ("w",), "o": ("opt", 0, "o"), 3: [(1, 2), {"tuple": [1]}, {"map": None}], (1, "k"): None},
        storage_data={dmd.MetadataIndex("w", [0, 0], 0): StoredItem(0, "w@0,0"),
                      dmd.MetadataIndex("w", [2, 0], 1): StoredItem(1, "w@2,0"),
                      dmd.MetadataIndex("o"): StoredItem(0, "o")},
        storage_meta=dmd.StorageMeta(checkpoint_id="r@1", save_id="s", load_id=None, modules=["m.a", "m.b"]),
        version="1.0.0")
    back = metadata_from_plain(metadata_to_plain(md))
    assert back == md
    assert back.planner_data[3][1] == {"tuple": [1]} and type(back.planner_data["o"]) is tuple
    assert [i.index for i in back.storage_data] == [0, 1, None]
    assert metadata_from_plain(metadata_to_plain(dmd.Metadata({}))) == dmd.Metadata({})


class _Opaque:
    pass


def test_metadata_that_is_not_plain_is_refused_naming_the_field():
    md = dmd.Metadata({}, planner_data={"x": ("x", [1, _Opaque()])})
    with pytest.raises(EncodeError, match=r"planner_data\['x'\]\[1\]\[1\].*_Opaque"):
        metadata_to_plain(md)
    with pytest.raises(EncodeError, match="storage_data"):
        metadata_to_plain(dmd.Metadata({}, storage_data={dmd.MetadataIndex("x"): "somewhere"}))
    with pytest.raises(EncodeError, match=r"state_dict_metadata\['x'\]"):
        metadata_to_plain(dmd.Metadata({"x": object()}))
    with pytest.raises(EncodeError, match="planner_data"):    # a tuple subclass is not a tuple
        metadata_to_plain(dmd.Metadata({}, planner_data=[True, torch.Size([1])]))
    loop: list = []
    loop.append(loop)
    with pytest.raises(EncodeError, match="nested deeper"):
        metadata_to_plain(dmd.Metadata({}, planner_data=loop))


def test_malformed_metadata_in_a_record_is_a_verdict():
    good = metadata_to_plain(dmd.Metadata({"w": dmd.BytesStorageMetadata()}))
    for bad in (None, {**good, "format": 2}, {**good, "state_dict_metadata": {"w": {"type": "pickle"}}},
                {**good, "storage_data": [["w", None, None, 0]]}, {**good, "planner_data": {"set": [1]}},
                {**good, "extra": 1}):
        with pytest.raises(MalformedCheckpointError, match="DCP metadata") as e:
            metadata_from_plain(bad, ref="here")
        assert e.value.ref == "here"


def test_sizes_and_offsets_torch_cannot_hold_are_a_verdict():
    md = dmd.Metadata({"w": dmd.TensorStorageMetadata(
        properties=dmd.TensorProperties(dtype=torch.float32), size=torch.Size([4]),
        chunks=[dmd.ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))])})
    good = metadata_to_plain(md)
    assert metadata_from_plain(good) == md
    for bad_size in ([1 << 63], [-1]):
        bad = copy.deepcopy(good)
        bad["state_dict_metadata"]["w"]["size"] = bad_size
        with pytest.raises(MalformedCheckpointError, match="not a size or offset"):
            metadata_from_plain(bad, ref="here")


class _ObjectPlanner(DefaultSavePlanner):
    def create_global_plan(self, plans):
        plans, md = super().create_global_plan(plans)
        return plans, dataclasses.replace(md, planner_data={"state": _Opaque()})


def test_save_with_unstorable_planner_data_commits_nothing(tmp_path):
    store = open_store(str(tmp_path / "store"))
    with pytest.raises(CheckpointException) as e:
        dcp.save({"x": torch.ones(3)}, storage_writer=StorageWriter(store, RUN, 1), planner=_ObjectPlanner(),
                 no_dist=True)
    [(exc, _)] = e.value.failures.values()
    assert isinstance(exc, EncodeError) and "planner_data['state']" in str(exc)
    assert store.steps(RUN) == []


# --- 7. async save --------------------------------------------------------------------------------

def _child_async(rank, world, spec, out):
    mesh = _mesh(world)
    store = _open(spec)
    writer = StorageWriter(store, RUN)
    for step in (1, 2):
        state = {"a": _dtensor(sharded_full(step), mesh, _shard(0)), "n": step}
        fut = dcp.async_save(state, storage_writer=writer, checkpoint_id=step)
        getattr(fut, "upload_completion", fut).result(timeout=60)
    target = {"a": _dtensor(torch.zeros(16, 6), mesh, _shard(0)), "n": 0}
    dcp.load(target, storage_reader=StorageReader(store, RUN))
    _report(out, rank, {"a": target["a"].full_tensor(), "n": target["n"]})


def test_async_save(request, tmp_path):
    spec = make_spec("file", request, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    spawn(tmp_path, 2, _child_async, spec, str(out))
    for rep in _reports(out, 2):
        assert rep["n"] == 2 and same_bits(rep["a"], sharded_full(2))
    with _open(spec) as store:
        assert store.steps(RUN) == [1, 2]
        epochs = {sharded.as_commit(store.read(RUN, s)).epoch for s in (1, 2)}
        assert epochs == {store.epoch(RUN)}      # one writer, one incarnation


# --- usage ------------------------------------------------------------------------------------------

def test_reader_refuses_what_is_not_a_dcp_save(tmp_path):
    store = open_store(str(tmp_path / "store"))
    dcp.save({"x": torch.ones(2)}, storage_writer=StorageWriter(store, RUN, 1), no_dist=True)
    store.put(RUN, 2, {"x": torch.ones(2)})
    with pytest.raises(UsageError, match="step 2 is a single-process checkpoint"):
        StorageReader(store, RUN).read_metadata()
    snap = sharded.Commit(run=RUN, step=3, epoch=1, world_size=1, parts=[sharded.PartRef(0, "r.e1.r0", "n")])
    store.put(RUN, 3, snap.state())
    with pytest.raises(UsageError, match="kind 'snapshot'"):
        StorageReader(store, RUN, step=3).read_metadata()
    with pytest.raises(CheckpointNotFoundError):
        StorageReader(store, "other").read_metadata()
    with pytest.raises(CheckpointException, match="run 'other' has no checkpoints"):   # DCP keeps only the text
        dcp.load({"x": torch.zeros(2)}, storage_reader=StorageReader(store, "other"), no_dist=True)
    assert StorageReader(store, RUN, step=1).read_metadata().state_dict_metadata.keys() == {"x"}


def test_writer_usage_errors(tmp_path):
    store = open_store(str(tmp_path / "store"))
    with pytest.raises(CheckpointException) as e:
        dcp.save({"x": torch.ones(2)}, storage_writer=StorageWriter(store, RUN), no_dist=True)
    [(exc, _)] = e.value.failures.values()
    assert isinstance(exc, UsageError) and "no step" in str(exc)
    with pytest.raises(UsageError, match="use_collectives"):
        dcp.save({"x": torch.ones(2)}, storage_writer=StorageWriter(store, RUN, 1), no_dist=True,
                 use_collectives=False)
    with pytest.raises(UsageError, match="URL"):
        pickle.dumps(StorageWriter(store, RUN, 1))
    by_url = pickle.loads(pickle.dumps(StorageWriter(str(tmp_path / "store"), RUN, 1)))
    dcp.save({"x": torch.ones(2)}, storage_writer=by_url, no_dist=True)
    assert store.steps(RUN) == [1]
    assert StorageWriter.validate_checkpoint_id(7) and StorageWriter.validate_checkpoint_id("7")
    assert not StorageWriter.validate_checkpoint_id("/some/dir") and not StorageWriter.validate_checkpoint_id(-1)


class _CachingPlanner(DefaultSavePlanner):   # a class of its own: DCP caches plans per planner class
    def __init__(self):
        super().__init__(enable_plan_caching=True)


def test_cached_save_plans_are_refused_not_misapplied(tmp_path):
    store = open_store(str(tmp_path / "store"))
    writer = StorageWriter(store, RUN)
    planner = _CachingPlanner()
    dcp.save({"x": torch.ones(2)}, storage_writer=writer, checkpoint_id=1, planner=planner, no_dist=True)
    with pytest.raises(CheckpointException, match="enable_plan_caching=False"):
        dcp.save({"x": torch.zeros(2)}, storage_writer=writer, checkpoint_id=2, planner=planner, no_dist=True)
    assert store.steps(RUN) == [1]
    target = {"x": torch.zeros(2)}
    dcp.load(target, storage_reader=StorageReader(store, RUN), no_dist=True)
    assert torch.equal(target["x"], torch.ones(2))


def test_ranks_that_resolved_different_steps_are_stopped(tmp_path):
    store = open_store(str(tmp_path / "store"))
    for step in (1, 2):
        dcp.save({"x": torch.ones(2)}, storage_writer=StorageWriter(store, RUN, step), no_dist=True)
    plans = []
    for step in (1, 2):     # as if a save committed step 2 between two ranks' reads
        reader = StorageReader(store, RUN, step=step)
        reader.read_metadata()
        plans.append(reader.prepare_local_plan(dcp.planner.LoadPlan([])))
    with pytest.raises(UsageError, match=r"steps \[1, 2\]"):
        reader.prepare_global_plan(plans)
    assert reader.prepare_global_plan(plans[1:] * 2) == plans[1:] * 2
