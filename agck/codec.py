"""The tensor-aware value codec: a state tree <-> (msgpack tree, tensor descriptors, blobs).

No pickle, no import-by-name, no code runs on decode: the decoder only builds
values of a fixed set of types from data, finding dtypes and devices in fixed
tables. Arrays and tensors are not put in the msgpack tree; they become blobs
(raw bytes, written by the format layer 64-byte aligned) described by
descriptors, and the tree holds a reference.

Sharing: tensors that share memory (the same object twice, tied weights,
views of one storage) are stored once and come back sharing memory. Within one
torch storage (or one numpy base buffer) the smallest byte span that covers
every tensor seen is stored, and each tensor is a strided view into it. A
tensor alone in its storage is stored compact (contiguous, only its own bytes).
"""

from __future__ import annotations

import copy
import ctypes
import math
import re
import sys
import weakref
from operator import attrgetter, is_, methodcaller
from typing import Any, Callable

import msgpack
import numpy as np

from .errors import AgckError, DependencyError, EncodeError, MalformedCheckpointError, UsageError
from .format import MAX_DEPTH, MAX_SAME_HASH, TreeBuilder, array_header, crowded, map_header

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

_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1

# --- dtypes -----------------------------------------------------------------------

_NP_NAMES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128"]
_NP_LONG_DOUBLE = ("float128", "complex256")  # x86-64 long double: 80-bit extended, 16 bytes
if hasattr(np, "float128"):
    _NP_NAMES += _NP_LONG_DOUBLE
_NP_TIME = re.compile(r"(datetime64|timedelta64)\[(Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\]")


def np_dtype_name(dt: np.dtype) -> str | None:
    """The format's name for a numpy dtype, or None if unsupported."""
    try:
        return _NP_NAME_OF[dt]
    except (KeyError, TypeError):
        pass
    name = _np_dtype_name(dt)
    if len(_NP_NAME_OF) < 1024:
        try:
            _NP_NAME_OF[dt] = name
        except TypeError:
            pass
    return name


_NP_NAME_OF: dict = {}   # dtypes are hashed by value (byte order included): a cache of the rule below


def _np_dtype_name(dt: np.dtype) -> str | None:
    if dt.kind in "mM":
        name = str(dt.newbyteorder("="))
        return name if _NP_TIME.fullmatch(name) else None
    name = dt.newbyteorder("=").name
    return name if name in _NP_NAMES and dt.fields is None else None


def np_dtype_from_name(name: str) -> np.dtype:
    """The little-endian numpy dtype of a format name (ValueError for any other
    name; DependencyError for long double where numpy lacks it)."""
    if isinstance(name, str) and (name in _NP_NAMES or _NP_TIME.fullmatch(name)):
        return np.dtype(name).newbyteorder("<")
    if name in _NP_LONG_DOUBLE:
        raise DependencyError(f"this checkpoint holds numpy {name} values, which numpy has no type for on "
                              "this platform", hint="load it on x86-64 Linux, where numpy has float128")
    raise ValueError(f"unknown numpy dtype {name!r}")


# Tensor dtypes (FORMAT.md section 7), then the other dtypes a torch.dtype value (ext 8) may
# be. Fixed lists: the decoder never looks a name up in the torch module.
_TORCH_NAMES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
                "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
_TORCH_VALUE_NAMES = _TORCH_NAMES + [
    "float4_e2m1fn_x2", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4"]
TORCH_DTYPES: dict[str, Any] = {}        # tensor dtypes by name; filled in place once torch is bound
_TORCH_DTYPE_NAMES: dict[Any, str] = {}
_TORCH_VALUES: dict[str, Any] = {}       # every dtype ext 8 may name, by name
_TORCH_VALUE_NAME: dict[Any, str] = {}

# Device types a torch.device value (ext 10) may have: torch 2.13's list.
_DEVICE_TYPES = frozenset({"cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve",
                           "fpga", "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone"})
_DEVICE_RE = re.compile(r"([a-z][a-z0-9_]*)(?::(0|[1-9][0-9]{0,2}))?")


def _device_syntax(s) -> str | None:
    """The device type of a device string ``type`` or ``type:index`` (index 0-127), else None."""
    m = _DEVICE_RE.fullmatch(s) if type(s) is str else None
    return m.group(1) if m and (m.group(2) is None or int(m.group(2)) < 128) else None


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
    dtype_type = getattr(mod, "dtype", None)
    found = {n: getattr(mod, n, None) for n in _TORCH_VALUE_NAMES} if isinstance(dtype_type, type) else {}
    dtypes = {n: d for n, d in found.items() if isinstance(d, dtype_type)}
    if "float32" not in dtypes:   # not a complete torch module: never bind a partial one
        if load:
            raise DependencyError("torch is importable but incomplete (no torch.float32)")
        return None
    _TORCH_VALUES.update(dtypes)
    _TORCH_VALUE_NAME.update({v: k for k, v in dtypes.items()})
    TORCH_DTYPES.update({n: d for n, d in dtypes.items() if n in _TORCH_NAMES})
    _TORCH_DTYPE_NAMES.update({v: k for k, v in TORCH_DTYPES.items()})
    torch = mod
    return torch


def _torch_dtype(name: str, table: dict, what: str, bad):
    """The torch.dtype a format name stands for: refused (``bad``) when the name
    is not in the format's list, DependencyError when this torch lacks it."""
    dt = table.get(name) if type(name) is str else None
    if dt is not None:
        return dt
    if name in (_TORCH_NAMES if table is TORCH_DTYPES else _TORCH_VALUE_NAMES):
        raise DependencyError(f"this checkpoint holds {what} of torch dtype {name}, which torch "
                              f"{torch.__version__} lacks", hint="load it with a newer torch")
    raise bad(f"unknown torch dtype {name!r} for {what}")


_bind_torch()


# --- encoding ---------------------------------------------------------------------

class _Unencodable(Exception):
    def __init__(self, msg: str):
        self.msg = msg
        self.path: list[str] = []


def _key_repr(k) -> str:
    return f"[{k!r}]"


class Encoded:
    """The result of :func:`encode_state`: the tree, the tensor descriptors, and per
    blob its bytes (``blobs``) and what keeps them alive (``owners``)."""

    def __init__(self, tree: bytes, tensors: list[dict], blobs: list[memoryview], owners: list,
                 cuts: list | None = None):
        self.tree = tree
        self.tensors = tensors
        self.blobs = blobs
        self.owners = owners
        # Where the tree's bytes fall apart naturally, as (offset, key, kind), around the
        # segments of a long list that were packed as a whole (their bytes stay put while the
        # list grows after them): "segment" where one starts after other bytes, "joined" where
        # one follows another, "tail" where the items after the last one start (the list's open
        # end), "end" where the list ends. ``key`` names the place across encodes.
        self.cuts = cuts if cuts is not None else []

    @property
    def payload_bytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)


class EncodeMemo:
    """What the last encode of a run found in its long lists, so the next encode
    walks only what changed. For each full segment of ``SEGMENT`` items of a list
    at a given path:

    - when it holds plain data only (exact None, bool, int, float, str, bytes,
      list, dict: no tensors, tuples or subclasses), its bytes. A segment that
      packs to the same bytes again holds the same values, already checked once,
      so it goes into the tree as it is instead of through the walker (packing
      in C costs about a tenth of walking in Python);
    - when it holds tensors only, each a different one, read in place
      (:func:`_signature`), what they encoded to (:class:`_TensorRun`). The same
      objects with the same signatures encode the same again (their bytes are
      read afresh: content is never remembered here).

    A list that only grew is walked only in its new tail."""

    SEGMENT = 64

    def __init__(self):
        self._last: dict = {}
        self._next: dict = {}
        self.reused_items = 0
        self.tensors = _TensorMemo()

    def done(self, ok: bool) -> None:
        if ok:
            self._last = self._next
        self._next = {}
        self.tensors.done(ok)


class _TensorRun:
    """A segment of a list that encoded to tensor references only, each a new
    reference: ``first`` is the first one's index, ``prefix`` the list's path."""
    __slots__ = ("refs", "sigs", "first", "prefix", "tree", "paths", "known", "descs")

    def __init__(self, seg: list, first: int, prefix: str, tree: list, paths: list, known: list):
        self.refs = list(map(weakref.ref, seg))
        self.sigs = _signatures(seg)
        self.first, self.prefix, self.tree, self.paths, self.known = first, prefix, tree, paths, known
        self.descs = [k.desc for k in known]

    def moved(self, first: int) -> _TensorRun:
        """A copy whose references start at ``first`` (the memo's own is left as it
        is: the encode may still fail)."""
        out = copy.copy(self)
        out.first = first
        out.tree = [msgpack.ExtType(EXT_TENSOR, _packed_index(i)) for i in range(first, first + len(self.tree))]
        out.descs = [{**d, "blob": b} for d, b in zip(self.descs, range(first, first + len(self.descs)))]
        out.known = [_Known(k.ref, k.sig, k.memory_key, d) for k, d in zip(self.known, out.descs)]
        return out


class _Known:
    """What encoding one tensor gave last time, valid while the same object has
    the same signature (:func:`_signature`)."""
    __slots__ = ("ref", "sig", "memory_key", "desc")

    def __init__(self, ref, sig, memory_key, desc):
        self.ref, self.sig, self.memory_key, self.desc = ref, sig, memory_key, desc


class _TensorMemo:
    """Per tensor object (by identity, through a weak reference) what the last
    encode derived from its type, dtype, shape, strides and memory: the format
    check, the memory group, the descriptor. A tensor with the same signature
    gets them again without the checks and the descriptor building; its bytes
    are read afresh every time. Content is never remembered here (the chunker
    and the footer digests look at the bytes). Also the path strings of tensor
    positions, which cost more to build than to look up."""

    def __init__(self):
        self.last: dict[int, _Known] = {}
        self.next: dict[int, _Known] = {}
        self.paths: dict[tuple, str] = {}
        self.next_paths: dict[tuple, str] = {}
        self.reused = 0

    def known(self, x) -> _Known | None:
        k = self.last.get(id(x))
        if k is None or k.ref() is not x or _signature(x) != k.sig:
            return None
        return k

    def done(self, ok: bool) -> None:
        if ok:
            self.last, self.paths = self.next, self.next_paths
        self.next, self.next_paths = {}, {}


_deref = weakref.ref.__call__


def _signature(x):
    """What a tensor's encoding depends on besides its bytes, for a tensor whose
    bytes the codec reads in place (C-contiguous, on the CPU); None for others.
    A numpy array's data pointer is not needed: numpy refuses to resize (the only
    way to move its data) an array that has a weak reference, which the memo holds.
    A torch tensor's can move (``set_``, ``.data =``, ``resize_``): it is part of it."""
    t = type(x)
    if t is np.ndarray:
        if not x.flags.c_contiguous or x.dtype.byteorder == ">" or x.size == 0:
            return None
        return (x.dtype, x.shape, x.strides)
    if torch is not None and (t is torch.Tensor or t is torch.nn.Parameter):
        if (x.device.type != "cpu" or x.layout != torch.strided or not x.is_contiguous() or x.is_conj()
                or x.is_neg() or x.numel() == 0):
            return None
        return (t, x.dtype, x.shape, x.stride(), x.storage_offset(), x.data_ptr(), x.requires_grad)
    return None


_NP_META = attrgetter("dtype", "shape", "strides")


def _all_numpy(xs: list) -> bool:
    return list(map(type, xs)).count(np.ndarray) == len(xs)


def _signatures(seg: list) -> list:
    """What :func:`_signature` depends on, for tensors it accepted, in bulk: in C
    (``map``) for a segment of numpy arrays, where it costs most per item."""
    if _all_numpy(seg):
        return list(map(_NP_META, seg))
    return [list(map(type, seg))] + list(map(_signature, seg))


def plain_packed(x) -> bytes | None:
    """msgpack of ``x`` if it holds only exact None, bool, int, float, str, bytes,
    list and dict (what the walker would pass through unchanged), else None."""
    try:
        return msgpack.packb(x, use_bin_type=True, strict_types=True, unicode_errors="surrogatepass")
    except (TypeError, ValueError, OverflowError):
        return None


def encode_state(state: Any, *, root: str = "state", memo: EncodeMemo | None = None) -> Encoded:
    """Encode ``state`` into a msgpack tree with tensor references, the tensor
    descriptors and the blobs. Raises :class:`EncodeError` naming the path.
    With ``memo``, lists that the last encode with the same memo saw are walked
    only where they changed (:class:`EncodeMemo`); the bytes are the same."""
    _bind_torch()
    enc = _Encoder(memo)
    ok = False
    try:
        tree = enc.value(state, 0)
        if type(tree) is _SplicedList or type(tree) is _SplicedMap:
            packed = _TreeBytes(tree)
            tree_bytes, cuts = b"".join(packed.parts), packed.cuts
        else:
            tree_bytes, cuts = _pack(tree), None
        tensors, blobs, owners = enc.finish()
        if memo is not None:
            enc.record_runs()
        ok = True
    except _Unencodable as e:
        path = root + "".join(reversed(e.path))
        raise EncodeError(f"{path}: {e.msg}") from None
    except RecursionError:
        raise EncodeError(f"{root}: nesting too deep (limit {MAX_DEPTH})") from None
    finally:
        if memo is not None:
            memo.done(ok)   # a failed encode leaves the memo as the last good one left it
    return Encoded(tree_bytes, tensors, blobs, owners, cuts)


_PLAIN_KEYS = (type(None), bool, int, float, str, bytes)


def encode_plain(value: Any, what: str = "meta") -> Any:
    """Check that ``value`` is plain data that loads back equal (FORMAT.md, ``meta``):
    None, bool, int in [-2**63, 2**64), float, str, bytes, bytearray, list, and
    dict whose keys are None, bool, int, float, str or bytes; subclasses of these
    load back as the base type. Not tuples (they would load back as lists) nor
    anything else. Returns ``value``; raises :class:`EncodeError` naming the path."""
    try:
        _check_plain(value, 2)   # the value sits in the metadata map, itself at depth 1
    except _Unencodable as e:
        raise EncodeError(f"{what}{''.join(reversed(e.path))}: {e.msg}") from None
    return value


def _check_plain(x, depth: int) -> None:
    if x is None or isinstance(x, (bool, float, str, bytes, bytearray)):
        return
    if isinstance(x, int):
        if not _INT_MIN <= x <= _INT_MAX:
            raise _Unencodable(f"int {x} is outside msgpack's range [-2**63, 2**64)")
        return
    if not isinstance(x, (list, dict)):
        hint = " (use a list: a tuple would load back as a list)" if isinstance(x, tuple) else ""
        raise _Unencodable(f"cannot encode {type(x)!r} in plain data{hint}")
    if depth > MAX_DEPTH:
        raise _Unencodable(f"nesting deeper than {MAX_DEPTH}")
    if isinstance(x, list):
        for i, item in enumerate(x):
            try:
                _check_plain(item, depth + 1)
            except _Unencodable as e:
                e.path.append(f"[{i}]")
                raise
        return
    if crowded(x, len(x)):
        raise _Unencodable(f"more than {MAX_SAME_HASH} keys share one hash (such a map cannot be loaded "
                           "in linear time)")
    for k, v in x.items():
        try:
            if not isinstance(k, _PLAIN_KEYS):
                raise _Unencodable(f"map key {k!r} is a {type(k).__name__}; plain map keys are None, bool, "
                                   "int, float, str or bytes")
            _check_plain(k, depth + 1)
            _check_plain(v, depth + 1)
        except _Unencodable as e:
            e.path.append(_key_repr(k))
            raise


class _Fragment:
    """Items of a list already packed: a segment whose bytes the memo compared."""
    __slots__ = ("data", "key")

    def __init__(self, data: memoryview, key):
        self.data, self.key = data, key


class _SplicedList:
    """A list of ``n`` items given as ``parts`` in order: :class:`_Fragment` s and
    lists of encoded items still to pack. ``nested``: those items may hold spliced
    containers themselves. ``tail``: the key of the place after the last fragment."""
    __slots__ = ("n", "parts", "nested", "tail")

    def __init__(self, n: int, parts: list, nested: bool, tail=None):
        self.n, self.parts, self.nested, self.tail = n, parts, nested, tail


class _SplicedMap:
    """An encoded dict some of whose values are spliced."""
    __slots__ = ("items",)

    def __init__(self, items: dict):
        self.items = items


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")


class _TreeBytes:
    """The msgpack bytes of an encoded tree holding spliced containers, as parts (no
    copy of a fragment), and where they fall apart (:attr:`Encoded.cuts`). The
    bytes are those of packing the same tree with every fragment's items in place:
    msgpack packs a container as its header then its members, one after another."""

    def __init__(self, tree):
        self.parts: list = []
        self.cuts: list = []
        self.pos = 0
        self.add(tree)

    def emit(self, b) -> None:
        self.parts.append(b)
        self.pos += len(b)

    def add(self, x) -> None:
        t = type(x)
        if t is _SplicedList:
            self.emit(array_header(x.n))
            after = False     # the last part was a fragment
            cut = False       # a fragment was cut at
            for p in x.parts:
                if type(p) is _Fragment:
                    self.cuts.append((self.pos, p.key, "joined" if after else "segment"))
                    self.emit(p.data)
                    after = cut = True
                    continue
                if after:
                    self.cuts.append((self.pos, x.tail, "tail"))
                    after = False
                if x.nested:
                    for item in p:
                        self.add(item)
                else:
                    b = _pack(p)
                    self.emit(memoryview(b)[len(array_header(len(p))):])
            if after:
                self.cuts.append((self.pos, x.tail, "tail"))
            if cut:
                self.cuts.append((self.pos, (x.tail, "end"), "end"))
        elif t is _SplicedMap:
            self.emit(map_header(len(x.items)))
            for k, v in x.items.items():
                self.emit(_pack(k))
                self.add(v)
        else:
            self.emit(_pack(x))


class _Encoder:
    def __init__(self, memo: EncodeMemo | None = None):
        self.memo = memo
        self.refs: list[Any] = []          # tensor objects, by reference index
        self.paths: list[str] = []
        self.by_id: dict[int, int] = {}    # id(obj) -> reference index
        self.stack: list[str] = []
        self.known: list[_Known | None] = []   # per reference, what the memo knew of it
        self.new_runs: list[tuple] = []        # segments to remember once finish() knows their tensors
        self.spans: list[tuple[int, _TensorRun]] = []   # segments taken as remembered: (first reference, run)
        self.spliced = 0                   # how many _SplicedList were made: a container holds one if it changed

    # The walker. Exact types first (the common case), then the rest.
    def value(self, x, depth):
        t = type(x)
        if x is None or t is bool or t is float or t is str or t is bytes:
            return x
        if t is int:
            return x if _INT_MIN <= x <= _INT_MAX else self.bigint(x)
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
            if crowded(items, len(items)):
                raise _Unencodable(f"more than {MAX_SAME_HASH} items of the set share one hash (such a set "
                                   "cannot be loaded in linear time)")
            if depth >= MAX_DEPTH:
                raise _Unencodable(f"nesting deeper than {MAX_DEPTH}")
            out = self.items(items, depth, 0)     # hashable items: no list, so nothing spliced
            if len(set(out)) != len(out):  # items equal once encoded (str subclasses with their own ==)
                raise _Unencodable("set items that differ only by their type would load back equal")
            return msgpack.ExtType(code, self.pack(out))
        if t is complex:
            return msgpack.ExtType(EXT_COMPLEX, self.pack([x.real, x.imag]))
        if torch is not None:
            if t is torch.Size:
                return msgpack.ExtType(EXT_TORCH_SIZE, self.pack(list(x)))
            if t is torch.dtype:
                name = _TORCH_VALUE_NAME.get(x)
                if name is None:
                    raise _Unencodable(f"cannot encode torch dtype {x} (not in the format's list)")
                return msgpack.ExtType(EXT_TORCH_DTYPE, self.pack(name))
            if t is torch.device:
                name = str(x)
                if _device_syntax(name) not in _DEVICE_TYPES:
                    raise _Unencodable(f"cannot encode torch device {name!r} (not in the format's list)")
                return msgpack.ExtType(EXT_TORCH_DEVICE, self.pack(name))
        if t is np.dtype or isinstance(x, np.dtype):
            name = np_dtype_name(x)
            if name is None:
                raise _Unencodable(f"cannot encode numpy dtype {x!r}")
            return msgpack.ExtType(EXT_NP_DTYPE, self.pack(name))
        # A subclass keeps its characters, not what its __str__ or __bytes__ says: str() of a
        # (str, Enum) member is 'Mode.TRAIN', not its value 'train'.
        if isinstance(x, str):
            return str.__str__(x)
        if isinstance(x, bytes):
            return bytes.__getitem__(x, slice(None))
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
        if type(obj) is _SplicedList or type(obj) is _SplicedMap:
            return b"".join(_TreeBytes(obj).parts)
        return _pack(obj)

    def bigint(self, x: int):
        n = (x.bit_length() + 8) // 8
        return msgpack.ExtType(EXT_BIGINT, x.to_bytes(n, "little", signed=True))

    def seq(self, xs, depth):
        if depth >= MAX_DEPTH:  # depth counts from 0 here: this container is at depth + 1
            raise _Unencodable(f"nesting deeper than {MAX_DEPTH}")
        memo = self.memo
        if memo is None or type(xs) is not list or len(xs) < 2 * memo.SEGMENT:
            spliced = self.spliced
            out = self.items(xs, depth, 0)
            return out if self.spliced == spliced else _SplicedList(len(xs), [out], True)
        spliced = self.spliced
        parts: list = []         # _Fragment, or a list of items still to pack
        out: list = []
        n = memo.SEGMENT
        full = len(xs) // n * n
        path = (depth, *self.stack)
        prefix = None
        for j in range(0, full, n):
            seg = xs[j:j + n]
            key = (path, j)
            last = memo._last.get(key)
            packed = None
            if type(last) is _TensorRun:
                if prefix is None:
                    prefix = self._path()
                run = self._reuse_run(last, seg, prefix, out)
                if run is not None:
                    memo._next[key] = run
                    memo.reused_items += n
                    continue
            else:
                packed = plain_packed(seg)
                if packed is not None and last == packed:
                    memo.reused_items += n
                    memo._next[key] = packed
                    out = self._fragment(parts, out, packed, key, n)
                    continue
            before, inner = len(self.refs), self.spliced
            walked = self.items(seg, depth, j)
            if packed is not None:
                # plain data walks to itself: the bytes packed above are the segment's, checked now
                memo._next[key] = packed
                self.spliced = inner
                out = self._fragment(parts, out, packed, key, n)
                continue
            out += walked
            if len(self.refs) == before + n and all(map(is_, self.refs[before:], seg)):
                if prefix is None:
                    prefix = self._path()
                self.new_runs.append((key, seg, before, prefix, out[-n:]))
        out += self.items(xs[full:], depth, full)
        if not parts:
            return out if self.spliced == spliced else _SplicedList(len(xs), [out], True)
        if out:
            parts.append(out)
        nested = self.spliced != spliced
        self.spliced += 1
        return _SplicedList(len(xs), parts, nested, (path, "tail"))

    @staticmethod
    def _fragment(parts: list, out: list, packed: bytes, key, n: int) -> list:
        """Add a segment of ``n`` items packed as a whole (an array) to ``parts``, after
        the items gathered in ``out``; returns the list to gather the next items in."""
        if out:
            parts.append(out)
        parts.append(_Fragment(memoryview(packed)[len(array_header(n)):], key))
        return [] if out else out

    def _reuse_run(self, run: _TensorRun, seg: list, prefix: str, out: list) -> _TensorRun | None:
        """Take ``seg`` as ``run`` encoded it, if it holds the same tensors with the
        same signatures and none of them was referenced earlier in this state.
        Returns the run to remember (itself, or a copy at its new first index)."""
        if run.prefix != prefix or not all(map(is_, map(_deref, run.refs), seg)):
            return None
        if _signatures(seg) != run.sigs:
            return None
        ids = list(map(id, seg))
        if not self.by_id.keys().isdisjoint(ids):
            return None
        first = len(self.refs)
        if first != run.first:      # what precedes it changed: its references (and blobs) moved
            run = run.moved(first)
        self.by_id.update(zip(ids, range(first, first + len(seg))))
        self.refs += seg
        self.paths += run.paths
        self.known += run.known
        self.spans.append((first, run))
        out += run.tree
        return run

    def record_runs(self) -> None:
        """Remember the tensor segments walked this time whose tensors all got a
        :class:`_Known` (after :meth:`finish`)."""
        for key, seg, first, prefix, tree in self.new_runs:
            known = self.known[first:first + len(seg)]
            if all(k is not None for k in known):
                self.memo._next[key] = _TensorRun(seg, first, prefix, tree, self.paths[first:first + len(seg)],
                                                  known)

    def items(self, xs, depth, first: int) -> list:
        out = []
        stack = self.stack
        d = depth + 1
        for i, item in enumerate(xs, first):
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
        if depth >= MAX_DEPTH:
            raise _Unencodable(f"nesting deeper than {MAX_DEPTH}")
        if crowded(m, len(m)):
            raise _Unencodable(f"more than {MAX_SAME_HASH} keys share one hash (such a map cannot be loaded "
                               "in linear time)")
        out = {}
        d = depth + 1
        spliced = self.spliced
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
        if len(out) != len(m):  # keys equal once encoded (str subclasses with their own ==)
            raise _Unencodable("keys that differ only by their type would load back equal")
        return out if self.spliced == spliced else _SplicedMap(out)

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
            known = self.memo.tensors.known(x) if self.memo is not None else None
            if known is None:
                if isinstance(x, np.ndarray):
                    _check_np(x)
                else:
                    _check_torch(x)
            idx = len(self.refs)
            self.by_id[id(x)] = idx
            self.refs.append(x)
            self.paths.append(self._path())
            self.known.append(known)
        return msgpack.ExtType(EXT_TENSOR, _packed_index(idx))

    def _path(self) -> str:
        if self.memo is None:
            return "state" + "".join(_key_repr(k) for k in self.stack)
        memo = self.memo.tensors
        # only str and int steps: other keys can be equal and print differently (1 and True, 0.0 and -0.0)
        key = tuple(self.stack)
        if not all(type(k) is str or type(k) is int for k in key):
            return "state" + "".join(_key_repr(k) for k in self.stack)
        path = memo.paths.get(key)
        if path is None:
            path = "state" + "".join(_key_repr(k) for k in self.stack)
        memo.next_paths[key] = path
        return path

    # Group tensors by the memory they live in, then lay out blobs.
    def finish(self) -> tuple[list[dict], list[memoryview], list]:
        refs, known = self.refs, self.known
        keys = [_memory_key(x, i) if k is None else k.memory_key for i, (x, k) in enumerate(zip(refs, known))]
        if len(set(keys)) == len(keys):     # no two tensors share memory: blob i holds tensor i
            return self._finish_unshared(keys)
        by_key: dict[Any, list[int]] = {}
        for i, key in enumerate(keys):
            by_key.setdefault(key, []).append(i)
        descs: list[dict | None] = [None] * len(refs)
        views: list[memoryview] = []
        owners: list = []
        for key, members in by_key.items():
            if len(members) == 1:
                i = members[0]
                d, view, owner = self._one(i, len(views), key)
                descs[i] = d
                views.append(view)
                owners.append(owner)
            else:
                _shared_group(members, refs, self.paths, descs, views, owners)
        return descs, views, owners  # type: ignore[return-value]

    def _finish_unshared(self, keys: list) -> tuple[list[dict], list[memoryview], list]:
        refs = self.refs
        n = len(refs)
        descs: list = [None] * n
        views: list = [None] * n
        owners: list = list(refs)
        pos = 0
        spans = self.spans + [(n, None)]
        for first, run in spans:
            for i in range(pos, first):       # walked one by one
                descs[i], views[i], owners[i] = self._one(i, i, keys[i])
            if run is None:
                break
            m = len(run.descs)
            if any(d["blob"] != b for d, b in zip(run.descs, range(first, first + m))):
                # made when some tensors shared memory (blobs were not numbered as references
                # then): renumber, blob i for reference i as below
                run = run.moved(first)
            seg = refs[first:first + m]
            views[first:first + m] = _own_bytes_all(seg)
            descs[first:first + m] = run.descs      # blob i is reference i
            if self.memo is not None:
                self.memo.tensors.next.update(zip(map(id, seg), run.known))
                self.memo.tensors.reused += m
            pos = first + m
        return descs, views, owners

    def _one(self, i: int, b: int, key) -> tuple[dict, memoryview, Any]:
        """Descriptor (blob ``b``), bytes and owner of reference ``i`` stored alone
        (``key``: its memory group)."""
        x, k = self.refs[i], self.known[i]
        memo = self.memo.tensors if self.memo is not None else None
        if k is not None and k.desc["path"] == self.paths[i]:
            memo.reused += 1
            d = k.desc if k.desc["blob"] == b else {**k.desc, "blob": b}
            view, owner = _own_bytes(x), x
        else:
            view, owner = _compact_bytes(x)
            d = _descriptor(x, self.paths[i], b, 0, None)
            if memo is not None:
                sig = _signature(x)
                k = None if sig is None else _Known(weakref.ref(x), sig, key, d)
                self.known[i] = k
        if k is not None:
            k.desc = d
            memo.next[id(x)] = k
        return d, view, owner


def _packed_index(idx: int) -> bytes:
    """msgpack of a non-negative int, as msgpack.packb writes it (the shortest form)."""
    if idx < 0x80:
        return _FIXINTS[idx]
    if idx < 0x100:
        return b"\xcc" + idx.to_bytes(1, "big")
    if idx < 0x10000:
        return b"\xcd" + idx.to_bytes(2, "big")
    if idx < 0x100000000:
        return b"\xce" + idx.to_bytes(4, "big")
    return b"\xcf" + idx.to_bytes(8, "big")


_FIXINTS = [bytes([i]) for i in range(0x80)]


def _shape_error(shape, itemsize: int) -> str | None:
    """What makes a shape one the format cannot hold (FORMAT.md section 6), or None."""
    if len(shape) > 64:
        return f"{len(shape)} dimensions (at most 64)"
    if any(n >= 1 << 62 for n in shape):
        return f"a dimension of 2**62 or more in {tuple(shape)}"
    if math.prod(n for n in shape if n) * itemsize >= 1 << 63:
        return f"shape {tuple(shape)} spans 2**63 bytes or more"
    return None


def _check_np(a: np.ndarray) -> None:
    if type(a) not in (np.ndarray, np.memmap):
        # a masked array or matrix would come back a plain array, silently losing what makes it one
        raise _Unencodable(f"cannot encode numpy array subclass {type(a)!r} (convert with np.asarray)")
    if np_dtype_name(a.dtype) is None:
        kind = "object" if a.dtype.kind == "O" else "structured" if a.dtype.fields else str(a.dtype)
        raise _Unencodable(f"cannot encode numpy array of {kind} dtype (only numeric, bool, complex and "
                           "datetime dtypes; object arrays would need pickle)")
    err = _shape_error(a.shape, a.itemsize)
    if err:
        raise _Unencodable(f"cannot encode an array of {err}")


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
    if _device_syntax(str(t.device)) is None:
        raise _Unencodable(f"cannot encode a tensor on device {str(t.device)!r}")
    err = _shape_error(t.shape, t.element_size())
    if err:
        raise _Unencodable(f"cannot encode a tensor of {err}")


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


def _extent(ptr: int, shape, byte_strides, itemsize: int) -> tuple[int, int]:
    lo = hi = ptr
    for n, s in zip(shape, byte_strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


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


# --- decoding ---------------------------------------------------------------------

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


sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * MAX_DEPTH + 1000))
