"""`agck`: the command line. Thin: parses, calls the library, prints.

Exit codes (also in the README):
  0  all good
  1  recovered, but had to walk back past rejected checkpoints; or verify found corruption
  2  usage error (bad arguments)
  3  nothing valid: no checkpoint verifies, or the file is corrupt
  4  cannot open the store or file (missing, unreachable server, bad credentials, unknown run/step),
     or the checkpoint needs torch and `import torch` fails here
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone

from . import checkpoint
from .errors import (AgckError, CheckpointNotFoundError, CorruptCheckpointError, DependencyError, FormatError,
                     NoValidCheckpointError, StoreConnectionError, StoreError)

EXIT_OK, EXIT_WALKED_BACK, EXIT_USAGE, EXIT_NOTHING_VALID, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4


class _Exit(Exception):
    def __init__(self, code: int, message: str | None = None):
        self.code, self.message = code, message


def _progress(total: int | None, desc: str, quiet: bool):
    """A tqdm bar on stderr, only on a terminal and without --quiet."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="ckpt", leave=False,
                disable=quiet or not sys.stderr.isatty())


def _json_default(o):
    if isinstance(o, bytes):
        return {"$bytes": o.hex()}
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def _emit(args, obj, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(obj, indent=2, default=_json_default, sort_keys=False))
    else:
        print(text)


def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _open(url: str):
    from .stores import open_store
    if not url.startswith(("postgres", "sqlite:", "file://")) and not os.path.isdir(url):
        raise _Exit(EXIT_UNAVAILABLE, f"agck: {url}: no such file or store directory")
    return open_store(url) if url.startswith(("postgres", "sqlite:")) else open_store(url, create=False)


def _stored_checkpoint(args, url: str, command: str):
    """``--run``/``--step`` of a store (step None: the newest that verifies)."""
    store = _open(url)
    with store:
        if args.run is None:
            raise _Exit(EXIT_USAGE, f"agck {command}: a store needs --run (and optionally --step)")
        return store.get(args.run, args.step)


def _is_file_arg(target: str) -> bool:
    return os.path.isfile(target)


# --- commands ---------------------------------------------------------------------

def cmd_show(args) -> int:
    if _is_file_arg(args.target):
        info = checkpoint.inspect(args.target, verify=args.verify)
    else:
        ck = _stored_checkpoint(args, args.target, "show")
        info = {"path": ck.ref, "header": ck.header.as_dict(), "run": ck.run, "step": ck.step,
                "parent": ck.parent, "meta": ck.meta, "tensors": ck.tensors, "verified": True}
    _emit(args, info, _format_show(info))
    return EXIT_OK


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
        lines.append(f"  meta       {json.dumps(info['meta'], default=_json_default)}")
    tensors = info.get("tensors") or []
    lines.append(f"  tensors    {len(tensors)}")
    if tensors:
        rows = [("path", "lib", "dtype", "shape", "offset", "bytes", "xxh3")]
        for t in tensors:
            rows.append((str(t.get("path")), str(t.get("lib")), str(t.get("dtype")),
                         "x".join(map(str, t.get("shape") or [])) or "()",
                         str(t.get("blob_offset", "-") if t.get("offset", 0) == 0 else
                             f"{t.get('blob_offset')}+{t.get('offset')}"),
                         str(t.get("blob_nbytes", "-")), str(t.get("xxh3", "-"))))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def cmd_ls(args) -> int:
    with _open(args.store) as store:
        infos = store.list(args.run)
        rows = [i.as_dict() for i in infos]
        text = ["run  step  parent  size  created  meta"] if infos else ["(no checkpoints)"]
        for i in infos:
            meta = json.dumps(i.meta, default=_json_default) if i.meta is not None else ""
            text.append(f"{i.run}  {i.step}  {'-' if i.parent is None else i.parent}  {_size(i.size)}  "
                        f"{_time(i.created_at)}  {meta}")
        _emit(args, rows, "\n".join(text))
    return EXIT_OK


def cmd_verify(args) -> int:
    from .recovery import verify_store
    if _is_file_arg(args.target):
        try:
            checkpoint.load(args.target, verify=True)
        except CorruptCheckpointError as e:
            _emit(args, {"ok": 0, "corrupt": 1, "rejected": [{"ref": args.target, "reason": e.reason,
                                                              "section": e.section}]},
                  f"CORRUPT {args.target}: {e.reason}")
            return EXIT_WALKED_BACK
        _emit(args, {"ok": 1, "corrupt": 0, "rejected": []}, f"OK {args.target}")
        return EXIT_OK
    with _open(args.target) as store:
        runs = [args.run] if args.run else store.runs()
        total = sum(len(store.steps(r)) for r in runs)
        with _progress(total, "verify", args.quiet) as bar:
            rep = verify_store(store, args.run, progress=lambda: bar.update(1))
    lines = [f"{len(rep.ok)} ok, {len(rep.rejected)} corrupt"]
    lines += [f"  CORRUPT {r.run} step {r.step} ({r.ref}): {r.reason}" for r in rep.rejected]
    lines += [f"  orphan  {p}" for p in rep.orphans]
    _emit(args, rep.as_dict(), "\n".join(lines))
    return EXIT_WALKED_BACK if rep.rejected else EXIT_OK


def cmd_recover(args) -> int:
    from .recovery import recover_run
    with _open(args.store) as store:
        runs = [args.run] if args.run else store.runs()
        if args.run and args.run not in store.runs():
            raise _Exit(EXIT_UNAVAILABLE, f"agck recover: no run {args.run!r} in {store.url} "
                                          f"(runs: {', '.join(store.runs()) or 'none'})")
        results = []
        with _progress(None, "recover", args.quiet) as bar:
            for r in runs:
                results.append(recover_run(store, r, on_candidate=lambda s: bar.update(1)))
        cleaned = []
        if args.clean:
            for r in runs:
                cleaned += store.clean_orphans(r)
            cleaned += store.clean_orphans(None) if not args.run else []
    if args.restore_to:
        if len(results) != 1 or results[0].checkpoint is None:
            raise _Exit(EXIT_USAGE if len(results) != 1 else EXIT_NOTHING_VALID,
                        "agck recover: --restore-to needs exactly one run with a valid checkpoint (use --run)")
        ck = results[0].checkpoint
        checkpoint.save(args.restore_to, ck.state, run=ck.run, step=ck.step, parent=ck.parent, meta=ck.meta)
    lines = []
    for rec in results:
        if rec.checkpoint is None:
            lines.append(f"{rec.run}: NOTHING VALID among {rec.candidates} checkpoints")
        else:
            how = f", walked back past {len(rec.rejected)}" if rec.rejected else ""
            lines.append(f"{rec.run}: last valid step {rec.step} ({rec.ref}){how}")
        for rj in rec.rejected:
            lines.append(f"  rejected step {rj.step} ({rj.ref}): {rj.reason}")
        for o in rec.orphans:
            lines.append(f"  orphan {o}{' (removed)' if o in cleaned else ''}")
    if args.restore_to:
        lines.append(f"restored to {args.restore_to}")
    out = {"runs": [r.as_dict() for r in results], "cleaned": cleaned, "restored_to": args.restore_to}
    _emit(args, out, "\n".join(lines) or "(no runs)")
    if any(r.checkpoint is None and r.candidates for r in results) or not results:
        return EXIT_NOTHING_VALID
    return EXIT_WALKED_BACK if any(r.rejected for r in results) else EXIT_OK


def cmd_prune(args) -> int:
    with _open(args.store) as store:
        deleted = store.prune(args.run, keep_last=args.keep_last, keep_every=args.keep_every, before=args.before)
        left = store.steps(args.run)
    _emit(args, {"deleted": deleted, "kept": left},
          f"deleted {len(deleted)} checkpoints of {args.run}; kept steps {left}")
    return EXIT_OK


def cmd_export(args) -> int:
    from .export import export
    if _is_file_arg(args.source):
        ck = checkpoint.load(args.source)
    else:
        ck = _stored_checkpoint(args, args.source, "export")
    summary = export(ck, args.to)
    _emit(args, summary, f"wrote {summary['tensors']} tensors to {args.to}"
          + (f" (skipped {len(summary['skipped'])} non-tensor values: {', '.join(summary['skipped'][:5])}"
             f"{'...' if len(summary['skipped']) > 5 else ''})" if summary["skipped"] else ""))
    return EXIT_OK


def cmd_db(args) -> int:
    from .stores.postgres import PostgresStore
    if not args.dsn.startswith(("postgres", "postgresql")):
        raise _Exit(EXIT_USAGE, "agck db: DSN must start with postgresql://")
    store = PostgresStore(args.dsn, prefix=args.prefix, check_schema=False)
    with store:
        if args.action == "init":
            store.init_schema()
        elif args.action == "migrate":
            store.migrate()
        status = store.schema_status()
    _emit(args, status, f"{store.url}: schema {status}")
    return EXIT_OK


# --- plumbing ---------------------------------------------------------------------

def _step(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, not {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"step must be a non-negative integer, not {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agck", description="Crash-safe checkpoints: inspect, verify, recover.",
                                epilog="Exit codes: 0 ok, 1 walked back / corruption found, 2 usage, "
                                       "3 nothing valid, 4 store or file unavailable (or torch needed and missing).")
    p.add_argument("--version", action="version", version=f"agck {__import__('agck').__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp, reads=True):
        if reads:
            sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bars")

    sp = sub.add_parser("recover", help="find each run's last valid checkpoint after a crash")
    sp.add_argument("store", help="store URL or directory")
    sp.add_argument("--run", help="only this run")
    sp.add_argument("--restore-to", metavar="FILE", help="write the recovered checkpoint as a standalone .agck")
    sp.add_argument("--clean", action="store_true", help="remove temp files left by interrupted writes")
    common(sp)
    sp.set_defaults(func=cmd_recover)

    sp = sub.add_parser("ls", help="list checkpoints (reads no payload)")
    sp.add_argument("store")
    sp.add_argument("--run")
    common(sp)
    sp.set_defaults(func=cmd_ls)

    sp = sub.add_parser("show", help="header, metadata and tensor table of a file or a stored checkpoint")
    sp.add_argument("target", metavar="STORE_OR_FILE")
    sp.add_argument("--run")
    sp.add_argument("--step", type=_step, help="default: the newest that verifies")
    sp.add_argument("--verify", action="store_true", help="also check every tensor checksum (files)")
    common(sp)
    sp.set_defaults(func=cmd_show)

    sp = sub.add_parser("verify", help="fully verify a file or every checkpoint of a store")
    sp.add_argument("target", metavar="STORE_OR_FILE")
    sp.add_argument("--run")
    common(sp)
    sp.set_defaults(func=cmd_verify)

    sp = sub.add_parser("prune", help="delete old checkpoints; never the newest valid one")
    sp.add_argument("store")
    sp.add_argument("--run", required=True)
    sp.add_argument("--keep-last", type=_step, required=True, metavar="N")
    sp.add_argument("--keep-every", type=_step, metavar="K")
    sp.add_argument("--before", type=_step, metavar="STEP", help="only delete steps below STEP")
    common(sp)
    sp.set_defaults(func=cmd_prune)

    sp = sub.add_parser("export", help="export a checkpoint to .safetensors, .pt or .npz")
    sp.add_argument("source", metavar="STORE_OR_FILE")
    sp.add_argument("--to", required=True, metavar="OUT")
    sp.add_argument("--run")
    sp.add_argument("--step", type=_step)
    common(sp)
    sp.set_defaults(func=cmd_export)

    sp = sub.add_parser("db", help="Postgres schema: init, migrate, status")
    sp.add_argument("action", choices=["init", "migrate", "status"])
    sp.add_argument("dsn")
    sp.add_argument("--prefix", default="agck", help="table prefix (default agck)")
    common(sp)
    sp.set_defaults(func=cmd_db)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _Exit as e:
        if e.message:
            print(e.message, file=sys.stderr)
        return e.code
    except NoValidCheckpointError as e:
        print(f"agck: {e}", file=sys.stderr)
        return EXIT_NOTHING_VALID
    except (StoreConnectionError, CheckpointNotFoundError, FormatError, DependencyError) as e:
        print(f"agck: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except CorruptCheckpointError as e:
        print(f"agck: {e}", file=sys.stderr)
        return EXIT_NOTHING_VALID
    except (StoreError, AgckError) as e:
        print(f"agck: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE if isinstance(e, StoreError) else EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
