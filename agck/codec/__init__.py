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

The package: ``tables`` (extension codes, dtype and device tables, the torch
binding, what both directions share), ``encode`` (state -> tree, descriptors,
blobs; EncodeMemo), ``blobs`` (the encoder's tensors -> blobs layout) and
``decode`` (tree, descriptors, blobs -> state). The names other modules use
are re-exported here.
"""

from ..errors import EncodeError
from ..format import MAX_DEPTH
from .decode import check_map_location, decode_state
from .encode import Encoded, EncodeMemo, encode_plain, encode_state, plain_packed
from .tables import (EXT_BIGINT, EXT_COMPLEX, EXT_FROZENSET, EXT_NP_DTYPE, EXT_NP_SCALAR, EXT_SET, EXT_TENSOR,
                     EXT_TORCH_DEVICE, EXT_TORCH_DTYPE, EXT_TORCH_SIZE, EXT_TUPLE, TORCH_DTYPES, np_dtype_from_name,
                     np_dtype_name)

# Private names that tests and tools reach through agck.codec, as they did when it was one module.
from .decode import _Decoder  # noqa: F401
from .tables import (_DEVICE_TYPES, _NP_LONG_DOUBLE, _NP_NAMES, _TORCH_NAMES, _TORCH_VALUE_NAMES,  # noqa: F401
                     _TORCH_VALUES, _bind_torch, _device_syntax)

__all__ = ["EncodeError", "MAX_DEPTH", "check_map_location", "decode_state", "Encoded", "EncodeMemo", "encode_plain",
           "encode_state", "plain_packed", "EXT_BIGINT", "EXT_COMPLEX", "EXT_FROZENSET", "EXT_NP_DTYPE",
           "EXT_NP_SCALAR", "EXT_SET", "EXT_TENSOR", "EXT_TORCH_DEVICE", "EXT_TORCH_DTYPE", "EXT_TORCH_SIZE",
           "EXT_TUPLE", "TORCH_DTYPES", "np_dtype_from_name", "np_dtype_name"]
