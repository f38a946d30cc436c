"""`agck`: the command line. Thin: parses, calls the library, prints.

Exit codes (also in the README)::

  0  all good
  1  recovered, but had to walk back past rejected checkpoints; or verify or scrub found damage
  2  usage error (bad arguments)
  3  nothing valid: no checkpoint verifies, or the file is corrupt
  4  cannot open the store or file (missing, unreachable server, bad credentials, unknown run/step,
     an output path that cannot be written), verify or recover of a store that holds no checkpoints,
     or the checkpoint needs torch and `import torch` fails here

Every error is one line on stderr, without a traceback and without a DSN password.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from datetime import datetime, timezone

from . import checkpoint, sharded
from .errors import (AgckError, CorruptCheckpointError, DependencyError, EncryptionKeyError, FormatError,
                     InvalidRunNameError, NoValidCheckpointError, StoreError, UsageError)
from .names import check_run

EXIT_OK, EXIT_WALKED_BACK, EXIT_USAGE, EXIT_NOTHING_VALID, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4

# Store arguments that name a store by URL (anything else must be an existing directory).
_STORE_SCHEMES = ("postgresql:", "postgres:", "sqlite:", "file://")


class _Exit(Exception):
    def __init__(self, code: int, message: str | None = None):
        self.code, self.message = code, message


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line, with any DSN password in the arguments hidden."""

    argv: list[str] = []

    def error(self, message):
        self.exit(EXIT_USAGE, _one_line(f"{self.prog}: error: {_redact_args(message, self.argv)} "
                                        f"(see {self.prog} --help)") + "\n")


def _redact(text: str) -> str:
    from .stores import redact_dsn
    return redact_dsn(text)


def _redact_args(message: str, argv: list[str]) -> str:
    for a in sorted(set(argv), key=len, reverse=True):
        if a and a in message and _redact(a) != a:
            message = message.replace(a, _redact(a))
    return message


def _one_line(text: str) -> str:
    """One line, safe for a terminal: line breaks joined, any other character that does not
    print (escapes, NUL, bidi overrides: from a path, a name or a store) escaped."""
    text = re.sub(r"\s*[\r\n]+\s*", " ", str(text)).strip()
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass


def _progress(total: int | None, desc: str, quiet: bool, unit: str = "ckpt"):
    """A tqdm bar on stderr, only on a terminal and without --quiet."""
    if quiet or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    if unit == "B":
        return tqdm(total=total, desc=desc, file=sys.stderr, unit="B", unit_scale=True, leave=False)
    return tqdm(total=total, desc=desc, file=sys.stderr, unit=unit, leave=False)


def _meta(meta):
    """``meta`` as every store lists it: the manifest's JSON form (same output on every backend)."""
    from .stores.metajson import meta_to_json
    return meta_to_json(meta)


def _jsonable(o):
    """Strict JSON for any output, in the forms the manifest uses where JSON has none:
    bytes as ``{"$bytes": base64}``, NaN and infinities as ``{"$float": "nan" | "inf" | "-inf"}``,
    non-string keys as ``str(key)``, tuples and sets as lists, anything else as ``str()``."""
    if o is None or isinstance(o, (bool, int, str)):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else _meta(o)
    if isinstance(o, (bytes, bytearray, memoryview)):
        return _meta(o)
    if isinstance(o, dict):
        return {(k if isinstance(k, str) else str(k)): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in o]
    return str(o)


def _json(obj, **kw) -> str:
    return json.dumps(_jsonable(obj), allow_nan=False, **kw)


def _emit(args, obj, text) -> None:
    """``obj`` as JSON with --json, else ``text()`` (built only when shown)."""
    print(_json(obj, indent=2) if getattr(args, "json", False) else text())


def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    try:
        return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):   # a forged timestamp still prints
        return str(ts)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _n(count: int, noun: str) -> str:
    """``count`` and ``noun``, singular or plural as the count needs: 1 tensor, 2 tensors."""
    return f"{count} {noun if count == 1 else noun + 's'}"


MAX_COLUMN = 60     # widest a table column gets in text output (--json prints every value whole)


def _clip(text: str, width: int = MAX_COLUMN) -> str:
    """``text`` at most ``width`` characters: a longer one keeps its start and end around an ellipsis."""
    if len(text) <= width:
        return text
    tail = (width - 1) // 2
    return text[:width - 1 - tail] + "\u2026" + text[len(text) - tail:]


def _shown(text: str, width: int = MAX_COLUMN) -> str:
    """A name or message from a store, safe for a terminal: every character that does
    not print (control characters, escapes, CR, NUL, bidi overrides) escaped as Python
    writes it, and the whole clipped to ``width``."""
    return _clip("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text)), width)


def _table(rows: list, right: tuple = ()) -> list[str]:
    """``rows`` (lists of cells) as aligned lines: each column as wide as its widest
    cell, cells clipped to MAX_COLUMN; the last column is neither clipped nor padded.
    Columns in ``right`` are aligned right."""
    if not rows:
        return []
    rows = [[_clip(c) for c in r[:-1]] + [r[-1]] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def _unknown_run(command: str, store, run: str) -> _Exit:
    """A --run with no checkpoints in ``store``: exit 4, naming the runs there are."""
    return _Exit(EXIT_UNAVAILABLE, f"agck {command}: no run {run!r} with checkpoints in {store.where} "
                                   f"(runs: {', '.join(store.runs()) or 'none'})")


def _nothing_stored(command: str, store, doing: str | None = None) -> _Exit:
    """A store with no checkpoint at all: verify, recover, scrub and gc have nothing to do,
    which is not a success."""
    return _Exit(EXIT_UNAVAILABLE, f"agck {command}: {store.where} holds no checkpoints, so there is nothing to "
                                   f"{doing or command} (check the path: an empty store, or not an agck store)")


def _open(url: str):
    """An existing store; reading commands (and prune) never create one."""
    from .stores import is_kv_dsn, open_store
    if not (url.startswith(_STORE_SCHEMES) or "://" in url or is_kv_dsn(url) or os.path.isdir(url)):
        what = "is a file, not a store directory" if os.path.exists(url) else "no such file or store directory"
        raise _Exit(EXIT_UNAVAILABLE, f"agck: {_redact(url)}: {what}")
    return open_store(url, create=False)


def _file_or_store(args, target: str, command: str) -> bool:
    """Whether ``target`` is a checkpoint file; --run and --step pick from a store only."""
    if not os.path.isfile(target):
        return False
    if getattr(args, "run", None) is not None or getattr(args, "step", None) is not None:
        raise _Exit(EXIT_USAGE, f"agck {command}: --run and --step pick a checkpoint from a store, "
                                f"and {target} is a file")
    return True


def _listing_in_store(path: str):
    """(store root, run, step) when ``path`` is a chunked checkpoint of a file store,
    whose content is read through that store; else None."""
    from .stores.file.store import locate
    return locate(path)


def _load_file(path: str, *, verify: bool = True):
    """A checkpoint file: a standalone container, or a store's chunked one read through its store."""
    where = _listing_in_store(path)
    if where is None:     # verified: read, not mapped (an I/O error is then an error, not a SIGBUS)
        return checkpoint.load(path, verify=verify, mmap=not verify)
    from .stores import open_store
    root, run, step = where
    with open_store(root, create=False) as store:
        return store.read(run, step, verify=verify)


def _stored_info(ck, verified: bool) -> dict:
    return {"path": ck.ref, "header": ck.header.as_dict(), "run": ck.run, "step": ck.step,
            "parent": ck.parent, "meta": ck.meta, "tensors": ck.tensors, "verified": verified}


def _stored_checkpoint(args, url: str, command: str):
    """``--run``/``--step`` of a store (step None: the newest that verifies)."""
    store = _open(url)
    with store:
        if args.run is None:
            raise _Exit(EXIT_USAGE, f"agck {command}: a store needs --run (and optionally --step)")
        return store.get(args.run, args.step)


# --- commands ---------------------------------------------------------------------

def cmd_show(args) -> int:
    if _file_or_store(args, args.target, "show"):
        if _listing_in_store(args.target):
            info = _stored_info(_load_file(args.target, verify=args.verify), args.verify)
        else:
            info = checkpoint.inspect(args.target, verify=args.verify)
    else:
        journal = _journal_only(args)
        if journal is not None:      # a run that keeps only a journal: what it holds
            _emit(args, journal, lambda: "\n".join([f"{journal['run']}: journal ({journal['ref']}): "
                                                    f"{_journal_line(journal)}, {_size(journal['bytes'])}"]
                                                   + _journal_damage(journal)))
            return EXIT_WALKED_BACK if journal["damaged"] else EXIT_OK
        info = _stored_info(_stored_checkpoint(args, args.target, "show"), True)
    info["meta"] = _meta(info["meta"])
    _emit(args, info, lambda: _format_show(info))
    return EXIT_OK


def _journal_only(args) -> dict | None:
    """``show STORE --run R`` of a run with a journal and no checkpoint: the journal's report."""
    if args.run is None or args.step is not None:
        return None
    from .journal import inspect_journal
    with _open(args.target) as store:
        if store.steps(args.run) or args.run not in store.log_runs():
            return None
        return inspect_journal(store, args.run)


def _shape(shape) -> str:
    if isinstance(shape, (list, tuple)):
        return "x".join(map(str, shape)) or "()"
    return str(shape)   # a malformed descriptor still shows


def _format_show(info: dict) -> str:
    h = info["header"]
    lines = [f"{info.get('path') or '<bytes>'}",
             f"  format     AGCK {h['version']}  flags=0x{h['flags']:08x}",
             f"  run        {info['run']!r}  step {info['step']}  parent {info['parent']}",
             f"  created    {_time(h['created_at_ns'] / 1e9)} UTC",
             f"  size       {h['total_len']} bytes (metadata {h['meta_len']}, payload {h['payload_len']}, "
             f"{h['blob_count']} blobs)",
             f"  checksums  header {h['header_xxh3']}  metadata {h['meta_xxh3']}  "
             f"({'payload verified' if info.get('verified') else 'payload not verified; use --verify'})"]
    if info.get("meta") is not None:
        lines.append(f"  meta       {_json(info['meta'])}")
    tensors = info.get("tensors") or []
    lines.append(f"  tensors    {len(tensors)}")
    if tensors:
        rows = [("path", "lib", "dtype", "shape", "offset", "bytes", "xxh3")]
        for t in tensors:
            rows.append((str(t.get("path")), str(t.get("lib")), str(t.get("dtype")), _shape(t.get("shape")),
                         str(t.get("blob_offset", "-") if t.get("offset", 0) == 0 else
                             f"{t.get('blob_offset')}+{t.get('offset')}"),
                         str(t.get("blob_nbytes", "-")), str(t.get("xxh3", "-"))))
        lines += ["    " + line for line in _table(rows, right=(4, 5))]
    return "\n".join(lines)


def cmd_ls(args) -> int:
    from .journal import inspect_journal
    with _open(args.store) as store:
        infos = store.list(args.run)
        partial = sharded.partial_parts(store, args.run)
        journals = [inspect_journal(store, r, decode=False) for r in _journal_runs(store, args.run)]
        if args.run is not None and not infos and not partial and not journals:   # a mistyped run
            raise _unknown_run("ls", store, args.run)
    rows = [{**i.as_dict(), "meta": _meta(i.meta)} for i in infos]
    # parts of multi-rank steps that no commit record binds: never resumed, listed apart
    rows += [{"run": p.run, "step": p.step, "partial": p.as_dict()} for p in partial]
    # step journals (agck.Journal, and the segments of snapshotted AppendLogs): a row per run
    rows += [{"run": j["run"], "step": None, "journal": j} for j in journals]

    def text():
        if not rows:
            return "(no checkpoints)"
        cells = [["run", "step", "parent", "size", "created", "meta"]]
        for r in rows:
            if "journal" in r:
                cells.append([r["run"], "journal", "-", _size(r["journal"]["bytes"]), "-", _journal_line(r["journal"])])
                continue
            if "partial" in r:
                p = r["partial"]
                cells.append([r["run"], str(r["step"]), "-", "-", "-",
                              f"partial: rank {p['rank']}'s part (epoch {p['epoch']}), not committed: {p['reason']}"])
                continue
            cells.append([r["run"], str(r["step"]), "-" if r["parent"] is None else str(r["parent"]),
                          _size(r["size"]), _time(r["created_at"]), _json(r["meta"]) if r["meta"] is not None else ""])
        return "\n".join(_table(cells, right=(1, 2, 3)))
    _emit(args, rows, text)
    return EXIT_OK


def cmd_verify(args) -> int:
    from .recovery import verify_store
    if _file_or_store(args, args.target, "verify"):
        try:
            _load_file(args.target, verify=True)
        except AgckError as e:    # judged as a store's scan judges it (a damaged magic too)
            if not e.verdict:
                raise
            _emit(args, {"ok": 0, "corrupt": 1, "rejected": [{"ref": args.target, "reason": e.reason,
                                                              "section": getattr(e, "section", None)}]},
                  lambda: f"CORRUPT {args.target}: {e.reason}")
            return EXIT_WALKED_BACK
        _emit(args, {"ok": 1, "corrupt": 0, "rejected": []}, lambda: f"OK {args.target}")
        return EXIT_OK
    from .journal import inspect_journal
    with _open(args.target) as store:
        journal_runs = _journal_runs(store, args.run)
        if args.run is not None and not store.steps(args.run) and not journal_runs:
            raise _unknown_run("verify", store, args.run)
        runs = [args.run] if args.run else store.runs()
        total = sum(len(store.steps(r)) for r in runs)
        if not total and not journal_runs:       # verified nothing: not a green result
            raise _nothing_stored("verify", store)
        with _progress(total, "verify", args.quiet) as bar:
            rep = verify_store(store, args.run, progress=lambda: bar.update(1))
        journals = [inspect_journal(store, r) for r in journal_runs]     # every record, every value
    damaged = sum(len(j["damaged"]) for j in journals)
    lines = [f"{len(rep.ok)} ok, {len(rep.rejected)} corrupt"
             + (f"; {_n(len(journals), 'journal')}: {sum(j['records'] for j in journals)} records ok, "
                f"{damaged} damaged" if journals else "")]
    lines += [f"  CORRUPT {r.run} step {r.step} ({r.ref}): {r.reason}" for r in rep.rejected]
    for j in journals:
        lines += _journal_damage(j)
    lines += [f"  orphan  {p}" for p in rep.orphans]
    _emit(args, {**rep.as_dict(), "journals": journals}, lambda: "\n".join(lines))
    return EXIT_WALKED_BACK if rep.rejected or damaged else EXIT_OK


def cmd_journal(args) -> int:
    """The step journals of a store (agck.Journal): what each holds, every record verified."""
    from .journal import inspect_journal
    with _open(args.store) as store:
        runs = store.log_runs()
        if args.run is not None:
            check_run(args.run)
            if args.run not in runs:
                raise _Exit(EXIT_UNAVAILABLE, f"agck journal: no journal of run {args.run!r} in {store.where} "
                                              f"(journals: {', '.join(runs) or 'none'})")
            runs = [args.run]
        reports = [inspect_journal(store, r) for r in runs]

    def text():
        if not reports:
            return "(no journals)"
        lines = []
        for r in reports:
            lines.append(f"{r['run']}: {_journal_line(r)}, {_size(r['bytes'])}")
            lines += _journal_damage(r)
        return "\n".join(lines)
    _emit(args, reports, text)
    return EXIT_WALKED_BACK if any(r["damaged"] for r in reports) else EXIT_OK


def _journal_runs(store, run: str | None) -> list[str]:
    runs = store.log_runs()
    return runs if run is None else [r for r in runs if r == run]


def _journal_line(r: dict) -> str:
    """What a journal holds (:func:`agck.journal.inspect_journal`), in one line."""
    steps = ", ".join(f"{_shown(n)} {k}" for n, k in r["steps"].items())
    return (f"{_n(r['results'], 'result')} ({steps or 'none'}), {_n(r['streams'], 'stream')} "
            f"({r['streams_complete']} complete), "
            + "".join(f"AppendLog {_shown(n)} in {_n(k, 'segment')}, " for n, k in r["log_segments"].items())
            + _n(r["records"], "record")
            + (f", {_n(len(r['damaged']), 'damaged record')}" if r["damaged"] else "")
            + (f", {_n(len(r['healed']), 'damaged record')} written again since" if r.get("healed") else "")
            + (", a torn tail (a write cut short: never acknowledged)" if r["torn_tail"] else ""))


def _journal_damage(r: dict) -> list[str]:
    def fate(d: dict) -> str:
        if d.get("kind") == "s":
            return "an AppendLog segment: a checkpoint counting its items walks back"
        if d.get("kind") == "batch":
            from .journal import FRAMING_FATE
            return FRAMING_FATE
        return "its step runs again"
    return [f"  DAMAGED at byte {d['at']} of {_shown(r['ref'], 300)}: {_shown(d['reason'], 300)} ({fate(d)})"
            for d in r["damaged"]]


def cmd_recover(args) -> int:
    from .journal import inspect_journal
    from .recovery import recover_run
    with _open(args.store) as store:
        with_parts = {r for _, r, _, _ in sharded.part_runs(store, args.run)}   # runs with multi-rank parts
        journal_runs = _journal_runs(store, args.run)
        runs = [check_run(args.run)] if args.run is not None else \
            sorted(set(store.runs()) | with_parts | set(journal_runs))
        if not with_parts and not journal_runs and not any(store.steps(r) for r in runs):
            # nothing to recover is not a success
            raise _unknown_run("recover", store, args.run) if args.run is not None else \
                _nothing_stored("recover", store)
        results = []
        with _progress(None, "recover", args.quiet) as bar:
            for r in runs:
                results.append(recover_run(store, r, on_candidate=lambda s: bar.update(1)))
        # what a journal of the run reads back when it opens: its steps whose records are
        # damaged run again; a torn tail is cut off by the next append
        journals = {r: inspect_journal(store, r) for r in journal_runs}
        partial = {r: sharded.partial_parts(store, r) for r in runs}
        cleaned = []
        if args.clean:
            for r in runs:
                cleaned += store.clean_orphans(r)
                cleaned += sharded.clean_partial(store, r)
            cleaned += store.clean_orphans(None) if not args.run else []
    if args.restore_to:
        if len(results) != 1 or results[0].checkpoint is None:
            raise _Exit(EXIT_USAGE if len(results) != 1 else EXIT_NOTHING_VALID,
                        "agck recover: --restore-to needs exactly one run with a valid checkpoint (use --run)")
        ck = results[0].checkpoint
        if sharded.is_commit(ck):
            raise _Exit(EXIT_USAGE, f"agck recover: run {ck.run!r} step {ck.step} is a multi-rank checkpoint "
                                    "(one part per rank): --restore-to writes single-process checkpoints only")
        checkpoint.save(args.restore_to, ck.state, run=ck.run, step=ck.step, parent=ck.parent, meta=ck.meta)
    lines = []
    for rec in results:
        if rec.checkpoint is None and not rec.candidates and rec.run in journals:
            pass        # a run that keeps only a journal: said below
        elif rec.checkpoint is None and not rec.candidates:
            lines.append(f"{rec.run}: no checkpoints")
        elif rec.checkpoint is None:
            lines.append(f"{rec.run}: NOTHING VALID among {_n(rec.candidates, 'checkpoint')}")
        else:
            how = f", walked back past {_n(len(rec.rejected), 'checkpoint')}" if rec.rejected else ""
            lines.append(f"{rec.run}: last valid step {rec.step} ({rec.ref}){how}")
        for rj in rec.rejected:
            lines.append(f"  rejected step {rj.step} ({rj.ref}): {rj.reason}")
        for o in rec.orphans:
            lines.append(f"  orphan {o}{' (removed)' if o in cleaned else ''}")
        for p in partial[rec.run]:
            state = " (removed)" if p.ref in cleaned else "" if p.removable else " (may be in flight: kept)"
            lines.append(f"  partial step {p.step}: rank {p.rank}'s part (epoch {p.epoch}), {p.reason}{state}")
        j = journals.get(rec.run)
        if j is not None:
            lines.append(f"{rec.run}: journal: {_journal_line(j)}")
            lines += _journal_damage(j)
    if args.restore_to:
        lines.append(f"restored to {args.restore_to}")
    out = {"runs": [{**r.as_dict(), "partial": [p.as_dict() for p in partial[r.run]],
                     "journal": journals.get(r.run)} for r in results],
           "cleaned": cleaned, "restored_to": args.restore_to}
    _emit(args, out, lambda: "\n".join(lines) or "(no runs)")
    if any(r.checkpoint is None and r.candidates for r in results) or not results:
        return EXIT_NOTHING_VALID
    if any(r.rejected for r in results) or any(j["damaged"] for j in journals.values()):
        return EXIT_WALKED_BACK
    return EXIT_OK


def cmd_prune(args) -> int:
    with _open(args.store) as store:
        if not store.steps(args.run):   # a mistyped run would otherwise "prune" nothing, successfully
            raise _unknown_run("prune", store, args.run)
        deleted = store.prune(args.run, keep_last=args.keep_last, keep_every=args.keep_every, before=args.before,
                              drop_unverified=args.drop_unverified)
        left = store.steps(args.run)
    _emit(args, {"deleted": deleted, "kept": left},
          lambda: f"deleted {_n(len(deleted), 'checkpoint')} of {args.run}; kept steps {left}")
    return EXIT_OK


def cmd_gc(args) -> int:
    with _open(args.store) as store:
        got = store.collect_garbage()
        stored = sum(len(store.steps(r)) for r in store.runs()) if got is not None else 0
        if not stored and not store.log_runs() and (got is None or not (got.deleted_chunks or got.live_chunks)):
            raise _nothing_stored("gc", store, "collect")
    if got is None:
        _emit(args, {"collected": None}, lambda: f"{store.url}: this store shares no content; nothing to collect")
        return EXIT_OK
    # checkpoints that list no chunks (written whole: small, or not incremental) hold their own bytes
    standalone = max(0, stored - got.listings - len(got.unreadable))

    def text():
        out = (f"deleted {_n(got.deleted_chunks, 'chunk')} ({_size(got.deleted_bytes)}); "
               f"{_n(got.live_chunks, 'chunk')} kept for {_n(got.listings, 'chunked checkpoint')}")
        if standalone:
            out += (f"; {_n(standalone, 'standalone checkpoint')}, which "
                    f"{'shares' if standalone == 1 else 'share'} no chunks (each holds its own bytes)")
        if got.unreadable:
            out += "; nothing deleted: a checkpoint that cannot be read may list any chunk"
        return (out + "".join(f"\n  damaged listing (its chunks kept): {p}" for p in got.damaged)
                + "".join(f"\n  cannot be read (delete it if you are sure, then gc again): {p}" for p in got.unreadable))
    _emit(args, {**got.as_dict(), "standalone": standalone}, text)
    return EXIT_OK


def cmd_scrub(args) -> int:
    with _open(args.store) as store:
        with _progress(None, "scrub", args.quiet, unit="B") as bar:
            rep = store.scrub(quarantine=not args.no_quarantine, progress=bar.update)
        if not (rep.chunks or rep.listings or rep.damaged or rep.missing or store.runs() or store.log_runs()):
            raise _nothing_stored("scrub", store)
    def text():
        lines = [f"{_n(rep.chunks, 'chunk')} ({_size(rep.bytes)}) of {_n(rep.listings, 'chunked checkpoint')} "
                 "checked: " + ("no damage" if rep.ok else
                                f"{len(rep.damaged)} damaged, {len(rep.missing)} missing, "
                                f"{_n(len(rep.damaged_listings), 'damaged listing')}; "
                                f"{_n(len(rep.broken), 'checkpoint')} broken")]
        for d in rep.damaged + rep.missing:
            fate = {"quarantined": "quarantined now", "quarantined earlier": "quarantined earlier as damaged",
                    "intact": "re-read intact, left in place", None: "left in place"}.get(d.quarantined, "")
            what = f"{d.reason}; {fate}" if d.ref else fate or "missing"
            lines.append(f"  {'DAMAGED' if d.ref else 'MISSING'} chunk {d.address[:16]} ({what}): "
                         f"breaks {_n(len(d.checkpoints), 'checkpoint')}")
            lines += [f"    {r}" for r in d.checkpoints[:10]]
            if len(d.checkpoints) > 10:
                lines.append(f"    ... and {len(d.checkpoints) - 10} more (--json lists them all)")
        lines += [f"  DAMAGED listing {r}" for r in rep.damaged_listings]
        if not rep.ok and not args.no_quarantine:
            lines.append("  the next put holding the content of a quarantined or missing chunk writes it afresh, "
                         "which heals every checkpoint that lists it")
        return "\n".join(lines)
    _emit(args, rep.as_dict(), text)
    return EXIT_OK if rep.ok else EXIT_WALKED_BACK


def cmd_export(args) -> int:
    from .export import export
    if _file_or_store(args, args.source, "export"):
        ck = _load_file(args.source)
    else:
        ck = _stored_checkpoint(args, args.source, "export")
    summary = export(ck, args.to, max_bytes=args.max_bytes)
    skipped = summary["skipped"]
    converted = summary.get("converted") or {}
    _emit(args, summary, lambda: f"wrote {_n(summary['tensors'], 'tensor')} to {args.to}"
          + (f" (skipped {len(skipped)}: {', '.join(skipped[:5])}"
             f"{'...' if len(skipped) > 5 else ''})" if skipped else "")
          + (f"; converted {_converted(converted)}, so that torch.load reads it with weights_only=True"
             if any(converted.values()) else ""))
    return EXIT_OK


def _converted(converted: dict) -> str:
    """What a .pt export converted, in words."""
    arrays, scalars = converted.get("arrays", 0), converted.get("scalars", 0)
    what = [f"{_n(arrays, 'numpy array')} to {'a torch tensor' if arrays == 1 else 'torch tensors'}" if arrays else "",
            f"{_n(scalars, 'numpy scalar')} to {'a Python number' if scalars == 1 else 'Python numbers'}"
            if scalars else ""]
    return " and ".join(w for w in what if w)


def cmd_key(args) -> int:
    """Key slots of an encrypted store (FORMAT.md 18.6): list, init, add, remove, rotate."""
    from .stores import encryption, open_store
    if args.slot is not None and args.action != "remove":
        raise _Exit(EXIT_USAGE, f"agck key {args.action}: takes no slot id (only remove does); nothing was changed")
    if args.action == "init":
        if "://" not in args.store and os.path.exists(args.store) and (not os.path.isdir(args.store)
                                                                      or os.listdir(args.store)):
            raise _Exit(EXIT_USAGE, f"agck key init: {_redact(args.store)} is not an empty directory")
        with open_store(args.store, key=encryption.new_key(args.new_key_file)) as store:
            encryption.commit_first_slot(store.sealer)     # what a first write would do
            if store.sealer is None or not store.sealer.made_now:
                raise _Exit(EXIT_USAGE, f"agck key init: {store.where} is encrypted already "
                                        "(agck key add adds a key to it)")
            [slot] = store.key_slots()
        _emit(args, {"store": store.url, "slot": _slot_row(slot)},
              lambda: f"{store.url}: encrypted; key slot {slot['id']} ({slot['kind']}). Keep that key: without "
                      "it (or another added later) nothing in the store can be read")
        return EXIT_OK
    with _open(args.store) as store:
        if args.action == "add":
            slot = store.add_key(encryption.new_key(args.new_key_file))
            _emit(args, _slot_row(slot), lambda: f"added key slot {slot['id']} ({slot['kind']})")
        elif args.action in ("remove", "rotate"):
            if args.action == "rotate":
                slot = store.add_key(encryption.new_key(args.new_key_file))
                gone = store.sealer.slot_id if store.sealer is not None else None
                if gone is None:
                    raise _Exit(EXIT_USAGE, "agck key rotate: the store is not encrypted")
            else:
                if not args.slot:
                    raise _Exit(EXIT_USAGE, "agck key remove: name the slot (agck key list STORE shows them)")
                gone, slot = args.slot, None
            store.remove_key(gone)
            _emit(args, {"removed": gone, "added": _slot_row(slot) if slot else None},
                  lambda: (f"added key slot {slot['id']}; " if slot else "") + f"removed key slot {gone}")
        else:
            slots, damaged = store.key_slots(), store.damaged_key_slots()
            rows = [_slot_row(x) for x in slots] + [{"id": d.id, "damaged": d.reason} for d in damaged]
            _emit(args, rows,
                  lambda: "\n".join([f"{x['id']}  {x['kind']:10}  created {_time(x['created'])}" for x in slots]
                                    + [f"{d.id}  damaged     {d.reason}" for d in damaged])
                  or f"{store.url}: not encrypted (no key slots)")
    return EXIT_OK


def _slot_row(slot: dict) -> dict:
    return {"id": slot["id"], "kind": slot["kind"], "created": slot["created"]}


def cmd_db(args) -> int:
    from .stores import is_kv_dsn, postgres_store_class, split_agck_params
    PostgresStore = postgres_store_class()
    if not (args.dsn.startswith(("postgresql://", "postgres://")) or is_kv_dsn(args.dsn)):
        raise _Exit(EXIT_USAGE, "agck db: DSN must be a postgresql:// URL or a libpq 'key=value ...' string")
    dsn, own = split_agck_params(args.dsn)
    opts = {}
    for name in ("prefix", "schema"):
        flag = getattr(args, name)
        if flag is not None and own.get(name, flag) != flag:
            raise _Exit(EXIT_USAGE, f"agck db: --{name} {flag} disagrees with agck_{name}={own[name]} in the DSN")
        value = flag if flag is not None else own.get(name)
        if value is not None:
            opts[name] = value
    if "pool" in own:
        opts["pool"] = own["pool"]
    applied = None
    if "objects" in own and args.action != "init":
        raise _Exit(EXIT_USAGE, f"agck db {args.action}: agck_objects binds a bucket at init; a catalog keeps the "
                                "bucket it was bound to (drop agck_objects here)")
    init = {"init": True, "objects": own["objects"]} if "objects" in own else {"check_schema": False}
    with PostgresStore(dsn, **init, **opts) as store:
        if args.action == "init":
            store.init_schema()
        elif args.action == "migrate":
            applied = store.migrate()
        status = store.schema_status()
    _emit(args, status, lambda: _format_schema(status, applied))
    return EXIT_OK


_SCHEMA_STATES = {"current": "current", "uninitialized": "uninitialized (run agck db init)",
                  "incomplete": "incomplete: tables missing (run agck db init)",
                  "outdated": "outdated (run agck db migrate)", "newer": "made by a newer agck (upgrade agck)"}


def _format_schema(status: dict, applied: list | None) -> str:
    """``agck db``'s text output: one line per fact of the schema's status."""
    version = "none" if status.get("version") is None else status["version"]
    lines = [f"{status.get('url')}",
             f"  state           {_SCHEMA_STATES.get(status.get('state'), status.get('state'))}",
             f"  version         {version} (this agck uses {status.get('expected')})",
             f"  prefix          {status.get('prefix')}",
             f"  schema          {status.get('schema') or '(the search_path)'}",
             f"  missing tables  {', '.join(status.get('missing_tables') or []) or 'none'}",
             f"  chunks in       {status.get('objects') or 'the database (no object store bound)'}",
             f"  pool            at most {status.get('pool')} connections per process (agck_pool)"]
    if applied is not None:
        lines.append("  migrated        " + (f"to version {', '.join(map(str, applied))}" if applied else
                                              "nothing to do"))
    return "\n".join(lines)


# --- plumbing ---------------------------------------------------------------------

def _step(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, not {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, not {text!r}")
    return v


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}   # not a threshold: units


def _bytes(text: str) -> int:
    """A byte count: 123, 512M, 8G, 1.5GiB (binary units)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.ASCII | re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 123, 512M or 8G, not {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_STORE_HELP = "a store directory or URL (sqlite:///x.db, postgresql://...)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agck", description="Crash-safe checkpoints: inspect, verify, recover.",
                                epilog="Exit codes: 0 ok, 1 walked back / corruption found, 2 usage, "
                                       "3 nothing valid, 4 store or file unavailable, no checkpoints to "
                                       "verify or recover (or torch needed and missing).")
    p.add_argument("--version", action="version", version=f"agck {__import__('agck').__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="what to do (agck COMMAND --help lists its options)")

    def common(sp, reads=True):
        if reads:
            sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    sp = sub.add_parser("recover", help="find each run's last valid checkpoint after a crash")
    sp.add_argument("store", help=_STORE_HELP)
    sp.add_argument("--run", help="only this run (default: every run of the store)")
    sp.add_argument("--restore-to", metavar="FILE", help="write the recovered checkpoint as a standalone .agck")
    sp.add_argument("--clean", action="store_true",
                    help="remove temp files left by interrupted writes and uncommitted multi-rank parts")
    common(sp)
    sp.set_defaults(func=cmd_recover)

    sp = sub.add_parser("ls", help="list checkpoints (reads no payload)")
    sp.add_argument("store", help=_STORE_HELP)
    sp.add_argument("--run", help="only this run's checkpoints (default: every run's)")
    common(sp)
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser("journal", help="what the step journals of a store hold, every record verified")
    sp.add_argument("store", help=_STORE_HELP)
    sp.add_argument("--run", help="only this run's journal (default: every run's)")
    common(sp)
    sp.set_defaults(func=cmd_journal)

    sp = sub.add_parser("show", help="header, metadata and tensor table of a file or a stored checkpoint")
    sp.add_argument("target", metavar="STORE_OR_FILE", help="a checkpoint file, or a store (with --run)")
    sp.add_argument("--run", help="the run to show a checkpoint of (a store needs it)")
    sp.add_argument("--step", type=_step, help="the step to show (default: the newest that verifies)")
    sp.add_argument("--verify", action="store_true", help="also check every tensor checksum (files)")
    common(sp)
    sp.set_defaults(func=cmd_show)

    sp = sub.add_parser("verify", help="fully verify a file or every checkpoint of a store")
    sp.add_argument("target", metavar="STORE_OR_FILE", help="a checkpoint file, or a store")
    sp.add_argument("--run", help="only this run's checkpoints (default: every run's)")
    common(sp)
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser("prune", help="delete old checkpoints; never the newest valid one")
    sp.add_argument("store", help=_STORE_HELP)
    sp.add_argument("--run", required=True, help="the run to prune")
    sp.add_argument("--keep-last", type=_step, required=True, metavar="N", help="keep the newest N checkpoints")
    sp.add_argument("--keep-every", type=_step, metavar="K", help="also keep every step that is a multiple of K")
    sp.add_argument("--before", type=_step, metavar="STEP", help="only delete steps below STEP")
    sp.add_argument("--drop-unverified", action="store_true",
                    help="also delete the checkpoints newer than the newest valid one, which do not verify "
                         "(by default they are kept: agck verify says why each fails)")
    common(sp)
    sp.set_defaults(func=cmd_prune)

    sp = sub.add_parser("gc", help="delete stored chunks no checkpoint refers to any more")
    sp.add_argument("store", help=_STORE_HELP)
    common(sp)
    sp.set_defaults(func=cmd_gc)

    sp = sub.add_parser("scrub", help="re-hash every stored chunk; report and quarantine damaged ones")
    sp.add_argument("store", help=_STORE_HELP)
    sp.add_argument("--no-quarantine", action="store_true",
                    help="only report: leave damaged chunks where they are")
    common(sp)
    sp.set_defaults(func=cmd_scrub)

    sp = sub.add_parser("export", help="export a checkpoint to .safetensors, .pt, .npz or a standalone .agck")
    sp.add_argument("source", metavar="STORE_OR_FILE", help="a checkpoint file, or a store (with --run)")
    sp.add_argument("--to", required=True, metavar="OUT",
                    help="the file to write; its extension picks the format (.safetensors, .pt, .npz, .agck)")
    sp.add_argument("--run", help="the run to export a checkpoint of (a store needs it)")
    sp.add_argument("--step", type=_step, help="the step to export (default: the newest that verifies)")
    sp.add_argument("--max-bytes", type=_bytes, metavar="SIZE",
                    help="write at most this much tensor data (default: twice the checkpoint's size)")
    common(sp)
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("key", help="an encrypted store's keys: list, init, add, remove, rotate")
    sp.add_argument("action", choices=["list", "init", "add", "remove", "rotate"],
                    help="list the key slots; init: make an empty encrypted store; add a key; remove a slot; "
                         "rotate: add a new key and remove the one used to open the store")
    sp.add_argument("store", help="a store directory (the store's current key: $AGCK_KEY or $AGCK_KEY_FILE)")
    sp.add_argument("slot", nargs="?", help="remove: the slot id (agck key list shows them)")
    sp.add_argument("--new-key-file", metavar="PATH",
                    help="init, add, rotate: the new key (64 hex digits, or a passphrase); else $AGCK_NEW_KEY, "
                         "else typed at the terminal")
    common(sp)
    sp.set_defaults(func=cmd_key)

    sp = sub.add_parser("db", help="Postgres schema: init, migrate, status")
    sp.add_argument("action", choices=["init", "migrate", "status"],
                    help="init: create the tables; migrate: bring an older schema forward; status: say where it stands")
    sp.add_argument("dsn", help="a postgresql:// URL or a libpq 'key=value ...' string")
    sp.add_argument("--prefix", help="table prefix (default agck, or agck_prefix= in the DSN)")
    sp.add_argument("--schema", help="Postgres schema of the tables (or agck_schema= in the DSN)")
    common(sp)
    sp.set_defaults(func=cmd_db)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.argv = argv
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")   # paths that are not valid UTF-8 still print
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:     # --help, --version, usage errors (already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return args.func(args)
    except _Exit as e:
        return _fail(e.message, e.code)
    except (NoValidCheckpointError, CorruptCheckpointError) as e:
        return _fail(f"agck: {e}", EXIT_NOTHING_VALID)
    except (UsageError, InvalidRunNameError) as e:
        return _fail(f"agck: {e}", EXIT_USAGE)
    except (StoreError, FormatError, DependencyError, EncryptionKeyError) as e:     # (a bad key: bad credentials)
        return _fail(f"agck: {e}", EXIT_UNAVAILABLE)
    except AgckError as e:
        return _fail(f"agck: {e}", EXIT_USAGE)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:   # a file agck reads or writes for the user: the output of export, --restore-to
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"agck: {where}{e.strerror or e}", EXIT_UNAVAILABLE)


def _fail(message: str | None, code: int) -> int:
    """One line on stderr, never a traceback nor a password."""
    if message:
        print(_one_line(_redact_args(message, _Parser.argv)), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
