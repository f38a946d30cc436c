"""The crash checker: judge each trial from the out-of-band ack log and a reference run.

After a crash, recovery runs twice, through the library (``recover_run``) and
through the CLI (``agck recover STORE --json``), and each trial is classified
as Jepsen classifies operations:

* ``ok``            every acknowledged checkpoint is covered: the recovered step
                    is the last acknowledged one, bit-identical to the reference;
* ``indeterminate`` a checkpoint was in flight at the crash and either outcome
                    happened (the old step or the in-flight one was recovered,
                    verified and bit-identical): fine, nothing acknowledged lost;
* ``lost``          an acknowledged checkpoint (or, after corruption, an intact
                    one) was not recovered;
* ``corrupt``       something that fails the reference was returned as valid: a
                    state hash mismatch, a damaged checkpoint accepted, the CLI
                    and the library disagreeing, or a resume that diverged;
* ``error``         the harness itself could not judge (reported, never hidden).

``lost`` and ``corrupt`` must be zero. A trial that never started (the campaign's
time limit came first) is ``skipped``: not judged, so neither ok nor an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

OUTCOMES = ("ok", "indeterminate", "lost", "corrupt", "error")
SKIPPED = "skipped"     # the outcome of a trial that never started: no outcome of the code under test
STORES = ("file", "sqlite", "postgres", "s3", "pgs3")   # pgs3: a Postgres catalog, chunks in SeaweedFS
FAULTS = ("kill", "failpoint", "pgkill", "pgload", "s3kill", "netcut", "powerloss", "corrupt", "stale", "dist",
          "distpower", "chunkrot", "journal", "failover", "dbpower", "applog",
          "journalrot")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Trial:
    id: int
    store: str                      # file | sqlite | postgres | s3
    fault: str                      # one of FAULTS
    run: str
    url: str
    point: str = ""                 # the crash point reached (label), "" when none was
    reached: bool = False           # did the fault actually happen (a kill delivered, a crash raised)
    acked: list = field(default_factory=list)
    in_flight: bool = False         # a checkpoint was being written when the crash hit
    expected: Any = "min"           # "min": recovered >= last ack; an int/None: exactly this step (corruption)
    damaged: list = field(default_factory=list)    # steps deliberately corrupted
    unreadable: list = field(default_factory=list)  # acknowledged steps that cannot be read and should be
    recovered: Any = None
    rejected: list = field(default_factory=list)
    orphans: int = 0
    rec_seconds: float | None = None
    hash_ok: Any = None
    cli_step: Any = "unchecked"
    resume: dict | None = None
    outcome: str = ""
    reasons: list = field(default_factory=list)
    detail: str = ""
    skipped: bool = False           # never started (the campaign's time limit): not judged
    hung: bool = False              # a workload did not end in time after its fault and was killed: an error
    load: dict | None = None        # a pgload trial: its runs, their last step, acknowledged, lost, corrupt
    profile: str = "small"          # the workload's state: small, or large (crashtests.workload.LARGE)

    @property
    def last_ack(self):
        return max(self.acked) if self.acked else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["last_ack"] = self.last_ack
        return d


def _recover(store, trial: Trial, map_location):
    """Recover ``trial.run`` and note what came back on the trial; the Recovery, or
    None when recovery raised (a finding: it must not fail on a damaged store)."""
    from agck.recovery import recover_run
    try:
        rec = recover_run(store, trial.run, map_location=map_location)
    except Exception as e:
        trial.reasons.append(f"recover_run raised {type(e).__name__}: {e}")
        trial.hash_ok = False
        trial.recovered = "raised"
        return None
    trial.recovered = rec.step
    trial.rec_seconds = rec.seconds
    trial.rejected = [r.step for r in rec.rejected]
    if rec.rejected and trial.fault != "corrupt":
        trial.detail = (trial.detail + f" rejected {rec.rejected[0].step}: {rec.rejected[0].reason}").strip()
    trial.orphans = len(rec.orphans)
    if rec.orphans:
        trial.in_flight = trial.in_flight or trial.fault != "corrupt"
    if rec.checkpoint is None:
        trial.hash_ok = None
    return rec


def check_library(store, trial: Trial, ref_full: dict, *, map_location="cpu") -> None:
    """Recover ``trial.run`` through the library and compare what comes back with the reference."""
    from crashtests.workload import state_hash
    rec = _recover(store, trial, map_location)
    if rec is None or rec.checkpoint is None:
        return
    want = ref_full.get(rec.step, ref_full.get(str(rec.step)))
    if want is None:
        trial.hash_ok = False
        trial.reasons.append(f"recovered step {rec.step} is not a step the reference run checkpointed")
        return
    got = state_hash(rec.checkpoint.state)
    trial.hash_ok = got == want
    if not trial.hash_ok:
        trial.reasons.append(f"state hash of recovered step {rec.step} is {got}, the reference says {want}")


def recheck(store, trials: list, ref_full: dict, after: str) -> None:
    """Each of ``trials`` must still recover to the step it recovered to when it was judged
    (``after`` says what has happened since); a trial that does not is corrupt."""
    for old in trials:
        if not isinstance(old.recovered, int):
            continue
        probe = Trial(id=0, store=old.store, fault=old.fault, run=old.run, url=old.url)
        check_library(store, probe, ref_full)
        if probe.recovered != old.recovered:
            old.hash_ok = False
            old.reasons.append(f"after {after} recovery says {probe.recovered}, before it said {old.recovered}")


def check_sharded(store, trial: Trial, ref_full: list[dict], *, map_location="cpu") -> None:
    """:func:`check_library` for a multi-rank run: the recovered step's commit record must
    bind a part for every rank, and each rank's part must match that rank's reference."""
    from agck import sharded
    from crashtests.workload import state_hash
    rec = _recover(store, trial, map_location)
    if rec is None or rec.checkpoint is None:
        return
    commit = sharded.as_commit(rec.checkpoint)
    if commit is None or commit.world_size != len(ref_full):
        trial.hash_ok = False
        trial.reasons.append(f"recovered step {rec.step} is not a commit of {len(ref_full)} ranks")
        return
    trial.hash_ok = True
    for rank, ref in enumerate(ref_full):
        want = ref.get(rec.step)
        got = state_hash(sharded.read_part(store, commit, rank, map_location=map_location).state)
        if want is None or got != want:
            trial.hash_ok = False
            trial.reasons.append(f"rank {rank}'s part of recovered step {rec.step} hashes to {got}, "
                                 f"the reference says {want}")


# Runs `agck recover URL --json --quiet` through the CLI's own entry point, once per URL
# given on stdin, in one interpreter: a campaign of a thousand small stores pays one
# start-up, not a thousand. Prints one JSON line per URL: the exit status and the output.
_CLI_MANY = r"""
import contextlib, io, json, sys
from agck import cli
for url in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["recover", url, "--json", "--quiet"])
    sys.__stdout__.write(json.dumps({"url": url, "rc": rc, "out": out.getvalue(), "err": err.getvalue()}) + "\n")
    sys.__stdout__.flush()
"""


def cli_recover_many(urls: list[str], timeout: float = 1800) -> dict:
    """{url: {run: recovered step or None}, or the exception that URL's `agck recover` ended with}."""
    r = subprocess.run([sys.executable, "-c", _CLI_MANY], input=json.dumps(list(urls)), capture_output=True,
                       text=True, timeout=timeout, cwd=REPO)
    found: dict = {}
    for line in r.stdout.splitlines():
        x = json.loads(line)
        if x["rc"] == 4 and "holds no checkpoints" in x["err"]:
            found[x["url"]] = {}
        elif x["rc"] not in (0, 1, 3):
            found[x["url"]] = RuntimeError(f"agck recover exited {x['rc']}: {x['err'].strip()[-500:]}")
        else:
            found[x["url"]] = {y["run"]: y["step"] for y in json.loads(x["out"])["runs"]}
    for url in urls:
        if url not in found:
            found[url] = RuntimeError(f"the CLI driver ended (exit {r.returncode}) before this store: "
                                      f"{r.stderr.strip()[-500:]}")
    return found


def classify(t: Trial) -> str:
    """Set and return ``t.outcome`` from what was observed."""
    if t.skipped:
        t.outcome = SKIPPED
        return t.outcome
    reasons = list(t.reasons)
    lost = corrupt = error = False
    rec = t.recovered
    if rec == "raised":
        error = True
    elif t.load is not None:        # many runs at once: judged step by step (crashtests.pgload)
        lost, corrupt = t.load["lost"] > 0, t.load["corrupt"] > 0
    elif t.expected == "min":
        last = t.last_ack
        if last is not None and (rec is None or rec < last):
            lost = True
            reasons.append(f"acknowledged step {last} not recovered (recovered {rec})")
        if rec is not None and last is not None and rec > last:
            t.in_flight = True     # an unacknowledged checkpoint became durable: the in-flight one
        if rec is not None and last is None:
            t.in_flight = True
    else:
        exp = t.expected
        if rec in t.damaged:
            corrupt = True
            reasons.append(f"damaged step {rec} returned as valid")
        elif rec != exp and (rec is None or exp is None or rec < exp):
            lost = True
            reasons.append(f"intact step {exp} not recovered (recovered {rec})")
        elif rec != exp:
            corrupt = True
            reasons.append(f"recovered step {rec}, expected {exp}")
    if t.unreadable:
        lost = True
    if t.hung:
        error = True
    if t.hash_ok is False and rec != "raised":
        corrupt = True
    if t.cli_step != "unchecked" and rec != "raised":
        if t.cli_step == "error":
            error = True
            reasons.append("the CLI check failed")
        elif t.cli_step != rec:
            if isinstance(t.cli_step, int) and isinstance(rec, int) and t.cli_step < rec or t.cli_step is None:
                lost = True
            else:
                corrupt = True
            reasons.append(f"CLI recovered step {t.cli_step}, the library {rec}")
    if t.resume is not None and not t.resume.get("ok", False):
        if t.resume.get("error"):
            error = True
        else:
            corrupt = True
        reasons.append(f"resume: {t.resume.get('why')}")
    t.reasons = reasons
    if corrupt:
        t.outcome = "corrupt"
    elif lost:
        t.outcome = "lost"
    elif error:
        t.outcome = "error"
    elif t.in_flight:
        t.outcome = "indeterminate"
    else:
        t.outcome = "ok"
    return t.outcome


def timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0
