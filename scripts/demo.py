#!/usr/bin/env python3
"""The agck demo, on the embedded default store (a directory).

1. Save a torch + numpy state to a standalone .agck file, load it back
   verified, and show it with `agck show`.
2. Run a checkpointed inference pipeline, SIGKILL it mid-run, recover with
   `agck recover`, and resume it to a result bit-identical to an uninterrupted run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import torch

import agck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def banner(text):
    print(f"\n=== {text}")


def sh(*cmd, check=True):
    print("$", " ".join(cmd))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    out = (p.stdout + p.stderr).rstrip()
    if out:
        print(out)
    if check and p.returncode not in (0, 1):
        sys.exit(f"demo: command failed with exit code {p.returncode}")
    return p


def main():
    work = tempfile.mkdtemp(prefix="agck-demo-")
    try:
        banner("1. save and load a standalone checkpoint")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        state = {
            "model": model.state_dict(),
            "embeddings": torch.randn(128, 32, dtype=torch.bfloat16),
            "doc_ids": np.arange(128, dtype=np.int64),
            "summaries": ["first doc", "second doc"],
            "config": {"lr": 3e-4, "betas": (0.9, 0.999), "tags": {"demo"}},
        }
        path = os.path.join(work, "state.agck")
        size = agck.save(path, state, run="demo", step=1, meta={"stage": "embedding"})
        back = agck.load(path)  # verify=True: every byte checked against its XXH3 checksum
        same = all(torch.equal(state["model"][k], back.state["model"][k]) for k in state["model"])
        print(f"saved {size} bytes to {path}; loaded run={back.run!r} step={back.step}; "
              f"weights identical: {same}; bfloat16 kept: {back.state['embeddings'].dtype}")
        sh("agck", "show", path)

        banner("2. a pipeline checkpointed every 4 steps, SIGKILLed at step 10")
        store = os.path.join(work, "ckpts")
        ref_dir = os.path.join(work, "reference")
        common = ["--steps", "16", "--every", "4"]
        sh(sys.executable, "-m", "crashtests.workload", "--store", ref_dir, *common,
           "--out", os.path.join(work, "reference.json"))
        p = sh(sys.executable, "-m", "crashtests.workload", "--store", store, *common,
               "--ack-log", os.path.join(work, "acks"), "--die-at", "10", check=False)
        print(f"(workload exited with {p.returncode}: {'SIGKILL' if p.returncode == -signal.SIGKILL else '?'})")

        banner("3. recover after the crash")
        sh("agck", "recover", store)
        sh("agck", "ls", store)

        banner("4. flip one byte of the newest checkpoint: recovery walks back and says why")
        newest = sorted(os.listdir(os.path.join(store, "pipeline")))[-1]
        victim = os.path.join(store, "pipeline", newest)
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        sh("agck", "recover", store)

        banner("5. resume: same command, picks up from the last valid checkpoint")
        sh(sys.executable, "-m", "crashtests.workload", "--store", store, *common,
           "--out", os.path.join(work, "resumed.json"))
        ref = json.load(open(os.path.join(work, "reference.json")))
        res = json.load(open(os.path.join(work, "resumed.json")))
        print(f"resumed from step {res['resumed_from']}; final hash {res['final_hash']} vs uninterrupted "
              f"{ref['final_hash']}: {'IDENTICAL' if res['final_hash'] == ref['final_hash'] else 'DIFFERENT'}")
        if res["final_hash"] != ref["final_hash"]:
            sys.exit(1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
