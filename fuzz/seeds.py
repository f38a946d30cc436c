"""The seed corpus: valid inputs of every target, written to ``fuzz/corpus/<target>/``
(``python -m fuzz.seeds``). The fuzzer starts from them; the repository keeps them
and what ``scripts/fuzz --merge`` adds."""

from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np

import agck
from agck import journalrec, sharded
from agck.stores import s3log

HERE = os.path.dirname(os.path.abspath(__file__))


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
            "s3_record": records, "store_url": [u.encode() for u in urls], "cli": [a.encode() for a in argv]}


def main() -> None:
    for target, items in seeds().items():
        d = os.path.join(HERE, "corpus", target)
        os.makedirs(d, exist_ok=True)
        for data in items:
            with open(os.path.join(d, "seed-" + hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
