"""An S3-compatible bucket as the object store below :class:`agck.stores.s3.S3Store`.

Only what the store needs, over obstore (the Rust ``object_store`` crate's
binding: parallel multipart uploads, conditional puts, and the releases of the
GIL a pipeline's writer thread needs): put (overwriting, or create-only with
``If-None-Match: *``), get (whole, or into a caller's buffer), head, list under
a prefix, delete. Errors become agck's: a write that failed without an answer
"may or may not have been written" (:class:`DurabilityError`); a server that
cannot be reached is a :class:`StoreConnectionError`. A request that failed
without an answer from the server (a connection reset or refused, a timeout) is
sent again, :data:`TRANSPORT_RETRIES` times with a growing pause, on top of the
client's own retries: every request here may be repeated (a create-only PUT whose
first try went through answers "exists" the second time, and its callers ask
whether the object there is theirs).

Where a bucket is and who may use it: the URL ``s3://bucket/prefix`` with
optional parameters (``endpoint``, ``region``, ``profile``, ``allow_http``),
then the usual environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE`` through boto3 when it is installed). Credentials are never part
of ``url`` or of any message.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import parse_qsl, unquote

from .. import thresholds
from ..errors import DependencyError, DurabilityError, StoreConnectionError, StoreError, UsageError

SCHEMES = ("s3://",)
_STATUS_RE = re.compile(r"status(?: code)?[:= ]+(\d{3})", re.IGNORECASE)
# URL parameters agck reads itself; any other is refused by name (a typo must not be ignored).
_PARAMS = ("endpoint", "region", "profile", "allow_http")
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


def parse_url(url: str) -> tuple[str, str, dict[str, str]]:
    """(bucket, prefix without slashes at its ends, parameters) of ``s3://bucket/prefix?k=v``."""
    if not url.startswith(SCHEMES):
        raise UsageError(f"not an object store URL: {url!r}", hint="use s3://bucket/prefix")
    rest = url[len("s3://"):]
    rest, _, query = rest.partition("?")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"no bucket in {url!r}", hint="use s3://bucket/prefix")
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(params) - set(_PARAMS))
    if unknown:
        raise UsageError(f"unknown parameter(s) {', '.join(unknown)} in an s3:// URL",
                         hint=f"agck reads {', '.join(_PARAMS)}; credentials come from the environment")
    return bucket, unquote(prefix).strip("/"), params


def _check_endpoint(endpoint: str) -> None:
    """An endpoint is http(s)://host[:port]: checked here, as the client would panic on it."""
    from urllib.parse import urlsplit
    try:
        u = urlsplit(endpoint)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        u.port           # raises on a port that is not a number in range
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"not an endpoint URL: {endpoint!r}", hint="give http(s)://host[:port], e.g. "
                                                                   "?endpoint=http://127.0.0.1:8333")


def _truthy(v: str) -> bool:
    return v.lower() in ("1", "true", "yes", "on")


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
        config: dict = {"conditional_put": "etag"}
        if endpoint:
            _check_endpoint(endpoint)
            config["endpoint"] = endpoint
        config["region"] = region or "us-east-1"
        allow_http = _truthy(params["allow_http"]) if "allow_http" in params else bool(
            endpoint and endpoint.startswith("http://"))
        provider = None
        profile = params.get("profile") or (None if os.environ.get("AWS_ACCESS_KEY_ID")
                                            else os.environ.get("AWS_PROFILE"))
        if profile:
            try:
                import boto3
                from obstore.auth.boto3 import Boto3CredentialProvider
            except ImportError:
                raise DependencyError("an AWS profile needs boto3 to read it", hint="pip install boto3") from None
            provider = Boto3CredentialProvider(boto3.Session(profile_name=profile))
        self.url = f"s3://{bucket}/{prefix}" + (f"?endpoint={endpoint}" if endpoint else "")
        try:
            self._store = _S3(bucket, prefix=prefix or None, config=config, credential_provider=provider,
                              client_options={"allow_http": allow_http, "connect_timeout": "5s",
                                              "timeout": "300s"},
                              retry_config={"max_retries": 4, "retry_timeout": _seconds(60)})
        except Exception as e:
            raise StoreConnectionError(f"cannot configure the object store client: {e}", ref=self.url) from None

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
        """``fn()``, sent again while it fails without the server's answer (see the module)."""
        for attempt in range(TRANSPORT_RETRIES + 1):
            try:
                return fn()
            except Exception as e:
                if attempt == TRANSPORT_RETRIES or not self._unanswered(e):
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
        text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        if isinstance(e, (PermissionError, ex.PermissionDeniedError, ex.UnauthenticatedError)):
            return StoreConnectionError(f"the object store refused to {doing}: {text}", ref=ref,
                                        hint="check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the "
                                             "bucket's policy")
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
            pos = 0
            for block in self._ob.get(self._store, key).stream(min_chunk_size=thresholds.STREAM_BLOCK):
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
        for attempt in range(TRANSPORT_RETRIES + 1):
            try:      # a listing cut off is taken up after the last key it gave
                for batch in self._ob.list(self._store, prefix, offset=last, chunk_size=1000):
                    for m in batch:
                        last = m["path"]
                        yield ObjectInfo(m["path"], m["size"], m["last_modified"].timestamp())
                return
            except Exception as e:
                if attempt == TRANSPORT_RETRIES or not self._unanswered(e):
                    raise self._error(e, prefix, "list objects") from None
                self._count("retry")
                time.sleep(0.1 * 2 ** attempt)


def _flat(p):
    v = memoryview(p)
    return v if v.format == "B" and v.ndim == 1 and v.contiguous else v.cast("B")


def _seconds(n: float):
    from datetime import timedelta
    return timedelta(seconds=n)


def _no_answer(e: Exception) -> bool:
    """Whether a request failed without a final answer from the server: no HTTP status
    at all (a reset, a refused connection, a timeout), or a 5xx (the server says: again)."""
    m = _STATUS_RE.search(str(e))
    return m is None or m.group(1).startswith("5")


def _unreachable(text: str) -> bool:
    t = text.lower()
    return any(s in t for s in ("connection refused", "error sending request", "dns", "timed out", "connect"))
