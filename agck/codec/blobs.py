"""Tensors to blobs, for the encoder: which memory a tensor lives in, the bytes
stored for it and its descriptor (FORMAT.md section 6).

A tensor alone in its memory is stored compact: C-contiguous, little-endian,
only its own bytes. Tensors over one torch storage (or one numpy base buffer)
are stored once, as the smallest byte span that covers them all, each described
as a strided view into it. The byte views returned read the tensors' memory in
place where they can: the caller keeps the owners returned with them alive
until the bytes are written.
"""

from __future__ import annotations

import ctypes
from operator import methodcaller
from typing import Any

import numpy as np

from .tables import _TORCH_DTYPE_NAMES, _extent, np_dtype_name, share_torch

torch: Any = None          # the torch module once it is bound: see share_torch
share_torch(globals())


def _all_numpy(xs: list) -> bool:
    return list(map(type, xs)).count(np.ndarray) == len(xs)


def _memory_key(x, i):
    if isinstance(x, np.ndarray):
        if x.size == 0:
            return ("solo", i)
        root = x
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        return ("np", id(root))
    if x.numel() == 0 or x.is_conj() or x.is_neg():
        # a lazy conj/neg view's storage holds the unresolved values: store it resolved, alone
        return ("solo", i)
    st = x.untyped_storage()
    return ("pt", str(x.device), st.data_ptr())


def _compact_bytes(x) -> tuple[memoryview, Any]:
    """The tensor's elements, C-contiguous little-endian, as a flat byte view."""
    if isinstance(x, np.ndarray):
        a = x
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a).reshape(x.shape)
        flat = a.reshape(-1).view(np.uint8)
        return memoryview(flat), a
    t = x.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b""), None
    flat = t.reshape(-1)
    if flat.numel() == 1:  # a one-element view may keep any stride; view(uint8) needs 1
        flat = flat.as_strided((1,), (1,))
    flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()), t


def _own_bytes_all(xs: list) -> list[memoryview]:
    """:func:`_own_bytes` of each, in C where every one is a numpy array with a buffer format."""
    if _all_numpy(xs):
        try:
            return list(map(_CAST_BYTES, map(memoryview, xs)))
        except ValueError:       # datetime64 and timedelta64 have no buffer format
            pass
    return list(map(_own_bytes, xs))


_CAST_BYTES = methodcaller("cast", "B")


def _own_bytes(x) -> memoryview:
    """The bytes of a tensor that :func:`_signature` accepts, in place: the view
    :func:`_compact_bytes` gives, taken the short way where the buffer protocol can."""
    try:
        if type(x) is np.ndarray:
            return memoryview(x).cast("B")
        return memoryview(x.detach().numpy()).cast("B")
    except (ValueError, TypeError):   # numpy: datetime64 and timedelta64; torch: dtypes numpy lacks (bfloat16)
        return _compact_bytes(x)[0]


def _descriptor(x, path: str, blob: int, offset: int, strides) -> dict:
    if isinstance(x, np.ndarray):
        d = {"path": path, "lib": "numpy", "dtype": np_dtype_name(x.dtype), "shape": list(x.shape),
             "blob": blob, "offset": offset}
        if strides is not None:
            d["strides"] = strides
        return d
    d = {"path": path, "lib": "torch", "dtype": _TORCH_DTYPE_NAMES[x.dtype], "shape": list(x.shape),
         "blob": blob, "offset": offset}
    if strides is not None:
        d["strides"] = strides
    if x.requires_grad:
        d["grad"] = True
    if isinstance(x, torch.nn.Parameter):
        d["param"] = True
    if x.device.type != "cpu":
        d["device"] = str(x.device)
    return d


def _shared_group(members, refs, paths, descs, views, owners) -> None:
    """Several tensors over one memory region: store the span covering all, once."""
    spans = []
    first = refs[members[0]]
    if isinstance(first, np.ndarray):
        for i in members:
            a = refs[i]
            if a.dtype.byteorder == ">":  # cannot share a byte-swapped view: store it alone
                view, owner = _compact_bytes(a)
                descs[i] = _descriptor(a, paths[i], len(views), 0, None)
                views.append(view)
                owners.append(owner)
                continue
            ptr = a.__array_interface__["data"][0]
            spans.append((i, ptr, list(a.strides), a.itemsize))
        base_ptr, owner, device = None, [refs[i] for i in members], None
    else:
        storage = first.untyped_storage()
        base_ptr, device = storage.data_ptr(), first.device
        for i in members:
            t = refs[i]
            spans.append((i, t.data_ptr(), [s * t.element_size() for s in t.stride()], t.element_size()))
        owner = [refs[i] for i in members]
    if not spans:
        return
    lo = min(_extent(p, refs[i].shape, st, k)[0] for i, p, st, k in spans)
    hi = max(_extent(p, refs[i].shape, st, k)[1] for i, p, st, k in spans)
    if base_ptr is not None:  # keep element offsets divisible by any itemsize
        lo = base_ptr + ((lo - base_ptr) & ~15)
    n = hi - lo
    if device is not None and device.type != "cpu":
        u8 = torch.empty(0, dtype=torch.uint8, device=device).set_(refs[members[0]].untyped_storage())
        host = u8[lo - base_ptr: hi - base_ptr].to("cpu")
        view, owner = memoryview(host.numpy()), host
    else:
        view = memoryview((ctypes.c_ubyte * n).from_address(lo)).cast("B")
    blob_index = len(views)
    views.append(view)
    owners.append(owner)
    for i, p, st, k in spans:
        x = refs[i]
        contiguous = (x.flags.c_contiguous if isinstance(x, np.ndarray) else x.is_contiguous())
        descs[i] = _descriptor(x, paths[i], blob_index, p - lo, None if contiguous else st)
