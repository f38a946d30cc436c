"""The value codec: bit-exact round trips, sharing, refusals, buffer ownership."""

import math
import os
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import agck
from agck import codec, errors
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
from make_golden import assert_same  # noqa: E402

# Warnings are errors here: decoding must not trip torch's non-writable-buffer warning.
# ComplexHalf creation warns inside torch itself; that one is not ours.
pytestmark = [pytest.mark.filterwarnings("error::UserWarning"),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

# AGCK_FUZZ_EXAMPLES raises the count for a longer session.
_N = int(os.environ.get("AGCK_FUZZ_EXAMPLES", 300))
SETTINGS = settings(max_examples=_N, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NP_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "float32", "float64", "complex64", "complex128",
             "datetime64[ns]", "datetime64[D]", "timedelta64[us]"]
if hasattr(np, "float128"):
    NP_DTYPES += ["float128", "complex256"]
codec._bind_torch(load=True)  # agck may have been imported, by another test module, before torch
TORCH_DTYPES = sorted(codec.TORCH_DTYPES.items())


def roundtrip(state, **kw):
    return agck.loads(agck.dumps(state), **kw).state


# --- strategies -----------------------------------------------------------------

float_bits = st.integers(0, 2 ** 64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0])
floats = st.one_of(float_bits, st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan]), st.floats())
big_ints = st.one_of(st.integers(), st.integers(2 ** 63, 2 ** 200), st.integers(-2 ** 200, -2 ** 63 - 1),
                     st.sampled_from([2 ** 64 - 1, 2 ** 64, -2 ** 63, -2 ** 63 - 1]))
texts = st.text(alphabet=st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=12)
hashable_leaf = st.one_of(st.none(), st.booleans(), big_ints, texts, st.binary(max_size=8))
keys = st.one_of(hashable_leaf, st.tuples(hashable_leaf, hashable_leaf),
                 st.frozensets(st.integers(-5, 5), max_size=3))


@st.composite
def shapes(draw, max_dims=4, max_side=5):
    return tuple(draw(st.lists(st.integers(0, max_side), max_size=max_dims)))


@st.composite
def strided_view(draw, a, allow_negative):
    """A random view: per-axis slice with a random step, then maybe a transpose."""
    idx = []
    for n in a.shape:
        step = draw(st.sampled_from([1, 2, 3] + ([-1, -2] if allow_negative else [])))
        start = draw(st.integers(0, max(n - 1, 0)))
        idx.append(slice(start, None, step) if step > 0 else slice(start, None, step))
    v = a[tuple(idx)]
    if v.ndim >= 2 and draw(st.booleans()):
        perm = draw(st.permutations(range(v.ndim)))
        v = v.transpose(*perm) if isinstance(v, np.ndarray) else v.permute(*perm)
    return v


@st.composite
def np_arrays(draw):
    dt = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = draw(shapes())
    n = math.prod(shape) * dt.itemsize
    raw = bytearray(draw(st.binary(min_size=n, max_size=n)))
    if dt.kind == "b":
        raw = bytearray(b & 1 for b in raw)
    a = np.frombuffer(bytes(raw), dtype=dt).reshape(shape).copy()
    kind = draw(st.sampled_from(["plain", "view", "big_endian", "base_and_view"]))
    if kind == "view":
        return draw(strided_view(a, True))
    if kind == "big_endian" and dt.itemsize > 1 and dt.kind not in "mM":
        return a.astype(dt.newbyteorder(">"))
    if kind == "base_and_view":
        return [a, draw(strided_view(a, True))]
    return a


@st.composite
def torch_tensors(draw):
    name, dt = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes())
    n = math.prod(shape) * dt.itemsize
    raw = bytearray(draw(st.binary(min_size=n, max_size=n)))
    if dt == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = (torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape).clone() if n
             else torch.empty(shape, dtype=dt))
    kind = draw(st.sampled_from(["plain", "view", "grad", "param", "views"]))
    if kind == "view":
        return draw(strided_view(t, False))
    if kind == "grad" and (dt.is_floating_point or dt.is_complex) and not name.startswith("float8") \
            and dt != torch.complex32:
        return t.requires_grad_(True)
    if kind == "param":
        return torch.nn.Parameter(t, requires_grad=False)
    if kind == "views":
        return [t, draw(strided_view(t, False))]
    return t


np_scalars = np_arrays().filter(lambda a: isinstance(a, np.ndarray) and a.size > 0).map(
    lambda a: a.reshape(-1)[0])
torch_misc = st.one_of(
    st.lists(st.integers(0, 2 ** 40), max_size=4).map(torch.Size),
    st.sampled_from([dt for _, dt in TORCH_DTYPES] + [torch.float32]),
    st.sampled_from(["cpu", "cuda", "cuda:3", "meta", "mps"]).map(torch.device))
leaves = st.one_of(hashable_leaf, floats, st.builds(complex, float_bits, float_bits),
                   np_arrays(), np_scalars, torch_tensors(), torch_misc,
                   st.sampled_from(NP_DTYPES).map(np.dtype))
states = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(keys, kids, max_size=4),
        st.sets(hashable_leaf, max_size=4),
        st.frozensets(hashable_leaf, max_size=4)),
    max_leaves=12)


# --- round trips ----------------------------------------------------------------

@SETTINGS
@given(states)
def test_roundtrip_arbitrary_states(state):
    assert_same(state, roundtrip(state))


@settings(max_examples=max(_N // 2, 1), deadline=None)
@given(np_arrays())
def test_roundtrip_numpy_zero_copy(a):
    data = agck.dumps({"a": a})
    assert_same({"a": a}, agck.loads(data, copy=False).state)
    assert_same({"a": a}, agck.loads(data, verify=False).state)


@settings(max_examples=max(_N // 2, 1), deadline=None)
@given(torch_tensors())
def test_roundtrip_torch_zero_copy(t):
    data = agck.dumps([t])
    got = agck.loads(data, copy=False).state
    assert_same([t], got)
    if isinstance(t, torch.nn.Parameter):
        assert type(got[0]) is torch.nn.Parameter


def test_every_torch_dtype_with_views():
    for name, dt in TORCH_DTYPES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.arange(24, dtype=torch.float32).to(torch.complex64 if dt.is_complex else torch.float32)
            t = t.reshape(4, 6).to(dt) if dt != torch.bool else (t.reshape(4, 6).real > 10)
        state = {"t": t, "view": t[1:, ::2].t(), "alone": t.t()[::2].clone().t()}
        assert_same(state, roundtrip(state), f"state<{name}>")


def test_float_bits_and_strings():
    nan_payload = struct.unpack("<d", struct.pack("<Q", 0x7FF4000000000ABC))[0]
    neg_nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000001))[0]
    state = [-0.0, nan_payload, neg_nan, 5e-324, "\ud800\udfff\udc00", "", "\x00", b"\x00" * 3,
             np.float32(-0.0), np.frombuffer(struct.pack("<I", 0x7FC00123), np.float32)[0],
             complex(-0.0, nan_payload)]
    assert_same(state, roundtrip(state))


def test_containers_and_keys():
    state = {(1, 2): "t", 2 ** 100: "big", b"b": [1, (2,), {3}], frozenset({1, 2}): frozenset(),
             None: None, -1: {"nested": {"deeper": (set(), [])}}, "": ()}
    got = roundtrip(state)
    assert_same(state, got)
    assert type(got[-1]["nested"]["deeper"][0]) is set


def test_dict_subclasses_and_buffers_decode_as_plain():
    from collections import OrderedDict, defaultdict
    state = {"od": OrderedDict(b=1, a=2), "dd": defaultdict(list, x=[1]),
             "ba": bytearray(b"xy"), "mv": memoryview(b"zz")}
    got = roundtrip(state)
    assert type(got["od"]) is dict and list(got["od"]) == ["b", "a"]
    assert got["ba"] == b"xy" and got["mv"] == b"zz"


def test_str_and_bytes_subclasses_keep_their_characters():
    """A subclass loads back as the base type with its own characters, whatever its
    __str__ or __bytes__ says (str() of a (str, Enum) member is its name)."""
    import enum

    class Mode(str, enum.Enum):
        TRAIN = "train"

    class Loud(str):
        def __str__(self):
            return "LOUD"

    class Raw(bytes):
        def __bytes__(self):
            return b"other"

    state = {"mode": Mode.TRAIN, Mode.TRAIN: [Loud("quiet")], "raw": Raw(b"xy")}
    got = roundtrip(state)
    assert got == {"mode": "train", "train": ["quiet"], "raw": b"xy"}
    assert type(got["mode"]) is str and type(got["raw"]) is bytes
    assert agck.loads(agck.dumps({}, meta={"mode": Mode.TRAIN, "l": Loud("q")})).meta == {"mode": "train", "l": "q"}


def test_numpy_scalars_and_dtypes():
    state = [np.float16(1.5), np.int64(-3), np.uint8(255), np.bool_(False), np.complex64(1j),
             np.datetime64("2024-01-01T00:00:00", "s"), np.timedelta64(-5, "ns"),
             np.dtype("int16"), np.dtype(">f8"), np.dtype("datetime64[ms]")]
    got = roundtrip(state)
    assert_same([s if not isinstance(s, np.dtype) else s.newbyteorder("=") for s in state], got)


def test_torch_flags_and_misc():
    p = torch.nn.Parameter(torch.randn(3, 2))
    g = torch.randn(4, dtype=torch.float64).requires_grad_(True)
    state = {"p": p, "g": g, "size": torch.Size([1, 2, 3]), "dtypes": [torch.bfloat16, torch.float8_e5m2],
             "dev": torch.device("cuda:2"), "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False)}
    got = roundtrip(state)
    assert_same(state, got)
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad and got["p"].is_leaf
    assert type(got["g"]) is torch.Tensor and got["g"].requires_grad and got["g"].is_leaf
    assert type(got["frozen"]) is torch.nn.Parameter and not got["frozen"].requires_grad


def test_conj_view_stored_resolved():
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    got = roundtrip({"x": x, "y": x.conj()})
    assert torch.equal(got["y"], torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert torch.equal(got["x"], x)


# --- sharing --------------------------------------------------------------------

def test_tied_weights_stay_one_object():
    w = torch.nn.Parameter(torch.randn(4, 3))
    sd = {"embed.weight": w, "head.weight": w}
    data = agck.dumps(sd)
    got = agck.loads(data).state
    assert got["embed.weight"] is got["head.weight"]
    assert len(agck.inspect(data)["tensors"]) == 1


def test_torch_views_of_one_storage_share():
    s = torch.arange(30, dtype=torch.float32)
    state = [s[5:25].reshape(4, 5), s[::3], s.reshape(5, 6).t(), s[10:12].view(torch.int32)]
    data = agck.dumps(state)
    info = agck.inspect(data)
    assert {t["blob"] for t in info["tensors"]} == {0}
    for copy in (True, False):
        got = agck.loads(bytearray(data), copy=copy).state
        assert_same(state, got)
        ptrs = {g.untyped_storage().data_ptr() for g in got}
        assert len(ptrs) == 1
        if copy:
            got[0][0, 0] = -1.0  # element 5 of the original storage
            assert got[2][5, 0] == -1.0 and got[1][0] == 0.0


def test_numpy_views_of_one_base_share():
    base = np.arange(40, dtype=np.int32).reshape(5, 8)
    state = {"v1": base[1:4, 2:6], "v2": base[::-1, ::2], "v3": base.T, "v4": base[2].view(np.uint8)}
    got = roundtrip(state)
    assert_same(state, got)
    arrs = list(got.values())
    assert all(np.shares_memory(arrs[0], a) or a is arrs[0] for a in arrs[1:3])
    got["v3"][2, 1] = 999      # base[1, 2]
    assert got["v1"][0, 0] == 999


def test_overlapping_views_single_span():
    s = torch.zeros(100, dtype=torch.float64)
    a, b = s[10:30], s[20:40]
    data = agck.dumps([a, b])
    info = agck.inspect(data)
    blob_sizes = {t["blob_nbytes"] for t in info["tensors"]}
    assert len(blob_sizes) == 1 and blob_sizes.pop() <= 8 * 30 + 16  # span, not the whole storage
    got = agck.loads(data).state
    got[0][15] = 7.0
    assert got[1][5] == 7.0


# --- refusals -------------------------------------------------------------------

def test_encode_error_names_the_path():
    state = {"model": {"layers": [0, 1, 2, object()]}}
    with pytest.raises(agck.EncodeError) as ei:
        agck.dumps(state)
    assert str(ei.value).startswith("state['model']['layers'][3]: cannot encode <class 'object'>")
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, agck.AgckError)


@pytest.mark.parametrize("bad, what", [
    (np.array([1, "a"], dtype=object), "object"),
    (np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "structured"),
    (np.array(["ab"]), "numpy array"),
    (np.zeros(2, dtype="datetime64[2s]"), "numpy array"),
    (torch.zeros(2).to_sparse(), "sparse"),
    (torch.zeros(2, device="meta"), "meta"),
    (torch.nn.Linear(2, 2), "state_dict"),
    (lambda: 0, "cannot encode"),
    (type("T", (tuple,), {})((1,)), "tuple subclass"),
])
def test_unencodable_values(bad, what):
    with pytest.raises(agck.EncodeError, match=what):
        agck.dumps({"k": [bad]})
    with pytest.raises(agck.EncodeError, match=r"state\['k'\]\[0\]"):
        agck.dumps({"k": [bad]})


def test_too_deep_is_refused():
    x = []
    for _ in range(codec.MAX_DEPTH + 5):
        x = [x]
    with pytest.raises(agck.EncodeError, match="nesting"):
        agck.dumps(x)
    y = []
    for _ in range(codec.MAX_DEPTH - 2):
        y = [y]
    assert_same(y, roundtrip(y))


def test_deepest_encodable_tuples_decode_in_a_small_thread():
    # each tuple level is one nested msgpack unpack; it must not exhaust a thread's C stack
    import threading
    x = ()
    for _ in range(codec.MAX_DEPTH - 1):
        x = (x, {1})
    data = agck.dumps(x)
    out = []
    old = threading.stack_size(2 << 20)
    try:
        t = threading.Thread(target=lambda: out.append(agck.loads(data).state))
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    assert_same(x, out[0])


# --- buffers and ownership ------------------------------------------------------

def test_loads_copy_false_views_the_input():
    a = np.arange(16, dtype=np.float32)
    t = torch.arange(8, dtype=torch.int64)
    data = agck.dumps({"a": a, "t": t})
    got = agck.loads(data, copy=False).state
    raw = np.frombuffer(data, np.uint8)
    assert np.shares_memory(got["a"], raw) and not got["a"].flags.writeable
    ba = bytearray(data)
    got2 = agck.loads(ba, copy=False).state
    assert got2["a"].flags.writeable
    got2["a"][0] = 42  # writes land in the caller's buffer
    assert 42 in np.frombuffer(bytes(ba), np.float32)


def test_loads_default_owns_writable_memory():
    data = agck.dumps({"a": np.arange(16, dtype=np.float32), "t": torch.arange(8)})
    got = agck.loads(data).state
    assert got["a"].flags.writeable and not np.shares_memory(got["a"], np.frombuffer(data, np.uint8))
    got["a"][:] = -1
    got["t"].add_(1)
    assert agck.loads(data).state["a"][1] == 1.0


def test_load_mmap_is_private_and_writable(tmp_path):
    p = tmp_path / "c.agck"
    agck.save(p, {"a": np.arange(100, dtype=np.float64), "t": torch.ones(50)})
    before = p.read_bytes()
    ck = agck.load(p)
    assert ck.state["a"].flags.writeable
    ck.state["a"][:] = 123.0
    ck.state["t"].mul_(3)
    del ck
    assert p.read_bytes() == before
    again = agck.load(p).state
    assert again["a"][5] == 5.0 and again["t"][0] == 1.0
    not_mapped = agck.load(p, mmap=False).state
    assert not_mapped["a"].flags.writeable


def test_zero_stride_views_share():
    base = np.arange(4.0)
    t = torch.arange(4.0)
    state = [base, np.broadcast_to(base, (3, 4)), t, t.expand(3, 4)]
    got = roundtrip(state)
    assert_same(state, got)
    assert np.shares_memory(got[0], got[1]) and got[3].stride() == (0, 1)
    assert got[3].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()


def test_torch_is_imported_only_when_a_state_needs_it(tmp_path):
    # `import agck` and numpy-only use never pay torch's import; torch values still
    # encode when torch arrives after agck, and a torch container imports it to decode.
    import subprocess
    script = f"""
import sys, numpy as np, agck
assert 'torch' not in sys.modules
agck.save({str(tmp_path / 'np.agck')!r}, {{'a': np.arange(3)}})
assert agck.load({str(tmp_path / 'np.agck')!r}).state['a'].tolist() == [0, 1, 2]
assert 'torch' not in sys.modules, 'numpy-only use imported torch'
import torch
agck.save({str(tmp_path / 'pt.agck')!r}, {{'t': torch.arange(4), 'dt': torch.bfloat16, 's': torch.Size([2])}})
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    script = f"""
import sys, agck
c = agck.load({str(tmp_path / 'pt.agck')!r})
import torch
assert torch.equal(c.state['t'], torch.arange(4)) and c.state['dt'] is torch.bfloat16
assert c.state['s'] == torch.Size([2])
"""
    subprocess.run([sys.executable, "-c", script], check=True)


def test_a_torch_import_in_progress_is_never_bound_half_done(tmp_path):
    # One thread imports torch while another keeps encoding numpy states: the codec
    # must not bind the half-initialised module (its dtype table would stay empty).
    import subprocess
    script = """
import threading, time, numpy as np, agck
from agck import codec, errors
import msgpack
done = threading.Event()
def importer():
    import torch  # noqa: F401
    done.set()
t = threading.Thread(target=importer)
t.start()
while not done.is_set():
    agck.dumps({"a": np.ones(3)})
    time.sleep(0.001)          # leave the GIL to the import most of the time
t.join()
import torch
assert agck.loads(agck.dumps({"x": torch.ones(3)})).state["x"].dtype == torch.float32
assert len(codec.TORCH_DTYPES) > 10
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_missing_torch_is_a_dependency_error_not_corruption(tmp_path):
    # A machine without (or with a broken) torch says nothing about the checkpoint:
    # loading raises DependencyError, and recovery does not walk back past it.
    import subprocess
    store = tmp_path / "store"
    s = agck.open_store(str(store))
    s.put("r", 1, {"n": np.arange(3)})
    s.put("r", 2, {"t": torch.arange(3)})
    s.close()
    script = f"""
import sys
sys.modules["torch"] = None      # `import torch` now raises ImportError
import agck
try:
    agck.open_store({str(store)!r}).get("r", 2)
except agck.DependencyError as e:
    assert "import torch" in str(e), e
else:
    raise SystemExit("no DependencyError")
try:
    agck.recover({str(store)!r}, "r")
except agck.DependencyError:
    pass
else:
    raise SystemExit("recovery walked back past a checkpoint it could not decode")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; "
                        "from agck.cli import main; sys.exit(main(['recover', sys.argv[1]]))", str(store)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 4 and "import torch" in r.stderr and "Traceback" not in r.stderr, r


# --- meta: what saves, loads ------------------------------------------------------

plain_leaf = st.one_of(st.none(), st.booleans(), big_ints, floats, texts, st.binary(max_size=8),
                       st.binary(max_size=4).map(bytearray))
plain_keys = st.one_of(st.none(), st.booleans(), big_ints, floats, texts, st.binary(max_size=8),
                       st.tuples(st.integers(), st.integers()), st.frozensets(st.integers(), max_size=2))
almost_plain = st.recursive(
    plain_leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
                           st.dictionaries(plain_keys, kids, max_size=3)),
    max_leaves=10)


@SETTINGS
@given(almost_plain)
def test_meta_that_saves_loads_back_equal(meta):
    try:
        data = agck.dumps({}, meta=meta)
    except agck.EncodeError as e:
        assert str(e).startswith("meta")
        return
    assert_same(meta, agck.loads(data).meta, "meta")


@pytest.mark.parametrize("meta, where", [
    ({"k": {(1, 2): 3}}, r"meta\['k'\]\[\(1, 2\)\]: map key \(1, 2\) is a tuple"),
    ({"k": [1, (2, 3)]}, r"meta\['k'\]\[1\]: .*tuple"),
    ({"k": {frozenset(): 1}}, r"meta\['k'\]\[frozenset\(\)\]: map key"),
    ({"k": {"x": np.int64(3)}}, r"meta\['k'\]\['x'\]: cannot encode"),
    ([2 ** 64], r"meta\[0\]: int .* outside"),
    ({2.0 ** (61 * k): k for k in range(9)}, r"meta: more than 8 keys share one hash"),
])
def test_meta_that_would_not_load_is_refused_at_save(tmp_path, meta, where):
    with pytest.raises(agck.EncodeError, match=where):
        agck.save(tmp_path / "m.agck", {}, meta=meta)
    assert not (tmp_path / "m.agck").exists()


def test_meta_subclasses_load_as_the_base_type():
    from collections import OrderedDict
    meta = {"v": torch.__version__, "od": OrderedDict(a=1), "b": bytearray(b"x"), "f": np.float64(0.5)}
    got = agck.loads(agck.dumps({}, meta=meta)).meta
    assert got == {"v": str(torch.__version__), "od": {"a": 1}, "b": b"x", "f": 0.5}
    assert type(got["v"]) is str and type(got["f"]) is float


# --- steps ----------------------------------------------------------------------

def test_numpy_integer_steps_are_accepted():
    ck = agck.loads(agck.dumps({}, step=np.int64(3), parent=np.uint32(2)))
    assert (ck.step, ck.parent) == (3, 2) and type(ck.step) is int and type(ck.parent) is int


@pytest.mark.parametrize("bad", [-1, 2 ** 63, 1.0, True, "3", np.float32(1)])
def test_bad_steps_are_usage_errors(bad):
    for kw in ({"step": bad}, {"parent": bad}):
        with pytest.raises(agck.UsageError):
            agck.dumps({}, **kw)


# --- map_location -----------------------------------------------------------------

def _unusable_devices():
    n = torch.cuda.device_count()
    out = ["banana", "cuda:-1", f"cuda:{n}", "cuda:7" if n < 8 else "banana", torch.device("cuda", n),
           {"cpu": "banana"}, {"cpu": f"cuda:{n}"}, {5: "cpu"}, lambda saved: "banana",
           lambda saved: f"cuda:{n}", lambda saved: 3, lambda saved: 1 / 0, 5, ["cpu"]]
    if not torch.cuda.is_available():
        out += ["cuda", {"cpu": "cuda"}, lambda saved: torch.device("cuda")]
    return out


@pytest.mark.parametrize("loc", _unusable_devices(), ids=repr)
def test_map_location_this_machine_cannot_honour_is_a_usage_error(tmp_path, loc):
    state = {"t": torch.arange(4.0), "p": torch.nn.Parameter(torch.ones(2))}
    data = agck.dumps(state)
    agck.save(tmp_path / "c.agck", state)
    for load in (lambda: agck.loads(data, map_location=loc), lambda: agck.load(tmp_path / "c.agck", map_location=loc)):
        with pytest.raises(agck.UsageError) as ei:
            load()
        assert not isinstance(ei.value, agck.CorruptCheckpointError)
    if not callable(loc):  # checked before anything is read
        with pytest.raises(agck.UsageError):
            agck.loads(b"not a checkpoint", map_location=loc)


@pytest.mark.parametrize("loc", ["cpu", torch.device("cpu"), {"cuda:0": "cpu"}, {"cpu": None},
                                 lambda saved: None, lambda saved: "cpu", "meta"], ids=repr)
def test_usable_map_locations(loc):
    got = agck.loads(agck.dumps({"t": torch.arange(4.0)}), map_location=loc).state["t"]
    assert got.device.type == ("meta" if loc == "meta" else "cpu")


def test_a_broken_torch_is_a_dependency_error_not_corruption():
    import subprocess
    data = agck.dumps({"t": torch.arange(3)})
    script = """
import sys, types
sys.modules["torch"] = types.ModuleType("torch")   # importable, but not torch
import agck
try:
    agck.loads(sys.stdin.buffer.read())
except agck.DependencyError:
    pass
"""
    subprocess.run([sys.executable, "-c", script], input=data, check=True, timeout=120)


def test_missing_dtypes_are_dependency_errors(monkeypatch):
    data = agck.dumps({"t": torch.zeros(2, dtype=torch.float8_e8m0fnu), "d": torch.int4})
    monkeypatch.delitem(codec.TORCH_DTYPES, "float8_e8m0fnu")
    with pytest.raises(agck.DependencyError, match="float8_e8m0fnu"):
        agck.loads(data)
    monkeypatch.undo()
    monkeypatch.delitem(codec._TORCH_VALUES, "int4")
    with pytest.raises(agck.DependencyError, match="int4"):
        agck.loads(data)
    if hasattr(np, "float128"):
        data = agck.dumps([np.zeros(2, np.float128)])
        monkeypatch.setattr(codec.tables, "_NP_NAMES", [n for n in codec._NP_NAMES if n != "float128"])
        with pytest.raises(agck.DependencyError, match="float128"):
            agck.loads(data)


def test_out_of_memory_is_not_corruption(monkeypatch):
    data = agck.dumps({"a": np.arange(4)})

    def no_memory(*a, **kw):
        raise MemoryError

    monkeypatch.setattr(codec._Decoder, "base", no_memory)
    with pytest.raises(MemoryError):
        agck.loads(data)


# --- copy=False over read-only memory ---------------------------------------------

def test_torch_views_of_read_only_bytes_never_write_through():
    t = torch.arange(8, dtype=torch.int64)
    data = agck.dumps({"t": t, "v": t[2:6], "a": np.arange(4.0)})
    before = bytes(data)
    got = agck.loads(data, copy=False).state
    got["t"].add_(100)
    got["v"].mul_(3)
    assert data == before
    assert got["v"][0] == 306 and got["v"].untyped_storage().data_ptr() == got["t"].untyped_storage().data_ptr()
    assert not got["a"].flags.writeable and np.shares_memory(got["a"], np.frombuffer(data, np.uint8))
    assert torch.equal(agck.loads(data).state["t"], t)
    ba = bytearray(data)   # writable memory: still zero-copy
    agck.loads(ba, copy=False).state["t"].add_(1)
    assert ba != data


# --- names come from fixed tables ------------------------------------------------

def test_every_listed_torch_dtype_round_trips():
    values = [codec._TORCH_VALUES[n] for n in codec._TORCH_VALUE_NAMES if n in codec._TORCH_VALUES]
    assert len(values) >= len(codec._TORCH_NAMES) + 10
    assert agck.loads(agck.dumps(values)).state == values


@pytest.mark.parametrize("value", [torch.device("cuda", 128), torch.device("cuda", 200)], ids=str)
def test_devices_the_reader_would_refuse_are_refused_at_save(value):
    if codec._device_syntax(str(value)):
        assert agck.loads(agck.dumps(value)).state == value
    else:
        with pytest.raises(agck.EncodeError, match="device"):
            agck.dumps(value)


def test_decoding_looks_no_name_up_in_torch():
    # A name torch would resolve to a submodule must not import it; aliases are not names either.
    import subprocess
    script = """
import sys, msgpack, torch, agck
from agck import format
assert "torch._dynamo" not in sys.modules and "torch.onnx" not in sys.modules
for name in ["_dynamo", "onnx", "nn", "Tensor", "float", "half", "__class__"]:
    tree = msgpack.packb(msgpack.ExtType(8, msgpack.packb(name)))
    data = b"".join(bytes(p) for p in format.ContainerWriter({"tensors": [], "state": tree}, []).parts())
    try:
        agck.loads(data)
    except agck.MalformedCheckpointError:
        pass
    else:
        raise SystemExit(f"{name!r} decoded")
assert "torch._dynamo" not in sys.modules and "torch.onnx" not in sys.modules, "decoding imported a submodule"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_map_location_device_when_torch_arrived_after_agck():
    import subprocess
    script = """
import sys, agck
data = agck.dumps({"a": 1})
assert "torch" not in sys.modules
import torch
assert agck.loads(data, map_location=torch.device("cpu")).state == {"a": 1}
try:
    agck.loads(data, map_location=torch.device("cuda", torch.cuda.device_count()))
except agck.UsageError:
    pass
else:
    raise SystemExit("no UsageError")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_a_deep_caller_stack_is_not_corruption():
    # Decoding nests a bounded number of frames; running out of stack is the caller's.
    x = ()
    for _ in range(codec.MAX_DEPTH - 1):
        x = (x,)
    data = agck.dumps(x)

    def deep(n):
        return deep(n - 1) if n else agck.loads(data)

    with pytest.raises(RecursionError):
        deep(sys.getrecursionlimit() - 200)


# --- the reader refuses what no writer writes (FORMAT.md sections 6 and 8) --------

def _container(tree: bytes, tensors: list = (), blobs: list = ()) -> bytes:
    from agck import format
    return b"".join(bytes(p) for p in format.ContainerWriter({"tensors": list(tensors), "state": tree},
                                                             list(blobs)).parts())


def _ext_tree(code: int, payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, payload))


@pytest.mark.parametrize("payload, what", [
    (bytes.fromhex("91cf8000000000000000"), "entry 0 is 9223372036854775808"),    # [2**63]
    (msgpack.packb([0, 2 ** 64 - 1]), "entry 1 is 18446744073709551615"),
])
def test_torch_size_entries_beyond_int64_are_refused(payload, what):
    with pytest.raises(errors.MalformedCheckpointError, match=f"torch.Size {what}, outside int64"):
        agck.loads(_container(_ext_tree(9, payload)))


def test_torch_size_entries_at_the_ends_of_int64_load():
    size = torch.Size([2 ** 63 - 1, 0, -2 ** 63, -1])
    assert agck.loads(_container(_ext_tree(9, msgpack.packb(list(size))))).state == size
    assert agck.loads(agck.dumps(size)).state == size


def _encoded_tensor():
    enc = codec.encode_state([np.arange(3, dtype=np.int32)])
    return enc.tree, enc.tensors, enc.blobs


@pytest.mark.parametrize("path, what", [(..., "no path"), (5, "path is a int"), (None, "path is a NoneType"),
                                        (b"state[0]", "path is a bytes")])
def test_a_descriptor_path_is_a_string(path, what):
    tree, tensors, blobs = _encoded_tensor()
    d = dict(tensors[0])
    if path is ...:
        del d["path"]
    else:
        d["path"] = path
    with pytest.raises(errors.MalformedCheckpointError, match=f"tensor 0: {what}"):
        agck.loads(_container(tree, [d], blobs))
    assert agck.loads(_container(tree, [dict(tensors[0], path="anything")], blobs)).state[0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("extra", [5, None, [], "d", b""])
def test_an_unreferenced_descriptor_is_still_a_map(extra):
    tree, tensors, blobs = _encoded_tensor()
    with pytest.raises(errors.MalformedCheckpointError, match="tensor descriptor 1 is not a map"):
        agck.loads(_container(tree, tensors + [extra], blobs))
    assert len(agck.loads(_container(tree, tensors + [{"unreferenced": 1}], blobs)).state) == 1


NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
OTHER_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000002))[0]


def _same_nan() -> float:
    """A NaN of NAN's bits, another object (Python compares NaNs as unequal, even to themselves)."""
    return struct.unpack("<d", struct.pack("<d", NAN))[0]


@pytest.mark.parametrize("tree, what", [
    (b"\x82" + msgpack.packb(NAN) + b"\x00" + msgpack.packb(NAN) + b"\x01", "duplicate map key"),
    (b"\x82" + _ext_tree(1, msgpack.packb([NAN, 1])) + b"\x00" + _ext_tree(1, msgpack.packb([NAN, 1.0])) + b"\x01",
     "duplicate map key"),
    (b"\x82" + _ext_tree(7, msgpack.packb([0.0, NAN])) + b"\x00" + _ext_tree(7, msgpack.packb([0.0, NAN])) + b"\x01",
     "duplicate map key"),
    (b"\x82" + _ext_tree(3, msgpack.packb([NAN])) + b"\x00" + _ext_tree(3, msgpack.packb([NAN])) + b"\x01",
     "duplicate map key"),
    (b"\x82" + _ext_tree(6, msgpack.packb(["float32", b"\x01\x00\xc0\x7f"])) + b"\x00"
     + _ext_tree(6, msgpack.packb(["float32", b"\x01\x00\xc0\x7f"])) + b"\x01", "duplicate map key"),
    (_ext_tree(2, msgpack.packb([NAN, 1, NAN])), "duplicate set item"),
], ids=["float", "tuple", "complex", "frozenset", "numpy", "set"])
def test_nan_keys_of_the_same_bits_are_one_key(tree, what):
    with pytest.raises(errors.MalformedCheckpointError, match=what):
        agck.loads(_container(tree))


def test_nan_keys_of_other_bits_are_distinct():
    tree = b"\x82" + msgpack.packb(NAN) + b"\x00" + msgpack.packb(OTHER_NAN) + b"\x01"
    got = agck.loads(_container(tree)).state
    assert sorted(struct.pack("<d", k) for k in got) == sorted(struct.pack("<d", k) for k in (NAN, OTHER_NAN))
    state = {NAN: 0, OTHER_NAN: 1, (NAN, 1): 2, (_same_nan(), 2): 3, "one": {NAN: 0}}
    assert_same(state, roundtrip(state))
    got = roundtrip({NAN, OTHER_NAN, 1.0})   # sets of NaNs never compare equal: compare their bits
    assert sorted(struct.pack("<d", k) for k in got) == sorted(struct.pack("<d", k) for k in (NAN, OTHER_NAN, 1.0))


@pytest.mark.parametrize("state", [
    {NAN: 0, _same_nan(): 1},
    {"k": [{(NAN, 1): 0, (_same_nan(), 1.0): 1}]},
    {complex(NAN, 0): 0, complex(_same_nan(), 0): 1},
    {np.float32(NAN): 0, np.float32(_same_nan()): 1},
    {"s": {NAN, _same_nan()}},
    [frozenset({NAN, _same_nan(), 1})],
], ids=["float", "tuple", "complex", "numpy", "set", "frozenset"])
def test_the_writer_refuses_nan_keys_of_the_same_bits(state):
    with pytest.raises(agck.EncodeError, match="NaN"):
        agck.dumps(state)
    with pytest.raises(agck.EncodeError, match=r"^state\['k'\]\[0\]: keys equal but for NaNs"):
        agck.dumps({"k": [{NAN: 0, _same_nan(): 1}]})


def test_meta_with_nan_keys_of_the_same_bits_is_refused():
    with pytest.raises(agck.EncodeError, match=r"meta\['k'\]: .*NaN"):
        agck.dumps({}, meta={"k": {NAN: 0, np.float64(_same_nan()): 1}})
    assert len(agck.loads(agck.dumps({}, meta={NAN: 0, OTHER_NAN: 1})).meta) == 2


# --- EncodeMemo: lists walked only where they changed, the same bytes as a fresh encode ---

def _tree_bytes(state, memo=None) -> bytes:
    e = codec.encode_state(state, memo=memo)
    return e.tree + msgpack.packb(e.tensors)


_TYPE_ONLY_CHANGES = [
    lambda r: r.__setitem__("n", float(r["n"])),        # 1 -> 1.0: equal, encoded otherwise
    lambda r: r.__setitem__("n", bool(r["n"] % 2)),      # 1 -> True
    lambda r: r.__setitem__("x", -0.0 if r["x"] == 0.0 else r["x"]),   # 0.0 -> -0.0
    lambda r: r.__setitem__("s", type("S", (str,), {})(r["s"])),     # a str subclass: the walker decides
    lambda r: r.__setitem__("v", tuple(r["v"])),         # a list becomes a tuple
    lambda r: r.__setitem__("v", np.float32(1.5)),       # a numpy scalar
    lambda r: r["v"].append(np.arange(3)),               # an array inside a record
    lambda r: r.__setitem__(1, "int key"),               # a new key
]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_encode_memo_gives_the_bytes_of_a_fresh_encode(seed):
    rng = np.random.default_rng(seed)
    n = codec.EncodeMemo.SEGMENT
    records = [{"s": f"doc-{i}", "n": i % 3, "x": 0.0, "v": [float(i)] * 3} for i in range(int(rng.integers(2 * n, 5 * n)))]
    state = {"records": records, "nested": {"deep": [list(range(4)) for _ in range(2 * n)]},
             "in_records": [{"long": list(range(2 * n + i))} for i in range(2)],   # spliced inside a dict in a list
             "in_tuple": (list(range(2 * n)), "x")}                                 # and inside a tuple
    memo = codec.EncodeMemo()
    for _ in range(5):
        assert _tree_bytes(state, memo) == _tree_bytes(state)
        _check_cuts(codec.encode_state(state, memo=memo))
        for _ in range(int(rng.integers(0, 4))):
            kind = int(rng.integers(0, 4))
            if kind == 0:
                records.append({"s": "new", "n": 1, "x": 2.0, "v": []})
            elif kind == 1:
                r = records[int(rng.integers(0, len(records)))]
                _TYPE_ONLY_CHANGES[int(rng.integers(0, len(_TYPE_ONLY_CHANGES)))](r)
            elif kind == 2:
                state["nested"]["deep"][int(rng.integers(0, 2 * n))][0] += 1
            else:
                del records[int(rng.integers(0, len(records)))]    # everything after it shifts
    assert memo.reused_items > 0


def _check_cuts(e) -> None:
    """Every cut of an encode falls between two items of a list: the bytes from it to
    the next cut (or the end) start with whole msgpack values."""
    offsets = [off for off, _, _ in e.cuts]
    assert offsets == sorted(offsets) and all(0 < off <= len(e.tree) for off in offsets)
    for off, key, kind in e.cuts:
        if off < len(e.tree):
            u = msgpack.Unpacker(raw=False, strict_map_key=False)
            u.feed(e.tree[off:])
            next(u)                           # a whole value starts here


def test_encode_memo_cuts_at_the_segments_of_a_list_that_grew():
    n = codec.EncodeMemo.SEGMENT
    records = [{"doc": f"d{i}", "x": float(i)} for i in range(3 * n + 10)]
    memo = codec.EncodeMemo()
    first = codec.encode_state({"out": records}, memo=memo)
    records += [{"doc": "new", "x": 0.5}] * 7
    again = codec.encode_state({"out": records}, memo=memo)
    assert again.tree == codec.encode_state({"out": records}).tree
    item = [len(msgpack.packb(r)) for r in records]
    start = len(msgpack.packb({"out": []})) + 2          # the array header grew from 1 to 3 bytes
    at = [start + sum(item[:j]) for j in (0, n, 2 * n, 3 * n, len(records))]
    assert [off for off, _, _ in again.cuts] == at
    assert [kind for _, _, kind in again.cuts] == ["segment", "joined", "joined", "tail", "end"]
    assert [k for _, k, _ in again.cuts] == [k for _, k, _ in first.cuts]   # places keep their names
    assert again.tree[at[0]:at[3]] == first.tree[at[0]:at[3]]              # the segments' bytes stay put
    assert len(again.tree) == at[4]                                         # the list ends the tree


def test_encode_memo_reports_a_changed_record_that_became_unencodable():
    n = codec.EncodeMemo.SEGMENT
    state = {"r": [{"a": i} for i in range(3 * n)]}
    memo = codec.EncodeMemo()
    codec.encode_state(state, memo=memo)
    state["r"][5]["a"] = object()
    with pytest.raises(errors.EncodeError, match=r"state\['r'\]\[5\]\['a'\]"):
        codec.encode_state(state, memo=memo)
    state["r"][5]["a"] = 7                  # the failed encode left the memo as it was
    assert _tree_bytes(state, memo) == _tree_bytes(state)


# --- the tensor memo: same objects with the same signature encode the same; anything else is walked ---

def _encoded(state, memo=None):
    """Everything an encode produces: tree, descriptors, and each blob's bytes."""
    e = codec.encode_state(state, memo=memo)
    return e.tree, msgpack.packb(e.tensors), [bytes(b) for b in e.blobs]


def _np_shape_in_place(xs, i):
    a = xs[i]
    if isinstance(a, np.ndarray) and a.size % 2 == 0:
        a.shape = (2, a.size // 2)            # same object, same memory, another shape


def _np_dtype_in_place(xs, i):
    a = xs[i]
    if isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype == np.float32:
        a.dtype = np.int32                     # same object, same bytes, another dtype


def _torch_data_assign(xs, i):
    if isinstance(xs[i], torch.Tensor):
        xs[i].data = torch.full((7,), 3, dtype=xs[i].dtype)    # same object, new storage and shape


def _torch_set(xs, i):
    if isinstance(xs[i], torch.Tensor):
        xs[i].set_(torch.ones(5))


def _torch_resize(xs, i):
    if isinstance(xs[i], torch.Tensor) and not xs[i].requires_grad:
        n = xs[i].numel()
        shape = xs[i].shape
        try:
            xs[i].resize_(n + 3)
        except RuntimeError:       # storage not resizable (from numpy, a view): torch leaves the new
            xs[i].resize_(shape)   # shape set over the old storage; put it back
            return
        xs[i].view(-1)[n:] = 7     # the new elements are uninitialized memory


def _torch_requires_grad(xs, i):
    t = xs[i]
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        t.requires_grad_(not t.requires_grad)


def _inplace_values(xs, i):
    x = xs[i]
    if isinstance(x, np.ndarray):
        x.reshape(-1)[0] += 1
    elif not isinstance(x, torch.Tensor):     # an item an earlier edit made something else
        return
    elif not x.requires_grad:
        x.view(-1)[0] += 1
    else:
        with torch.no_grad():
            x.view(-1)[0] += 1


def _view_of_another(xs, i):
    other = xs[(i + 3) % len(xs)]
    if isinstance(other, (np.ndarray, torch.Tensor)) and other.ndim:     # (an earlier edit may have nested it)
        xs[i] = other[:1]


_TENSOR_EDITS = [
    lambda xs, i: xs.append(np.random.default_rng(i).random(6, dtype=np.float32)),     # grows
    lambda xs, i: xs.append(torch.arange(float(i % 9 + 1))),
    lambda xs, i: xs.__setitem__(i, np.arange(6, dtype=np.float32)),                 # replaced
    lambda xs, i: xs.insert(i, torch.zeros(3)),                                         # everything after shifts
    lambda xs, i: xs.__delitem__(i),
    lambda xs, i: xs.__setitem__(i, xs[(i + 1) % len(xs)]),                            # the same tensor twice
    lambda xs, i: _view_of_another(xs, i),
    lambda xs, i: xs.__setitem__(i, np.arange(8, dtype=np.float32)[::2]),              # not contiguous
    lambda xs, i: xs.__setitem__(i, np.arange(4, dtype=">f4")),                        # big-endian
    lambda xs, i: xs.__setitem__(i, torch.nn.Parameter(torch.ones(3))),
    lambda xs, i: xs.__setitem__(i, torch.ones(4, dtype=torch.bfloat16)),
    lambda xs, i: xs.__setitem__(i, {"nested": xs[i]}),                                # no longer a tensor
    _np_shape_in_place, _np_dtype_in_place, _torch_data_assign, _torch_set, _torch_resize,
    _torch_requires_grad, _inplace_values,
]


def _apply(edit, xs, i):
    with torch.no_grad():
        try:
            edit(xs, i)
        except RuntimeError:     # an edit torch refuses for this tensor (a leaf that requires grad)
            pass


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
@example(981480)   # a run of tensors remembered while two earlier ones shared memory, reused once they no longer do
def test_tensor_memo_gives_what_a_fresh_encode_gives(seed):
    rng = np.random.default_rng(seed)
    n = codec.EncodeMemo.SEGMENT
    xs: list = []
    for i in range(int(rng.integers(2 * n, 4 * n))):
        xs.append(np.random.default_rng(i).random(int(rng.integers(1, 9)), dtype=np.float32) if i % 3
                  else torch.arange(float(i % 5 + 2)))
    state = {"out": xs, "model": {"w": torch.ones(4, 4), "b": np.zeros(3)}}
    memo = codec.EncodeMemo()
    for _ in range(6):
        assert _encoded(state, memo) == _encoded(state)
        for _ in range(int(rng.integers(0, 5))):
            edit = _TENSOR_EDITS[int(rng.integers(0, len(_TENSOR_EDITS)))]
            _apply(edit, xs, int(rng.integers(0, len(xs))))
        if rng.integers(0, 4) == 0:
            _apply(_TENSOR_EDITS[int(rng.integers(14, len(_TENSOR_EDITS)))], [state["model"]["w"]], 0)
    assert memo.tensors.reused > 0


def test_tensor_memo_takes_unchanged_segments_whole():
    n = codec.EncodeMemo.SEGMENT
    xs = [np.full(4, i, dtype=np.float32) for i in range(3 * n + 5)]
    memo = codec.EncodeMemo()
    codec.encode_state({"out": xs}, memo=memo)
    before = memo.reused_items
    xs.append(np.zeros(4, dtype=np.float32))
    assert _encoded({"out": xs}, memo) == _encoded({"out": xs})
    assert memo.reused_items - before == 3 * n        # the full segments, not walked again
    xs[n + 1].shape = (2, 2)                           # one array of the second segment changes shape
    assert _encoded({"out": xs}, memo) == _encoded({"out": xs})


def test_numpy_refuses_to_move_an_array_the_memo_references():
    """The memo leaves numpy arrays' data pointers out of their signature because a weak
    reference makes numpy refuse resize() (the one way to move an array's data in place)."""
    a = np.zeros(8, dtype=np.float32)
    memo = codec.EncodeMemo()
    codec.encode_state({"a": a}, memo=memo)
    with pytest.raises(ValueError):
        a.resize(1 << 20, refcheck=False)
