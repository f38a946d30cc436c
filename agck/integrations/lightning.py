"""A Lightning ``CheckpointIO`` plugin that writes AGCK containers: :class:`AgckCheckpointIO`.

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from agck.integrations.lightning import AgckCheckpointIO, newest_valid_checkpoint

    ckpt = ModelCheckpoint(dirpath="ckpts/", save_top_k=2, save_last=True, monitor="val_loss")
    trainer = pl.Trainer(plugins=[AgckCheckpointIO()], callbacks=[ckpt])
    trainer.fit(model, ckpt_path=newest_valid_checkpoint("ckpts/"))   # None on the first run: starts fresh

Needs ``lightning`` 2.x (the ``lightning`` package; tested with 2.6.6); ``import
agck`` does not import this module.

Writing
-------
``save_checkpoint`` writes Lightning's checkpoint dict with :func:`agck.save`:
temp file, write, fsync, rename, fsync of the directory, so a crash leaves the
old file or the new one, never a torn one; every byte is covered by a checksum.
Missing parent directories are created, each made durable. The file keeps
Lightning's name (``epoch=3-step=120.ckpt``, ``last.ckpt``) but holds an AGCK
container, not a ``torch.save`` zip. Nothing is pickled: agck's codec stores
tensors, numpy arrays and plain Python values, and refuses anything else with
:class:`agck.EncodeError` naming the entry, e.g.
``checkpoint['hyper_parameters']['act']: cannot encode <class 'function'>``,
having written nothing. ``storage_options`` is refused (:class:`agck.UsageError`),
as Lightning's own ``TorchCheckpointIO`` does.

What comes back as what (``load_checkpoint``):

- tensors (any dtype, ``requires_grad``, ``nn.Parameter``, tied/shared
  storage), numpy arrays, None, bool, int, float (bit-exact), complex, str,
  bytes, list, tuple, set, frozenset, dict: as themselves. Tensors load on the
  CPU unless ``map_location`` says otherwise (Lightning moves them where the
  model is when it restores);
- ``collections.OrderedDict`` (the model's ``state_dict``): an ``OrderedDict``
  again, with its ``_metadata`` (module versions ``load_state_dict`` reads);
- Lightning's ``AttributeDict``: an ``AttributeDict``;
- ``argparse.Namespace`` (in ``hyper_parameters``): a ``Namespace``;
- ``pathlib`` paths (a data directory among the hyperparameters): stored as
  str; a concrete path comes back as ``pathlib.Path`` (this platform's), a
  ``PurePosixPath``/``PureWindowsPath`` as itself;
- any other dict subclass (``defaultdict``, ...): a plain ``dict``; one of
  the four above found under a dict key that is not None, bool, int, float, str
  or bytes: also a plain dict;
- refused with ``EncodeError``: dataclass instances, OmegaConf containers (and
  the ``hparams_type`` class Lightning stores beside them), functions, modules,
  any other object. Convert them to plain values before ``save_hyperparameters``
  (``dataclasses.asdict(cfg)``, ``OmegaConf.to_container(cfg, resolve=True)``) or
  leave them out (``save_hyperparameters(ignore=[...])``).

The conversions are listed in the container's ``meta["lightning"]`` (with the
epoch, global step and Lightning version), and ``agck.load(path).state`` is the
checkpoint dict with those containers as plain dicts.

Reading
-------
``load_checkpoint`` verifies every checksum (:func:`agck.load`); a damaged or
truncated file raises :class:`agck.CorruptCheckpointError` naming the path, a
file that is not an AGCK container :class:`agck.FormatError` (a ``torch.save``
file is recognised and said to be one; it is never unpickled). ``weights_only``
is accepted and ignored: nothing here can run code on load.
``LightningModule.load_from_checkpoint`` reads with ``torch.load`` and cannot
read these files; use :func:`load_from_checkpoint` here instead.

Removing
--------
``remove_checkpoint`` unlinks the file (a symlink itself, never its target) and
fsyncs the directory, so the removal survives a crash.

``last.ckpt`` and resuming
--------------------------
``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` through this plugin as
a full copy (durable like any other). ``save_last="link"`` makes Lightning
create ``last.ckpt`` itself as a relative symlink to the newest top-k file
(``ModelCheckpoint._link_checkpoint``: remove, then ``os.symlink``, no fsync, not
through the plugin), so after a crash it may be missing or dangling; a symlink to
a file that verifies is as good as the file.

``trainer.fit(ckpt_path="last")`` does not verify: Lightning gathers the
``last*.ckpt`` files of the ``ModelCheckpoint`` directories and takes the one
with the newest mtime (``_CheckpointConnector._parse_ckpt_path``), and only then
calls the plugin with that single path; no plugin hook takes part in the choice.
A damaged ``last.ckpt`` then fails the resume, and a ``last.ckpt`` whose rewrite
was interrupted is older than the top-k file written just before it. Resume with
:func:`newest_valid_checkpoint` instead::

    trainer.fit(model, ckpt_path=newest_valid_checkpoint("ckpts/"))

It returns the newest ``*.ckpt`` file of the directory (by the time written in
its header, which a copy of the directory keeps) that fully verifies and holds
training state, logging every newer one it passed
over with the reason; None when the directory holds no checkpoint (a first run
starts fresh); and raises :class:`agck.NoValidCheckpointError` when it holds
some but none verifies (``strict=False``: None). :func:`scan_checkpoints`
returns the whole report.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fnmatch
import inspect
import logging
import os
import pathlib
import stat
from typing import Any

from .. import durable, format
from ..checkpoint import load as _agck_load, save as _agck_save
from ..errors import (AgckError, CorruptCheckpointError, DependencyError, DurabilityError, EncodeError, FormatError,
                      MalformedCheckpointError, NoValidCheckpointError, StoreConnectionError, UsageError)
from ..recovery import Candidate, Recovery, Rejection, Unsuitable, walk_back

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.data import AttributeDict
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise DependencyError(f"agck.integrations.lightning needs Lightning 2.x: {_e}",
                          hint="pip install lightning==2.6.6 (the `lightning` package; "
                          "`pytorch_lightning` alone is not supported)") from _e

try:  # what LightningModule.hparams holds: a subclass of Fabric's, rebuilt as itself
    from lightning.pytorch.utilities.parsing import AttributeDict as _LoadedAttributeDict
except ImportError:  # pragma: no cover - Fabric without the Trainer
    _LoadedAttributeDict = AttributeDict

log = logging.getLogger(__name__)

__all__ = ["AgckCheckpointIO", "newest_valid_checkpoint", "scan_checkpoints", "CheckpointScan", "Rejected",
           "load_from_checkpoint"]

FORMAT_VERSION = 1

# Kinds of container turned into plain dicts on save and rebuilt on load.
_ATTRDICT, _ODICT, _NAMESPACE, _PATH = "AttributeDict", "OrderedDict", "Namespace", "Path"
# Paths come back from a fixed table, never by looking a name up: a concrete path as this
# platform's Path, a pure one as the flavour it was.
_PATHS = {"PurePosixPath": pathlib.PurePosixPath, "PureWindowsPath": pathlib.PureWindowsPath}
_PLAIN_KEY_TYPES = (type(None), bool, int, float, str, bytes)
_ZIP_MAGIC = b"PK\x03\x04"   # torch.save's default format


def _leaf_types() -> frozenset:
    # Values passed to the codec untouched, skipped by the walk without a call.
    import torch
    return frozenset({type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.nn.Parameter})


def _path_str(keys) -> str:
    return "checkpoint" + "".join(f"[{k!r}]" for k in keys)


def _hint_for(keys) -> str:
    if keys and keys[0] == "hyper_parameters":
        name = keys[1] if len(keys) > 1 else None
        ignore = f"self.save_hyperparameters(ignore=[{name!r}])" if isinstance(name, str) else \
            "self.save_hyperparameters(ignore=[...])"
        return (f"pass plain values (numbers, str, lists, tuples, dicts, tensors) to save_hyperparameters, "
                f"or leave this one out with {ignore}")
    return ("a checkpoint holds tensors, numpy arrays and plain Python values; store this entry as those "
            "(in state_dict()/on_save_checkpoint), or leave it out")


class _ToPlain:
    """Copies the checkpoint's containers, turning the few non-plain ones agck
    does not keep (AttributeDict, OrderedDict's ``_metadata``, Namespace, paths) into
    dicts (or str) and recording where they were; leaves every leaf to the codec."""

    def __init__(self):
        self.records: list = []
        self.leaf = _leaf_types()

    def record(self, kind: str, keys: tuple, extra=None) -> None:
        # the record must itself be plain meta, and its keys found again (a NaN key never is)
        if all(type(k) in _PLAIN_KEY_TYPES and k == k for k in keys):
            self.records.append([kind, list(keys)] if extra is None else [kind, list(keys), extra])

    def items(self, x: dict, keys: tuple) -> dict:
        leaf = self.leaf
        return {k: (v if type(v) in leaf else self.value(v, keys + (k,))) for k, v in x.items()}

    def value(self, x, keys: tuple):
        t = type(x)
        if t is dict:
            return self.items(x, keys)
        if t is list or t is tuple:
            leaf = self.leaf
            out = [v if type(v) in leaf else self.value(v, keys + (i,)) for i, v in enumerate(x)]
            return out if t is list else tuple(out)
        if isinstance(x, AttributeDict):
            self.record(_ATTRDICT, keys)
            return self.items(x, keys)
        if isinstance(x, collections.OrderedDict):
            self.record(_ODICT, keys, _plain_module_metadata(getattr(x, "_metadata", None)))
            return self.items(x, keys)
        if isinstance(x, dict):
            return self.items(x, keys)     # documented: comes back as a dict
        if isinstance(x, argparse.Namespace):
            self.record(_NAMESPACE, keys)
            return self.items(vars(x), keys)
        if isinstance(x, pathlib.PurePath):
            self.record(_PATH, keys, type(x).__name__ if type(x) in _PATHS.values() else "Path")
            return str(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            raise EncodeError(f"{_path_str(keys)}: cannot encode dataclass {type(x).__qualname__}", hint=(
                "convert it to plain values first (dataclasses.asdict(obj)); " + _hint_for(keys)))
        if (getattr(type(x), "__module__", None) or "").startswith("omegaconf") or \
                (isinstance(x, type) and (x.__module__ or "").startswith("omegaconf")):
            raise EncodeError(f"{_path_str(keys)}: cannot encode OmegaConf {getattr(x, '__name__', type(x).__name__)}",
                              hint="pass OmegaConf.to_container(cfg, resolve=True) to save_hyperparameters instead")
        return x   # everything else: the codec encodes it or names it


def _plain_module_metadata(md) -> dict | None:
    """``state_dict._metadata`` ({prefix: {"version": 1, ...}}) if it is plain, else None."""
    if not isinstance(md, dict):
        return None
    out = {}
    for k, v in md.items():
        if type(k) is not str or not isinstance(v, dict):
            return None
        if not all(type(a) is str and type(b) in (type(None), bool, int, float, str) for a, b in v.items()):
            return None
        out[k] = dict(v)
    return out


def _rebuild(state: dict, records, ref: str) -> dict:
    """Apply the recorded conversions back, innermost first (a tuple on the way is rebuilt)."""
    root: list = [{}, None]                 # [children by key, (kind, extra) or None]

    def tree():
        if not isinstance(records, list):
            raise ValueError(f"conversion records are a {type(records).__name__}, not a list")
        for rec in records:
            if not isinstance(rec, list) or len(rec) not in (2, 3) or not isinstance(rec[1], list):
                raise ValueError(f"bad conversion record {rec!r}")
            node = root
            for k in rec[1]:
                node = node[0].setdefault(k, [{}, None])
            node[1] = (rec[0], rec[2] if len(rec) == 3 else None)

    def apply(obj, node):
        children, conv = node
        if children:
            if type(obj) is tuple:
                items = list(obj)
                for k, sub in children.items():
                    items[k] = apply(items[k], sub)
                obj = tuple(items)
            elif type(obj) in (dict, list):
                for k, sub in children.items():
                    obj[k] = apply(obj[k], sub)
            else:
                raise TypeError(f"a conversion record goes through a {type(obj).__name__}")
        if conv is None:
            return obj
        kind, extra = conv
        if kind == _PATH:
            if type(obj) is not str:
                raise TypeError(f"a Path record names a {type(obj).__name__}")
            return _PATHS.get(extra, pathlib.Path)(obj)
        if type(obj) is not dict:
            raise TypeError(f"a {kind} record names a {type(obj).__name__}")
        if kind == _ATTRDICT:
            return _LoadedAttributeDict(obj)
        if kind == _ODICT:
            out = collections.OrderedDict(obj)
            if isinstance(extra, dict):
                out._metadata = collections.OrderedDict(extra)  # type: ignore[attr-defined]
            return out
        if kind == _NAMESPACE:
            if not all(type(k) is str for k in obj):
                raise TypeError("a Namespace record names a dict with non-str keys")
            return argparse.Namespace(**obj)
        raise ValueError(f"unknown conversion {kind!r}")

    try:
        tree()
        return apply(state, root)
    except (KeyError, IndexError, TypeError, ValueError, RecursionError) as e:
        raise MalformedCheckpointError(f"its Lightning conversion records do not fit its state: {e}", ref=ref,
                                       section="metadata") from None


def _local_path(path) -> str:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise UsageError(f"a checkpoint path must be a str or os.PathLike, not {type(path).__name__}",
                         hint="AgckCheckpointIO reads and writes local files by path")
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if p.startswith("file://"):
        p = p[len("file://"):]
    elif "://" in p:
        raise UsageError("AgckCheckpointIO writes local files only (a durable rename needs a local file system)",
                         ref=p, hint="give ModelCheckpoint a local dirpath, or keep TorchCheckpointIO for "
                         "remote storage")
    return p


def _make_dirs(directory: str) -> None:
    """Create ``directory`` and missing parents, each entry made durable."""
    d = os.path.abspath(directory)
    missing = []
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for m in reversed(missing):
        durable.make_dir(durable.REAL, m, os.path.dirname(m), "checkpoint directory")


def _map_location(m):
    """agck takes None, a device, a dict {saved device: device} or a callable of the
    saved device string; torch.load's ``fn(storage, location)`` has no equivalent."""
    if m is None or isinstance(m, (str, dict)) or not callable(m):
        return m
    try:
        params = [p for p in inspect.signature(m).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return m
    if len(params) >= 2:
        raise UsageError("map_location is a torch.load-style callable (storage, location)",
                         hint="pass a device ('cpu', 'cuda:0'), a dict {'cuda:1': 'cuda:0'}, or a callable "
                         "taking the saved device string and returning a device")
    return m


def _not_agck_hint(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None
    if head == _ZIP_MAGIC:
        return ("this is a torch.save checkpoint (Lightning's default TorchCheckpointIO), not AGCK; agck never "
                "unpickles. If it is from a trusted source, load it with TorchCheckpointIO and save it again "
                "through AgckCheckpointIO")
    return None


class AgckCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing durable, checksummed AGCK containers.

    ``Trainer(plugins=[AgckCheckpointIO()])``. ``mmap=True`` makes loaded tensors
    views of a private copy-on-write mapping of the file instead of a copy read
    into memory; the default reads, so what a run resumed from does not depend on
    the file staying in place (ModelCheckpoint deletes old files)."""

    def __init__(self, *, mmap: bool = False):
        super().__init__()
        self.mmap = bool(mmap)
        self._cleaned: set[str] = set()     # directories whose dead writers' temp files were removed

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        p = _local_path(path)
        if storage_options is not None:
            raise UsageError("storage_options are not supported by AgckCheckpointIO", ref=p,
                             hint="call trainer.save_checkpoint(path) without storage_options")
        if not isinstance(checkpoint, dict):
            raise EncodeError(f"checkpoint: expected a dict, got {type(checkpoint).__name__}", ref=p,
                              hint="Lightning passes a dict; save other objects with agck.save")
        conv = _ToPlain()
        try:
            state = conv.value(checkpoint, ())
        except EncodeError as e:
            raise e.at(p)
        except RecursionError:
            raise EncodeError("checkpoint: nesting too deep", ref=p, hint=_hint_for(())) from None
        epoch, step = checkpoint.get("epoch"), checkpoint.get("global_step")
        version = checkpoint.get("pytorch-lightning_version")
        info = {"format": FORMAT_VERSION, "restore": conv.records,
                "epoch": epoch if type(epoch) is int else None,
                "global_step": step if type(step) is int else None,
                "version": version if type(version) is str else None}
        agck_step = step if type(step) is int and 0 <= step < 2 ** 63 else None
        d = os.path.dirname(p) or "."
        _make_dirs(d)
        if d not in self._cleaned:      # a save a SIGKILL cut short left its temp file: a checkpoint's size each
            self._cleaned.add(d)
            for gone in durable.remove_dead_temps(d):
                log.info("removed %s, left by a save that a crash cut short", gone)
        try:
            _agck_save(p, state, step=agck_step, meta={"lightning": info})
        except EncodeError as e:
            reason = e.reason
            if reason.startswith("state"):
                reason = "checkpoint" + reason[len("state"):]
            keys = _keys_of(reason)
            raise EncodeError(reason, ref=p, hint=e.hint or _hint_for(keys)) from None
        log.debug("saved checkpoint %s", p)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        p = _local_path(path)
        try:
            ck = _agck_load(p, verify=True, mmap=self.mmap, map_location=_map_location(map_location))
        except CorruptCheckpointError as e:
            e.hint = (f"this checkpoint cannot be trusted; resume from the newest one that verifies: "
                      f"trainer.fit(model, ckpt_path=newest_valid_checkpoint({os.path.dirname(p) or '.'!r}))")
            raise
        except FormatError as e:
            hint = _not_agck_hint(p) if type(e) is FormatError else None
            if hint is None:
                raise
            raise FormatError("not an AGCK container", ref=p, hint=hint) from None
        return _lightning_state(ck, p)

    def remove_checkpoint(self, path) -> None:
        p = _local_path(path)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return
        except OSError as e:
            raise DurabilityError(f"cannot remove the checkpoint: {e.strerror}", ref=p,
                                  hint="check the directory's permissions") from None
        if stat.S_ISDIR(st.st_mode):
            raise UsageError("is a directory, not a checkpoint file", ref=p,
                             hint="AgckCheckpointIO writes single files; remove the directory yourself")
        try:
            os.unlink(p)
        except FileNotFoundError:
            return
        except OSError as e:
            raise DurabilityError(f"cannot remove the checkpoint: {e.strerror}", ref=p,
                                  hint="check the directory's permissions; the file is still there") from None
        try:
            durable.REAL.fsync_dir(os.path.dirname(p) or ".")
        except OSError as e:
            raise DurabilityError(f"removed, but fsync of its directory failed: {e.strerror}", ref=p,
                                  hint="the removal may not survive a crash; check the storage") from None
        log.debug("removed checkpoint %s", p)


def _keys_of(reason: str) -> tuple:
    """The first key of a codec error path (``checkpoint['hyper_parameters']['x']``), for its hint."""
    import ast
    out: list = []
    rest = reason[len("checkpoint"):] if reason.startswith("checkpoint") else ""
    while rest.startswith("[") and len(out) < 2:
        end = rest.find("]")
        try:
            out.append(ast.literal_eval(rest[1:end]))
        except (ValueError, SyntaxError):
            break
        rest = rest[end + 1:]
    return tuple(out)


def _lightning_state(ck, ref: str) -> dict:
    state = ck.state
    if type(state) is not dict:
        raise FormatError(f"not a Lightning checkpoint: the container holds a {type(state).__name__}, not a dict",
                          ref=ref, hint="point Lightning at a checkpoint written by AgckCheckpointIO")
    info = ck.meta.get("lightning") if isinstance(ck.meta, dict) else None
    if isinstance(info, dict) and info.get("restore"):
        state = _rebuild(state, info["restore"], ref)
    return state


# --- choosing the checkpoint to resume from -----------------------------------------------

# What scan_checkpoints returns: the walk back's report (``run`` is the directory,
# ``path`` the file chosen, ``rejected`` the newer files passed over, each a
# Rejection with its ``path``), and the name it had for a rejection.
CheckpointScan = Recovery
Rejected = Rejection


def scan_checkpoints(dirpath, pattern: str = "*.ckpt", *, weights_only_ok: bool = False) -> CheckpointScan:
    """Walk the ``pattern`` files of ``dirpath`` from the newest (the time each
    container's header says it was written, so copying a directory does not
    reorder it; the modification time of a file whose header cannot be read; at
    equal times a file before a link to it) and stop at the first that fully verifies and is a Lightning
    checkpoint holding training state (``weights_only_ok=True`` also accepts
    ``save_weights_only`` files, which cannot resume ``fit``).

    A file is passed over, logged with its reason, only on a verdict on its bytes
    (damaged, truncated, not an AGCK container, not a Lightning checkpoint, a
    dangling symlink). Anything else (a missing torch, no permission) is raised:
    it says nothing about the checkpoint."""
    d = _local_path(dirpath)
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        log.info("%s: no such directory; no checkpoint to resume from", d)
        return Recovery(run=d)
    except NotADirectoryError:
        raise UsageError("not a directory", ref=d, hint="pass the ModelCheckpoint dirpath") from None
    except PermissionError:
        raise StoreConnectionError("permission denied", ref=d, hint="check the directory's permissions") from None
    found, orphans = [], []
    for e in entries:
        if durable.is_temp_name(e.name):
            orphans.append(e.path)
            continue
        if not fnmatch.fnmatch(e.name, pattern):
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                continue
            link = e.is_symlink()
            try:
                st, why = os.stat(e.path), None
            except OSError as err:       # dangling or looping link: judged in its turn
                st, why = os.lstat(e.path), f"symlink to {os.readlink(e.path)!r} that cannot be followed: " \
                    f"{err.strerror}"
        except FileNotFoundError:
            continue                     # removed while we looked
        written = _written_at(e.path) if why is None else None
        found.append((st.st_mtime_ns if written is None else written, 0 if link else 1, e.name, e.path, st, why))
    found.sort(reverse=True)
    facts = {path: (st, why) for _, _, _, path, st, why in found}
    judged: dict = {}                    # (dev, inode) -> the verdict: a link and its target judged once

    def judge(c: Candidate) -> str:
        st, why = facts[c.ref]
        if why is None:
            ident = (st.st_dev, st.st_ino)
            if ident not in judged:
                try:
                    judged[ident] = _judge(c.ref, weights_only_ok)
                except AgckError as e:
                    if not e.verdict:
                        raise
                    judged[ident] = (e.reason, getattr(e, "section", None))
            why = judged[ident]
        if why is not None:       # named by the candidate's own path: a link and its target apart
            reason, section = why if isinstance(why, tuple) else (why, None)
            raise Unsuitable(reason, ref=c.ref, section=section)
        return c.ref

    scan = walk_back(d, [Candidate(None, path) for _, _, _, path, _, _ in found], judge, orphans=orphans,
                     on_reject=lambda r: log.warning("%s: passed over, %s", r.path, r.reason))
    if scan.path is not None:
        log.info("%s: newest checkpoint that verifies%s", scan.path,
                 f" ({len(scan.rejected)} newer passed over)" if scan.rejected else "")
    return scan


def _written_at(path: str) -> int | None:
    """The creation time in the container's header (checked by its own XXH3), or None."""
    try:
        with open(path, "rb") as f:
            return format.parse_header(f.read(format.HEADER_SIZE), ref=path).created_at_ns
    except (OSError, AgckError):
        return None      # judged in its turn


def _judge(path: str, weights_only_ok: bool) -> None:
    """Returns if ``path`` verifies and can be resumed from; raises a verdict
    (:class:`agck.recovery.Unsuitable` for a file that verifies but cannot be
    resumed from) or anything that is not one."""
    ck = _agck_load(path, verify=True, mmap=True)
    state = _lightning_state(ck, path)
    ours = isinstance(ck.meta, dict) and isinstance(ck.meta.get("lightning"), dict)
    if not ours and "pytorch-lightning_version" not in state:
        raise Unsuitable("verifies, but is not a Lightning checkpoint", ref=path)
    if not weights_only_ok and "optimizer_states" not in state:
        raise Unsuitable("verifies, but holds weights only (save_weights_only=True): fit cannot resume from it",
                         ref=path)


def newest_valid_checkpoint(dirpath, pattern: str = "*.ckpt", *, strict: bool = True,
                            weights_only_ok: bool = False, clean: bool = True) -> str | None:
    """The path of the newest checkpoint in ``dirpath`` that fully verifies
    (:func:`scan_checkpoints`), for ``trainer.fit(model, ckpt_path=...)``.

    None when the directory is missing or holds no ``pattern`` file (a first run
    starts fresh). When it holds some and none verifies, raises
    :class:`agck.NoValidCheckpointError` (``.report`` is the scan), since starting
    over would silently discard the run; ``strict=False`` returns None instead.
    With ``clean`` (the default) the temp files of saves a crash cut short, whose
    writer no longer runs, are removed first (each logged)."""
    if clean:
        for gone in durable.remove_dead_temps(_local_path(dirpath)):
            log.info("removed %s, left by a save that a crash cut short", gone)
    scan = scan_checkpoints(dirpath, pattern, weights_only_ok=weights_only_ok)
    if scan.path is None and scan.candidates and strict:
        raise NoValidCheckpointError(
            f"none of the {scan.candidates} checkpoint files verifies: "
            + "; ".join(f"{os.path.basename(r.path)}: {r.reason}" for r in scan.rejected[:5])
            + (" ..." if len(scan.rejected) > 5 else ""),
            ref=scan.run, report=scan,
            hint="nothing to resume from: start the run over (strict=False returns None), or restore the "
                 "directory from a backup")
    return scan.path


def load_from_checkpoint(cls, checkpoint_path, map_location=None, strict: bool | None = None, **kwargs):
    """``cls.load_from_checkpoint(path, ...)`` for a file written by :class:`AgckCheckpointIO`
    (Lightning's own reads with ``torch.load``). ``cls`` is a LightningModule or
    LightningDataModule class; ``kwargs`` override saved hyperparameters. Verifies
    every checksum as ``load_checkpoint`` does."""
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    path = _local_path(checkpoint_path)
    if not isinstance(cls, type) or not issubclass(cls, (pl.LightningModule, pl.LightningDataModule)):
        raise UsageError(f"{cls!r} is neither a LightningModule nor a LightningDataModule class", ref=path,
                         hint="pass the class whose checkpoint this is")
    if "hparams_file" in kwargs:
        raise UsageError("hparams_file is not supported: the checkpoint holds its hyperparameters", ref=path,
                         hint="pass the values to override as keyword arguments")
    kwargs.pop("weights_only", None)     # nothing here is unpickled, whatever it says
    checkpoint = AgckCheckpointIO().load_checkpoint(path, map_location=map_location)
    if "pytorch-lightning_version" not in checkpoint:
        raise FormatError("verifies, but is not a Lightning checkpoint (no pytorch-lightning_version)", ref=path,
                          hint="load it with agck.load")
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model if device is None else model.to(device)
