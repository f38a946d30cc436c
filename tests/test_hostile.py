"""Hostile inputs at every public entry point and every CLI command.

Hypothesis draws URLs, names, parameters, argument types and environment values;
each case runs against each store kind and plants known secret strings (in URL
userinfo, in an endpoint, in a Postgres password, in the environment). Whatever
happens, only an ``AgckError`` subclass escapes, its message is one line with no
control character, and no secret appears in any output, log line, exception,
store URL or JSON. A function or subcommand added to the public surface without
a case here fails :func:`test_every_public_function_and_command_is_in_the_suite`.

CI draws ``AGCK_HOSTILE_EXAMPLES`` examples per case (default 15, about a minute in
all); ``scripts/full_suite`` draws 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import re
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agck
from agck import cli
from agck.errors import AgckError
from agck.stores import PutEntry, Store

from conftest import s3_url

SECRET = "SECRETzq81HOSTILEkey"          # planted everywhere; must never come back
EXAMPLES = int(os.environ.get("AGCK_HOSTILE_EXAMPLES", 15))
HOSTILE = settings(max_examples=EXAMPLES, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u202a-\u202e\u2066-\u2069]")

# -- strategies ------------------------------------------------------------------------------

nasty_text = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Cc", "Cf", "Zs")), max_size=40)
names = st.one_of(nasty_text, st.sampled_from(["../x", "/abs", ".h", "-x", "a" * 300, "a\x00b", "\x1b[2J",
                                                "\u202eevil", "r'; DROP TABLE x; --", "ok-name"]))
values = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                   st.floats(allow_nan=True, allow_infinity=True), nasty_text, st.binary(max_size=20),
                   st.lists(st.integers(), max_size=3), st.just(object()))
steps = st.one_of(st.integers(-5, 2 ** 70), st.floats(allow_nan=True), st.none(), nasty_text, st.booleans())
# (an environment value cannot hold a NUL: the OS refuses it before agck sees it)
env_values = st.one_of(nasty_text, st.sampled_from(["us-east-1\r", "tok\nen", "", " ", "é"])).filter(
    lambda v: "\x00" not in v)


def _s3_urls(endpoint: str):
    """s3:// URLs, some well formed, some with planted credentials or nonsense parameters."""
    host = endpoint.split("://", 1)[1]
    return st.one_of(
        st.builds(lambda b, p: f"s3://{b}/{quote(p, safe='')}?endpoint={endpoint}", nasty_text, nasty_text),
        st.just(f"s3://AKIA:{SECRET}@agck-test/p?endpoint={endpoint}"),
        st.just(f"s3://agck-test/p?endpoint=http://AKIA:{SECRET}@{host}"),
        st.just(f"s3://agck-test/p?endpoint={quote(f'http://k:{SECRET}@{host}', safe='')}"),
        st.builds(lambda k, v: f"s3://agck-test/p?endpoint={endpoint}&{quote(k)}={quote(v)}",
                  st.sampled_from(["region", "profile", "allow_http", "read_timeout", "connect_timeout",
                                   "retry_for", "endpoint", "nope"]), nasty_text))


# -- checking one call -------------------------------------------------------------------------

def _clean(text: str, where: str) -> None:
    assert SECRET not in text, f"the planted secret reached {where}: {text[:300]!r}"


def _agck_error_only(e: BaseException) -> None:
    assert isinstance(e, AgckError), f"{type(e).__name__} escaped: {e!r}"[:500]
    msg = str(e)
    _clean(msg, "an exception")
    assert "\n" not in msg and not CONTROL.search(msg), f"not one clean line: {msg[:300]!r}"


def attempt(fn, *args, **kwargs):
    """``fn(...)``: its result, or None after an AgckError (checked); anything else fails."""
    try:
        out = fn(*args, **kwargs)
        if asyncio.iscoroutine(out):
            out = asyncio.run(out)
        return out
    except BaseException as e:          # (a Rust panic is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        _agck_error_only(e)
        return None


def run_cli(argv: list) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([str(a) for a in argv])
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            raise AssertionError(f"agck {' '.join(map(str, argv))[:200]} raised {type(e).__name__}: {e}") from None
    o, r = out.getvalue(), err.getvalue()
    _clean(o + r, f"the output of agck {argv[0]}")
    assert "Traceback" not in r and "panicked" not in r, r[-500:]
    assert isinstance(code, int), code
    if code not in (0, 1, 3):       # an error: one line on stderr
        assert len(r.strip().splitlines()) <= 2 and not CONTROL.search(r), (argv[:2], r[:300])
    return code, o, r


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="agck")
    yield caplog
    _clean(caplog.text, "a log line")


@pytest.fixture(autouse=True)
def planted_secret(monkeypatch, tmp_path):
    """The secret key in the environment too: no error may echo it. Drawn names become
    relative paths and sqlite:/// files: they land in a directory of the test's own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY_HOSTILE", SECRET)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# -- the stores --------------------------------------------------------------------------------

KINDS = ("file", "sqlite", "postgres", "s3", "catalog")      # catalog: Postgres over a bucket


@pytest.fixture(params=KINDS)
def store_url(request, tmp_path, pg_dsn, pg_schema):
    kind = request.param
    if kind == "file":
        return str(tmp_path / "store")
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/s.db"
    if kind in ("postgres", "catalog"):
        scheme, rest = pg_dsn.split("://", 1)
        user_host = rest.split("@", 1)[-1]
        user = rest.split("@", 1)[0].split(":")[0] if "@" in rest else "postgres"
        sep = "&" if "?" in user_host else "?"
        # a password (trust auth ignores it): it must never be printed
        url = (f"{scheme}://{user}:{SECRET}@{user_host}{sep}agck_prefix=h{os.getpid()}x{id(request) % 10 ** 6}"
               f"&agck_schema={pg_schema}")
        if kind == "catalog":       # a Postgres catalog over a bucket
            url += "&agck_objects=" + quote(s3_url(request.getfixturevalue("seaweed")), safe="")
        agck.open_store(url, init=True).close()
        return url
    return s3_url(request.getfixturevalue("seaweed"))


# Store methods: what each is called with. Every public method of Store is here (checked below).
def _store_calls(s: Store, run, step, value, extra) -> list:
    state = {"x": np.arange(3), "v": value}
    return [
        ("put", lambda: s.put(run, step, state, meta=value, parent=extra)), ("get", lambda: s.get(run, step)),
        ("read", lambda: s.read(run, step, map_location=value)), ("read_newest", lambda: s.read_newest(run)),
        ("steps", lambda: s.steps(run, last=extra)), ("list", lambda: s.list(run)), ("runs", lambda: s.runs()),
        ("delete", lambda: s.delete(run, step, epoch=extra)),
        ("prune", lambda: s.prune(run, keep_last=extra, keep_every=value, before=step)),
        ("put_many", lambda: s.put_many(value)), ("aput_many", lambda: s.aput_many(value)),
        ("aread", lambda: s.aread(run, step)), ("aread_newest", lambda: s.aread_newest(run)),
        ("asteps", lambda: s.asteps(run, last=extra)), ("ref", lambda: s.ref(run, step)),
        ("orphans", lambda: s.orphans(run)), ("clean_orphans", lambda: s.clean_orphans(run)),
        ("collect_garbage", lambda: s.collect_garbage()), ("quarantine", lambda: s.quarantine(value)),
        ("quarantined", lambda: s.quarantined()), ("scrub", lambda: s.scrub(progress=value)),
        ("begin_epoch", lambda: s.begin_epoch(run)), ("epoch", lambda: s.epoch(run)),
        ("can_confirm_unchanged", lambda: s.can_confirm_unchanged(run)),
        ("log_append", lambda: s.log_append(run, value, sync=True)), ("log_read", lambda: s.log_read(run, extra)),
        ("log_runs", lambda: s.log_runs()), ("log_ref", lambda: s.log_ref(run)),
        ("log_claims", lambda: s.log_claims(run)), ("parts_store", lambda: s.parts_store(create=False)),
        ("key_slots", lambda: s.key_slots()), ("add_key", lambda: s.add_key(value)),
        ("remove_key", lambda: s.remove_key(value)),
    ]


# Store attributes that are values, not calls (read only)
STORE_VALUES = {"damaged_key_slots", "location", "where", "incremental", "full_every", "min_chunked", "verify_reused", "log_positions_are_bytes",
                "policies", "native_async", "compression"}


@HOSTILE
@given(run=names, step=steps, value=values, extra=values)
def test_store_methods_take_hostile_arguments(store_url, logs, run, step, value, extra):
    s = agck.open_store(store_url)
    try:
        _clean(s.url + repr(s) + str(s.where), "store.url")
        for name, call in _store_calls(s, run, step, value, extra):
            out = attempt(call)
            _clean(repr(out)[:10000], f"what {name} returned")
    finally:
        s.close()


@HOSTILE
@given(data=st.data())
def test_open_store_takes_hostile_urls_and_options(seaweed, logs, tmp_path_factory, data):
    endpoint = seaweed.endpoint
    url = data.draw(st.one_of(_s3_urls(endpoint), names, st.builds(lambda v: f"sqlite:///{v}", nasty_text),
                              st.builds(lambda v: f"postgresql://u:{SECRET}@127.0.0.1:1/{quote(v)}?connect_timeout=1",
                                        nasty_text),
                              st.just(f"postgresql://u:{SECRET}@127.0.0.1:5432/test?agck_objects="
                                      + quote(f"s3://AKIA:{SECRET}@b/p", safe="")),
                              values))
    options = data.draw(st.dictionaries(st.sampled_from(["create", "incremental", "full_every", "min_chunked",
                                                         "verify_reused", "pool", "pool_timeout", "grace",
                                                         "stale_after", "chunk_grid", "objects", "compress",
                                                         "level", "bogus"]),
                                        values, max_size=2))
    if isinstance(url, str) and not url.startswith(("s3:", "sqlite:", "postgresql:")):
        url = str(tmp_path_factory.mktemp("h") / "x") + url.replace("/", "_").replace("\x00", "")[:50]
    s = attempt(agck.open_store, url, **options)
    if s is not None:
        _clean(s.url + repr(s), "store.url")
        s.close()


@HOSTILE
@given(env=st.dictionaries(st.sampled_from(["AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                                            "AGCK_COMPRESS"]),
                           env_values, min_size=1, max_size=3))
def test_s3_with_hostile_environment_values(seaweed, logs, env):
    url = s3_url(seaweed)
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        s = attempt(agck.open_store, url)
        if s is not None:
            attempt(s.runs)
            s.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- the functions of agck's face --------------------------------------------------------------

def _closed(store):
    """A store a case made, closed (a tiered one runs a copier thread)."""
    store.close()
    return store


def _api_cases(tmp, store_url, value, name, step):
    path = os.path.join(tmp, (name if isinstance(name, str) else "x").replace("/", "_").replace("\x00", "")[:60]
                        or "x")
    return {
        "dumps": lambda: agck.dumps(value, run=name, step=step, meta=value),
        "loads": lambda: agck.loads(value, map_location=name),
        "save": lambda: agck.save(path, value, run=name, step=step),
        "load": lambda: agck.load(value if isinstance(value, str) else path, map_location=name),
        "inspect": lambda: agck.inspect(value if isinstance(value, (str, bytes)) else path),
        "open_store": lambda: agck.open_store(value),
        "recover": lambda: agck.recover(store_url, run=name, map_location=value),
        "Journal": lambda: agck.Journal(store_url, name, commit=value, every=step, ms=value),
        "AppendLog": lambda: agck.AppendLog(value, name=name),
        "TieredStore": lambda: _closed(agck.TieredStore(store_url, value, durable_every=step, keep_local=value,
                                                        keep_local_bytes=step, replicas=value)),
        "Snapshotter": lambda: agck.Snapshotter(store_url, name, every=value, mode=name, max_in_flight=step,
                                                handle_signals=False),
        "checkpoint_every": lambda: agck.checkpoint_every(value, store=store_url, run=name, total=step),
    }


# Names of agck's face that are not entry points: results and the error classes.
NOT_ENTRY_POINTS = {"Checkpoint": "a result (what get/read return)", "Recovery": "a result of recover",
                    "Rejection": "part of a Recovery"}


@HOSTILE
@given(value=values, name=names, step=steps)
def test_the_public_functions_take_hostile_arguments(tmp_path_factory, logs, value, name, step):
    tmp = str(tmp_path_factory.mktemp("api"))
    store_url = os.path.join(tmp, "store")
    for fn, call in _api_cases(tmp, store_url, value, name, step).items():
        out = attempt(call)
        if hasattr(out, "close"):
            attempt(out.close)


# -- the agck command ---------------------------------------------------------------------------

def _cli_cases(store: str, run: str, word: str) -> dict:
    return {
        "recover": [["recover", store, "--run", run], ["recover", store, "--restore-to", word]],
        "ls": [["ls", store, "--run", run], ["ls", store, "--json"]],
        "journal": [["journal", store, "--run", run], ["journal", store, "--json"]],
        "show": [["show", store, "--run", run, "--step", word], ["show", word]],
        "verify": [["verify", store, "--run", run], ["verify", word]],
        "prune": [["prune", store, "--run", run, "--keep-last", word]],
        "gc": [["gc", store], ["gc", word]],
        "scrub": [["scrub", store, "--no-quarantine"], ["scrub", word]],
        "export": [["export", store, word, "--run", run], ["export", word, word]],
        "db": [["db", "status", store], ["db", word, store], ["db", "init", f"postgresql://u:{SECRET}@127.0.0.1:1/x"
                                                               "?connect_timeout=1"]],
        "key": [["key", "list", store], ["key", word, store], ["key", "remove", store, word],
                ["key", "add", store, "--new-key-file", word], ["key", "init", word]],
    }


@HOSTILE
@given(run=names, word=st.one_of(names, st.sampled_from(["-1", "nan", "1e99", "--json"])))
def test_every_command_takes_hostile_arguments(store_url, run, word):
    for cmd, argvs in _cli_cases(store_url, run if "\x00" not in run else "r", word.replace("\x00", "")).items():
        for argv in argvs:
            run_cli(argv)


def test_every_public_function_and_command_is_in_the_suite(tmp_path):
    """The suite covers the whole public surface: a function of agck's face, a public
    method of Store, or a subcommand of agck without a case here fails this test."""
    face = {n for n in agck.__all__ if not (isinstance(getattr(agck, n), type)
                                             and issubclass(getattr(agck, n), BaseException))}
    cases = set(_api_cases(str(tmp_path), str(tmp_path), 0, "r", 1)) | set(NOT_ENTRY_POINTS)
    assert face <= cases, f"public names with no hostile case: {sorted(face - cases)}"
    methods = {n for n in dir(Store) if not n.startswith("_")}
    covered = {n for n, _ in _store_calls(Store.__new__(_Bare), "r", 1, 0, 0)} | STORE_VALUES | {"close"}
    assert methods <= covered, f"Store methods with no hostile case: {sorted(methods - covered)}"
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    commands = set(sub.choices)
    assert commands <= set(_cli_cases("s", "r", "w")), \
        f"agck commands with no hostile case: {sorted(commands - set(_cli_cases('s', 'r', 'w')))}"


class _Bare(Store):
    """A Store with nothing behind it: only for listing the methods the suite calls."""
    def _put(self, *a, **k): ...
    def list(self, run=None): return []
    def runs(self): return []
    def steps(self, run, *, last=None): return []
    def read(self, run, step, *, verify=True, map_location=None): ...
    def delete(self, run, step): ...
    def ref(self, run, step): return ""


_Bare.__abstractmethods__ = frozenset()


@pytest.mark.parametrize("call", ["save", "load", "inspect", "export"])
@pytest.mark.parametrize("path", ["x\x00y.agck", b"x\x00y.npz"])
def test_a_path_the_os_cannot_take_is_one_usage_error(tmp_path, monkeypatch, call, path):
    """A NUL in a checkpoint path (drawn once by the public-function case above) was
    Python's ValueError from open(); every function that takes a path says it in one line."""
    from agck.errors import UsageError
    from agck.export import export
    monkeypatch.chdir(tmp_path)
    ck = agck.loads(agck.dumps({"a": 1}))
    fns = {"save": lambda: agck.save(path, {"a": 1}), "load": lambda: agck.load(path),
           "inspect": lambda: agck.inspect(path if isinstance(path, str) else path.decode()),
           "export": lambda: export(ck, path)}
    with pytest.raises(UsageError, match="NUL character"):
        fns[call]()
    assert list(tmp_path.iterdir()) == []
