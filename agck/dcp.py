"""A torch.distributed.checkpoint (DCP) storage backend on agck's stores.

    import torch.distributed.checkpoint as dcp
    from agck.dcp import StorageReader, StorageWriter

    writer = StorageWriter("ckpts/", "run-7")            # one per process and incarnation
    dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)
    dcp.load(state_dict, storage_reader=StorageReader("ckpts/", "run-7"))   # newest step that verifies

A DCP save of step k is an agck multi-rank checkpoint (:mod:`agck.sharded`):
every rank puts one *part* holding all the items it writes (ranks with nothing
to write put an empty one), and the coordinator then puts the *commit record*,
fenced by the writer's epoch, with DCP's metadata in it as plain data. The step
is visible only once the record is durable, every byte of it and of its parts
is checksummed, a writer of an older incarnation cannot commit, and
``StorageReader(step=None)`` walks back to the newest step that fully verifies.
Planners, resharding (save with N ranks, load with M) and ``dcp.async_save``
work as with DCP's own FileSystemWriter/Reader.

Epochs: the coordinator's writer takes a new epoch of the run
(:meth:`Store.begin_epoch`) at its first save unless ``epoch=`` was given, and
keeps it for every later save. Create one writer per process when the job
starts and pass ``checkpoint_id=step`` to each save: a new writer per save would
begin a new incarnation each time, fencing off any save still in flight. A step
already committed in the writer's own epoch is not saved again
(CheckpointExistsError): its parts would be overwritten before the new record
commits. A later incarnation may save it again; its record replaces the old one
atomically.

Safety of non-tensor items: tensors are stored raw, and agck never unpickles
anything. DCP itself serialises every non-tensor value with ``torch.save`` and
its default load planner reads it back with ``torch.load(weights_only=False)``;
agck stores those bytes opaquely. Its checksums show they are the bytes that
were written, not that the writer was benign: load checkpoints with non-tensor
items only from writers you trust, exactly as with DCP's own storage.

DCP's metadata is kept without pickle (:func:`metadata_to_plain`); a planner
that puts anything but plain values, lists, tuples and dicts in
``planner_data`` is refused with an :class:`EncodeError`.

Errors raised inside a DCP save or load reach the caller wrapped by DCP in a
``CheckpointException``, whose ``failures`` maps each failing rank to its error;
of an error in ``read_metadata`` (no such step, nothing verifies) DCP keeps
only the message, in an AssertionError. Call ``read_metadata()`` directly to
get the agck error itself.
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
import uuid
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import metadata as dmd
from torch.distributed.checkpoint import storage as dstorage
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.futures import Future

from . import codec, sharded
from .errors import (AgckError, CheckpointExistsError, CheckpointNotFoundError, EncodeError,
                     MalformedCheckpointError, NoValidCheckpointError, StaleEpochError, UsageError)
from .names import check_run, check_step
from .recovery import recover_run
from .stores import Store, open_store

__all__ = ["StorageWriter", "StorageReader", "StoredItem", "metadata_to_plain", "metadata_from_plain"]

KIND = "dcp"
PLAIN_FORMAT = 1     # the layout of the plain metadata in a commit record's ``extra``


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where one item of a DCP checkpoint is: the key in rank ``rank``'s part."""

    rank: int
    key: str


def _item_key(index: dmd.MetadataIndex) -> str:
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _checkpoint_step(checkpoint_id) -> int:
    if isinstance(checkpoint_id, str) and checkpoint_id.isascii() and checkpoint_id.isdigit():
        checkpoint_id = int(checkpoint_id)
    return check_step(checkpoint_id, "checkpoint_id")


class _StoreUser:
    """The store of a writer or reader: a Store given, or a URL opened once per process."""

    def _init_store(self, store, run: str) -> None:
        self.run = check_run(run)
        if isinstance(store, Store):
            self._url, self._store, self._pid = None, store, None
        else:
            if isinstance(store, os.PathLike):
                store = os.fspath(store)
            if not isinstance(store, str):
                raise UsageError(f"store must be a Store or a store URL, not {type(store).__name__}")
            self._url, self._store, self._pid = store, None, None

    @property
    def store(self) -> Store:
        if self._url is not None and (self._store is None or self._pid != os.getpid()):
            self._store, self._pid = open_store(self._url), os.getpid()
        return self._store

    def close(self) -> None:
        """Close the store if this object opened it from a URL."""
        if self._url is not None and self._store is not None and self._pid == os.getpid():
            self._store.close()
        if self._url is not None:
            self._store = None

    # DCP's checkpoint_id is the step
    @property
    def checkpoint_id(self) -> int | None:
        return self.step

    def _reset_step(self, checkpoint_id) -> None:
        if checkpoint_id is not None:
            self.step = _checkpoint_step(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        try:
            _checkpoint_step(checkpoint_id)
        except UsageError:
            return False
        return True

    def __getstate__(self):
        # DCP's process-based async save sends the writer to another process.
        if self._url is None:
            raise UsageError(f"a {type(self).__name__} made with a Store object cannot be sent to another process",
                             hint="construct it with the store's URL instead")
        state = dict(self.__dict__)
        state["_store"] = state["_pid"] = None
        return state


class StorageWriter(_StoreUser, dstorage.StorageWriter):
    """Writes a DCP save of ``step`` of ``run`` into ``store`` (a Store or a URL).

    ``step`` may instead come with each save, as ``checkpoint_id=step``. ``epoch``:
    the run's incarnation this writer commits under; by default the coordinator
    begins a new one at its first save (module docstring). ``meta``: plain data
    put with each commit record (``store.read(run, step).meta``).

    DCP's process-based async save sends the writer to another process for each
    save: make it from a URL, and give it ``epoch=`` so that every save commits
    under that one incarnation."""

    def __init__(self, store, run: str, step: int | None = None, *, epoch: int | None = None, meta: Any = None):
        super().__init__()
        self._init_store(store, run)
        self.step = None if step is None else check_step(step)
        self.epoch = None if epoch is None else check_step(epoch, "epoch")
        self.meta = codec.encode_plain(meta, "meta")
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self._nonce: str | None = None       # this rank's nonce for the save in progress
        self._plan: dict | None = None       # the coordinator's assignment of the save in progress

    def reset(self, checkpoint_id=None) -> None:
        self._reset_step(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._nonce = self._plan = None

    def storage_meta(self) -> dmd.StorageMeta:
        return dmd.StorageMeta(checkpoint_id=self.run if self.step is None else f"{self.run}@{self.step}",
                               save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise UsageError("agck.dcp.StorageWriter needs use_collectives=True: the commit record binds every "
                             "rank's part, so one coordinator must see them all",
                             ref=f"run {self.run!r}", hint="call dcp.save without use_collectives=False")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._nonce = sharded.new_nonce()
        return dataclasses.replace(plan, storage_data={"nonce": self._nonce})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.step is None:
            raise UsageError(f"no step to save for run {self.run!r}", ref=self.store.url,
                             hint="pass checkpoint_id=step to dcp.save, or step= to StorageWriter")
        where = f"run {self.run!r} step {self.step}"
        nonces = []
        for rank, p in enumerate(plans):
            sd = p.storage_data
            if not isinstance(sd, dict) or not isinstance(sd.get("nonce"), str):
                raise UsageError(f"rank {rank}'s save plan for {where} lost its storage data: the planner replaced "
                                 "it (plan caching does)", ref=self.store.ref(self.run, self.step),
                                 hint="use DefaultSavePlanner(enable_plan_caching=False)")
            nonces.append(sd["nonce"])
        if self.epoch is None:
            self.epoch = self.store.begin_epoch(self.run)
        current = self.store.epoch(self.run)
        if current is not None and current > self.epoch:   # refuse before every rank writes its part
            raise StaleEpochError(f"{where}: the run is at epoch {current}, this writer's epoch is {self.epoch}: "
                                  "a newer incarnation of the run began", ref=self.store.ref(self.run, self.step))
        self._refuse_overwrite(where)
        world = len(plans)
        self._plan = {"run": self.run, "step": self.step, "epoch": self.epoch, "world_size": world, "nonces": nonces}
        return [dataclasses.replace(p, storage_data={**self._plan, "rank": rank, "nonce": nonces[rank]})
                for rank, p in enumerate(plans)]

    def _refuse_overwrite(self, where: str) -> None:
        """A step committed in this writer's epoch has its parts where this save
        would put its own, so writing them would break that step before the new
        one commits. Another epoch's step is replaced atomically by the record."""
        if self.step not in self.store.steps(self.run):
            return
        try:
            old = sharded.as_commit(self.store.read(self.run, self.step, map_location="cpu"))
        except AgckError as e:
            if e.verdict or isinstance(e, CheckpointNotFoundError):
                return      # nothing there that verifies: nothing to lose
            raise
        if old is not None and old.epoch == self.epoch:
            raise CheckpointExistsError(f"{where} was already saved in this incarnation (epoch {self.epoch})",
                                        ref=self.store.ref(self.run, self.step),
                                        hint="save under a new step, or delete this one first "
                                             "(store.delete(run, step))")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[dstorage.WriteResult]]:
        a = plan.storage_data
        if not isinstance(a, dict) or a.get("nonce") != self._nonce or self._nonce is None:
            raise UsageError(f"rank {self.rank} was handed a save plan of another save of run {self.run!r} "
                             "(the planner reused a cached plan)",
                             hint="use DefaultSavePlanner(enable_plan_caching=False)")
        run, step, epoch, rank, world = a["run"], a["step"], a["epoch"], a["rank"], a["world_size"]
        where = f"run {run!r} step {step} rank {rank}"
        if run != self.run or rank != self.rank or (self.step is not None and step != self.step):
            raise UsageError(f"{where}: this writer is rank {self.rank}'s for run {self.run!r} step {self.step}, "
                             "the coordinator planned another", hint="give every rank the same run and step")
        part: dict[str, Any] = {}
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            key = _item_key(item.index)
            n = 1
            while key in part:          # two indexes with one string form: keep both
                key, n = f"{_item_key(item.index)}#{n}", n + 1
            if isinstance(data, io.BytesIO):
                value = bytes(data.getbuffer())
                size = len(value)
            elif isinstance(data, torch.Tensor):
                value = data.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
                size = value.numel() * value.element_size()
            else:
                raise EncodeError(f"{where}: the planner resolved {item.index.fqn!r} to a "
                                  f"{type(data).__name__}, not a tensor or BytesIO")
            part[key] = value
            results.append(dstorage.WriteResult(index=item.index, size_in_bytes=size,
                                                storage_data=StoredItem(rank, key)))
        sharded.put_part(self.store.parts_store(), run, step, epoch, rank, world, a["nonce"], part)
        fut: Future[list[dstorage.WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: dmd.Metadata, results: list[list[dstorage.WriteResult]]) -> None:
        p = self._plan
        if p is None:
            raise UsageError(f"finish without a planned save of run {self.run!r}",
                             hint="save through torch.distributed.checkpoint.save")
        run, step, epoch, world = p["run"], p["step"], p["epoch"], p["world_size"]
        if len(results) != world:
            raise UsageError(f"run {run!r} step {step}: {len(results)} ranks reported writes, {world} planned")
        storage: dict = {}
        for rank, wrs in enumerate(results):
            for wr in wrs:
                if not isinstance(wr.storage_data, StoredItem) or wr.storage_data.rank != rank:
                    raise UsageError(f"run {run!r} step {step}: rank {rank} reported a write agck did not make "
                                     f"({wr.storage_data!r})")
                storage[wr.index] = wr.storage_data
        metadata.storage_data = storage
        if metadata.version is None:
            metadata.version = CURRENT_DCP_VERSION
        if metadata.storage_meta is None:
            metadata.storage_meta = self.storage_meta()
        sharded.commit_step(self.store, run, step, epoch, p["nonces"], kind=KIND, extra=metadata_to_plain(metadata),
                            meta=self.meta)   # the step becomes visible
        self._plan = None


class StorageReader(_StoreUser, dstorage.StorageReader):
    """Reads a DCP save of ``run`` from ``store`` (a Store or a URL).

    ``step=None`` (or no ``checkpoint_id`` given to ``dcp.load``): the newest step
    whose commit record and every part verify; finding it reads every part of
    each step it judges, on every rank, before the load reads the parts it needs
    again. ``map_location``: where stored tensors are loaded before they are
    copied into the state dict (default: the CPU).

    After ``read_metadata``, ``commit`` is the commit record read and ``rejected``
    the newer steps passed over, with the reason."""

    def __init__(self, store, run: str, step: int | None = None, *, map_location=None):
        super().__init__()
        self._init_store(store, run)
        self.step = None if step is None else check_step(step)
        self.map_location = map_location
        self.rank = 0
        self.load_id = uuid.uuid4().hex
        self.commit: sharded.Commit | None = None
        self.rejected: list = []
        self._failed: Exception | None = None
        self._storage: dict = {}

    def reset(self, checkpoint_id=None) -> None:
        self._reset_step(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.commit, self.rejected, self._storage = None, [], {}

    def read_metadata(self) -> dmd.Metadata:
        # No **kwargs on purpose: DCP would then retry a failed read as "rank-local
        # metadata" and load without collectives.
        # DCP's load turns an exception raised here into AssertionError("metadata is None;
        # ..."), losing the agck error. Called by DCP, the error is kept instead, an empty
        # Metadata returned, and the error raised by set_up_storage_reader, which DCP
        # reports as it is in CheckpointException.failures. Called by anyone else, it raises.
        self._failed = None
        try:
            return self._read_metadata()
        except Exception as e:
            if not sys._getframe(1).f_globals.get("__name__", "").startswith("torch.distributed.checkpoint"):
                raise
            self._failed = e
            return dmd.Metadata(state_dict_metadata={})

    def _read_metadata(self) -> dmd.Metadata:
        store = self.store
        if self.step is not None:
            ck = store.read(self.run, self.step, map_location="cpu")    # a commit record holds no tensors
            self.rejected = []
        else:
            rec = recover_run(store, self.run, map_location="cpu")
            if rec.checkpoint is None:
                if not rec.candidates:
                    raise CheckpointNotFoundError(f"run {self.run!r} has no checkpoints", ref=store.where,
                                                  hint="check the run name (`agck ls` lists the runs)")
                raise NoValidCheckpointError(f"none of the {rec.candidates} checkpoints of run {self.run!r} "
                                             "verifies", ref=store.where, report=rec)
            ck, self.rejected = rec.checkpoint, rec.rejected
        commit = sharded.as_commit(ck)
        if commit is None:
            raise UsageError(f"run {self.run!r} step {ck.step} is a single-process checkpoint, not a "
                             "torch.distributed.checkpoint save", ref=ck.ref,
                             hint="read it with store.read(run, step), or pass the step of a DCP save")
        if commit.kind != KIND:
            raise UsageError(f"run {self.run!r} step {ck.step} is a multi-rank checkpoint of kind {commit.kind!r}, "
                             "not a torch.distributed.checkpoint save", ref=ck.ref,
                             hint="load it with the tool that wrote it, or pass the step of a DCP save")
        md = metadata_from_plain(commit.extra, ref=ck.ref)
        if md.storage_data is None:
            raise MalformedCheckpointError("the DCP metadata has no storage data", ref=ck.ref, section="commit")
        for index, item in md.storage_data.items():
            if not 0 <= item.rank < commit.world_size:
                raise MalformedCheckpointError(f"the DCP metadata puts {index.fqn!r} in rank {item.rank}'s part; "
                                               f"the step has {commit.world_size} ranks", ref=ck.ref,
                                               section="commit")
        if md.storage_meta is None:
            md.storage_meta = dmd.StorageMeta()
        md.storage_meta.load_id = self.load_id
        self.commit = commit
        return md

    def set_up_storage_reader(self, metadata: dmd.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:      # read_metadata's error (see there)
            raise failed
        self.rank = int(kwargs.get("rank", 0))
        self._storage = metadata.storage_data

    def _identity(self) -> tuple:
        c = self.commit
        return (c.step, c.epoch, tuple(p.nonce for p in c.parts))

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self._identity())

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # With step=None each rank chose the newest step itself; a save committed
        # (or a step pruned) meanwhile could make them choose differently.
        seen = {p.storage_data for p in plans if isinstance(p.storage_data, tuple)}
        if len(seen) > 1:
            steps = sorted({s[0] for s in seen})
            raise UsageError(f"the ranks loading run {self.run!r} resolved different checkpoints (steps {steps}): "
                             "the run changed while they looked", ref=self.store.url,
                             hint="retry, or pass step= so every rank reads the same step")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        commit = self.commit
        by_rank: dict[int, list] = {}
        for req in plan.items:
            item = self._storage.get(req.storage_index)
            if item is None:
                raise MalformedCheckpointError(f"run {self.run!r} step {commit.step}: the DCP metadata does not say "
                                               f"where {req.storage_index} is stored", ref=self.store.ref(
                                                   self.run, commit.step), section="commit")
            by_rank.setdefault(item.rank, []).append(req)
        for rank in sorted(by_rank):
            part = sharded.read_part(self.store, commit, rank, map_location=self.map_location)
            state = part.state if isinstance(part.state, dict) else {}
            for req in by_rank[rank]:
                key = self._storage[req.storage_index].key
                where = f"run {self.run!r} step {commit.step}: rank {rank}'s part"
                if key not in state:
                    raise MalformedCheckpointError(f"{where} lacks {key!r}, which the DCP metadata names",
                                                   ref=part.ref, section="part")
                value = state[key]
                if req.type == LoadItemType.BYTE_IO:
                    if not isinstance(value, bytes):
                        raise MalformedCheckpointError(f"{where} holds a {type(value).__name__} at {key!r}, "
                                                       "expected bytes", ref=part.ref, section="part")
                    planner.load_bytes(req, io.BytesIO(value))
                    continue
                if not isinstance(value, torch.Tensor):
                    raise MalformedCheckpointError(f"{where} holds a {type(value).__name__} at {key!r}, "
                                                   "expected a tensor", ref=part.ref, section="part")
                tensor = narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise MalformedCheckpointError(f"{where} holds {key!r} with shape {tuple(tensor.size())} "
                                                   f"where the load needs {tuple(target.size())}",
                                                   ref=part.ref, section="part")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
            del part, state
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


# --- DCP metadata as plain data ---------------------------------------------------------

def _names(kind) -> dict:
    return {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, kind)}


_DTYPES = _names(torch.dtype)
_LAYOUTS = _names(torch.layout)
_MEMORY_FORMATS = _names(torch.memory_format)

_HINT = "agck keeps DCP metadata without pickle: plain values, lists, tuples and dicts only"


_MAX_DEPTH = 64


def _at(where: str) -> str:
    return f"DCP metadata {where}" if where else "DCP metadata"


def _enc_err(where: str, what: str) -> EncodeError:
    return EncodeError(f"{_at(where)}: {what}", hint=_HINT)


def _check_fields(obj, known: tuple, where: str) -> None:
    """Refuse a field this module does not know (a newer torch) unless it holds its default."""
    for f in dataclasses.fields(obj):
        if f.name in known:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(obj, f.name) != default:
            raise _enc_err(f"{where}.{f.name}" if where else f.name, "a field this agck does not know how to store")


def _name_of(value, table: dict, where: str) -> str:
    name = str(value).removeprefix("torch.")
    if table.get(name) is not value:
        raise _enc_err(where, f"unknown value {value!r}")
    return name


def _size_to_plain(x, where: str) -> list:
    if not isinstance(x, (tuple, list)) or not all(type(v) is int for v in x):
        raise _enc_err(where, f"expected a sequence of ints, got {x!r}")
    return list(x)


def _value_to_plain(x, where: str, depth: int = 0):
    """planner_data: lists stay lists; tuples and dicts are tagged maps, so they come back as such."""
    t = type(x)
    if x is None or t in (bool, int, float, str, bytes):
        return x
    if depth >= _MAX_DEPTH:
        raise _enc_err(where, f"nested deeper than {_MAX_DEPTH}")
    d = depth + 1
    if t is list:
        return [_value_to_plain(v, f"{where}[{i}]", d) for i, v in enumerate(x)]
    if t is tuple:
        return {"tuple": [_value_to_plain(v, f"{where}[{i}]", d) for i, v in enumerate(x)]}
    if t is dict:
        return {"map": [[_value_to_plain(k, f"{where} key {k!r}", d), _value_to_plain(v, f"{where}[{k!r}]", d)]
                        for k, v in x.items()]}
    raise _enc_err(where, f"cannot store a {t.__module__}.{t.__qualname__}")


def _index_to_plain(index, where: str) -> list:
    if not isinstance(index, dmd.MetadataIndex) or not isinstance(index.fqn, str):
        raise _enc_err(where, f"expected a MetadataIndex, got {index!r}")
    offset = None if index.offset is None else _size_to_plain(index.offset, f"{where}.offset")
    if index.index is not None and type(index.index) is not int:
        raise _enc_err(f"{where}.index", f"expected an int, got {index.index!r}")
    return [index.fqn, offset, index.index]


def _storage_md_to_plain(md, where: str) -> dict:
    if type(md) is dmd.BytesStorageMetadata:
        return {"type": "bytes"}
    if type(md) is not dmd.TensorStorageMetadata:
        raise _enc_err(where, f"cannot store a {type(md).__name__}")
    _check_fields(md, ("properties", "size", "chunks"), where)
    p = md.properties
    if type(p) is not dmd.TensorProperties:
        raise _enc_err(f"{where}.properties", f"cannot store a {type(p).__name__}")
    _check_fields(p, ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), f"{where}.properties")
    for name in ("requires_grad", "pin_memory"):
        if type(getattr(p, name)) is not bool:
            raise _enc_err(f"{where}.properties.{name}", f"expected a bool, got {getattr(p, name)!r}")
    chunks = []
    for i, c in enumerate(md.chunks):
        if type(c) is not dmd.ChunkStorageMetadata:
            raise _enc_err(f"{where}.chunks[{i}]", f"cannot store a {type(c).__name__}")
        chunks.append([_size_to_plain(c.offsets, f"{where}.chunks[{i}].offsets"),
                       _size_to_plain(c.sizes, f"{where}.chunks[{i}].sizes")])
    return {"type": "tensor", "dtype": _name_of(p.dtype, _DTYPES, f"{where}.properties.dtype"),
            "layout": _name_of(p.layout, _LAYOUTS, f"{where}.properties.layout"),
            "requires_grad": p.requires_grad,
            "memory_format": _name_of(p.memory_format, _MEMORY_FORMATS, f"{where}.properties.memory_format"),
            "pin_memory": p.pin_memory, "size": _size_to_plain(md.size, f"{where}.size"), "chunks": chunks}


def _opt_str(x, where: str):
    if x is None or type(x) is str:
        return x
    raise _enc_err(where, f"expected a str, got {x!r}")


def metadata_to_plain(md: dmd.Metadata) -> dict:
    """DCP's Metadata as plain data (no tuples, no objects): what a commit record's
    ``extra`` holds. EncodeError, naming the field, for anything of a type it does
    not know; nothing is pickled. ``storage_data`` must map indexes to
    :class:`StoredItem` (as this module's writer makes it), or be None."""
    if type(md) is not dmd.Metadata:
        raise _enc_err("", f"expected a torch.distributed.checkpoint.metadata.Metadata, not {type(md).__name__}")
    _check_fields(md, ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"), "")
    if type(md.state_dict_metadata) is not dict:
        raise _enc_err("state_dict_metadata", f"expected a dict, got {type(md.state_dict_metadata).__name__}")
    sdm = {}
    for fqn, v in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise _enc_err("state_dict_metadata", f"key {fqn!r} is not a str")
        sdm[fqn] = _storage_md_to_plain(v, f"state_dict_metadata[{fqn!r}]")
    storage = None
    if md.storage_data is not None:
        if type(md.storage_data) is not dict:
            raise _enc_err("storage_data", f"expected a dict, got {type(md.storage_data).__name__}")
        storage = []
        for index, item in md.storage_data.items():
            where = f"storage_data[{index!r}]"
            if type(item) is not StoredItem or type(item.rank) is not int or type(item.key) is not str:
                raise _enc_err(where, f"cannot store a {type(item).__name__} (not written by agck.dcp)")
            storage.append(_index_to_plain(index, where) + [item.rank, item.key])
    sm = md.storage_meta
    if sm is not None:
        if type(sm) is not dmd.StorageMeta:
            raise _enc_err("storage_meta", f"cannot store a {type(sm).__name__}")
        _check_fields(sm, ("checkpoint_id", "save_id", "load_id", "modules"), "storage_meta")
        cid = os.fspath(sm.checkpoint_id) if isinstance(sm.checkpoint_id, os.PathLike) else sm.checkpoint_id
        if type(sm.modules) is not list or not all(type(m) is str for m in sm.modules):
            raise _enc_err("storage_meta.modules", f"expected a list of str, got {sm.modules!r}")
        sm = {"checkpoint_id": _opt_str(cid, "storage_meta.checkpoint_id"),
              "save_id": _opt_str(sm.save_id, "storage_meta.save_id"),
              "load_id": _opt_str(sm.load_id, "storage_meta.load_id"), "modules": list(sm.modules)}
    out = {"format": PLAIN_FORMAT, "version": _opt_str(md.version, "version"), "state_dict_metadata": sdm,
           "planner_data": _value_to_plain(md.planner_data, "planner_data"), "storage_data": storage,
           "storage_meta": sm}
    return codec.encode_plain(out, "DCP metadata")


class _Decoder:
    def __init__(self, ref: str | None):
        self.ref = ref

    def bad(self, where: str, what: str) -> MalformedCheckpointError:
        return MalformedCheckpointError(f"{_at(where)}: {what}", ref=self.ref, section="commit")

    def expect(self, x, t, where: str):
        if not isinstance(x, t) or (t is int and isinstance(x, bool)):
            raise self.bad(where, f"expected {getattr(t, '__name__', t)}, got {x!r}")
        return x

    def map(self, x, keys: set, where: str) -> dict:
        self.expect(x, dict, where)
        if set(x) != keys:
            raise self.bad(where, f"keys {sorted(map(str, x))}, expected {sorted(keys)}")
        return x

    def size(self, x, where: str) -> torch.Size:
        """A shape, chunk offsets or chunk sizes: integers torch can hold, none negative."""
        self.expect(x, list, where)
        for v in x:
            self.expect(v, int, where)
            if not 0 <= v < 1 << 63:
                raise self.bad(where, f"{v} is not a size or offset (0 to 2**63-1)")
        return torch.Size(x)

    def named(self, x, table: dict, where: str):
        if not isinstance(x, str) or x not in table:
            raise self.bad(where, f"unknown name {x!r}")
        return table[x]

    def value(self, x, where: str, depth: int = 0):
        if depth > _MAX_DEPTH:
            raise self.bad(where, f"nested deeper than {_MAX_DEPTH}")
        if x is None or isinstance(x, (bool, int, float, str, bytes)):
            return x
        if isinstance(x, list):
            return [self.value(v, where, depth + 1) for v in x]
        if isinstance(x, dict) and len(x) == 1 and isinstance(x.get("tuple"), list):
            return tuple(self.value(v, where, depth + 1) for v in x["tuple"])
        if isinstance(x, dict) and len(x) == 1 and isinstance(x.get("map"), list):
            out = {}
            for kv in x["map"]:
                if not isinstance(kv, list) or len(kv) != 2:
                    raise self.bad(where, f"map entry {kv!r}")
                k = self.value(kv[0], where, depth + 1)
                try:
                    out[k] = self.value(kv[1], where, depth + 1)
                except TypeError:
                    raise self.bad(where, f"unhashable map key {k!r}") from None
            return out
        raise self.bad(where, f"unexpected {x!r}")

    def tensor_md(self, x, where: str):
        if isinstance(x, dict) and x.get("type") == "bytes":
            self.map(x, {"type"}, where)
            return dmd.BytesStorageMetadata()
        self.map(x, {"type", "dtype", "layout", "requires_grad", "memory_format", "pin_memory", "size", "chunks"},
                 where)
        if x["type"] != "tensor":
            raise self.bad(f"{where}.type", f"unknown type {x['type']!r}")
        props = dmd.TensorProperties(
            dtype=self.named(x["dtype"], _DTYPES, f"{where}.dtype"),
            layout=self.named(x["layout"], _LAYOUTS, f"{where}.layout"),
            requires_grad=self.expect(x["requires_grad"], bool, f"{where}.requires_grad"),
            memory_format=self.named(x["memory_format"], _MEMORY_FORMATS, f"{where}.memory_format"),
            pin_memory=self.expect(x["pin_memory"], bool, f"{where}.pin_memory"))
        chunks = []
        for i, c in enumerate(self.expect(x["chunks"], list, f"{where}.chunks")):
            if not isinstance(c, list) or len(c) != 2:
                raise self.bad(f"{where}.chunks[{i}]", f"expected [offsets, sizes], got {c!r}")
            chunks.append(dmd.ChunkStorageMetadata(offsets=self.size(c[0], f"{where}.chunks[{i}].offsets"),
                                                   sizes=self.size(c[1], f"{where}.chunks[{i}].sizes")))
        return dmd.TensorStorageMetadata(properties=props, size=self.size(x["size"], f"{where}.size"), chunks=chunks)

    def opt_str(self, x, where: str):
        return x if x is None else self.expect(x, str, where)

    def metadata(self, obj) -> dmd.Metadata:
        keys = {"format", "version", "state_dict_metadata", "planner_data", "storage_data", "storage_meta"}
        if isinstance(obj, dict) and isinstance(obj.get("format"), int) and obj["format"] > PLAIN_FORMAT:
            raise self.bad("format", f"{obj['format']} is newer than this agck reads ({PLAIN_FORMAT}); upgrade agck")
        self.map(obj, keys, "")
        if obj["format"] != PLAIN_FORMAT:
            raise self.bad("format", f"unknown format {obj['format']!r}")
        sdm = {}
        for fqn, v in self.expect(obj["state_dict_metadata"], dict, "state_dict_metadata").items():
            self.expect(fqn, str, "state_dict_metadata key")
            sdm[fqn] = self.tensor_md(v, f"state_dict_metadata[{fqn!r}]")
        storage = None
        if obj["storage_data"] is not None:
            storage = {}
            for i, e in enumerate(self.expect(obj["storage_data"], list, "storage_data")):
                where = f"storage_data[{i}]"
                if not isinstance(e, list) or len(e) != 5:
                    raise self.bad(where, f"expected [fqn, offset, index, rank, key], got {e!r}")
                fqn, offset, index, rank, key = e
                idx = dmd.MetadataIndex(self.expect(fqn, str, where),
                                        None if offset is None else self.size(offset, where),
                                        None if index is None else self.expect(index, int, where))
                storage[idx] = StoredItem(self.expect(rank, int, where), self.expect(key, str, where))
        sm = obj["storage_meta"]
        if sm is not None:
            self.map(sm, {"checkpoint_id", "save_id", "load_id", "modules"}, "storage_meta")
            modules = self.expect(sm["modules"], list, "storage_meta.modules")
            sm = dmd.StorageMeta(checkpoint_id=self.opt_str(sm["checkpoint_id"], "storage_meta.checkpoint_id"),
                                 save_id=self.opt_str(sm["save_id"], "storage_meta.save_id"),
                                 load_id=self.opt_str(sm["load_id"], "storage_meta.load_id"),
                                 modules=[self.expect(m, str, "storage_meta.modules") for m in modules])
        return dmd.Metadata(state_dict_metadata=sdm, planner_data=self.value(obj["planner_data"], "planner_data"),
                            storage_data=storage, storage_meta=sm,
                            version=self.opt_str(obj["version"], "version"))


def metadata_from_plain(obj, *, ref: str | None = None) -> dmd.Metadata:
    """The Metadata :func:`metadata_to_plain` made ``obj`` from (equal to it).
    MalformedCheckpointError (``ref``: where ``obj`` was read) naming the field
    for anything that is not such data."""
    return _Decoder(ref).metadata(obj)
