"""Periodic snapshots of a running pipeline, and bit-exact resume.

Two forms over one engine, :class:`Snapshotter`:

    @checkpoint_every(10, store="ckpts/", run="doc-pipeline")
    def step(state, i):
        ...
        return state

    for i in range(total):          # unchanged user loop: after a crash, the
        state = step(state, i)      # steps already checkpointed are skipped
    step.close()                    # checkpoints the last step, flushes

and the loop form::

    with Snapshotter("ckpts/", "doc-pipeline", every=10) as snap:
        state = snap.restore(state)
        for i in snap.steps(total):
            ...
            snap.update(state)

A checkpoint at step ``k`` holds the state after ``k`` completed steps, the RNG
states, and a fingerprint of the software and hardware. Capture happens at a
step boundary and is by value: in async mode every mutable part of the state
(containers, sets, bytearrays, arrays, tensors, state_dict() results) is copied
there, the tensors into reusable staging buffers (pinned host memory for CUDA
tensors, one synchronization per device), and encoding plus the durable write
run on a background thread; at most ``max_in_flight`` (1-64) snapshots are
pending (backpressure). A failed write is raised on the next step or at close,
never swallowed, naming its step and the steps queued behind it that were not
written; an exception of ``on_durable`` is raised as a ``SnapshotError`` that
says the checkpoint itself is durable.

What a SIGKILL loses: the steps completed since ``last_durable_step``, and
nothing else.
"""

from __future__ import annotations

import atexit
import collections
import copy
import ctypes
import functools
import inspect
import logging
import math
import numbers
import os
import platform
import queue
import random
import signal
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator

try:
    import resource
except ImportError:  # pragma: no cover (not on Windows)
    resource = None

import numpy as np

from . import chunking, failpoints
from .codec import encode_plain, plain_packed
from .errors import AgckError, ContentChangedError, SnapshotError, UsageError
from .names import check_run, check_step
from .distributed import Group, ShardedRun, active as dist_active
from .recovery import Recovery, recover_run
from .sharded import is_commit
from .stores import Store, open_store
from .version import __version__

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

log = logging.getLogger("agck")

TAG = "__agck__"   # marks a captured object inside the saved tree


class FingerprintWarning(UserWarning):
    """Resuming under different software or hardware: bit-exactness may not hold."""


def fingerprint() -> dict:
    fp = {"agck": __version__, "python": platform.python_version(), "numpy": np.__version__,
          "machine": platform.machine()}
    if torch is not None:
        fp["torch"] = torch.__version__
        fp["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            fp["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            try:
                fp["driver"] = ".".join(map(str, torch.cuda.driver_version())) \
                    if hasattr(torch.cuda, "driver_version") else None
            except Exception:  # driver query is best effort
                fp["driver"] = None
    return fp


# --- capture and restore ----------------------------------------------------------

def _stateful(x) -> bool:
    return (callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))
            and not isinstance(x, (dict, list, tuple)))


def capture(x: Any) -> Any:
    """The user's state as a tree the codec takes: objects with state_dict()
    (modules, optimizers, schedulers, GradScaler) become tagged dicts of their
    state_dict; RNG generators become tagged dicts of their state. Plain data
    (what msgpack packs as is) is returned as it is, checked in C, not walked."""
    t = type(x)
    if t in _ATOMS or t is np.ndarray or t in _TENSOR_TYPES:
        return x
    if (t is list or t is dict) and len(x) >= _PLAIN_CHECK_MIN:
        if plain_packed(x) is not None:
            return x
        if t is list and all(map(_PASSED.__contains__, map(type, x))):   # a list of tensors, checked in C
            return x
    if isinstance(x, dict):
        return {k: capture(v) for k, v in x.items()}
    if t is list:
        return [capture(v) for v in x]
    if type(x) is tuple:
        return tuple(capture(v) for v in x)
    if isinstance(x, np.random.Generator):
        return {TAG: "np.Generator", "state": x.bit_generator.state}
    if isinstance(x, random.Random):
        return {TAG: "random.Random", "state": x.getstate()}
    if torch is not None and isinstance(x, torch.Generator):
        return {TAG: "torch.Generator", "state": x.get_state(), "device": str(x.device)}
    if torch is not None and isinstance(x, torch.Tensor):
        if _is_dtensor(x):
            # this rank's shard: what the rank owns and restores in place (no resharding)
            return {TAG: "dtensor", "local": x.to_local(), "shape": list(x.shape),
                    "placements": [str(p) for p in x.placements], "mesh": list(x.device_mesh.shape)}
        return x
    if _stateful(x):
        sd = x.state_dict()
        dtensor = _dtensor_class()
        if dtensor is not None and any(isinstance(v, dtensor) for v in _leaves(sd)):
            sd = capture(sd)      # sharded parameters and optimizer state (FSDP2): their local shards
        return {TAG: "stateful", "type": f"{type(x).__module__}.{type(x).__qualname__}", "state": sd}
    return x


def _dtensor_class():
    """DTensor, or None while torch.distributed.tensor is not imported (then there are none:
    no import, no walk)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor
    return DTensor


def _is_dtensor(x) -> bool:
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(x, dtensor)


def _leaves(x):
    stack = [x]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            yield v


def _has_tag(x, kind: str) -> bool:
    return any(isinstance(v, dict) and v.get(TAG) == kind for v in _walk_dicts(x))


def _walk_dicts(x):
    stack = [x]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            yield v
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _restore_dtensor(live, saved: dict):
    """A DTensor's local shard, copied back in place; refused when the live DTensor is
    laid out otherwise (another shape, placement or mesh: that needs resharding)."""
    if not _is_dtensor(live):
        raise AgckError(f"the checkpoint holds a DTensor shard but the live state has {type(live).__name__} "
                        "there", hint="pass the same state structure on resume")
    now = {"shape": list(live.shape), "placements": [str(p) for p in live.placements],
           "mesh": list(live.device_mesh.shape)}
    was = {k: saved.get(k) for k in now}
    if now != was:
        raise UsageError(f"a DTensor was saved as {was} and is now {now}: a snapshot restores each rank's own "
                         "shard and cannot reshard it",
                         hint="resume with the same mesh and placements, or save it through agck.dcp")
    local = live.to_local()
    src = saved["local"]
    if tuple(src.shape) != tuple(local.shape):
        raise UsageError(f"this rank's DTensor shard is {tuple(local.shape)}, the saved one "
                         f"{tuple(src.shape)}", hint="resume with the same world size and mesh")
    with torch.no_grad():
        local.copy_(src)
    return live


_PLAIN_CHECK_MIN = 32


def restore_into(live: Any, saved: Any) -> Any:
    """Merge a loaded tree into the user's live state. Stateful objects and
    generators are restored in place; dicts are updated in place; anything
    else is replaced by the saved value. Returns the restored state."""
    if isinstance(saved, dict) and TAG in saved:
        kind = saved[TAG]
        if kind == "stateful" and live is not None and _stateful(live):
            state = saved["state"]
            if _has_tag(state, "dtensor"):
                # sharded state: copy each shard into the live state_dict's DTensors, then load that
                state = restore_into(live.state_dict(), state)
            live.load_state_dict(state)
            return live
        if kind == "dtensor":
            return _restore_dtensor(live, saved)
        if kind == "np.Generator":
            g = live if isinstance(live, np.random.Generator) else np.random.default_rng()
            g.bit_generator.state = saved["state"]
            return g
        if kind == "random.Random":
            g = live if isinstance(live, random.Random) else random.Random()
            g.setstate(saved["state"])
            return g
        if kind == "torch.Generator" and torch is not None:
            g = live if isinstance(live, torch.Generator) else torch.Generator(device=saved.get("device", "cpu"))
            g.set_state(saved["state"])
            return g
        if kind == "stateful":
            raise AgckError(f"the checkpoint holds the state of a {saved.get('type')} but the live state has "
                            f"{type(live).__name__} there", hint="pass the same state structure on resume")
    if torch is not None and isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor):
        return saved.to(live.device) if saved.device != live.device else saved
    if isinstance(saved, dict) and isinstance(live, dict):
        for k in list(live.keys()):
            if k not in saved:
                del live[k]
        for k, v in saved.items():
            live[k] = restore_into(live.get(k), v)
        return live
    if type(saved) is list and type(live) is list and len(saved) == len(live):
        live[:] = [restore_into(a, b) for a, b in zip(live, saved)]
        return live
    if type(saved) is tuple and type(live) is tuple and len(saved) == len(live):
        return tuple(restore_into(a, b) for a, b in zip(live, saved))
    return _plain(saved)


def _plain(x):
    """A saved subtree with no live counterpart: rebuild tagged objects fresh."""
    if isinstance(x, dict):
        if TAG in x:
            return restore_into(None, x)
        return {k: _plain(v) for k, v in x.items()}
    if type(x) is list:
        return [_plain(v) for v in x]
    if type(x) is tuple:
        return tuple(_plain(v) for v in x)
    return x


def rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state()}
    if torch is not None:
        st["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    if "python" in st:
        random.setstate(st["python"])
    if "numpy" in st:
        np.random.set_state(st["numpy"])
    if torch is not None:
        if "torch" in st:
            torch.set_rng_state(st["torch"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])


class _Stager:
    """Reusable host buffers that hold a copy of the state's tensors between the
    step boundary and the end of the background write.

    Tensors are matched to buffers by their position in the tree walk, dtype
    and shape, so a steady pipeline allocates once; a buffer that no tensor
    matched in the last staging is let go. CUDA tensors go to pinned memory
    with non_blocking copies and one synchronization at the end. The same
    tensor object appearing twice (tied weights) is copied once.

    :meth:`plan` walks a tree as :meth:`stage` would and lists the buffers the
    pool lacks, copying nothing; :meth:`make` allocates them (on the writer
    thread, before the first snapshot, so the pipeline does not wait for a
    fresh gigabyte's page faults at its first checkpoint)."""

    def __init__(self):
        self.pool: dict[tuple, Any] = {}
        self.dry = False
        self.seen: dict | None = None

    def stage(self, tree: Any, seen: dict | None = None) -> Any:
        """Copy ``tree``'s tensors into staging buffers. With ``seen`` (what
        :attr:`now` was at the last staging whose snapshot is durable), a CPU tensor
        of ``LARGE_PART`` bytes or more that is the same object with the same
        version counter, memory and layout as then is not copied: it goes into the
        tree as itself, its address into :attr:`referenced`, and the store confirms
        its bytes against that snapshot while it writes (``expect_unchanged``)."""
        self.memo: dict[int, Any] = {}
        self.n = 0
        self.cuda: set = set()      # the devices whose copies into pinned memory are in flight
        self.used: set = set()
        self.seen = seen
        self.now: dict[int, tuple] = {}
        self.referenced: set[int] = set()
        self.referenced_bytes = 0
        out = self._walk(tree)
        self.seen = None
        for device in self.cuda:    # synchronize() alone waits for the current device only
            torch.cuda.synchronize(device)
        del self.memo
        if len(self.used) != len(self.pool):
            self.pool = {k: v for k, v in self.pool.items() if k in self.used}
        return out

    def plan(self, tree: Any) -> list[tuple[tuple, Callable[[], Any]]]:
        self.memo, self.n, self.cuda, self.used, self.missing = {}, 0, set(), set(), []
        self.dry = True
        try:
            self._walk(tree)
            return self.missing
        finally:
            self.dry = False
            del self.memo, self.missing

    def make(self, missing, cancelled: Callable[[], bool] = lambda: False) -> None:
        for key, make in missing:
            if cancelled():
                return
            if key not in self.pool:
                self.pool[key] = make()

    def _buffer(self, key, make):
        self.used.add(key)
        buf = self.pool.get(key)
        if buf is None:
            buf = self.pool[key] = make()
        return buf

    def _walk(self, x):
        t = type(x)
        if t in _ATOMS:
            return x
        if isinstance(x, dict):  # dict subclasses too; the codec saves them as dict
            return {self._walk(k): self._walk(v) for k, v in x.items()}
        if t is list:
            return [self._walk(v) for v in x]
        if t is tuple:  # immutable, but may hold mutable items
            return tuple(self._walk(v) for v in x)
        if t is set:
            return {self._walk(v) for v in x}
        if t is frozenset:  # may hold tensors
            return frozenset(self._walk(v) for v in x)
        if isinstance(x, (bytearray, memoryview)):  # the codec saves both as bytes
            return x if self.dry else bytes(x)
        if t is np.ndarray or t is np.memmap:
            hit = self.memo.get(id(x))
            if hit is not None:
                return hit
            self.n += 1
            key = (self.n, "np", x.dtype.str, x.shape)
            if self.dry:
                if key not in self.pool:
                    self.missing.append((key, functools.partial(_host_array, x.shape, x.dtype, True)))
                self.memo[id(x)] = x
                return x
            buf = self._buffer(key, lambda: _host_array(x.shape, x.dtype))
            np.copyto(buf, x)
            self.memo[id(x)] = buf
            return buf
        if torch is not None and _stageable(x):
            hit = self.memo.get(id(x))
            if hit is not None:
                return hit
            self.n += 1
            pin = x.device.type == "cuda"
            key = (self.n, "pt", x.dtype, tuple(x.shape), pin)
            if self.dry:
                if key not in self.pool:
                    self.missing.append((key, functools.partial(_host_tensor, tuple(x.shape), x.dtype, pin, True)))
                self.memo[id(x)] = x
                return x
            if self.seen is not None and not pin and _referable(x):
                sig = _version_signature(x)
                if sig is not None:
                    self.now[id(x)] = (weakref.ref(x), sig)
                    last = self.seen.get(id(x))
                    if last is not None and last[0]() is x and last[1] == sig:
                        self.used.add(key)       # its buffer stays for when it changes
                        self.referenced.add(x.data_ptr())
                        self.referenced_bytes += x.nbytes
                        self.memo[id(x)] = x
                        return x
            buf = self._buffer(key, lambda: _host_tensor(x.shape, x.dtype, pin))
            src = x.detach()
            if src.is_conj():
                src = src.resolve_conj()
            buf.copy_(src, non_blocking=pin)
            if pin:
                self.cuda.add(x.device)
            out = buf
            if isinstance(x, torch.nn.Parameter) or x.requires_grad:
                # keep what the codec records (Parameter, requires_grad, device) without copying again
                out = _with_flags_of(buf, x)
            self.memo[id(x)] = out
            return out
        # Immutable, or a value the codec refuses (array or tensor subclasses, sparse
        # tensors): a plain copy here would save what sync mode refuses.
        return x


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_TENSOR_TYPES = frozenset() if torch is None else frozenset({torch.Tensor, torch.nn.Parameter})
_PASSED = _ATOMS | _TENSOR_TYPES | {np.ndarray}     # what capture() returns as it is


# Staging buffers are plain host memory (pinned for CUDA tensors). Made ahead of
# the first snapshot (Snapshotter._prepare_staging), their pages are touched on
# the writer thread, so the first staging copy does not fault them in while the
# pipeline waits. Not huge pages: on a VM that hands free memory back to its
# host, a fresh 2 MiB page costs the host far more than the 4 KiB faults saved.
_TOUCH_MIN = 1 << 20


def _host_array(shape, dtype, touch: bool = False) -> np.ndarray:
    buf = np.empty(shape, dtype)
    if touch and buf.nbytes >= _TOUCH_MIN and not dtype.hasobject:
        buf.reshape(-1).view(np.uint8).fill(0)
    return buf


def _host_tensor(shape, dtype, pin: bool, touch: bool = False):
    if not touch or pin:   # pinned memory is resident once allocated
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    n = math.prod(shape) * dtype.itemsize
    if n < _TOUCH_MIN:
        return torch.empty(shape, dtype=dtype)
    return torch.zeros(n, dtype=torch.uint8).view(dtype).view(shape)


def _stageable(x) -> bool:
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided and not x.is_nested
            and not x.is_quantized and x.device.type != "meta")


def _referable(x) -> bool:
    """A tensor that can go into a snapshot uncopied: its memory is exactly its bytes
    (contiguous, the whole of its storage), large enough to be a chunked piece of
    its own, so the store can confirm it as a whole (``expect_unchanged``)."""
    if x.device.type != "cpu" or x.is_conj() or x.is_neg() or not x.is_contiguous() or x.storage_offset():
        return False
    n = x.numel() * x.element_size()
    return n >= chunking.LARGE_PART and x.untyped_storage().nbytes() == n


def _version_signature(x) -> tuple | None:
    """What changes when a tensor's bytes may have: autograd's version counter (every
    in-place op, ``optimizer.step()``, ``load_state_dict``), its memory and layout.
    Not sound alone (``.data`` and numpy views write without it), hence confirmed."""
    try:
        return (x._version, x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
    except RuntimeError:     # inference tensors keep no version counter
        return None


def _with_flags_of(buf, src):
    """The staged buffer, marked as the codec must record it: Parameter, requires_grad."""
    t = buf.detach()
    if isinstance(src, torch.nn.Parameter):
        return torch.nn.Parameter(t, requires_grad=src.requires_grad)
    return t.requires_grad_(True) if src.requires_grad else t


# --- the background writer's priority -------------------------------------------

# The writer runs beside the pipeline and is never what the pipeline waits for,
# except at backpressure or close. Its I/O goes at the lowest best-effort I/O
# priority (honoured by the bfq and mq-deadline schedulers), so the pipeline's
# own reads come first. Its CPU priority is left alone by default
# (WRITER_NICE = 0): the writer shares the GIL with the pipeline, and a
# low-priority thread preempted while it holds the GIL stalls the pipeline
# until it runs again; on a busy machine that cost more than it saved.
WRITER_NICE = 0
WRITER_IDLE_IO = True
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_SYSCALL = {"x86_64": 251, "aarch64": 30, "arm64": 30, "riscv64": 30, "ppc64le": 273, "s390x": 282}


def _yield_to_pipeline() -> None:
    """Lower this thread's I/O priority (and its CPU priority by WRITER_NICE);
    on Linux both are per thread. Best effort: a refusal changes nothing."""
    if not platform.system() == "Linux":
        return  # elsewhere a thread id passed as a pid could name another process
    tid = threading.get_native_id()
    if WRITER_NICE:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
        except (OSError, AttributeError):
            pass
    nr = _IOPRIO_SYSCALL.get(platform.machine())
    if nr is not None and WRITER_IDLE_IO:
        try:
            ctypes.CDLL(None, use_errno=True).syscall(nr, _IOPRIO_WHO_PROCESS, tid, (_IOPRIO_CLASS_BE << 13) | 7)
        except (OSError, AttributeError):
            pass


def _thread_cpu() -> tuple[float, float | None]:
    """(user, system) CPU seconds of the calling thread; system is None where
    only the sum is available."""
    if resource is not None and hasattr(resource, "RUSAGE_THREAD"):
        r = resource.getrusage(resource.RUSAGE_THREAD)
        return r.ru_utime, r.ru_stime
    return time.thread_time(), None


# --- the engine -------------------------------------------------------------------

class _Signals:
    """SIGTERM and SIGINT while snapshotters are open: one handler, which passes the
    signal to the newest open one. The handlers found before the first are put back
    when the last closes, whatever order they close in (each keeping its own
    predecessor's would leave a closed one's handler installed)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    owners: list = []       # open snapshotters, newest last
    saved: dict = {}        # signal -> the handler before the first owner

    @classmethod
    def add(cls, snap) -> None:
        if not cls.owners:
            for sig in cls.SIGNALS:
                try:
                    cls.saved[sig] = signal.signal(sig, cls.dispatch)
                except (ValueError, OSError):
                    pass
        cls.owners.append(snap)

    @classmethod
    def remove(cls, snap) -> None:
        if snap in cls.owners:
            cls.owners.remove(snap)
            if not cls.owners:
                cls.restore_all()

    @classmethod
    def restore_all(cls) -> None:
        cls.owners.clear()
        for sig, old in cls.saved.items():
            try:
                if signal.getsignal(sig) == cls.dispatch:    # not one installed after ours
                    signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        cls.saved.clear()

    @classmethod
    def dispatch(cls, signum, frame) -> None:
        if cls.owners:
            cls.owners[-1]._on_signal(signum, frame)
        else:      # all closed in the meantime: as if we had never been here
            cls.restore_all()
            signal.raise_signal(signum)


def _count(value: Any, name: str) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise UsageError(f"{name} must be a positive integer, not {value!r}")


MAX_IN_FLIGHT = 64     # each slot holds a staged copy of the whole state


def _in_flight(value: Any) -> int:
    n = _count(value, "max_in_flight")
    if n > MAX_IN_FLIGHT:
        raise UsageError(f"max_in_flight must be at most {MAX_IN_FLIGHT}, not {value!r}",
                         hint="each pending snapshot holds a staged copy of the whole state")
    return n


def _options(every: int, *, resume: bool = True, mode: str = "auto", max_in_flight: int = 1,
             on_durable: Callable[[int, str], Any] | None = None, meta: Any = None,
             handle_signals: bool = True, capture_rng: bool = True, distributed: bool | None = None) -> dict:
    """The Snapshotter's options, checked and normalized before anything is opened."""
    if not isinstance(mode, str) or mode not in ("auto", "async", "sync"):
        raise UsageError(f"mode must be 'auto', 'async' or 'sync', not {mode!r}")
    for name, flag in (("resume", resume), ("handle_signals", handle_signals), ("capture_rng", capture_rng)):
        if not isinstance(flag, bool):
            raise UsageError(f"{name} must be True or False, not {flag!r}")
    if distributed is not None and not isinstance(distributed, bool):
        raise UsageError(f"distributed must be True, False or None, not {distributed!r}")
    if on_durable is not None and not callable(on_durable):
        raise UsageError(f"on_durable must be callable or None, not {on_durable!r}")
    # Checked here, not in the background write, nested as snapshot() writes it (the
    # checkpoint's meta['user']); copied, so later edits cannot reach a checkpoint.
    encode_plain({"fingerprint": None, "user": meta, "snapshot": True}, "meta")
    meta = copy.deepcopy(meta)
    return {"every": _count(every, "every"), "resume": resume, "mode": mode,
            "max_in_flight": _in_flight(max_in_flight), "on_durable": on_durable, "meta": meta,
            "handle_signals": handle_signals, "capture_rng": capture_rng, "distributed": distributed}


_OPTION_NAMES = frozenset(inspect.signature(_options).parameters) - {"every"}


class Snapshotter:
    """Checkpoints a pipeline's state every ``every`` steps into ``store``.

    ``mode``: ``"async"`` (stage and persist in the background), ``"sync"``
    (persist before returning), or ``"auto"`` (async when the state holds CUDA
    tensors, else sync). ``on_durable(step, ref)`` is called once a checkpoint is
    durable. ``resume=False`` deletes the run's existing checkpoints before the
    first new one is written, so a later crash can never resume into the old run.
    ``meta`` (plain data, checked and copied here) goes into every checkpoint as
    its ``meta['user']``.

    ``distributed``: under torch.distributed (None, the default: whenever a default
    process group of more than one rank is initialized), every rank makes its own
    Snapshotter of the same run at the same point of its program, each rank's state
    is written as its own part in parallel, and a step becomes visible only when
    every part is durable, through one commit record (README, "Multi-rank
    checkpoints"). Restore then takes the newest step whose every part verifies,
    on every rank alike. A signal does not add an out-of-cadence checkpoint there
    (the ranks would not agree on its step): pending ones are flushed and the
    process exits.

    Arguments are checked before the store is opened: a bad one raises
    :class:`UsageError` naming it (a bad run name :class:`InvalidRunNameError`,
    unencodable meta :class:`EncodeError`). After :meth:`close`, every method
    but ``close`` and ``flush`` raises :class:`UsageError`.
    """

    def __init__(self, store: Store | str, run: str, *, every: int = 10, resume: bool = True,
                 mode: str = "auto", max_in_flight: int = 1, on_durable: Callable[[int, str], Any] | None = None,
                 meta: Any = None, handle_signals: bool = True, capture_rng: bool = True,
                 distributed: bool | None = None):
        opts = _options(every, resume=resume, mode=mode, max_in_flight=max_in_flight, on_durable=on_durable,
                        meta=meta, handle_signals=handle_signals, capture_rng=capture_rng, distributed=distributed)
        self.run = check_run(run)
        self._own_store = not isinstance(store, Store)
        self.store = open_store(store)
        self.every = opts["every"]
        self.resume = resume
        self.mode = mode
        self.max_in_flight = opts["max_in_flight"]
        self.on_durable = on_durable
        self.meta = opts["meta"]
        self.capture_rng = capture_rng
        self.start_step = 0
        self.last_durable_step: int | None = None
        self.last_durable_ref: str | None = None
        self.recovery = None
        self.blocked_seconds: list[float] = []   # time the pipeline waited per snapshot
        # per persisted snapshot, newest last: step, thread, start/end (perf_counter), and the
        # CPU seconds (user, system) of the thread that encoded and wrote it
        self.write_stats: collections.deque = collections.deque(maxlen=10_000)
        self.prepare_stats: dict | None = None   # the same for making the staging buffers ahead
        self._state: Any = None
        self._restored = False
        self._started_over = False
        self._taken: int | None = None            # the step of the newest snapshot taken (durable or pending)
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._stagers: list[_Stager] = []
        self._free_stagers: queue.Queue | None = None
        self._pending = 0
        self._cv = threading.Condition()
        self._closed = False
        self._stop_signal: int | None = None
        self._error_step: int | None = None
        self._failed = 0           # background writes that failed (the writer's count)
        self._raised = 0           # of those, raised in the pipeline's thread
        self._skipped: list[int] = []             # steps queued behind a failed write, not written
        self._async: bool | None = None if mode == "auto" else mode == "async"
        self._fingerprint: dict | None = None
        self._prepared = False                    # staging buffers made ahead of the first snapshot
        # the large CPU tensors of the last durable async snapshot, by id: (weakref, version signature)
        self._seen: dict[int, tuple] = {}
        self.dropped_steps: list[int] = []        # snapshots not written: a tensor taken uncopied changed
        self.epoch: int | None = None              # this incarnation of the run (_incarnate)
        # under torch.distributed: this rank's side of the run's collective checkpoints
        self._dist: ShardedRun | None = None
        if distributed or (distributed is None and dist_active()):
            self._dist = ShardedRun(self.store, self.run, Group())
        if handle_signals:
            self._install_signals()
        atexit.register(self._close_at_exit)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"the snapshotter of run {self.run!r} is closed",
                             hint="create a new Snapshotter to continue the run")

    # -- resume ----------------------------------------------------------------
    def restore(self, state: Any = None) -> Any:
        """Restore the run's last valid checkpoint into ``state`` (in place for
        modules, optimizers and dicts) and set ``start_step``. On a fresh run,
        or with ``resume=False``, returns ``state`` unchanged.

        Raises :class:`UsageError` if the newest valid checkpoint of the run was
        not written by a snapshotter (a plain ``store.put``): it holds no step
        boundary state to resume from, and the run is left as it is."""
        self._check_open()
        self._restored = True
        self._incarnate()
        if not self.resume:
            self._start_over()
            self._state = state
            return state
        if self._dist is not None:
            commit, ck, rejected, candidates = self._dist.find()
            self.recovery = Recovery(run=self.run, checkpoint=ck, rejected=rejected, candidates=candidates)
            meta_source = commit
        else:
            self.recovery = recover_run(self.store, self.run)
            ck = meta_source = self.recovery.checkpoint
            if ck is not None and is_commit(ck):
                raise UsageError(f"run {self.run!r} step {ck.step} was checkpointed under torch.distributed "
                                 f"with world size {next(iter(ck.state.values()))['world_size']}, and this "
                                 "process runs alone (world size 1): a snapshot's per-rank state (its values and "
                                 "RNG states) cannot be resharded", ref=ck.ref,
                                 hint="restore it under torch.distributed with the same world size")
        rec = self.recovery
        for rj in rec.rejected:
            log.warning("agck: run %r: skipped step %d (%s): %s", self.run, rj.step, rj.ref, rj.reason)
        if ck is None:
            if rec.candidates:
                log.warning("agck: run %r: none of %d checkpoints verifies; starting over",
                            self.run, rec.candidates)
            self._state = state
            return state
        saved = ck.state
        meta = meta_source.meta if isinstance(meta_source.meta, dict) else {}
        if meta.get("snapshot") is not True or not isinstance(saved, dict) or "state" not in saved:
            raise UsageError(f"run {self.run!r}: the newest valid checkpoint (step {ck.step}) was not written by "
                             "a snapshotter, so there is no step boundary to resume from", ref=ck.ref,
                             hint="give the snapshotter a run of its own, or pass resume=False to start over "
                                  "(it deletes the run's checkpoints)")
        fp = meta.get("fingerprint")
        now = fingerprint()
        if fp and {k: fp.get(k) for k in now} != now:
            diff = {k: (fp.get(k), now[k]) for k in now if fp.get(k) != now[k]}
            warnings.warn(f"resuming run {self.run!r} at step {ck.step} under a different environment {diff}: "
                          "results may not be bit-identical to an uninterrupted run", FingerprintWarning,
                          stacklevel=2)
        if self.capture_rng and "rng" in saved:
            set_rng_state(saved["rng"])
        restored = restore_into(state, saved["state"])
        self.start_step = ck.step
        self.last_durable_step = ck.step
        self.last_durable_ref = meta_source.ref
        self._state = restored
        log.info("agck: run %r resumed at step %d from %s", self.run, ck.step, ck.ref)
        return restored

    def _incarnate(self) -> None:
        """Once, before this snapshotter restores or writes anything: begin a new epoch
        of the run (:meth:`Store.begin_epoch`). Every put carries it, so a snapshotter
        of an earlier incarnation still running somewhere (a job restarted elsewhere
        while the old one hung) can no longer commit: its puts fail with
        :class:`StaleEpochError`, raised as a :class:`SnapshotError` in its pipeline."""
        if self.epoch is None:
            if self._dist is None:
                self.epoch = self.store.begin_epoch(self.run)
            else:
                self.epoch = self._dist.begin_epoch()
                self._dist.clean_partial()   # earlier incarnations' uncommitted parts can never commit now

    def _start_over(self) -> None:
        """resume=False: delete the run's old checkpoints, once, before anything new is written."""
        if self._started_over:
            return
        self._started_over = True
        if self._dist is not None:
            self._dist.delete_all(self.epoch)
            return
        old = self.store.steps(self.run)
        if old:
            log.warning("agck: resume=False: deleting %d old checkpoints of run %r (steps %d..%d)",
                        len(old), self.run, old[0], old[-1])
            for s in old:
                self.store.delete(self.run, s, epoch=self.epoch)

    # -- the loop form ---------------------------------------------------------
    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield step indices from ``start_step``; after each step's body the
        step counts as completed and a snapshot is taken every ``every`` steps
        (and after the last one)."""
        self._check_open()
        if total is not None:
            total = check_step(total, "total")
        if not self._restored:
            self.restore(self._state)
        return self._steps(total)

    def _steps(self, total: int | None) -> Iterator[int]:
        i = self.start_step
        while total is None or i < total:
            self.raise_pending()
            yield i
            done = i + 1
            last = total is not None and done == total
            self.completed(done, self._state, force=last)
            i = done

    def update(self, state: Any) -> None:
        """Tell the snapshotter the current state (when it is a new object)."""
        self._check_open()
        self._state = state

    def completed(self, steps_done: int, state: Any, *, force: bool = False) -> None:
        """``steps_done`` steps are complete and ``state`` is their result."""
        self._check_open()
        steps_done = check_step(steps_done, "steps_done")
        self._state = state
        # (under torch.distributed every rank must take the same steps: no extra one on a signal)
        if force or steps_done % self.every == 0 or (self._stop_signal is not None and self._dist is None):
            self.snapshot(steps_done, state)
        elif not self._prepared:
            self._prepare_staging(state)
        if self._stop_signal is not None:
            self._exit_on_signal()

    # -- snapshots -------------------------------------------------------------
    def snapshot(self, step: int, state: Any = None) -> None:
        """Checkpoint ``state`` as the state after ``step`` completed steps."""
        self._check_open()
        step = check_step(step)
        self.raise_pending()
        self._incarnate()
        if not self.resume:
            self._start_over()
        state = self._state if state is None else state
        t0 = time.perf_counter()
        # the step first: what changes at every checkpoint sits together, before the
        # state, not between the end of a growing list and the RNG states (chunking)
        tree = {"step": step, "state": capture(state)}
        if self.capture_rng:
            tree["rng"] = rng_state()
        if self._fingerprint is None:
            self._fingerprint = fingerprint()
        meta = {"fingerprint": self._fingerprint, "user": self.meta, "snapshot": True}
        if self._async is None:
            self._async = _has_cuda(tree)
        if not self._async:
            self.blocked_seconds.append(0.0)
            ref = self._persist(step, tree, meta, self.last_durable_step)
            self._taken = step
            self.blocked_seconds[-1] = time.perf_counter() - t0
            self._acknowledge(step, ref)
            return
        self._start_worker()
        stager = self._free_stagers.get()          # backpressure: waits while max_in_flight are pending
        try:     # any failure from here gives the stager back: the next snapshot would wait for it forever
            self.raise_pending()
            # ({} still notes this staging's tensors, for the snapshot after it)
            seen = self._seen if self._seen and self._can_confirm_unchanged() else {}
            try:
                staged = stager.stage(tree, seen)
            except AgckError:
                raise
            except Exception as e:
                raise SnapshotError(f"staging step {step} of run {self.run!r} failed: {type(e).__name__}: {e}",
                                    hint="nothing was written; the previous checkpoint is untouched") from e
            failpoints.hit("snapshot.after_stage")
        except BaseException:
            self._free_stagers.put(stager)
            raise
        with self._cv:
            self._pending += 1
        self._queue.put((step, staged, meta, stager, self._raised))
        self._taken = step
        self.blocked_seconds.append(time.perf_counter() - t0)

    def _persist(self, step, tree, meta, parent, stager: _Stager | None = None) -> str:
        t0, (u0, s0) = time.perf_counter(), _thread_cpu()
        referenced = stager.referenced if stager is not None else ()
        if self._dist is not None:
            ref = self._dist.write(step, tree, meta=meta, parent=parent, epoch=self.epoch,
                                   expect_unchanged=referenced)
        else:
            ref = self.store.put(self.run, step, tree, meta=meta, parent=parent, expect_unchanged=referenced,
                                 epoch=self.epoch)
        u1, s1 = _thread_cpu()
        self.write_stats.append({"step": step, "thread": threading.current_thread().name, "start": t0,
                                 "end": time.perf_counter(), "cpu_user_s": u1 - u0,
                                 "cpu_sys_s": None if s0 is None else s1 - s0,
                                 "referenced_bytes": stager.referenced_bytes if stager is not None else 0})
        return ref

    def _can_confirm_unchanged(self) -> bool:
        if self._dist is not None:
            return self._dist.parts.can_confirm_unchanged(self._dist.part_run(self.epoch))
        return self.store.can_confirm_unchanged(self.run)

    def _acknowledge(self, step: int, ref: str) -> None:
        failpoints.hit("snapshot.before_ack")
        self.last_durable_step = step
        self.last_durable_ref = ref
        if self.on_durable is not None:
            try:
                self.on_durable(step, ref)
            except Exception as e:
                raise SnapshotError(f"on_durable raised for step {step} of run {self.run!r}: {type(e).__name__}: "
                                    f"{e}", ref=ref, hint="the checkpoint itself is durable; fix the callback"
                                    ) from e

    def _start_worker(self) -> None:
        if self._worker is not None:
            return
        self._queue = queue.Queue()
        self._free_stagers = queue.Queue()
        for _ in range(self.max_in_flight):
            s = _Stager()
            self._stagers.append(s)
            self._free_stagers.put(s)
        self._worker = threading.Thread(target=self._work, name=f"agck-snapshot-{self.run}", daemon=True)
        self._worker.start()

    def _prepare_staging(self, state: Any) -> None:
        """Once, at a step boundary before the first snapshot: have the writer thread
        make the staging buffers the state will need, while the pipeline computes."""
        self._prepared = True
        if self._async is False or self._taken is not None:
            return
        jobs: list = []     # (stager, buffers to make); every stager taken here goes back through the job
        try:
            tree = {"step": 0, "state": capture(state)}
            if self.capture_rng:
                tree["rng"] = rng_state()
            if self._async is None and not _has_cuda(tree):
                return   # auto mode will choose sync: nothing to stage
            self._start_worker()
            while True:
                try:
                    jobs.append((self._free_stagers.get_nowait(), []))
                except queue.Empty:
                    break
            for i, (stager, _) in enumerate(jobs):
                jobs[i] = (stager, stager.plan(tree))
        except Exception as e:  # only a head start: the snapshot itself reports what is wrong
            log.debug("agck: planning staging buffers failed: %s", e)
        if jobs:
            self._queue.put(_Prepare(jobs))

    def _work(self) -> None:
        _yield_to_pipeline()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Prepare):
                t0, (u0, s0) = time.perf_counter(), _thread_cpu()
                for stager, missing in item.jobs:
                    try:
                        stager.make(missing, lambda: self._closed)
                    except Exception as e:  # staging allocates again, and raises, in the pipeline's thread
                        log.debug("agck: preparing staging buffers failed: %s", e)
                u1, s1 = _thread_cpu()
                self.prepare_stats = {"start": t0, "end": time.perf_counter(), "cpu_user_s": u1 - u0,
                                      "cpu_sys_s": None if s0 is None else s1 - s0}
                for stager, _ in item.jobs:
                    self._free_stagers.put(stager)
                continue
            step, staged, meta, stager, raised = item
            try:
                # written unless a write failed that the pipeline had not been told of when it
                # queued this one: decided by the queue's order alone, so ranks of one job,
                # whose writes fail together, write (or skip) the same steps
                if self._failed == raised:
                    ref = self._persist(step, staged, meta, self.last_durable_step, stager)
                    self._seen = stager.now
                    self._acknowledge(step, ref)
                else:            # queued behind a failure, not written: said with it
                    self._skipped.append(step)
            except ContentChangedError as e:
                # A tensor taken uncopied changed without its version counter saying so, or
                # while it was read: this snapshot cannot hold the step's state, so it is not
                # written; the next one copies every tensor.
                self._seen = {}
                self.dropped_steps.append(step)
                log.warning("agck: step %d of run %r was not checkpointed (%s); the next checkpoint copies every "
                            "tensor", step, self.run, e)
            except BaseException as e:  # surfaced to the pipeline thread, never swallowed
                self._seen = {}
                self._failed += 1          # before _error: raise_pending reads them in the other order
                self._error_step = step
                self._error = e
            finally:
                del staged
                self._free_stagers.put(stager)
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def raise_pending(self) -> None:
        """Raise a background write's failure in the caller's thread."""
        e = self._error
        if e is not None:
            self._error = None
            self._raised = self._failed
            skipped, self._skipped = self._skipped, []
            if isinstance(e, SnapshotError):      # already says what happened (on_durable)
                raise e
            also = f"; steps {skipped} queued behind it were not written either" if skipped else ""
            what = f"the background snapshot of step {self._error_step} of run {self.run!r} failed"
            cause = str(e) if isinstance(e, AgckError) else f"{type(e).__name__}: {e}"
            raise SnapshotError(f"{what}: {cause}{also}", ref=getattr(e, "ref", None),
                                hint="the previous checkpoint is untouched") from e

    def flush(self) -> None:
        """Wait until every pending snapshot is durable (or raise its failure)."""
        with self._cv:
            while self._pending:
                self._cv.wait()
        self.raise_pending()

    def _close_at_exit(self) -> None:
        # Join the worker before the interpreter finalizes: a daemon thread still
        # inside torch then is killed mid C++ frame and the process aborts.
        try:
            self.close()
        except Exception as e:  # at interpreter exit there is nobody left to raise to
            log.error("agck: pending snapshot of run %r failed at exit: %s", self.run, e)

    def close(self) -> None:
        """Flush pending snapshots, stop the worker, restore signal handlers.
        Idempotent; afterwards the snapshotter refuses further use."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join()
                self._worker = None
            self._restore_signals()
            atexit.unregister(self._close_at_exit)
            if self._dist is not None:
                self._dist.close()
            if self._own_store:
                self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except AgckError as e:
                log.error("agck: %s", e)  # the original exception is the one to see

    # -- signals ---------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            _Signals.add(self)

    def _restore_signals(self) -> None:
        _Signals.remove(self)

    def _on_signal(self, signum, frame) -> None:
        # The state is mid-step here; the final checkpoint is taken at the next
        # step boundary, then the signal is re-raised with the old handler.
        if self._stop_signal is not None:  # a second signal: stop now
            _Signals.restore_all()
            signal.raise_signal(signum)
            return
        self._stop_signal = signum
        log.warning("agck: %s received: checkpointing run %r at the end of this step, then exiting",
                    signal.Signals(signum).name, self.run)

    def _exit_on_signal(self) -> None:
        signum = self._stop_signal
        self.close()
        signal.raise_signal(signum)
        raise SystemExit(128 + signum)


class _Prepare:
    """A writer job: make staging buffers ahead of the first snapshot."""

    def __init__(self, jobs):
        self.jobs = jobs


def _has_cuda(tree) -> bool:
    if torch is None or not torch.cuda.is_available():
        return False
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.is_cuda:
                return True
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return False


# --- the decorator ----------------------------------------------------------------

def checkpoint_every(n: int, *, store: Store | str = "ckpts/", run: str | None = None, total: int | None = None,
                     **options):
    """Decorate ``step(state, i, ...) -> state`` to checkpoint every ``n`` steps.

    The first call restores the run's last valid checkpoint into the state it is
    given; calls for steps already covered by that checkpoint return the
    restored state without running, so the caller's loop needs no change to
    resume. ``run`` defaults to the function's qualified name; ``options`` are
    the Snapshotter's, checked here. The wrapper has ``.snapshotter``
    (``last_durable_step``, ``flush()``) and ``.close()``.

    The end of the loop gets a checkpoint too: with ``total``, the call for step
    ``total - 1`` takes one; and ``close()`` checkpoints the state the last call
    returned if its step has none yet (unless that call raised). Call ``close()``
    right after the loop, before changing the state."""
    n = _count(n, "n")
    if total is not None:
        total = check_step(total, "total")
    unknown = set(options) - _OPTION_NAMES
    if unknown:
        raise UsageError(f"checkpoint_every: unknown option(s) {', '.join(sorted(unknown))}",
                         hint=f"options are {', '.join(sorted(_OPTION_NAMES))}")
    _options(n, **options)

    def decorate(fn):
        run_name = check_run(run or f"{fn.__module__}.{fn.__qualname__}".replace("<", "").replace(">", ""))
        snap: Snapshotter | None = None
        last: tuple[int, Any] | None = None      # (steps done, state) of the last call that returned
        closed = False

        @functools.wraps(fn)
        def wrapper(state, i, *args, **kwargs):
            nonlocal snap, last
            if closed:
                raise UsageError(f"{fn.__qualname__} is closed: its snapshotter of run {run_name!r} was closed",
                                 hint="decorate the function again to start another pass")
            i = check_step(i, "step index")
            if total is not None and i >= total:
                raise UsageError(f"step index {i} is past total={total}")
            if snap is None:
                snap = Snapshotter(store, run_name, every=n, **options)
                wrapper.snapshotter = snap
                state = snap.restore(state)
            snap._check_open()
            if i < snap.start_step:
                return snap._state          # covered by the restored checkpoint
            snap.raise_pending()
            last = None                     # a call that raises leaves the state half-stepped
            out = fn(state, i, *args, **kwargs)
            last = (i + 1, out)
            snap.completed(i + 1, out, force=total is not None and i + 1 == total)
            return out

        def close():
            nonlocal closed
            if closed:
                return
            closed = True
            if snap is None:
                return
            try:
                if last is not None and last[0] != snap._taken and not snap._closed:
                    snap.snapshot(*last)
            finally:
                snap.close()

        wrapper.snapshotter = None
        wrapper.close = close
        return wrapper

    return decorate
