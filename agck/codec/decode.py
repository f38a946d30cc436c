"""The decoder: a msgpack tree, its tensor descriptors and blobs -> the state
(:func:`decode_state`); and the check of ``map_location`` (:func:`check_map_location`).

No pickle, no import by name, no code runs: it builds only values of the types
FORMAT.md section 8 lists, finding dtypes and devices in the fixed tables.
Anything the format does not allow is a MalformedCheckpointError (section
"metadata"); what the reading side lacks is never one: a missing or older torch
is a DependencyError, a device this process cannot use a UsageError.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import msgpack
import numpy as np

from ..errors import AgckError, DependencyError, MalformedCheckpointError, UsageError
from ..format import MAX_DEPTH, TreeBuilder
from .tables import (EXT_BIGINT, EXT_COMPLEX, EXT_FROZENSET, EXT_NP_DTYPE, EXT_NP_SCALAR, EXT_SET, EXT_TENSOR,
                     EXT_TORCH_DEVICE, EXT_TORCH_DTYPE, EXT_TORCH_SIZE, EXT_TUPLE, TORCH_DTYPES, _DEVICE_TYPES,
                     _INT_MIN, _TORCH_VALUES, _bind_torch, _device_syntax, _extent, _shape_error, _torch_dtype,
                     np_dtype_from_name, share_torch)

torch: Any = None          # the torch module once it is bound: see share_torch
share_torch(globals())


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _usable_device(target, what: str):
    """``target`` as a torch.device this process can allocate on, else UsageError."""
    if not isinstance(target, (str, torch.device)):
        raise UsageError(f"{what} is a {type(target).__name__}, not a device (a str or torch.device)")
    try:
        dev = torch.device(target)
    except (RuntimeError, ValueError, TypeError) as e:
        raise UsageError(f"{what}: {target!r} is not a device ({_first_line(e)})") from None
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"{what}: {str(dev)!r} is not available here "
                         f"({torch.cuda.device_count()} CUDA devices)")
    try:
        torch.empty(0, device=dev)
    except Exception as e:  # each backend fails its own way (AssertionError, RuntimeError, ...)
        raise UsageError(f"{what}: device {str(dev)!r} is not available here ({_first_line(e)})") from None
    return dev


class _DeviceMap:
    """A checked ``map_location``: saved device string -> torch.device, or None for
    "leave it on the CPU". Results of a callable are checked once per saved device."""

    def __init__(self, *, fixed=None, table: dict | None = None, fn: Callable | None = None):
        self.fixed, self.table, self.fn = fixed, table, fn
        self.seen: dict[str, Any] = {}

    def __call__(self, saved: str):
        if self.table is not None:
            return self.table.get(saved)
        if self.fn is None:
            return self.fixed
        if saved not in self.seen:
            try:
                target = self.fn(saved)
            except Exception as e:
                raise UsageError(f"map_location({saved!r}) raised {type(e).__name__}: {e}") from e
            self.seen[saved] = None if target is None else _usable_device(target, f"map_location({saved!r})")
        return self.seen[saved]


def check_map_location(map_location) -> _DeviceMap | None:
    """Check ``map_location`` before anything is decoded: None; a device (str or
    torch.device) for every tensor; a dict from saved device (``"cuda:0"``) to
    device, tensors saved elsewhere staying on the CPU; or a callable taking the
    saved device string and returning a device or None (the CPU), checked when
    first called. A device that does not parse or that this process cannot
    allocate on raises :class:`UsageError`, never a checkpoint error."""
    if map_location is None or isinstance(map_location, _DeviceMap):
        return map_location
    if callable(map_location):
        return _DeviceMap(fn=map_location)
    _bind_torch(load=True)
    if not isinstance(map_location, dict):
        return _DeviceMap(fixed=_usable_device(map_location, "map_location"))
    table = {}
    for k, v in map_location.items():
        if not isinstance(k, (str, torch.device)):
            raise UsageError(f"map_location keys are saved devices (str), not {type(k).__name__}")
        table[str(k)] = None if v is None else _usable_device(v, f"map_location[{k!r}]")
    return _DeviceMap(table=table)


_CONTAINER_EXT = {EXT_TUPLE: tuple, EXT_SET: set, EXT_FROZENSET: frozenset}


class _Decoder(TreeBuilder):
    def __init__(self, tensors: list, blob: Callable[[int], memoryview], nblobs: int, *, copy: bool,
                 devices: _DeviceMap | None, ref):
        super().__init__(lambda msg: MalformedCheckpointError(msg, ref=ref, section="metadata"))
        self.descs = tensors
        self.blob = blob
        self.nblobs = nblobs
        self.copy = copy
        self.devices = devices
        self.ref = ref
        self.cache: dict[int, Any] = {}
        self.bases: dict[tuple[str, int], Any] = {}
        self.depth = 0

    def ext(self, code: int, data: bytes):
        self.depth += 1
        try:
            # Containers nest at most MAX_DEPTH deep and a leaf extension value may sit in
            # the deepest; this bounds the recursion before heights are known.
            if self.depth > MAX_DEPTH + 1:
                raise self.bad(f"extension values nest deeper than {MAX_DEPTH + 1}")
            if code == EXT_BIGINT:
                return int.from_bytes(data, "little", signed=True)
            inner = self.unpack(data)
            kind = _CONTAINER_EXT.get(code)
            if kind is not None and type(inner) is list:
                h = self.heights.pop(id(inner), 1)   # the payload array is this container
                return self.place(tuple(inner) if kind is tuple else self.members(inner, kind), h)
            if code == EXT_TENSOR and type(inner) is int:
                return self.tensor(inner)
            if (code == EXT_NP_SCALAR and type(inner) is list and len(inner) == 2
                    and type(inner[1]) is bytes):
                dt = np_dtype_from_name(inner[0])
                raw = inner[1]
                if len(raw) != dt.itemsize:
                    raise self.bad(f"numpy scalar of {inner[0]} with {len(raw)} bytes")
                if dt.kind == "b" and raw not in (b"\x00", b"\x01"):
                    raise self.bad(f"numpy bool scalar with byte {raw!r}")
                return np.frombuffer(raw, dtype=dt)[0].astype(dt.newbyteorder("="))[()]
            if code == EXT_COMPLEX and type(inner) is list and len(inner) == 2 \
                    and all(type(v) is float for v in inner):
                return complex(inner[0], inner[1])
            if code == EXT_NP_DTYPE and type(inner) is str:
                return np_dtype_from_name(inner).newbyteorder("=")
            if code == EXT_TORCH_SIZE and type(inner) is list and all(type(v) is int for v in inner):
                for i, v in enumerate(inner):
                    if not _INT_MIN <= v < -_INT_MIN:   # msgpack holds up to 2**64 - 1; torch.Size takes int64
                        raise self.bad(f"torch.Size entry {i} is {v}, outside int64 [-2**63, 2**63)")
                _bind_torch(load=True)
                return torch.Size(inner)
            if code == EXT_TORCH_DTYPE and type(inner) is str:
                _bind_torch(load=True)
                return _torch_dtype(inner, _TORCH_VALUES, "a torch.dtype value", self.bad)
            if code == EXT_TORCH_DEVICE and _device_syntax(inner) in _DEVICE_TYPES:
                _bind_torch(load=True)
                try:
                    return torch.device(inner)
                except RuntimeError:  # a device type of the format's list that this torch lacks
                    raise DependencyError(f"this checkpoint holds a torch.device {inner!r}, which torch "
                                          f"{torch.__version__} does not know",
                                          hint="load it with a newer torch") from None
            raise self.bad(f"invalid extension value (type {code})")
        except (AgckError, RecursionError):  # the caller's stack, not the data: the nesting is bounded above
            raise
        except (ValueError, TypeError, RuntimeError, IndexError, OverflowError) as e:
            raise self.bad(f"invalid extension value (type {code}): {e}") from None
        finally:
            self.depth -= 1

    def unpack(self, data):
        # Extension payloads nest one unpack per level. unpackb keeps its parse stack
        # (~40 KB) on the C stack, so ~200 levels overflow it and crash the process;
        # an Unpacker keeps it on the heap.
        if not data:
            raise ValueError("empty msgpack document")
        u = msgpack.Unpacker(None, raw=False, strict_map_key=False, ext_hook=self.ext, list_hook=self.array,
                             object_pairs_hook=self.map, unicode_errors="surrogatepass",
                             max_buffer_size=len(data))
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
            dt = _torch_dtype(dtype_name, TORCH_DTYPES, f"tensor {idx}", self.bad)
        itemsize = dt.itemsize
        err = _shape_error(shape, itemsize)
        if err:
            raise self.bad(f"tensor {idx}: {err}")
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
                    or not all(type(s) is int and _INT_MIN <= s < -_INT_MIN for s in strides)):
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
            # torch has no read-only tensors: over read-only memory it gets a copy, so
            # that no write through a tensor can change the caller's bytes
            if self.copy or (lib == "torch" and not arr.flags.writeable):
                arr = arr.copy()
            base = torch.from_numpy(arr) if lib == "torch" else arr
            self.bases[key] = base
        return base

    def torch_tensor(self, d, b, blob, dt, shape, strides, off, lo, hi, count, contiguous, idx):
        itemsize = dt.itemsize
        if any(s % itemsize for s in strides) or off % itemsize:
            raise self.bad(f"tensor {idx}: strides/offset not multiples of the {itemsize}-byte element")
        if any(s < 0 for s in strides):
            raise self.bad(f"tensor {idx}: negative strides")
        if d.get("grad") and not (dt.is_floating_point or dt.is_complex):
            raise self.bad(f"tensor {idx}: grad on a tensor of {dt}")
        if count == 0:
            t = torch.empty(shape, dtype=dt)
        else:
            base = self.base("torch", b, blob)
            window = base[off: off + (hi - lo)]
            if contiguous:
                t = window.view(dt).reshape(shape)
            else:
                t = window.view(dt).as_strided(shape, [s // itemsize for s in strides])
        dev = self.devices(d.get("device", "cpu")) if self.devices is not None else None
        if dev is not None and dev.type != "cpu":
            try:
                t = t.to(dev)
            except Exception as e:  # out of memory there, or a device gone since it was checked
                raise UsageError(f"cannot move tensor {idx} ({d.get('path')}) to {dev}: {_first_line(e)}",
                                 ref=self.ref) from None
        if d.get("param"):
            t = torch.nn.Parameter(t, requires_grad=bool(d.get("grad")))
        elif d.get("grad"):
            t.requires_grad_(True)
        return t


def _check_descriptor(d: dict, nblobs, bad, idx):
    """The checked fields of descriptor ``idx`` (FORMAT.md section 6); decode_state
    has checked that every descriptor is a map."""
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
        torch_only = [k for k in ("grad", "param", "device") if k in d]
        if torch_only:
            raise bad(f"tensor {idx}: {', '.join(torch_only)} on a numpy descriptor")
    else:
        if any(k in d and type(d[k]) is not bool for k in ("grad", "param")):
            raise bad(f"tensor {idx}: grad and param are booleans")
        if "device" in d and _device_syntax(d["device"]) is None:
            raise bad(f"tensor {idx}: invalid device {d['device']!r}")
    if (type(shape) is not list or len(shape) > 64
            or not all(type(n) is int and 0 <= n < (1 << 62) for n in shape)):
        raise bad(f"tensor {idx}: invalid shape {shape!r}")
    if type(b) is not int or not 0 <= b < nblobs:
        raise bad(f"tensor {idx}: blob index {b!r} out of range ({nblobs} blobs)")
    if type(off) is not int or off < 0:
        raise bad(f"tensor {idx}: invalid offset {off!r}")
    if "path" not in d:
        raise bad(f"tensor {idx}: no path")
    if type(d["path"]) is not str:
        raise bad(f"tensor {idx}: path is a {type(d['path']).__name__}, not a string")
    return lib, dtype_name, shape, b, off


def decode_state(tree: bytes, tensors: list, blob: Callable[[int], memoryview], nblobs: int, *,
                 copy: bool = True, map_location=None, ref: str | None = None) -> Any:
    """Rebuild the state tree. ``blob(i)`` returns blob i's bytes (a view).

    With ``copy`` every blob is copied once into owned, writable memory; without
    it numpy arrays are views of the blobs' memory (read-only when it is), and so
    are torch tensors over writable memory; over read-only memory torch tensors
    get a copy, as torch has no read-only tensors. ``map_location``: see
    :func:`check_map_location`, which runs before anything is decoded."""
    devices = check_map_location(map_location)
    if type(tensors) is not list:
        raise MalformedCheckpointError("tensor index is not a list", ref=ref, section="metadata")
    if list(map(type, tensors)).count(dict) != len(tensors):   # referenced or not, each is a map
        idx = next(i for i, d in enumerate(tensors) if type(d) is not dict)
        raise MalformedCheckpointError(f"tensor descriptor {idx} is not a map", ref=ref, section="metadata")
    dec = _Decoder(tensors, blob, nblobs, copy=copy, devices=devices, ref=ref)
    try:
        value = msgpack.unpackb(tree, raw=False, strict_map_key=False, ext_hook=dec.ext, list_hook=dec.array,
                                object_pairs_hook=dec.map, unicode_errors="surrogatepass")
    except (AgckError, MemoryError, RecursionError):  # not the data's fault: it nests boundedly
        raise
    except Exception as e:  # msgpack reports bad input with several exception types
        raise dec.bad(f"state tree is not valid ({type(e).__name__}: {e})") from None
    if type(value) is msgpack.Timestamp:
        raise dec.bad("msgpack timestamp (extension type -1) in the tree")
    return value
