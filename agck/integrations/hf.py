"""Verified, durable checkpoints for Hugging Face ``transformers.Trainer``.

One line to save, one line to resume::

    from agck.integrations.hf import AgckCallback, newest_valid_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[AgckCallback()])   # save
    trainer.train(resume_from_checkpoint=newest_valid_checkpoint(args.output_dir))            # resume

The resume line also starts a fresh run: with no ``checkpoint-*`` directory in
``output_dir`` it returns None. Or use the subclass, which adds the callback
and makes ``resume_from_checkpoint=True`` go through the same check::

    trainer = AgckTrainer(model=model, args=args, train_dataset=ds)
    trainer.train(resume_from_checkpoint=True)

(``AgckTrainerMixin`` does the same for another Trainer class:
``class MyTrainer(AgckTrainerMixin, Seq2SeqTrainer)``.)

Needs ``transformers`` (tested with 5.24.0); ``import agck`` does not import
this module.

Why
---
Trainer writes ``checkpoint-<step>/`` in place, file by file, without fsync, and
``resume_from_checkpoint=True`` takes the directory with the highest step
(``transformers.trainer_utils.get_last_checkpoint``) without looking inside.
A save killed halfway (SIGKILL, OOM kill, power cut) leaves a directory that is
picked anyway: the resume fails, or loads a torn optimizer or RNG state and
carries on silently.

What the manifest guarantees
----------------------------
On every save, after Trainer has written the directory, :class:`AgckCallback`
fsyncs every file in it, every directory below it, the directory itself and
``output_dir`` (so the ``checkpoint-<step>`` entry survives too), then writes
``agck_manifest.agck`` into it: an AGCK container (written atomically and
fsync'd, checksummed itself) listing each file's relative path, size and XXH3-64.
The manifest is written last, so its presence means the whole directory was
durable at that point.

:func:`newest_valid_checkpoint` walks the ``checkpoint-<step>`` directories
from the highest step down and returns the first whose manifest verifies, whose
step matches the directory's, and whose files are exactly those listed (none
missing, none extra), each of the listed size and checksum. It logs every
directory it passes over with the reason (logger ``agck.integrations.hf``);
:func:`scan_checkpoints` returns the same as data. Checking costs one read of
the directory (XXH3 runs at memory speed), at save and at resume.

What it does not guarantee
--------------------------
- The contents are Trainer's. ``optimizer.pt``, ``scheduler.pt``,
  ``rng_state.pth`` and ``training_args.bin`` are torch pickles written by
  Trainer (``torch.save``). agck never unpickles anything: it only hashes their
  bytes. Trainer unpickles the first three on resume, with
  ``torch.load(weights_only=True)`` (torch's restricted unpickler), and in 5.24
  does not read ``training_args.bin`` at all. The manifest proves that these
  are the bytes written at save time, not that a directory from someone else
  is safe to load: it is a checksum, not a signature.
- ``save_total_limit``: Trainer deletes old checkpoints before ``on_save`` runs,
  so the callback cannot stop it. With ``save_total_limit=1`` the previous
  checkpoint is gone before the new one is verified, and a crash in that window
  leaves nothing to resume from (a warning says so at the start of training);
  use 2 or more, 3 or more with ``load_best_model_at_end`` (the best checkpoint
  takes a slot, so with 2 that window leaves only the best).
- One process. With several ranks, files of other ranks may still be in flight
  when rank 0 writes the manifest, so the callback refuses to run there
  (``UsageError``, at ``Trainer(...)``). Hyperparameter search (``run-<trial>/``
  directories) is not covered: the callback refuses it (``UsageError``).
- ``save_strategy="best"`` decides to save after evaluation, when no callback
  runs before the save: a checkpoint directory rewritten in place (the same
  step saved again) keeps its old manifest until the new one is written, which
  the rewritten files fail (sizes and XXH3 are checked), never pass.
- A callback that writes into the checkpoint directory in ``on_save`` after
  this one makes the directory fail verification (an unlisted file): add
  :class:`AgckCallback` last.
- Checkpoints written without the callback have no manifest and are passed over.
  To adopt one you have checked by other means, call :func:`write_manifest` on it.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

try:
    import transformers
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # raised at import of this module only; agck itself never needs transformers
    from ..errors import DependencyError
    raise DependencyError(f"agck.integrations.hf needs transformers, which cannot be imported: {e}",
                          hint="pip install transformers==5.24.0 accelerate==1.15.0") from e

from .. import durable, format, thresholds
from ..checkpoint import load, save
from ..errors import (CorruptCheckpointError, DurabilityError, MalformedCheckpointError,
                      NoValidCheckpointError, StoreConnectionError, UnsupportedVersionError, UsageError)
from ..recovery import Candidate, Recovery, walk_back

logger = logging.getLogger(__name__)

MANIFEST_NAME = "agck_manifest.agck"
KIND = "agck.hf-trainer-checkpoint"
VERSION = 1
_CHECKPOINT_RE = re.compile(r"^" + re.escape(PREFIX_CHECKPOINT_DIR) + r"-(\d+)$")
_READ = thresholds.HF_READ


# --- writing -----------------------------------------------------------------------

def _walk(directory: str) -> tuple[list[str], list[str]]:
    """(files, directories) below ``directory``, relative, '/'-separated, sorted;
    the manifest and agck's temp files (a manifest write cut short) left out."""
    files, dirs = [], []
    for root, dnames, fnames in os.walk(directory, onerror=_raise):
        dnames.sort()
        rel_root = os.path.relpath(root, directory)
        for d in dnames:
            rel = d if rel_root == "." else f"{rel_root}/{d}".replace(os.sep, "/")
            if os.path.islink(os.path.join(root, d)):
                files.append(rel)  # judged as an entry: refused at write, unlisted at verify
            else:
                dirs.append(rel)
        for f in fnames:
            if rel_root == "." and (f == MANIFEST_NAME or durable.is_temp_name(f)):
                continue
            files.append(f if rel_root == "." else f"{rel_root}/{f}".replace(os.sep, "/"))
    return sorted(files), dirs


def _raise(e: OSError) -> None:
    raise e


def _hash_file(path: str, *, sync: bool) -> tuple[int, int]:
    """(size, XXH3-64) of the file's bytes; with ``sync`` also fsync it first, so
    what is hashed is what is on the device."""
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        h = format.new_hasher()
        size = 0
        while True:
            chunk = f.read(_READ)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    return size, h.intdigest()


def _abspath(path: Any, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"{what} must be a path (str or os.PathLike), not {type(path).__name__}")
    return os.path.abspath(os.fspath(path))


def _fsync_dir(path: str) -> None:
    durable.REAL.fsync_dir(path)


def write_manifest(checkpoint_dir: str | os.PathLike, *, step: int | None = None) -> str:
    """Make ``checkpoint_dir`` durable and write its manifest; returns the manifest's path.

    fsyncs every file, every subdirectory, the directory and its parent, then
    writes the manifest atomically (temp file, fsync, rename, fsync). ``step``
    defaults to the number in the directory's name (``checkpoint-<step>``).
    Raises :class:`UsageError` for a directory that is not a checkpoint
    directory or holds something other than files and directories, and
    :class:`DurabilityError` when a file cannot be read or synced."""
    d = _abspath(checkpoint_dir, "checkpoint_dir")
    m = _CHECKPOINT_RE.match(os.path.basename(d))
    if not os.path.isdir(d):
        raise UsageError("not a directory", ref=d, hint="pass the checkpoint-<step> directory Trainer wrote")
    if step is None:
        if m is None:
            raise UsageError(f"the directory name is not {PREFIX_CHECKPOINT_DIR}-<step>", ref=d,
                             hint="pass step= explicitly, or rename it as Trainer names checkpoints")
        step = int(m.group(1))
    if type(step) is not int or step < 0:
        raise UsageError(f"step must be an int >= 0, not {step!r}", ref=d)
    if m is not None and int(m.group(1)) != step:   # verify_checkpoint would always reject it
        raise UsageError(f"step={step} but the directory is named for step {m.group(1)}", ref=d,
                         hint="leave step= out, or pass the step in the directory's name")
    durable.remove_dead_temps(d)       # a manifest write a crash cut short (never the manifest)
    try:
        files, dirs = _walk(d)
        table = []
        for rel in files:
            p = os.path.join(d, rel)
            if os.path.islink(p) or not os.path.isfile(p):
                raise UsageError(f"{rel!r} is not a regular file; the manifest covers regular files only",
                                 ref=d, hint="remove it from the checkpoint directory, then save again")
            size, digest = _hash_file(p, sync=True)
            table.append([rel, size, digest])
        for rel in reversed(dirs):          # deepest first: each entry is durable before its parent's
            _fsync_dir(os.path.join(d, rel))
        _fsync_dir(d)
        _fsync_dir(os.path.dirname(d))      # the checkpoint-<step> entry itself
        _fsync_dir(os.path.dirname(os.path.dirname(d)))   # and output_dir's, made by Trainer just before
    except OSError as e:
        where = e.filename or d
        raise DurabilityError(f"cannot make the checkpoint durable: {e.strerror or e}", ref=os.fspath(where),
                              hint="the checkpoint has no manifest and will not be resumed from; "
                              "fix the storage, the previous verified checkpoint is untouched") from e
    path = os.path.join(d, MANIFEST_NAME)
    state = {"kind": KIND, "version": VERSION, "step": step, "files": table}
    save(path, state, step=step, meta={"kind": KIND, "files": len(table),
                                       "transformers": transformers.__version__})
    return path


def _drop_manifest(checkpoint_dir: str) -> None:
    """Remove a manifest left from an earlier save of this step, durably, before
    Trainer rewrites the directory in place: a crash during the rewrite must not
    leave an old manifest standing over new files."""
    path = os.path.join(checkpoint_dir, MANIFEST_NAME)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise DurabilityError(f"cannot remove the old manifest before the checkpoint is rewritten: "
                              f"{e.strerror}", ref=path, hint="fix the storage and restart training") from e
    try:
        _fsync_dir(checkpoint_dir)
    except OSError as e:
        raise DurabilityError(f"fsync failed: {e.strerror}", ref=checkpoint_dir,
                              hint="fix the storage and restart training") from e


# --- verifying ---------------------------------------------------------------------

def _bad_manifest(msg: str, path: str) -> MalformedCheckpointError:
    return MalformedCheckpointError(msg, ref=path, section="manifest")


def _read_manifest(d: str, step: int | None) -> list[tuple[str, int, int]]:
    path = os.path.join(d, MANIFEST_NAME)
    if not os.path.lexists(path):
        raise CorruptCheckpointError("no manifest: the save did not finish (killed or failed before the "
                                     "directory was made durable), or the directory was written without "
                                     "AgckCallback", ref=d, section="manifest",
                                     hint="an earlier checkpoint is used; write_manifest() adopts a "
                                     "directory you have checked by other means")
    ck = load(path, mmap=False)   # verifies the container's checksums
    s = ck.state
    if type(s) is not dict or s.get("kind") != KIND:
        raise _bad_manifest(f"not a {KIND} manifest", path)
    if type(s.get("version")) is not int:
        raise _bad_manifest("manifest version is not an int", path)
    if s["version"] > VERSION:
        raise UnsupportedVersionError(f"manifest version {s['version']}, this agck reads up to {VERSION}",
                                      ref=path)
    if step is not None and s.get("step") != step:
        raise _bad_manifest(f"the manifest is for step {s.get('step')!r}, the directory for step {step}", path)
    files = s.get("files")
    if type(files) is not list:
        raise _bad_manifest("file table missing", path)
    out = []
    for row in files:
        ok = (type(row) in (list, tuple) and len(row) == 3 and type(row[0]) is str and type(row[1]) is int
              and type(row[2]) is int)
        rel = row[0] if ok else ""
        if not ok or not rel or rel.startswith("/") or "\\" in rel or ".." in rel.split("/") or "\x00" in rel:
            raise _bad_manifest(f"bad file entry {row!r}", path)
        out.append((rel, row[1], row[2]))
    return out


def verify_checkpoint(checkpoint_dir: str | os.PathLike) -> int:
    """Check one ``checkpoint-<step>`` directory against its manifest; returns
    the number of files checked.

    Raises :class:`agck.CorruptCheckpointError` (``section`` ``manifest`` or
    ``file``) or :class:`agck.FormatError` when it does not verify; other
    errors (:class:`StoreConnectionError` for a permission problem,
    :class:`UnsupportedVersionError` for a manifest of a newer agck) say
    nothing about the checkpoint."""
    d = _abspath(checkpoint_dir, "checkpoint_dir")
    m = _CHECKPOINT_RE.match(os.path.basename(d))
    if not os.path.isdir(d):    # a verdict all the same: rotation may delete it while a scan runs
        raise CorruptCheckpointError("the checkpoint directory is not there (deleted, or a wrong path)", ref=d,
                                     section="file")
    try:
        table = _read_manifest(d, int(m.group(1)) if m else None)
        present, _ = _walk(d)
        listed = {rel for rel, _, _ in table}
        extra = [rel for rel in present if rel not in listed]
        if extra:
            raise CorruptCheckpointError(f"{extra[0]!r} is in the directory but not in the manifest "
                                         f"({len(extra)} such): written after the save, or left from "
                                         "an earlier one", ref=d, section="file")
        for rel, size, _ in table:   # sizes first: a truncated file is found without hashing anything
            p = os.path.join(d, rel)
            if os.path.islink(p) or not os.path.isfile(p):
                raise CorruptCheckpointError(f"{rel!r} is missing", ref=d, section="file")
            got = os.path.getsize(p)
            if got != size:
                raise CorruptCheckpointError(f"{rel!r} is {got} bytes, the manifest says {size} "
                                             "(truncated or rewritten after the save)", ref=d, section="file")
        for rel, size, digest in table:
            got_size, got = _hash_file(os.path.join(d, rel), sync=False)
            if got_size != size or got != digest:
                raise CorruptCheckpointError(f"{rel!r} checksum mismatch (XXH3 {got:016x}, the manifest "
                                             f"says {digest:016x}): its bytes changed after the save",
                                             ref=d, section="file")
    except PermissionError as e:
        raise StoreConnectionError(f"permission denied: {e.filename}", ref=d,
                                   hint="check the permissions; the checkpoint itself was not judged") from None
    except OSError as e:   # a file that vanished or cannot be read is a verdict on the checkpoint
        raise CorruptCheckpointError(f"cannot read {e.filename or d}: {e.strerror or e}", ref=d,
                                     section="file") from None
    return len(table)


# What scan_checkpoints returns: the walk back's report (``run`` is the output
# directory, ``path`` the checkpoint directory chosen, ``rejected`` the newer ones).
CheckpointScan = Recovery


def _candidates(output_dir: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise UsageError("not a directory", ref=output_dir, hint="pass TrainingArguments.output_dir") from None
    except PermissionError:
        raise StoreConnectionError("permission denied", ref=output_dir, hint="check the permissions") from None
    out = []
    for n in names:
        m = _CHECKPOINT_RE.match(n)
        if m and os.path.isdir(os.path.join(output_dir, n)):
            out.append((int(m.group(1)), os.path.join(output_dir, n)))
    out.sort(reverse=True)
    return out


def scan_checkpoints(output_dir: str | os.PathLike) -> Recovery:
    """Walk ``output_dir``'s ``checkpoint-<step>`` directories from the highest
    step down to the first that verifies (:func:`verify_checkpoint`), logging
    each one passed over with its reason (:func:`agck.recovery.walk_back`).
    Raises whatever is not a verdict on a checkpoint (a permission problem, a
    manifest of a newer agck): walking past those could resume from an older
    state for no reason."""
    out = _abspath(output_dir, "output_dir")
    scan = walk_back(out, [Candidate(step, path) for step, path in _candidates(out)],
                     lambda c: verify_checkpoint(c.ref),
                     on_reject=lambda r: logger.warning("agck: not resuming from %s: %s", r.ref, r.reason))
    if scan.path is not None and scan.rejected:
        logger.warning("agck: resuming from %s, the newest checkpoint that verifies (%d newer passed over)",
                       scan.path, len(scan.rejected))
    return scan


def newest_valid_checkpoint(output_dir: str | os.PathLike, *, strict: bool = True) -> str | None:
    """The newest ``checkpoint-<step>`` directory of ``output_dir`` that
    verifies, for ``trainer.train(resume_from_checkpoint=...)``.

    None when there is no checkpoint directory at all (a fresh run: Trainer
    then starts from scratch). When there are some but none verifies, raises
    :class:`agck.NoValidCheckpointError` (its ``report`` is the
    :class:`CheckpointScan`): starting over would overwrite them, so that is
    left to you; with ``strict=False`` returns None instead."""
    scan = scan_checkpoints(output_dir)
    if scan.path is None and scan.candidates and strict:
        first = scan.rejected[0]
        raise NoValidCheckpointError(
            f"none of the {scan.candidates} checkpoint directories verifies (newest, step {first.step}: "
            f"{first.reason})", ref=scan.run, report=scan,
            hint="see the log for every reason; to start over, move them away or pass strict=False; "
            "directories written without AgckCallback can be adopted with write_manifest()")
    return scan.path


# --- the Trainer hooks -------------------------------------------------------------

class AgckCallback(TrainerCallback):
    """Writes a verified manifest into every checkpoint directory Trainer saves.

    ``trainer = Trainer(..., callbacks=[AgckCallback()])``, or
    ``trainer.add_callback(AgckCallback())``. Add it after any callback that
    writes into the checkpoint directory."""

    def on_init_end(self, args, state, control, **kwargs):
        self._check_world(args)     # at Trainer(...): before a resume loads anything

    def on_train_begin(self, args, state, control, **kwargs):
        self._check_world(args)     # again for a callback added after Trainer(...)
        if state.trial_name is not None or state.trial_params is not None:
            raise UsageError("AgckCallback does not cover hyperparameter search: its trials save to "
                             "run-<trial>/checkpoint-<step>, which the callback does not follow",
                             ref=args.output_dir, hint="remove AgckCallback for the search; add it to the final "
                             "training run")
        if args.save_total_limit == 1 or (args.save_total_limit == 2 and args.load_best_model_at_end):
            logger.warning("agck: save_total_limit=%d%s: Trainer deletes the previous checkpoint before the "
                           "new one is verified, so a crash during a save leaves %s to resume from; use "
                           "save_total_limit=%d or more", args.save_total_limit,
                           " with load_best_model_at_end (the best checkpoint takes a slot)"
                           if args.save_total_limit == 2 else "",
                           "only the best checkpoint" if args.save_total_limit == 2 else "nothing",
                           args.save_total_limit + 1)

    @staticmethod
    def _check_world(args) -> None:
        if args.world_size > 1:
            raise UsageError(f"AgckCallback verifies single-process checkpoints; this run has "
                             f"{args.world_size} processes", ref=args.output_dir,
                             hint="train in one process, or remove AgckCallback (files of other ranks may "
                             "still be in flight when the manifest would be written)")

    def _about_to_save(self, args, state, control) -> None:
        if control.should_save and state.is_world_process_zero:
            _drop_manifest(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def on_step_end(self, args, state, control, **kwargs):
        self._about_to_save(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._about_to_save(args, state, control)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        d = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(d):
            raise UsageError("Trainer reported a save but the checkpoint directory is not there", ref=d,
                             hint="AgckCallback covers checkpoints in TrainingArguments.output_dir, "
                             "not hyperparameter-search runs")
        write_manifest(d, step=state.global_step)


class AgckTrainerMixin:
    """Adds :class:`AgckCallback` to a Trainer class, and resolves
    ``train(resume_from_checkpoint=True)`` with :func:`newest_valid_checkpoint`
    (Trainer's own choice, ``get_last_checkpoint``, is the highest step, unchecked)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        if not any(isinstance(cb, AgckCallback) for cb in self.callback_handler.callbacks):
            self.add_callback(AgckCallback())

    def train(self, resume_from_checkpoint=None, *a, **kw):
        """``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the newest checkpoint that verifies."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_valid_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:   # as Trainer does when asked to resume from nothing
                raise NoValidCheckpointError("resume_from_checkpoint=True but there is no checkpoint directory",
                                             ref=os.path.abspath(self.args.output_dir),
                                             hint="check output_dir, or call train() without resuming")
        return super().train(resume_from_checkpoint, *a, **kw)


class AgckTrainer(AgckTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`AgckTrainerMixin`."""


__all__ = ["AgckCallback", "AgckTrainer", "AgckTrainerMixin", "CheckpointScan", "MANIFEST_NAME",
           "newest_valid_checkpoint", "scan_checkpoints", "verify_checkpoint", "write_manifest"]
