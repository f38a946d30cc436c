"""Postgres DSNs as text: passwords found and hidden, agck's own parameters split off.

A DSN is a URL (``postgresql://user:pw@host/db?password=...``) or a libpq
``key=value`` string. :func:`redact_dsn` masks the password for ``store.url``
and messages, :func:`dsn_without_password` drops it for a command to be shown,
:func:`dsn_secrets` lists every spelling of it to scrub from any text, and
:func:`split_agck_params` takes ``agck_prefix``/``agck_schema``/``agck_objects``/``agck_pool``
out before the DSN reaches libpq. Nothing here raises on a malformed DSN, and nothing needs
psycopg2: any layer (the CLI, error messages) can hide a password.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# One ``key = value`` of a libpq key/value string: a value is single-quoted (backslash
# escapes inside) or runs to the next unescaped whitespace.
_KV_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*('(?:[^'\\]|\\.)*'|(?:[^\s'\\]|\\.)(?:[^\s\\]|\\.)*|)",
                    re.ASCII | re.DOTALL)
# The value of a ``password`` key, also in malformed strings (an unclosed quote runs to the end).
_KV_PASSWORD_RE = re.compile(r"(?<![A-Za-z0-9_])(password\s*=\s*)('(?:[^'\\]|\\.)*'?|(?:[^\s\\]|\\.)*)",
                             re.ASCII | re.DOTALL)
_CONNECT_KEYS = {"host", "hostaddr", "port", "dbname", "user", "password", "passfile", "service"}
_AGCK_PARAMS = ("agck_prefix", "agck_schema", "agck_objects", "agck_pool")


def _kv_pairs(dsn: str) -> list[re.Match] | None:
    """The ``key=value`` matches covering all of ``dsn``, or None if it is not one."""
    pairs, pos = [], 0
    while pos < len(dsn):
        if not dsn[pos:].strip():
            break
        m = _KV_RE.match(dsn, pos)
        if m is None:
            return None
        pairs.append(m)
        pos = m.end()
    return pairs or None


def _kv_value(raw: str) -> str:
    if raw.startswith("'"):
        raw = raw[1:-1]
    return re.sub(r"\\(.)", r"\1", raw, flags=re.DOTALL)


def is_kv_dsn(text: str) -> bool:
    """A libpq ``key=value`` connection string naming at least one connection key."""
    pairs = _kv_pairs(text) if "=" in text and "://" not in text else None
    return bool(pairs) and any(m.group(1) in _CONNECT_KEYS for m in pairs)


def _url_parts(dsn: str) -> tuple[str, str, str, str, str]:
    """(scheme, netloc, path, query, fragment) of a URL, split by hand: never raises
    (urlsplit refuses some malformed netlocs, which must still be redacted)."""
    scheme, _, rest = dsn.partition("://")
    m = re.match(r"([^/?#]*)([^?#]*)(?:\?([^#]*))?(?:#(.*))?\Z", rest, re.DOTALL)
    return scheme, m.group(1), m.group(2), m.group(3) or "", m.group(4) or ""


def _userinfo_password(netloc: str) -> str | None:
    userinfo, at, _ = netloc.rpartition("@")
    return userinfo.split(":", 1)[1] if at and ":" in userinfo else None


def redact_dsn(dsn: str) -> str:
    """The DSN with any password removed: URL userinfo, ``?password=``, ``password=...``."""
    if "://" not in dsn:
        return _KV_PASSWORD_RE.sub(r"\1***", dsn)
    scheme, netloc, path, query, fragment = _url_parts(dsn)
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        userinfo = userinfo.split(":", 1)[0]
        netloc = f"{userinfo}@{hosts}" if userinfo else hosts
    query = "&".join(p for p in query.split("&") if p and unquote(p.partition("=")[0]) != "password")
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "") + (f"#{fragment}" if fragment else "")


def dsn_without_password(dsn: str) -> str:
    """The DSN with its password taken out altogether (not masked), for commands to run."""
    if "://" in dsn:
        return redact_dsn(dsn)
    return re.sub(r"\s*" + _KV_PASSWORD_RE.pattern, "", dsn, flags=_KV_PASSWORD_RE.flags).strip()


def dsn_secrets(dsn: str) -> list[str]:
    """Every spelling of the password a DSN carries, longest first, to scrub from any text shown."""
    found = []
    if "://" in dsn:
        _, netloc, _, query, _ = _url_parts(dsn)
        pw = _userinfo_password(netloc)
        if pw is not None:
            found += [pw, unquote(pw)]
        for p in query.split("&"):
            k, _, v = p.partition("=")
            if unquote(k) == "password":
                found += [v, unquote(v)]
    else:
        for m in _KV_PASSWORD_RE.finditer(dsn):
            raw = m.group(2)
            found += [raw, raw.strip("'"), _kv_value(raw)]
    return sorted({s for s in found if s}, key=len, reverse=True)


def split_agck_params(dsn: str) -> tuple[str, dict]:
    """``agck_prefix``/``agck_schema`` in a Postgres DSN (URL query or key=value) choose
    the tables (so the CLI can reach them), ``agck_objects`` the object store holding
    the chunks, ``agck_pool`` the most connections a store opens; they are removed
    before the DSN reaches libpq."""
    own = {}
    if "://" in dsn:
        scheme, netloc, path, query, fragment = _url_parts(dsn)
        keep = []
        for p in query.split("&") if query else []:
            k, _, v = p.partition("=")
            if unquote(k) in _AGCK_PARAMS:
                own[unquote(k)[len("agck_"):]] = unquote(v)
            else:
                keep.append(p)    # as written: re-encoding could change what libpq reads
        if not own:
            return dsn, {}
        return (f"{scheme}://{netloc}{path}" + (f"?{'&'.join(keep)}" if keep else "")
                + (f"#{fragment}" if fragment else "")), own
    pairs = _kv_pairs(dsn)
    if not pairs:
        return dsn, {}
    kept = []
    for m in pairs:
        if m.group(1) in _AGCK_PARAMS:
            own[m.group(1)[len("agck_"):]] = _kv_value(m.group(2))
        else:
            kept.append(m.group(0).strip())
    return (" ".join(kept), own) if own else (dsn, {})
