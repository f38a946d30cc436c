"""Key trials: key operations SIGKILLed at random instants, two admins at once.

Each trial makes an encrypted store of its own (file, SQLite, Postgres, s3), puts a
checkpoint under key 0, then runs two processes against it at once:

- a **rotator** that rotates keys 0 -> 1 -> 2 ...: adds the next key, logs the add,
  removes the slot of the key it opened with, logs the removal (fsync'd each time: an
  out-of-band log of what was acknowledged);
- a **rival admin**, opened with key 0, that adds one key of its own and then removes
  slots of the store, one at a time, as ``agck key remove`` run beside the rotator would
  (each removal it is not refused logged).

Both are SIGKILLed at a random instant. Judged against the logs (FORMAT.md rules
18.11 and 18.12):

- **lost**: a key acknowledged added and not acknowledged removed (nor removed by the
  rival, nor the one whose removal was in flight) opens the store no more, or the
  store has no intact slot left, or the checkpoint does not read back verified with
  a key that opens it;
- **damaged**: the store's scrub finds anything damaged, or any slot damaged.

    python -m crashtests.keys --trials 200 --stores file,sqlite,postgres,s3 [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

KEY = "key number {} of the rotation"
RIVAL = "the rival admin's own key"


def _spec_store(spec: dict):
    from agck.stores import open_store
    return lambda key: open_store(spec["url"], key=key, **spec["options"])


def rotator(spec: dict, log_path: str) -> None:
    opened = _spec_store(spec)
    s, i = opened(KEY.format(0)), 0
    with open(log_path, "a") as log:
        while True:
            s.add_key(KEY.format(i + 1))
            _ack(log, f"add {i + 1}")
            s2 = opened(KEY.format(i + 1))
            s.remove_key(s.sealer.slot_id)
            _ack(log, f"rm {i}")
            s.close()
            s, i = s2, i + 1


def rival(spec: dict, log_path: str, seed: int) -> None:
    from agck.errors import AgckError
    rng = random.Random(seed)
    s = _spec_store(spec)(KEY.format(0))
    with open(log_path, "a") as log:
        s.add_key(RIVAL)
        _ack(log, "add rival")
        while True:
            slots = [x["id"] for x in s.key_slots()]
            if not slots:
                return
            victim = rng.choice(slots)
            try:
                s.remove_key(victim)
                _ack(log, f"rm-slot {victim}")
            except AgckError:
                pass
            time.sleep(rng.uniform(0, 0.05))


def _ack(log, line: str) -> None:
    log.write(line + "\n")
    log.flush()
    os.fsync(log.fileno())


def _child(role: str, spec: dict, log_path: str, seed: int) -> subprocess.Popen:
    code = ("import json, sys; from crashtests import keys; "
            f"keys.{role}(json.loads(sys.argv[1]), sys.argv[2]" + (", int(sys.argv[3]))" if role == "rival" else ")"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(spec), log_path, str(seed)], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def trial(spec: dict, work: str, rng: random.Random) -> dict:
    """One trial on a fresh store of ``spec``; its verdict."""
    import numpy as np
    from agck.errors import EncryptionKeyError
    opened = _spec_store(spec)
    s = opened(KEY.format(0))
    want = np.random.default_rng(rng.randrange(1 << 30)).standard_normal(1 << 15)
    s.put("r", 1, {"w": want})
    slot0 = s.sealer.slot_id
    s.close()
    logs = {r: os.path.join(work, f"{r}.log") for r in ("rotator", "rival")}
    open(logs["rotator"], "w").write("add 0\n")
    open(logs["rival"], "w").close()
    procs = [_child("rotator", spec, logs["rotator"], 0)]
    if rng.random() < 0.5:                      # two admins at once in half the trials
        procs.append(_child("rival", spec, logs["rival"], rng.randrange(1 << 30)))
    time.sleep(rng.uniform(0.3, 2.5))
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    added, removed = set(), set()
    for line in open(logs["rotator"]):
        what, i = line.split()
        (added if what == "add" else removed).add(int(i))
    rival_lines = open(logs["rival"]).read().split("\n")
    rival_removed = {ln.split()[1] for ln in rival_lines if ln.startswith("rm-slot ")}
    reasons = []
    # which slot each key holds is known to the store alone: a key is owed if its add was
    # acknowledged, its removal was not, it is not the one whose removal may be in flight
    # (the oldest present), and the rival did not acknowledge removing slots it could hold
    present = sorted(added - removed)
    owed = present[1:] if len(present) > 1 else present
    opens = []
    # the rotator's add in flight at the kill (made, not yet logged) may hold the last slot
    for i in present + [max(added) + 1]:
        try:
            st = opened(KEY.format(i))
            opens.append(i)
            got = st.get("r", 1).state["w"]
            if not np.array_equal(got, want):
                reasons.append(f"key {i}: the checkpoint reads back different")
            st.close()
        except EncryptionKeyError:
            pass
    rival_ok = False
    if "add rival" in rival_lines:
        try:
            opened(RIVAL).close()
            rival_ok = True
        except EncryptionKeyError:
            pass
    if not opens and not rival_ok:
        reasons.append(f"no key opens the store (present {present}, rival removed {sorted(rival_removed)})")
    if not rival_removed:
        missing = [i for i in owed if i not in opens]
        if missing:
            reasons.append(f"keys {missing} were acknowledged and never removed, and open the store no more")
    holder = opened(KEY.format(opens[0])) if opens else (opened(RIVAL) if rival_ok else None)
    damaged = []
    if holder is not None:
        damaged = [d.id for d in holder.damaged_key_slots()] + [str(a) for a in holder.scrub(quarantine=False).damaged]
        if not holder.key_slots():
            reasons.append("no intact slot left")
        holder.close()
    errs = [p.stderr.read().decode(errors="replace").strip().splitlines()[-1:] for p in procs]
    odd = [e[0] for e in errs if e and "Error" in e[0] and not e[0].startswith("agck.errors.")]   # (a refusal is an answer)
    return {"lost": bool(reasons), "damaged": bool(damaged), "reasons": reasons + [f"damaged: {damaged}"] * bool(damaged),
            "rotations": max(added), "rival": len(procs) > 1, "rival_removed": len(rival_removed),
            "slot0": slot0, "child_errors": odd}


def store_spec(kind: str, work: str, n: int, pg_dsn: str, s3_url: str | None) -> dict:
    if kind == "file":
        return {"url": os.path.join(work, f"s{n}"), "options": {}}
    if kind == "sqlite":
        return {"url": f"sqlite:///{work}/s{n}.db", "options": {}}
    if kind == "postgres":
        from agck.stores import open_store
        prefix = f"keys{os.getpid()}_{n}"
        open_store(pg_dsn, prefix=prefix, init=True).close()
        return {"url": pg_dsn, "options": {"prefix": prefix}}
    path, _, query = s3_url.partition("?")
    return {"url": f"{path}/k{os.getpid()}-{n}?{query}", "options": {}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="per store")
    p.add_argument("--stores", default="file,sqlite,postgres,s3")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dsn", default=os.environ.get("AGCK_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    stores = a.stores.split(",")
    work = tempfile.mkdtemp(prefix="agck-keys-")
    server = None
    s3_url = None
    if "s3" in stores:
        from crashtests import s3server
        if s3server.seaweed_available() is not None:
            print(f"no SeaweedFS here: s3 left out ({s3server.seaweed_available()})")
            stores.remove("s3")
        else:
            os.environ.update({k: v for k, v in s3server.CREDENTIALS.items() if k not in os.environ})
            server = s3server.Seaweed()
            server.start()
            server.bucket("agck-keys")
            s3_url = server.url("agck-keys", "t")
    rows, started = {}, time.monotonic()
    try:
        for kind in stores:
            r = rows[kind] = {"trials": 0, "lost": 0, "damaged": 0, "with a rival": 0, "rotations": 0,
                              "rival removals": 0, "examples": []}
            for n in range(a.trials):
                d = os.path.join(work, f"{kind}-{n}")
                os.makedirs(d)
                v = trial(store_spec(kind, d, n, a.dsn, s3_url), d, rng)
                r["trials"] += 1
                r["lost"] += v["lost"]
                r["damaged"] += v["damaged"]
                r["with a rival"] += v["rival"]
                r["rotations"] += v["rotations"]
                r["rival removals"] += v["rival_removed"]
                if (v["lost"] or v["damaged"] or v["child_errors"]) and len(r["examples"]) < 5:
                    r["examples"].append(v)
                shutil.rmtree(d, ignore_errors=True)
            print(f"{kind}: {r['trials']} trials, {r['lost']} lost, {r['damaged']} damaged, "
                  f"{r['rotations']} acknowledged rotations, {r['with a rival']} with a rival admin "
                  f"({r['rival removals']} removals)", flush=True)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    print("| store | trials | with a rival admin | rotations acknowledged | lost | damaged |")
    print("|---|---|---|---|---|---|")
    for kind, r in rows.items():
        print(f"| {kind} | {r['trials']} | {r['with a rival']} | {r['rotations']} | {r['lost']} | {r['damaged']} |")
    print(f"seed {seed}, {time.monotonic() - started:.0f} s")
    for kind, r in rows.items():
        for e in r["examples"]:
            print(f"{kind}: {json.dumps(e)[:600]}")
    return 1 if any(r["lost"] or r["damaged"] for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
