"""An S3-compatible bucket as the object store below :class:`agck.stores.s3.store.S3Store`.

Only what the store needs, over obstore (the Rust ``object_store`` crate's
binding: parallel multipart uploads, conditional puts, and the releases of the
GIL a pipeline's writer thread needs): put (overwriting, or create-only with
``If-None-Match: *``), get (whole, or into a caller's buffer), head, list under
a prefix, delete. Errors become agck's: a write that failed without an answer
"may or may not have been written" (:class:`DurabilityError`); a server that
cannot be reached is a :class:`StoreConnectionError`. A request that failed
without an answer from the server (a connection reset or refused, a timeout) is
sent again, :data:`TRANSPORT_RETRIES` times with a growing pause, on top of the
client's own retries, while ``retry_for`` seconds have not passed (:data:`TIMEOUTS`:
every request is bounded): every request here may be repeated (a create-only PUT whose
first try went through answers "exists" the second time, and its callers ask
whether the object there is theirs).

Where a bucket is and who may use it: the URL ``s3://bucket/prefix`` with
optional parameters (``endpoint``, ``region``, ``profile``, ``allow_http``),
then the usual environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE`` through boto3 when it is installed). Credentials are never part
of ``url`` or of any message: a URL or endpoint carrying them is refused, and
values that cannot go in an HTTP header are refused by name before the client
(which panics on them) sees them. A 4xx answer is a refusal, not an uncertain write.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from ... import thresholds
from .. import compression
from ...errors import DependencyError, DurabilityError, StoreConnectionError, StoreError, UsageError

SCHEMES = ("s3://",)
_STATUS_RE = re.compile(r"status(?: code)?[:= ]+(\d{3})", re.IGNORECASE)
# How long a request may take, in seconds: settable per URL (``?read_timeout=5``). A request
# with no answer is cut after ``read_timeout`` without a byte (reset at each byte: a slow
# transfer of a large object is not cut), a connection not made in ``connect_timeout`` is given
# up, and a request without an answer is sent again only until ``retry_for`` has passed since
# its first try: a server that accepts connections and never answers fails in about
# retry_for + read_timeout (55 s by default), one that is down in about retry_for.
TIMEOUTS = {"connect_timeout": 5.0, "read_timeout": 15.0, "retry_for": 40.0}
# URL parameters agck reads itself; any other is refused by name (a typo must not be ignored).
_PARAMS = ("endpoint", "region", "profile", "allow_http", *TIMEOUTS)
_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# what may go in an HTTP header of a signed request (the client panics on anything else)
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")
_CREDENTIAL_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
MULTIPART_PART = thresholds.MULTIPART_PART        # bytes per part of a multipart upload
MULTIPART_MIN = thresholds.MULTIPART_MIN        # below this an object goes up in one request
UPLOAD_CONCURRENCY = 8          # parts in flight per multipart upload
TRANSPORT_RETRIES = 5           # a request that got no answer, sent again (0.1 s, then twice as long each time)


class ObjectExists(StoreError):
    """A create-only put found the key taken (HTTP 412 to ``If-None-Match: *``)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str                 # relative to the client's prefix
    size: int
    modified: float          # the server's clock, seconds since the epoch


def redact_url(url: str) -> str:
    """``url`` with any credentials taken out: userinfo before an s3:// bucket, and in an
    ``endpoint`` parameter (for messages: agck refuses both, never sends or stores them)."""
    def strip(u: str) -> str:
        scheme, sep, rest = u.partition("://")
        if not sep:
            return u
        head, tail = re.match(r"([^/?#]*)(.*)\Z", rest, re.DOTALL).groups()
        return f"{scheme}://{head.rpartition('@')[2]}{tail}"
    base, sep, query = url.partition("?")
    if not sep:
        return strip(base)
    parts = []
    for p in query.split("&"):
        k, eq, v = p.partition("=")
        if unquote(k, errors="surrogateescape") == "endpoint" and eq:   # (any text: this runs on bad URLs)
            v = quote(strip(unquote(v, errors="surrogateescape")), safe=":/", errors="surrogateescape")
        parts.append(f"{k}={v}" if eq else p)
    return strip(base) + "?" + "&".join(parts)


def parse_url(url: str) -> tuple[str, str, dict[str, str]]:
    """(bucket, prefix without slashes at its ends, parameters) of ``s3://bucket/prefix?k=v``."""
    if not url.startswith(SCHEMES):
        raise UsageError(f"not an object store URL: {redact_url(url)!r}", hint="use s3://bucket/prefix")
    rest = url[len("s3://"):]
    rest, _, query = rest.partition("?")
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket:
        raise UsageError(f"an s3:// URL with credentials before its bucket: {redact_url(url)!r}",
                         hint="agck never takes credentials from a URL: set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment")
    if not bucket:
        raise UsageError(f"no bucket in {redact_url(url)!r}", hint="use s3://bucket/prefix")
    pairs = parse_qsl(query, keep_blank_values=True)
    params = dict(pairs)
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise UsageError(f"unknown parameter(s) {', '.join(unknown)} in an s3:// URL",
                         hint=f"agck reads {', '.join(_PARAMS)}; credentials come from the environment")
    twice = sorted({k for k, _ in pairs if sum(1 for j, _ in pairs if j == k) > 1})
    if twice:
        raise UsageError(f"parameter(s) {', '.join(twice)} given more than once in an s3:// URL",
                         hint="give each parameter once")
    if params.get("endpoint") == "":
        raise UsageError("an empty endpoint parameter in an s3:// URL",
                         hint="give ?endpoint=http(s)://host[:port], or leave it out for AWS_ENDPOINT_URL or AWS")
    if "endpoint" in params:
        _check_endpoint(params["endpoint"])
    if "allow_http" in params and params["allow_http"].lower() not in _BOOL:
        raise UsageError(f"allow_http={params['allow_http']!r} in an s3:// URL is neither true nor false",
                         hint="give allow_http=true or allow_http=false")
    if "region" in params:
        _check_region(params["region"], "the region parameter")
    for k in TIMEOUTS:
        if k in params:
            _seconds_param(k, params[k])
    try:
        prefix = unquote(prefix, errors="strict")
    except UnicodeDecodeError:
        raise UsageError(f"the prefix of {redact_url(url)!r} is not UTF-8 once its %-escapes are decoded",
                         hint="escape the prefix's UTF-8 bytes, e.g. %C3%A9 for é") from None
    return bucket, prefix.strip("/"), params


def _seconds_param(name: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (0 < v <= 3600):
        raise UsageError(f"{name}={text!r} in an s3:// URL is not a number of seconds above 0 and up to 3600",
                         hint=f"e.g. {name}={TIMEOUTS[name]:g}")
    return v


def _truth(v: str | None) -> bool:
    return bool(v) and v.strip().lower() in ("1", "true", "yes", "on")


def _check_region(region: str, where: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", region):
        raise UsageError(f"{where} is not a region name (letters, digits and '-' only): {_shown(region)}",
                         hint="e.g. us-east-1")


def _shown(text: str) -> str:
    """A value for a message: escaped, cut at 60 characters."""
    r = repr(text)
    return r if len(r) <= 60 else r[:57] + "..."


def _check_credentials_env() -> None:
    """Credentials in the environment must fit in an HTTP header; named, never shown."""
    for var in _CREDENTIAL_VARS:
        v = os.environ.get(var)
        if v and not _HEADER_SAFE.fullmatch(v):
            raise UsageError(f"{var} holds a character that cannot go in an HTTP header (a space, a control "
                             f"character such as a carriage return, or a non-ASCII one)",
                             hint=f"set {var} again without it (a file with Windows line ends leaves '\\r')")


def _check_endpoint(endpoint: str) -> None:
    """An endpoint is http(s)://host[:port]: checked here, as the client would panic on it."""
    from urllib.parse import urlsplit
    try:
        u = urlsplit(endpoint)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        u.port           # raises on a port that is not a number in range
        userinfo = "@" in u.netloc
    except ValueError:
        ok, userinfo = False, "@" in endpoint
    if userinfo:
        raise UsageError(f"an endpoint with credentials in it: {redact_url(endpoint)!r}",
                         hint="agck never takes credentials from a URL: set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment")
    if not ok:
        raise UsageError(f"not an endpoint URL: {_shown(endpoint)}", hint="give http(s)://host[:port], e.g. "
                                                                         "?endpoint=http://127.0.0.1:8333")


class ObjectClient:
    """One bucket and key prefix. Safe to share between threads."""

    def __init__(self, url: str):
        try:
            import obstore
            from obstore.store import S3Store as _S3
        except ImportError as e:
            raise DependencyError(f"s3:// stores need obstore, which cannot be imported here ({e})",
                                  hint="pip install obstore") from None
        self._ob = obstore
        self._given = url
        self.requests: Counter = Counter()     # what this client asked the server, by kind (benchmarks)
        self._count_lock = threading.Lock()
        ex = obstore.exceptions
        # obstore raises its own classes for some answers and Python's for others
        self._missing = (FileNotFoundError, ex.NotFoundError)
        self._taken = (FileExistsError, ex.AlreadyExistsError, ex.PreconditionError)
        bucket, prefix, params = parse_url(url)
        self.bucket, self.prefix = bucket, prefix
        endpoint = params.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
            "AWS_ENDPOINT_URL")
        region = params.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region and "region" not in params:
            _check_region(region, "AWS_REGION (or AWS_DEFAULT_REGION)")
        _check_credentials_env()
        if _truth(os.environ.get("AWS_EC2_METADATA_DISABLED")) and not params.get("profile") and not any(
                os.environ.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                                            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                                            "AWS_CONTAINER_CREDENTIALS_FULL_URI")):
            raise UsageError("no AWS credentials: none in the environment, no profile, and the instance metadata "
                             "service is off (AWS_EC2_METADATA_DISABLED)",
                             hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
        timeouts = {k: _seconds_param(k, params[k]) if k in params else v for k, v in TIMEOUTS.items()}
        self.timeouts = timeouts
        # whether the server is on this machine (what compress="auto" decides by); AWS is not
        self.local = bool(endpoint) and compression.is_local_host(urlsplit(endpoint).hostname)
        config: dict = {"conditional_put": "etag"}
        if endpoint:
            _check_endpoint(endpoint)
            config["endpoint"] = endpoint
        config["region"] = region or "us-east-1"
        allow_http = _BOOL[params["allow_http"].lower()] if "allow_http" in params else bool(
            endpoint and endpoint.startswith("http://"))
        if endpoint and endpoint.startswith("http://") and not allow_http:
            raise UsageError("an http:// endpoint with allow_http=false: the client would refuse every request",
                             hint="use an https:// endpoint, or drop allow_http=false")
        provider = None
        profile = params.get("profile") or (None if os.environ.get("AWS_ACCESS_KEY_ID")
                                            else os.environ.get("AWS_PROFILE"))
        if profile:
            try:
                import boto3
                from obstore.auth.boto3 import Boto3CredentialProvider
            except ImportError:
                raise DependencyError("an AWS profile needs boto3 to read it", hint="pip install boto3") from None
            import botocore.exceptions
            try:
                provider = Boto3CredentialProvider(boto3.Session(profile_name=profile))
            except botocore.exceptions.ProfileNotFound:
                raise UsageError(f"no AWS profile named {_shown(profile)} (given by "
                                 f"{'the profile parameter' if 'profile' in params else 'AWS_PROFILE'})",
                                 hint="name a profile of ~/.aws/config or ~/.aws/credentials, or set "
                                      "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
            except botocore.exceptions.BotoCoreError as e:
                raise UsageError(f"cannot read the AWS profile {_shown(profile)}: {type(e).__name__}",
                                 hint="check ~/.aws/config and ~/.aws/credentials") from None
        self.url = f"s3://{bucket}/{prefix}" + (f"?endpoint={endpoint}" if endpoint else "")
        try:
            self._store = _S3(bucket, prefix=prefix or None, config=config, credential_provider=provider,
                              client_options={"allow_http": allow_http,
                                              "connect_timeout": _seconds(timeouts["connect_timeout"]),
                                              "read_timeout": _seconds(timeouts["read_timeout"]),
                                              "timeout": "3600s"},
                              retry_config={"max_retries": 3, "retry_timeout": _seconds(timeouts["retry_for"])})
        except BaseException as e:       # (a Rust panic is a BaseException)
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise StoreConnectionError(f"cannot configure the object store client: {_error_text(e)}",
                                       ref=self.url) from None

    def child(self, sub: str) -> "ObjectClient":
        """The same bucket, credentials and endpoint, under ``<prefix>/<sub>``."""
        base, _, query = self._given.partition("?")
        return ObjectClient(f"{base.rstrip('/')}/{sub}" + (f"?{query}" if query else ""))

    def prefixes(self, prefix: str) -> list[str]:
        """The "directories" right under ``prefix`` (which ends with '/'), as keys ending with '/'."""
        self._count("list")
        try:
            found = self._again(lambda: self._ob.list_with_delimiter(self._store, prefix))
        except self._missing:
            return []
        except Exception as e:
            raise self._error(e, prefix, "list objects") from None
        return [p.rstrip("/") + "/" for p in found["common_prefixes"]]

    def _again(self, fn):
        """``fn()``, sent again while it fails without the server's answer (see the module),
        until ``retry_for`` seconds have passed since the first try."""
        deadline = time.monotonic() + self.timeouts["retry_for"]
        for attempt in range(TRANSPORT_RETRIES + 1):
            try:
                return fn()
            except BaseException as e:
                if not isinstance(e, Exception):
                    if type(e).__name__ == "PanicException":     # the client refused its input by panicking
                        raise StoreError(f"the object store client failed on its input: {_error_text(e)}",
                                         hint="check the URL's parameters and the AWS_* environment") from None
                    raise
                if attempt == TRANSPORT_RETRIES or not self._unanswered(e) or time.monotonic() >= deadline:
                    raise
                self._count("retry")
                time.sleep(0.1 * 2 ** attempt)

    def _unanswered(self, e: Exception) -> bool:
        """Whether ``e`` is a request that failed without a final answer (:func:`_no_answer`);
        absent, taken and refused keys are answers."""
        ex = self._ob.exceptions
        if isinstance(e, (*self._missing, *self._taken, PermissionError, ex.PermissionDeniedError,
                          ex.UnauthenticatedError)):
            return False
        return _no_answer(e)

    def _count(self, kind: str, nbytes: int = 0) -> None:
        with self._count_lock:
            self.requests[kind] += 1
            if nbytes:
                self.requests[kind + "_bytes"] += nbytes

    def ref(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}/{key}" if self.prefix else f"s3://{self.bucket}/{key}"

    # -- errors -----------------------------------------------------------------
    def _error(self, e: Exception, key: str, doing: str, *, write: bool = False) -> Exception:
        ex = self._ob.exceptions
        ref = self.ref(key)
        text = _error_text(e)
        if "169.254.169.254" in str(e) or "169.254.170.2" in str(e):
            return StoreConnectionError(f"no AWS credentials were found to {doing}: none in the environment, no "
                                        f"profile, and the instance metadata service did not give any", ref=ref,
                                        hint="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
        if isinstance(e, (PermissionError, ex.PermissionDeniedError, ex.UnauthenticatedError)):
            return StoreConnectionError(f"the object store refused to {doing}: {text}", ref=ref,
                                        hint="check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the "
                                             "bucket's policy")
        status = _status(e)
        if status is not None and 400 <= status < 500 and status not in (408, 429):
            code = re.search(r"<Code>([^<]{1,64})</Code>", str(e))
            return StoreError(f"the object store refused to {doing}: HTTP {status}"
                              + (f" {code.group(1)}" if code else "")
                              + (" (nothing was written)" if write else ""), ref=ref,
                              hint="check the bucket's name, the key's length and the endpoint" if status == 400
                              else "check the URL and the bucket")
        if write:
            return DurabilityError(f"could not {doing}; it may or may not have been written: {text}", ref=ref,
                                   hint="check that the object store is reachable, then retry")
        if _unreachable(text):
            return StoreConnectionError(f"cannot reach the object store to {doing}: {text}", ref=ref,
                                        hint="check the endpoint (AWS_ENDPOINT_URL) and that the server runs")
        return StoreError(f"could not {doing}: {text}", ref=ref)

    # -- writing ----------------------------------------------------------------
    def put(self, key: str, data, *, create: bool = False) -> None:
        """Store ``data`` (bytes-like, or a list of them) at ``key``; durable when this
        returns (S3 acknowledges a PUT once it is stored). ``create``: only if ``key``
        is absent (``ObjectExists`` otherwise); never multipart, so that the
        precondition holds on every S3-compatible server."""
        parts = data if isinstance(data, list) else [data]
        n = sum(memoryview(p).nbytes for p in parts)
        # a multipart upload is 2 + one request per part
        self._count("put", n) if create or n < MULTIPART_MIN else self._count("multipart", n)
        try:
            if create:
                body = _flat(parts[0] if len(parts) == 1 else b"".join(parts))
                self._again(lambda: self._ob.put(self._store, key, body, mode="create", use_multipart=False))
            elif n >= MULTIPART_MIN:
                self._again(lambda: self._ob.put(self._store, key, [_flat(p) for p in parts], use_multipart=True,
                                                 chunk_size=MULTIPART_PART, max_concurrency=UPLOAD_CONCURRENCY))
            else:
                body = _flat(parts[0] if len(parts) == 1 else b"".join(parts))
                self._again(lambda: self._ob.put(self._store, key, body, use_multipart=False))
        except self._taken:
            raise ObjectExists("the key is taken", ref=self.ref(key)) from None
        except Exception as e:
            raise self._error(e, key, "store an object", write=True) from None

    def delete(self, key: str) -> None:
        """Remove ``key``; absent is fine (S3 answers 204 either way)."""
        self._count("delete")
        try:
            self._again(lambda: self._ob.delete(self._store, key))
        except self._missing:
            pass
        except Exception as e:
            raise self._error(e, key, "delete an object", write=True) from None

    # -- reading ----------------------------------------------------------------
    def get(self, key: str) -> memoryview | None:
        """The bytes at ``key``, None if there is no such object."""
        self._count("get")
        try:
            return memoryview(self._again(lambda: self._ob.get(self._store, key).bytes()))
        except self._missing:
            return None
        except Exception as e:
            raise self._error(e, key, "read an object") from None

    def get_into(self, key: str, view: memoryview) -> int | None:
        """Read ``key`` into ``view``; its size (which may differ from ``view``'s: the
        caller judges), None if absent. Bytes beyond ``view`` are not kept."""
        self._count("get")
        def read() -> int:
            got = self._ob.get(self._store, key)
            size = got.meta.get("size") if isinstance(got.meta, dict) else None
            if size is not None and size > view.nbytes:
                return size      # longer than its place: judged by its length, never downloaded whole
            pos = 0
            for block in got.stream(min_chunk_size=thresholds.STREAM_BLOCK):
                b = memoryview(block)
                take = min(b.nbytes, max(0, view.nbytes - pos))
                if take:
                    view[pos:pos + take] = b[:take]
                pos += b.nbytes
            return pos
        try:
            return self._again(read)
        except self._missing:
            return None
        except Exception as e:
            raise self._error(e, key, "read an object") from None

    def head(self, key: str) -> ObjectInfo | None:
        self._count("head")
        try:
            m = self._again(lambda: self._ob.head(self._store, key))
        except self._missing:
            return None
        except Exception as e:
            raise self._error(e, key, "look up an object") from None
        return ObjectInfo(key, m["size"], m["last_modified"].timestamp())

    def list(self, prefix: str, *, after: str | None = None) -> Iterator[ObjectInfo]:
        """The objects whose keys start with ``prefix``, in key order (after ``after``)."""
        self._count("list")
        last = after
        deadline = time.monotonic() + self.timeouts["retry_for"]
        for attempt in range(TRANSPORT_RETRIES + 1):
            try:      # a listing cut off is taken up after the last key it gave
                for batch in self._ob.list(self._store, prefix, offset=last, chunk_size=1000):
                    for m in batch:
                        last = m["path"]
                        yield ObjectInfo(m["path"], m["size"], m["last_modified"].timestamp())
                return
            except BaseException as e:
                if not isinstance(e, Exception):
                    if type(e).__name__ == "PanicException":
                        raise StoreError(f"the object store client failed on its input: {_error_text(e)}",
                                         hint="check the URL's parameters and the AWS_* environment") from None
                    raise
                if attempt == TRANSPORT_RETRIES or not self._unanswered(e) or time.monotonic() >= deadline:
                    raise self._error(e, prefix, "list objects") from None
                self._count("retry")
                time.sleep(0.1 * 2 ** attempt)


def _flat(p):
    v = memoryview(p)
    return v if v.format == "B" and v.ndim == 1 and v.contiguous else v.cast("B")


def _seconds(n: float):
    from datetime import timedelta
    return timedelta(seconds=n)


def _error_text(e: BaseException) -> str:
    """An error's text on one line, its cause kept: the client's errors say what failed
    first and why last ("... Caused by: connection refused"), so a long one keeps its
    start and its end, each cut at a word."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    text = " | ".join(lines)
    if len(text) <= 600:
        return text
    head = text[:400].rsplit(" ", 1)[0]
    tail = text[-200:].split(" ", 1)[-1]
    return f"{head} ... {tail}"


def _status(e: BaseException) -> int | None:
    """The HTTP status the server answered a failed request with, if it did."""
    m = _STATUS_RE.search(str(e))
    return int(m.group(1)) if m else None


def _no_answer(e: Exception) -> bool:
    """Whether a request failed without a final answer from the server: no HTTP status
    at all (a reset, a refused connection, a timeout), or a 5xx (the server says: again)."""
    status = _status(e)
    return status is None or status >= 500


def _unreachable(text: str) -> bool:
    t = text.lower()
    return any(s in t for s in ("connection refused", "error sending request", "dns", "timed out", "connect"))
