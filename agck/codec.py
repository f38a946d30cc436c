"""The tensor-aware value codec: a state tree <-> (msgpack tree, tensor descriptors, blobs).

No pickle, no import-by-name, no code runs on decode: the decoder only builds
values of a fixed set of types from data. Arrays and tensors are not put in
the msgpack tree; they become blobs (raw bytes, written by the format layer
64-byte aligned) described by descriptors, and the tree holds a reference.

Sharing: tensors that share memory (the same object twice, tied weights,
views of one storage) are stored once and come back sharing memory. Within one
torch storage (or one numpy base buffer) the smallest byte span that covers
every tensor seen is stored, and each tensor is a strided view into it. A
tensor alone in its storage is stored compact (contiguous, only its own bytes).
"""

from __future__ import annotations

import ctypes
import math
import re
import sys
import warnings
from typing import Any, Callable

import msgpack
import numpy as np

from .errors import DependencyError, EncodeError, MalformedCheckpointError

# torch is optional and slow to import (about a second), so agck never imports it
# to encode (a state can only hold torch values if the process already has torch)
# and imports it to decode only when a container holds torch values. `import agck`
# and the CLI stay fast; see _bind_torch.
torch: Any = None

EXT_TUPLE = 1
EXT_SET = 2
EXT_FROZENSET = 3
EXT_BIGINT = 4
EXT_TENSOR = 5
EXT_NP_SCALAR = 6
EXT_COMPLEX = 7
EXT_TORCH_DTYPE = 8
EXT_TORCH_SIZE = 9
EXT_TORCH_DEVICE = 10
EXT_NP_DTYPE = 11

MAX_DEPTH = 256
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1

# --- dtypes -----------------------------------------------------------------------

_NP_NAMES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]
if hasattr(np, "float128"):
    _NP_NAMES += ["float128", "complex256"]  # x86-64 long double: 80-bit extended, 16 bytes
_NP_TIME = re.compile(r"^(datetime64|timedelta64)\[(Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\]$")


def np_dtype_name(dt: np.dtype) -> str | None:
    """The format's name for a numpy dtype, or None if unsupported."""
    if dt.kind in "mM":
        name = str(dt.newbyteorder("="))
        return name if _NP_TIME.match(name) else None
    name = dt.newbyteorder("=").name
    return name if name in _NP_NAMES and dt.fields is None else None


def np_dtype_from_name(name: str) -> np.dtype:
    if isinstance(name, str) and (name in _NP_NAMES or _NP_TIME.match(name)):
        return np.dtype(name).newbyteorder("<")
    raise ValueError(f"unknown numpy dtype {name!r}")


_TORCH_NAMES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
                "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
TORCH_DTYPES: dict[str, Any] = {}        # filled in place once torch is bound
_TORCH_DTYPE_NAMES: dict[Any, str] = {}


def _bind_torch(load: bool = False):
    """The torch module once it is in use, else None. ``load`` imports it (to
    decode torch values; raises :class:`DependencyError` if torch is missing or
    broken); without it, only a torch the process has fully imported counts."""
    global torch
    if torch is not None:
        return torch
    mod = sys.modules.get("torch")
    if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False):
        mod = None            # another thread is importing it: only a real import waits for that
    if mod is None:
        if not load:
            return None
        try:
            import torch as mod
        except Exception as e:  # ImportError, or a broken install (OSError, RuntimeError, ...)
            raise DependencyError(f"this checkpoint holds torch values and `import torch` failed: "
                                  f"{type(e).__name__}: {e}") from None
    dtypes = {n: getattr(mod, n) for n in _TORCH_NAMES if isinstance(getattr(mod, n, None), mod.dtype)}
    if "float32" not in dtypes:   # not a complete torch module: never bind a partial one
        if load:
            raise DependencyError("torch is importable but incomplete (no torch.float32)")
        return None
    TORCH_DTYPES.update(dtypes)
    _TORCH_DTYPE_NAMES.update({v: k for k, v in dtypes.items()})
    torch = mod
    return torch


_bind_torch()


def _torch_dtype_any_name(dt) -> str:
    return str(dt).removeprefix("torch.")


# --- encoding ---------------------------------------------------------------------

class _Unencodable(Exception):
    def __init__(self, msg: str):
        self.msg = msg
        self.path: list[str] = []


def _key_repr(k) -> str:
    return f"[{k!r}]"


class _Blob:
    """Memory to be written as one blob, plus what keeps it alive."""
    __slots__ = ("view", "owner")

    def __init__(self, view: memoryview, owner: Any):
        self.view = view
        self.owner = owner


class Encoded:
    """The result of :func:`encode_state`."""

    def __init__(self, tree: bytes, tensors: list[dict], blobs: list[_Blob]):
        self.tree = tree
        self.tensors = tensors
        self._blobs = blobs

    @property
    def blobs(self) -> list[memoryview]:
        return [b.view for b in self._blobs]

    @property
    def payload_bytes(self) -> int:
        return sum(b.view.nbytes for b in self._blobs)


def encode_state(state: Any, *, root: str = "state") -> Encoded:
    """Encode ``state`` into a msgpack tree with tensor references, the tensor
    descriptors and the blobs. Raises :class:`EncodeError` naming the path."""
    _bind_torch()
    enc = _Encoder()
    try:
        tree = enc.value(state, 0)
        tree_bytes = msgpack.packb(tree, use_bin_type=True, unicode_errors="surrogatepass")
    except _Unencodable as e:
        path = root + "".join(reversed(e.path))
        raise EncodeError(f"{path}: {e.msg}") from None
    except RecursionError:
        raise EncodeError(f"{root}: nesting too deep (limit {MAX_DEPTH})") from None
    tensors, blobs = enc.finish()
    return Encoded(tree_bytes, tensors, blobs)


def encode_plain(value: Any, what: str = "meta") -> Any:
    """Check that ``value`` is plain msgpack (None, bool, int, float, str, bytes, list, dict)."""
    try:
        msgpack.packb(value, use_bin_type=True, strict_types=False, unicode_errors="surrogatepass")
    except (TypeError, ValueError, OverflowError) as e:
        raise EncodeError(f"{what}: not plain msgpack data ({e})") from None
    return value


class _Encoder:
    def __init__(self):
        self.refs: list[Any] = []          # tensor objects, by reference index
        self.paths: list[str] = []
        self.by_id: dict[int, int] = {}    # id(obj) -> reference index
        self.stack: list[str] = []

    # The walker. Exact types first (the common case), then the rest.
    def value(self, x, depth):
        t = type(x)
        if x is None or t is bool or t is float or t is str or t is bytes:
            return x
        if t is int:
            return x if _INT_MIN <= x <= _INT_MAX else self.bigint(x)
        if depth >= MAX_DEPTH:
            raise _Unencodable(f"nesting deeper than {MAX_DEPTH}")
        if t is list:
            return self.seq(x, depth)
        if t is dict:
            return self.mapping(x, depth)
        if t is tuple:
            return msgpack.ExtType(EXT_TUPLE, self.pack(self.seq(x, depth)))
        if isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor)):
            return self.tensor(x)
        if isinstance(x, np.generic):
            return self.np_scalar(x)
        if isinstance(x, dict):       # OrderedDict (state_dict()), defaultdict: come back as dict
            return self.mapping(x, depth)
        if t is set or t is frozenset:
            code = EXT_SET if t is set else EXT_FROZENSET
            try:
                items = sorted(x)  # deterministic bytes where the items order
            except TypeError:
                items = list(x)
            return msgpack.ExtType(code, self.pack(self.seq(items, depth)))
        if t is complex:
            return msgpack.ExtType(EXT_COMPLEX, self.pack([x.real, x.imag]))
        if torch is not None:
            if t is torch.Size:
                return msgpack.ExtType(EXT_TORCH_SIZE, self.pack(list(x)))
            if t is torch.dtype:
                return msgpack.ExtType(EXT_TORCH_DTYPE, self.pack(_torch_dtype_any_name(x)))
            if t is torch.device:
                return msgpack.ExtType(EXT_TORCH_DEVICE, self.pack(str(x)))
        if t is np.dtype or isinstance(x, np.dtype):
            name = np_dtype_name(x)
            if name is None:
                raise _Unencodable(f"cannot encode numpy dtype {x!r}")
            return msgpack.ExtType(EXT_NP_DTYPE, self.pack(name))
        if isinstance(x, str):
            return str(x)
        if isinstance(x, bytes):
            return bytes(x)
        if isinstance(x, (bytearray, memoryview)):
            return bytes(x)
        hint = ""
        if isinstance(x, tuple):
            hint = " (a tuple subclass would come back a plain tuple; convert it first)"
        elif torch is not None and isinstance(x, torch.nn.Module):
            hint = " (save module.state_dict(), or use checkpoint_every which does)"
        raise _Unencodable(f"cannot encode {t!r}{hint}")

    @staticmethod
    def pack(obj) -> bytes:
        return msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")

    def bigint(self, x: int):
        n = (x.bit_length() + 8) // 8
        return msgpack.ExtType(EXT_BIGINT, x.to_bytes(n, "little", signed=True))

    def seq(self, xs, depth):
        out = []
        stack = self.stack
        d = depth + 1
        for i, item in enumerate(xs):
            stack.append(i)
            try:
                out.append(self.value(item, d))
            except _Unencodable as e:
                e.path.append(f"[{i}]")
                raise
            finally:
                stack.pop()
        return out

    def mapping(self, m, depth):
        out = {}
        d = depth + 1
        for k, v in m.items():
            try:
                kk = self.value(k, d)
                if isinstance(kk, list) or isinstance(kk, dict):
                    raise _Unencodable(f"unhashable dict key {type(k)!r}")
                self.stack.append(k)
                try:
                    out[kk] = self.value(v, d)
                finally:
                    self.stack.pop()
            except _Unencodable as e:
                e.path.append(_key_repr(k))
                raise
        return out

    def np_scalar(self, x):
        name = np_dtype_name(x.dtype)
        if name is None:
            raise _Unencodable(f"cannot encode numpy scalar of dtype {x.dtype} (only numeric, bool, "
                               "complex and datetime dtypes)")
        raw = np.asarray(x).astype(np_dtype_from_name(name), copy=False).tobytes()
        return msgpack.ExtType(EXT_NP_SCALAR, self.pack([name, raw]))

    def tensor(self, x):
        idx = self.by_id.get(id(x))
        if idx is None:
            if isinstance(x, np.ndarray):
                _check_np(x)
            else:
                _check_torch(x)
            idx = len(self.refs)
            self.by_id[id(x)] = idx
            self.refs.append(x)
            self.paths.append(self._path())
        return msgpack.ExtType(EXT_TENSOR, self.pack(idx))

    def _path(self) -> str:
        return "state" + "".join(_key_repr(k) for k in self.stack)

    # Group tensors by the memory they live in, then lay out blobs.
    def finish(self) -> tuple[list[dict], list[_Blob]]:
        groups: dict[Any, list[int]] = {}
        for i, x in enumerate(self.refs):
            groups.setdefault(_memory_key(x, i), []).append(i)
        descs: list[dict | None] = [None] * len(self.refs)
        blobs: list[_Blob] = []
        for members in groups.values():
            if len(members) == 1:
                i = members[0]
                view, owner = _compact_bytes(self.refs[i])
                descs[i] = _descriptor(self.refs[i], self.paths[i], len(blobs), 0, None)
                blobs.append(_Blob(view, owner))
            else:
                _shared_group(members, self.refs, self.paths, descs, blobs)
        return descs, blobs  # type: ignore[return-value]


def _check_np(a: np.ndarray) -> None:
    if type(a) not in (np.ndarray, np.memmap):
        # a masked array or matrix would come back a plain array, silently losing what makes it one
        raise _Unencodable(f"cannot encode numpy array subclass {type(a)!r} (convert with np.asarray)")
    if np_dtype_name(a.dtype) is None:
        kind = "object" if a.dtype.kind == "O" else "structured" if a.dtype.fields else str(a.dtype)
        raise _Unencodable(f"cannot encode numpy array of {kind} dtype (only numeric, bool, complex and "
                           "datetime dtypes; object arrays would need pickle)")


def _check_torch(t) -> None:
    if t.layout != torch.strided:
        raise _Unencodable(f"cannot encode a {t.layout} tensor (convert with .to_dense())")
    if t.dtype not in _TORCH_DTYPE_NAMES:
        raise _Unencodable(f"cannot encode torch tensor of dtype {t.dtype}")
    if t.device.type == "meta":
        raise _Unencodable("cannot encode a meta tensor (it has no data)")
    if getattr(t, "is_nested", False) or type(t) not in (torch.Tensor, torch.nn.Parameter):
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise _Unencodable(f"cannot encode tensor subclass {type(t)!r}")
        raise _Unencodable("cannot encode a nested tensor")


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


def _extent(ptr: int, shape, byte_strides, itemsize: int) -> tuple[int, int]:
    lo = hi = ptr
    for n, s in zip(shape, byte_strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def _shared_group(members, refs, paths, descs, blobs) -> None:
    """Several tensors over one memory region: store the span covering all, once."""
    spans = []
    first = refs[members[0]]
    if isinstance(first, np.ndarray):
        for i in members:
            a = refs[i]
            if a.dtype.byteorder == ">":  # cannot share a byte-swapped view: store it alone
                view, owner = _compact_bytes(a)
                descs[i] = _descriptor(a, paths[i], len(blobs), 0, None)
                blobs.append(_Blob(view, owner))
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
    blob_index = len(blobs)
    blobs.append(_Blob(view, owner))
    for i, p, st, k in spans:
        x = refs[i]
        contiguous = (x.flags.c_contiguous if isinstance(x, np.ndarray) else x.is_contiguous())
        descs[i] = _descriptor(x, paths[i], blob_index, p - lo, None if contiguous else st)


# --- decoding ---------------------------------------------------------------------

class _Decoder:
    def __init__(self, tensors: list, blob: Callable[[int], memoryview], nblobs: int, *, copy: bool,
                 map_location, ref):
        self.descs = tensors
        self.blob = blob
        self.nblobs = nblobs
        self.copy = copy
        self.map_location = map_location
        self.ref = ref
        self.cache: dict[int, Any] = {}
        self.bases: dict[tuple[str, int], Any] = {}
        self.depth = 0

    def bad(self, msg: str) -> MalformedCheckpointError:
        return MalformedCheckpointError(msg, ref=self.ref, section="metadata")

    def ext(self, code: int, data: bytes):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise self.bad(f"state nests deeper than {MAX_DEPTH}")
            if code == EXT_BIGINT:
                return int.from_bytes(data, "little", signed=True)
            inner = self.unpack(data)
            if code == EXT_TUPLE and type(inner) is list:
                return tuple(inner)
            if code == EXT_SET and type(inner) is list:
                return set(inner)
            if code == EXT_FROZENSET and type(inner) is list:
                return frozenset(inner)
            if code == EXT_TENSOR and type(inner) is int:
                return self.tensor(inner)
            if code == EXT_NP_SCALAR and type(inner) is list and len(inner) == 2:
                dt = np_dtype_from_name(inner[0])
                if type(inner[1]) is not bytes or len(inner[1]) != dt.itemsize:
                    raise self.bad(f"numpy scalar of {inner[0]} with {len(inner[1])} bytes")
                return np.frombuffer(inner[1], dtype=dt)[0].astype(dt.newbyteorder("="))[()]
            if code == EXT_COMPLEX and type(inner) is list and len(inner) == 2 \
                    and all(type(v) is float for v in inner):
                return complex(inner[0], inner[1])
            if code == EXT_NP_DTYPE and type(inner) is str:
                return np_dtype_from_name(inner).newbyteorder("=")
            if code in (EXT_TORCH_DTYPE, EXT_TORCH_SIZE, EXT_TORCH_DEVICE):
                _bind_torch(load=True)
                if code == EXT_TORCH_SIZE and type(inner) is list and all(type(v) is int for v in inner):
                    return torch.Size(inner)
                if code == EXT_TORCH_DTYPE and type(inner) is str:
                    dt = getattr(torch, inner, None)
                    if isinstance(dt, torch.dtype):
                        return dt
                if code == EXT_TORCH_DEVICE and type(inner) is str:
                    return torch.device(inner)
            raise self.bad(f"invalid extension value (type {code})")
        except MalformedCheckpointError:
            raise
        except (ValueError, TypeError, RuntimeError, IndexError) as e:
            raise self.bad(f"invalid extension value (type {code}): {e}") from None
        finally:
            self.depth -= 1

    def unpack(self, data):
        # Extension payloads nest one unpack per level. unpackb keeps its parse stack
        # (~40 KB) on the C stack, so ~200 levels overflow it and crash the process;
        # an Unpacker keeps it on the heap.
        if not data:
            raise ValueError("empty msgpack document")
        u = msgpack.Unpacker(None, raw=False, strict_map_key=False, ext_hook=self.ext,
                             unicode_errors="surrogatepass", max_buffer_size=len(data))
        u.feed(data)
        try:
            value = u.unpack()
        except msgpack.OutOfData:
            raise ValueError("truncated msgpack document") from None
        if u.tell() != len(data):
            raise ValueError(f"{len(data) - u.tell()} bytes after a msgpack document")
        return value

    def tensor(self, idx: int):
        if idx in self.cache:
            return self.cache[idx]
        if not 0 <= idx < len(self.descs):
            raise self.bad(f"tensor reference {idx} out of range ({len(self.descs)} tensors)")
        d = self.descs[idx]
        value = self.build(d, idx)
        self.cache[idx] = value
        return value

    def build(self, d, idx):
        lib, dtype_name, shape, b, off = _check_descriptor(d, self.nblobs, self.bad, idx)
        blob = self.blob(b)
        if lib == "numpy":
            dt = np_dtype_from_name(dtype_name)
        else:
            _bind_torch(load=True)
            if dtype_name not in TORCH_DTYPES:
                raise self.bad(f"tensor {idx}: unknown torch dtype {dtype_name!r}")
            dt = TORCH_DTYPES[dtype_name]
        itemsize = dt.itemsize
        strides = d.get("strides")
        count = math.prod(shape)
        if strides is None:
            strides = []
            acc = itemsize
            for n in reversed(shape):
                strides.append(acc)
                acc *= n
            strides.reverse()
            contiguous = True
        else:
            if (type(strides) is not list or len(strides) != len(shape)
                    or not all(type(s) is int for s in strides)):
                raise self.bad(f"tensor {idx}: strides {strides!r} do not match shape {shape}")
            contiguous = False
        if count == 0:
            lo, hi = off, off
        else:
            lo, hi = _extent(off, shape, strides, itemsize)
        if lo < 0 or hi > blob.nbytes:
            raise self.bad(f"tensor {idx} ({d.get('path')}): bytes [{lo}, {hi}) lie outside its blob "
                           f"of {blob.nbytes} bytes")
        if contiguous and hi - lo != count * itemsize:
            raise self.bad(f"tensor {idx}: shape {shape} needs {count * itemsize} bytes")
        if lib == "numpy":
            base = self.base("numpy", b, blob)
            arr = np.ndarray(shape, dtype=dt, buffer=base, offset=off, strides=strides)
            return arr.view(dt.newbyteorder("="))
        return self.torch_tensor(d, b, blob, dt, shape, strides, off, lo, hi, count, contiguous, idx)

    def base(self, lib, b, blob):
        key = (lib, b)
        base = self.bases.get(key)
        if base is None:
            arr = np.frombuffer(blob, dtype=np.uint8) if blob.nbytes else np.empty(0, np.uint8)
            if self.copy:
                arr = arr.copy()
            if lib == "torch":
                if arr.flags.writeable:
                    base = torch.from_numpy(arr)
                else:  # zero-copy over read-only memory: documented as not to be written
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        base = torch.from_numpy(arr)
            else:
                base = arr
            self.bases[key] = base
        return base

    def torch_tensor(self, d, b, blob, dt, shape, strides, off, lo, hi, count, contiguous, idx):
        itemsize = dt.itemsize
        if any(s % itemsize for s in strides) or off % itemsize:
            raise self.bad(f"tensor {idx}: strides/offset not multiples of the {itemsize}-byte element")
        if any(s < 0 for s in strides):
            raise self.bad(f"tensor {idx}: negative strides")
        if count == 0:
            t = torch.empty(shape, dtype=dt)
        else:
            base = self.base("torch", b, blob)
            window = base[off: off + (hi - lo)]
            if contiguous:
                t = window.view(dt).reshape(shape)
            else:
                t = window.view(dt).as_strided(shape, [s // itemsize for s in strides])
        device = _map_device(d.get("device", "cpu"), self.map_location)
        if device is not None and device != "cpu":
            t = t.to(device)
        if d.get("param"):
            t = torch.nn.Parameter(t, requires_grad=bool(d.get("grad")))
        elif d.get("grad"):
            t.requires_grad_(True)
        return t


def _map_device(saved: str, map_location):
    if map_location is None:
        return None
    if isinstance(map_location, dict):
        target = map_location.get(saved)
        return None if target is None else str(target)
    if callable(map_location):
        return str(map_location(saved))
    return str(map_location)


def _check_descriptor(d, nblobs, bad, idx):
    if type(d) is not dict:
        raise bad(f"tensor descriptor {idx} is not a map")
    lib, dtype_name, shape, b, off = d.get("lib"), d.get("dtype"), d.get("shape"), d.get("blob"), d.get("offset")
    if lib not in ("numpy", "torch"):
        raise bad(f"tensor {idx}: unknown lib {lib!r}")
    if type(dtype_name) is not str:
        raise bad(f"tensor {idx}: dtype is not a string")
    if lib == "numpy":
        try:
            np_dtype_from_name(dtype_name)
        except ValueError:
            raise bad(f"tensor {idx}: unknown numpy dtype {dtype_name!r}") from None
    if (type(shape) is not list or len(shape) > 64
            or not all(type(n) is int and 0 <= n < (1 << 62) for n in shape)):
        raise bad(f"tensor {idx}: invalid shape {shape!r}")
    if type(b) is not int or not 0 <= b < nblobs:
        raise bad(f"tensor {idx}: blob index {b!r} out of range ({nblobs} blobs)")
    if type(off) is not int or off < 0:
        raise bad(f"tensor {idx}: invalid offset {off!r}")
    return lib, dtype_name, shape, b, off


def decode_state(tree: bytes, tensors: list, blob: Callable[[int], memoryview], nblobs: int, *,
                 copy: bool = True, map_location=None, ref: str | None = None) -> Any:
    """Rebuild the state tree. ``blob(i)`` returns blob i's bytes (a view).

    With ``copy`` every blob is copied once into owned, writable memory; without
    it arrays and tensors are views of the blobs' memory."""
    if type(tensors) is not list:
        raise MalformedCheckpointError("tensor index is not a list", ref=ref, section="metadata")
    dec = _Decoder(tensors, blob, nblobs, copy=copy, map_location=map_location, ref=ref)
    try:
        return msgpack.unpackb(tree, raw=False, strict_map_key=False, ext_hook=dec.ext,
                               unicode_errors="surrogatepass")
    except (MalformedCheckpointError, DependencyError):
        raise
    except RecursionError:
        raise dec.bad("state nests too deep") from None
    except Exception as e:  # msgpack reports bad input with several exception types
        raise dec.bad(f"state tree is not valid ({type(e).__name__}: {e})") from None


sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * MAX_DEPTH + 1000))
