#!/usr/bin/env python3
"""agck.Journal against DBOS's steps (``pip install dbos==3.4.0``), on SQLite and on the
same Postgres server, in one run.

For each peer, database and result kind (a small record; a record with a 256 KiB
float32 array), in a fresh process each:

- record: a run of --steps steps, each result durable before the next step starts
  (agck: ``commit="sync"``; DBOS: ``@DBOS.step()`` inside one ``@DBOS.workflow()``);
  time per step;
- replay: the same run killed (``os._exit``) in its last step, then started again in
  a new process: the time from starting (opening the store, or ``DBOS.launch()``,
  which recovers the pending workflow) to having every step's result back, all but
  the last read from the database and the last one run.

After each of agck's runs, every result its journal recorded is read back in this
process, through a store object of its own, and compared bit for bit with the
step's result (benchio.readback): the first that differs, is missing or damaged
ends the run, status 1.

    python scripts/bench_journal_peers.py [--steps 500] [--rounds 3] [--dsn postgresql://...] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchio  # noqa: E402  (puts the checkout on sys.path, before agck is imported)

DSN = os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
JOURNAL_RUN, JOURNAL_STEP = "bench", "summarize"     # agck's journal: its run, and the name of its step

# The child: python bench_journal_peers.py --child PEER DB_URL KIND STEPS MODE
#   MODE "record": run all steps, print the seconds per step; "crash": os._exit in the last
#   step; "replay": start again after a crash, print the seconds to every result.


def _result(i: int, kind: str):
    import numpy as np
    r = {"doc": i, "summary": f"document {i}: " + "lorem ipsum " * 14, "score": i / 7}
    if kind == "array":
        r["emb"] = np.full(65536, i, dtype=np.float32)
    return r


def _child(peer: str, url: str, kind: str, steps: int, mode: str) -> None:
    crash = mode == "crash"

    def work(i):
        if crash and i == steps - 1:
            os._exit(0)
        return _result(i, kind)

    t0 = time.perf_counter()
    if peer == "agck":
        import agck
        opts = {"init": True} if url.startswith("postgresql") else {}
        with agck.Journal(url, JOURNAL_RUN, commit="sync", **opts) as j:
            t1 = time.perf_counter()
            for i in range(steps):
                j.step(JOURNAL_STEP, work, i)
        t2 = time.perf_counter()
    else:
        from dbos import DBOS, SetWorkflowID
        DBOS(config={"name": "bench", "system_database_url": url})

        @DBOS.step()
        def summarize(i):
            return work(i)

        @DBOS.workflow()
        def pipeline(n):
            return sum(int(summarize(i)["doc"]) for i in range(n))

        DBOS.launch()      # in "replay": recovers the workflow the crash left pending
        t1 = time.perf_counter()
        if mode == "replay":
            DBOS.retrieve_workflow("bench-wf").get_result()
        else:
            with SetWorkflowID("bench-wf"):
                pipeline(steps)
        t2 = time.perf_counter()
        DBOS.destroy()
    print(json.dumps({"per_step": (t2 - t1) / steps, "total": t2 - t0}))


def _run(peer, url, kind, steps, mode) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", peer, url, kind, str(steps), mode],
                       capture_output=True, text=True, timeout=1800)
    if mode == "crash":
        return {}
    if p.returncode != 0:
        raise SystemExit(f"{peer} {mode} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dsn", default=DSN)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    import psycopg2

    import agck
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    admin = psycopg2.connect(a.dsn)
    admin.autocommit = True
    work = tempfile.mkdtemp(prefix="agck-bench-peers-", dir=a.dir)
    results: dict = {}
    n = 0
    try:
        for r in range(a.rounds):
            for db in ("sqlite", "postgres"):
                for kind in ("record", "array"):
                    for peer in (("agck", "dbos") if r % 2 == 0 else ("dbos", "agck")):
                        n += 1
                        if db == "sqlite":
                            url = f"sqlite:///{work}/{peer}-{n}.db"
                        else:
                            name = f"bench_peers_{os.getpid()}_{n}"
                            admin.cursor().execute(f"CREATE DATABASE {name}")
                            base = a.dsn.rsplit("/", 1)[0]
                            url = f"{base}/{name}"
                        rec = _run(peer, url, kind, a.steps, "record")
                        if db == "postgres":    # the replay case needs a run of its own
                            name2 = f"{name}_r"
                            admin.cursor().execute(f"CREATE DATABASE {name2}")
                            url2 = f"{a.dsn.rsplit('/', 1)[0]}/{name2}"
                        else:
                            url2 = url.replace(".db", "-r.db")
                        _run(peer, url2, kind, a.steps, "crash")
                        rep = _run(peer, url2, kind, a.steps, "replay")
                        if peer == "agck":     # both runs must hold every step's result
                            for u in (url, url2):
                                benchio.readback(lambda u=u: agck.open_store(u),
                                                 (((JOURNAL_RUN, i), _result(i, kind)) for i in range(a.steps)),
                                                 reader=benchio.journal_results(JOURNAL_STEP))
                        key = (db, kind, peer)
                        results.setdefault(key, {"record": [], "replay": []})
                        results[key]["record"].append(rec["per_step"])
                        results[key]["replay"].append(rep["total"])
                        log(f"  round {r + 1} {db} {kind} {peer}: record {rec['per_step'] * 1e3:.2f} ms/step, "
                            f"replay {rep['total']:.2f} s")
                        if db == "postgres":
                            for d in (name, name2):
                                admin.cursor().execute(f"DROP DATABASE IF EXISTS {d} WITH (FORCE)")
    finally:
        admin.close()
    print(f"## agck.Journal against DBOS steps, {a.steps} steps, medians of {a.rounds} rounds\n")
    print("| database | result | agck record ms/step | DBOS record ms/step | ratio | agck replay s | DBOS replay s "
          "| ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for db in ("sqlite", "postgres"):
        for kind in ("record", "array"):
            ag, db_ = results[(db, kind, "agck")], results[(db, kind, "dbos")]
            ar, dr = statistics.median(ag["record"]), statistics.median(db_["record"])
            ap_, dp = statistics.median(ag["replay"]), statistics.median(db_["replay"])
            label = "a small record" if kind == "record" else "a record with a 256 KiB array"
            print(f"| {db} | {label} | {ar * 1e3:.2f} | {dr * 1e3:.2f} | {dr / ar:.1f}x | {ap_:.2f} | {dp:.2f} | "
                  f"{dp / ap_:.1f}x |")
    log(benchio.read_back_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
