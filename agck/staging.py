"""Staging: copies of a state's tensors and mutable values, taken at a step boundary.

Contract:

- :meth:`Stager.stage` returns a tree equal to the one given whose every mutable
  part (dicts and subclasses, lists, sets, bytearrays, memoryviews, arrays,
  tensors) is a copy, so the pipeline may change its state as soon as it returns
  while a background thread encodes the copy. Tensors and arrays go into reusable
  buffers of the stager's pool, matched by position in the walk, dtype and shape:
  a steady pipeline allocates once. CUDA tensors go to pinned host memory with
  non-blocking copies and one synchronization per device before ``stage``
  returns. Values the codec refuses are passed through uncopied, so async mode
  refuses what sync mode refuses.
- Given ``seen`` (what :attr:`Stager.now` was at the last staging whose snapshot is
  durable), a large CPU tensor unchanged since then by its version signature is
  not copied; its address goes into :attr:`Stager.referenced`, for the store to
  confirm (``expect_unchanged``).
- :meth:`Stager.plan` and :meth:`Stager.make` allocate the buffers ahead of the
  first snapshot, on another thread, without copying anything.
- :func:`has_cuda`: whether a tree holds CUDA tensors (auto mode then goes async).

A stager is used by one thread at a time; the snapshotter hands each to the
pipeline (stage) and then to its writer (make, and reading the staged tree).
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable

import numpy as np

from . import chunking, thresholds
from .capture import ATOMS

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


class Stager:
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

    def stage(self, tree: Any, seen: dict | None = None, untrusted: set | frozenset = frozenset()) -> Any:
        """Copy ``tree``'s tensors into staging buffers. With ``seen`` (what
        :attr:`now` was at the last staging whose snapshot is durable), a CPU tensor
        of ``LARGE_PART`` bytes or more that is the same object with the same
        version counter, memory and layout as then is not copied: it goes into the
        tree as itself, its address into :attr:`referenced`, and the store confirms
        its bytes against that snapshot while it writes (``expect_unchanged``).
        ``untrusted``: ids of tensors once caught changing behind their version
        counter (edited through ``.numpy()`` or ``.data``): always copied."""
        self.memo: dict[int, Any] = {}
        self.n = 0
        self.cuda: set = set()      # the devices whose copies into pinned memory are in flight
        self.used: set = set()
        self.seen = seen
        self.untrusted = untrusted
        self.now: dict[int, tuple] = {}
        self.referenced: set[int] = set()
        self.referenced_ids: dict[int, int] = {}      # data address -> id of the tensor passed uncopied
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
        if t in ATOMS:
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
            if self.seen is not None and not pin and _referable(x) and id(x) not in self.untrusted:
                sig = _version_signature(x)
                if sig is not None:
                    self.now[id(x)] = (weakref.ref(x), sig)
                    last = self.seen.get(id(x))
                    if last is not None and last[0]() is x and last[1] == sig:
                        self.used.add(key)       # its buffer stays for when it changes
                        self.referenced.add(x.data_ptr())
                        self.referenced_ids[x.data_ptr()] = id(x)
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


# Staging buffers are plain host memory (pinned for CUDA tensors). Made ahead of
# the first snapshot (Snapshotter._prepare_staging), their pages are touched on
# the writer thread, so the first staging copy does not fault them in while the
# pipeline waits. Not huge pages: on a VM that hands free memory back to its
# host, a fresh 2 MiB page costs the host far more than the 4 KiB faults saved.
TOUCH_MIN = thresholds.TOUCH_MIN


# A large one starts on a page: the chunker cuts a large blob every 1 MiB from its
# start, so each chunk is then page-aligned and goes to an O_DIRECT chunk file
# straight from the staging buffer, without a copy into a bounce buffer.
PAGE = 4096


def _host_array(shape, dtype, touch: bool = False) -> np.ndarray:
    n = math.prod(shape) * dtype.itemsize
    if n < TOUCH_MIN or dtype.hasobject:
        return np.empty(shape, dtype)
    raw = np.empty(n + PAGE, np.uint8)
    skip = -raw.ctypes.data % PAGE
    buf = raw[skip:skip + n]
    if touch:
        buf.fill(0)
    return buf.view(dtype).reshape(shape)


def _host_tensor(shape, dtype, pin: bool, touch: bool = False):
    n = math.prod(shape) * dtype.itemsize
    if pin or n < TOUCH_MIN:   # pinned memory is resident once allocated (and CUDA aligns it to pages)
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    raw = torch.zeros(n + PAGE, dtype=torch.uint8) if touch else torch.empty(n + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip:skip + n].view(dtype).view(shape)


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


def has_cuda(tree) -> bool:
    """Whether ``tree`` holds a CUDA tensor (the walk stops at the first)."""
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
