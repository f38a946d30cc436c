"""The seed corpus: valid inputs of every target, written to ``fuzz/corpus/<target>/``
(``python -m fuzz.seeds``). The fuzzer starts from them; the repository keeps them
and what ``scripts/fuzz --merge`` adds."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import warnings

import numpy as np

import agck
from agck import checkpoint, codec, format, journalrec, sharded
from agck.stores.s3 import log as s3log

from fuzz import targets

HERE = os.path.dirname(os.path.abspath(__file__))
_CREATED = 1_700_000_000_000_000_000      # fixed: a seed's bytes (and file name) the same every time


def listing_seeds() -> list[bytes]:
    """The metadata maps of the listings agck's writer makes for targets.listed_checkpoints."""
    out = []
    for listing in targets.listed_checkpoints()[1]:
        meta_len = format.parse_header(listing).meta_len
        out.append(listing[format.HEADER_SIZE:format.HEADER_SIZE + meta_len])
    return out


def _part(commit: sharded.Commit, rank: int, state, user=None) -> bytes:
    """Rank ``rank``'s part of ``commit`` as put_part writes it: its metadata map."""
    p = commit.parts[rank]
    meta = sharded.part_meta(commit.run, commit.step, commit.epoch, rank, commit.world_size, p.nonce, user)
    return checkpoint.encode(state, run=p.run, step=commit.step, meta=meta, created_at_ns=_CREATED).meta_bytes


def _record(commit: sharded.Commit, parts) -> bytes:
    return targets.join(codec.encode_state(commit.state()).tree, *parts)


def commit_seeds() -> list[bytes]:
    """Commit records (the state tree commit_step puts) with their parts: two ranks,
    one rank with extra data, and a torch.distributed.checkpoint save (kind "dcp")."""
    run, step = targets.COMMIT_RUN, targets.COMMIT_STEP

    def commit(epoch, nonces, kind="snapshot", extra=None):
        return sharded.Commit(run=run, step=step, epoch=epoch, world_size=len(nonces),
                              parts=[sharded.PartRef(r, sharded.part_run(run, epoch, r), n)
                                     for r, n in enumerate(nonces)], kind=kind, extra=extra)

    two = commit(1, ["a1b2c3d4e5f60718293a4b5c", "0f1e2d3c4b5a69788796a5b4"])
    one = commit(7, ["00112233445566778899aabb"], extra={"fingerprint": "ab" * 8, "n": [1, 2.5, None]})
    out = [_record(two, [_part(two, r, {"rank": r, "l": [r, "x"]}) for r in range(2)]),
           _record(one, [_part(one, 0, {"x": 1}, user={"u": True})])]
    dcp = targets.dcp_module()
    if dcp is not None:
        import torch
        import torch.distributed.checkpoint as tdcp
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")     # DCP warns on every no_dist call
            store = agck.open_store(d)
            tdcp.save({"w": torch.arange(6.0).reshape(2, 3), "o": {"lr": 0.1, "k": [1, 2]}},
                      storage_writer=dcp.StorageWriter(store, run), checkpoint_id=step, no_dist=True)
            saved = sharded.as_commit(store.read(run, step))
            parts = [sharded.read_part(store, saved, r) for r in range(saved.world_size)]
            store.close()
        # the parts' metadata as written; their state plain (a framed part has no payload)
        out.append(_record(saved, [checkpoint.encode({"keys": sorted(p.state)}, run=p.run, step=p.step, meta=p.meta,
                                                     created_at_ns=_CREATED).meta_bytes for p in parts]))
    return out


def seeds() -> dict[str, list[bytes]]:
    import torch
    states = [{"a": 1}, {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "s": "x", "l": [1, 2.5, None]},
              {"t": torch.arange(4, dtype=torch.bfloat16), "n": {"k": (1, {2}), "b": b"\x00\x01"}},
              {"c": np.array([1 + 2j]), "d": np.datetime64("2020-01-01"), "e": torch.zeros(0)}]
    containers = [agck.dumps(s, run="r", step=i) for i, s in enumerate(states)]
    commit = sharded.Commit(run="r", step=3, epoch=1, world_size=2,
                            parts=[sharded.PartRef(r, sharded.part_run("r", 1, r), "n" * 16) for r in range(2)],
                            kind="snapshot", extra=None)
    containers.append(agck.dumps(commit.state(), run="r", step=3))
    with tempfile.TemporaryDirectory() as d:
        store = agck.open_store(d)
        store.put("r", 1, {"w": np.arange(200_000, dtype=np.float32)})
        containers.append(open(store.path("r", 1), "rb").read())      # a chunked listing
        store.close()
    key = journalrec.fingerprint(("doc",), {})
    log = b"".join([journalrec.record("r", "embed", key, 0, *journalrec.encode_value({"n": 3})),
                    journalrec.record("i", "gen", key, 0, *journalrec.encode_value(np.ones(3))),
                    journalrec.record("e", "gen", key, 1, "t", b"\xc0"),
                    journalrec.record("s", "results", bytes(16), 0, *journalrec.encode_value([{"i": 0}]))])
    records = [s3log.encode_record({"op": "put", "step": 1, "epoch": 1, "w": "ab", "n": "cd", "size": 10,
                                    "checksum": "00" * 8, "parent": None, "created_at": 1.0, "meta": None}, b"x" * 10)]
    urls = ["postgresql://u:secret@h:5432/db?agck_prefix=p&agck_schema=s", "host=a,b port=1 user=u password=p",
            "sqlite:///tmp/x.db", "s3://bucket/prefix?endpoint=http://127.0.0.1:9000&region=us",
            "postgres://h/db?target_session_attrs=read-write"]
    argv = ["recover\0ckpts/\0--run\0r\0--json", "ls\0s3://b/p", "show\0x.agck\0--verify",
            "export\0ckpts/\0--run\0r\0--step\03\0--to\0out.safetensors\0--max-bytes\08G",
            "db\0status\0postgresql://h/db\0--prefix\0p", "journal\0ckpts/\0--run\0r"]
    return {"container": containers, "container_resealed": containers, "journal": [log],
            "s3_record": records, "store_url": [u.encode() for u in urls], "cli": [a.encode() for a in argv],
            "chunk_listing": listing_seeds(), "commit_part": commit_seeds(), "chunk_frame": frame_seeds()}


def frame_seeds() -> list[bytes]:
    """Compressed chunks as a store writes them (both methods, every itemsize), and a raw one."""
    from agck import chunkcodec
    rng = np.random.default_rng(0)
    floats = (rng.standard_normal(3000) * 0.02).astype(np.float32)
    out = [chunkcodec.frame(b"the checkpoint is safe. " * 200, chunkcodec.Method.ZSTD)]
    for itemsize, data in ((2, floats.astype(np.float16).tobytes() + b"\x01"), (4, floats.tobytes()),
                           (8, floats.astype(np.float64).tobytes()[:5003])):
        out.append(chunkcodec.frame(data, chunkcodec.Method.PLANES_ZSTD, itemsize=itemsize))
    out.append(floats.tobytes()[:512])
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m fuzz.seeds [TARGET...]``: write the seeds of those targets (all by
    default). The containers' seeds differ on each run (their creation time), and so does
    the DCP save's (its nonces)."""
    only = set(sys.argv[1:] if argv is None else argv)
    for target, items in seeds().items():
        if only and target not in only:
            continue
        d = os.path.join(HERE, "corpus", target)
        os.makedirs(d, exist_ok=True)
        for data in items:
            with open(os.path.join(d, "seed-" + hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
