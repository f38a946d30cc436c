"""The encoder: a state tree -> a msgpack tree with tensor references, the tensor
descriptors and the blobs (:func:`encode_state`); and the check that metadata
is plain data that loads back equal (:func:`encode_plain`).

What the format cannot hold, or what would not load back as it was saved,
raises EncodeError naming its path; a tree it returns obeys the tree rules
(FORMAT.md section 8), so it loads. The bytes depend only on the state:
:class:`EncodeMemo` lets the next encode of a run skip what it already walked,
and it gives the bytes a fresh encode gives.
"""

from __future__ import annotations

import copy
import weakref
from operator import attrgetter, is_
from typing import Any

import msgpack
import numpy as np

from ..errors import EncodeError
from ..format import MAX_DEPTH, MAX_SAME_HASH, array_header, crowded, map_header, nan_twins
from .blobs import _all_numpy, _compact_bytes, _descriptor, _memory_key, _own_bytes, _own_bytes_all, _shared_group
from .tables import (EXT_BIGINT, EXT_COMPLEX, EXT_FROZENSET, EXT_NP_DTYPE, EXT_NP_SCALAR, EXT_SET, EXT_TENSOR,
                     EXT_TORCH_DEVICE, EXT_TORCH_DTYPE, EXT_TORCH_SIZE, EXT_TUPLE, _DEVICE_TYPES, _INT_MAX, _INT_MIN,
                     _TORCH_DTYPE_NAMES, _TORCH_VALUE_NAME, _bind_torch, _device_syntax, _shape_error,
                     np_dtype_from_name, np_dtype_name, share_torch)

torch: Any = None          # the torch module once it is bound: see share_torch
share_torch(globals())


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
_NAN_TWINS = "keys equal but for NaNs of the same bits are one key in the format (the map would not load)"


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
    if nan_twins(x):
        raise _Unencodable(_NAN_TWINS)


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
            if nan_twins(x):
                raise _Unencodable("set items equal but for NaNs of the same bits are one item in the format "
                                   "(the set would not load)")
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
        if nan_twins(m):
            raise _Unencodable(_NAN_TWINS)
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
