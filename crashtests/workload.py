"""A deterministic torch inference pipeline, checkpointed with checkpoint_every.

Each step embeds a batch of synthetic documents with a small transformer
encoder, samples a "summary" of token ids (global torch RNG), and takes one
Adam step on an online adapter (so module and optimizer state evolve). Every
acknowledgement is appended to an fsync'd ack log *before* the pipeline goes
on (the out-of-band record the checker trusts).

    python -m crashtests.workload --store DIR --run R --steps 40 --every 5 \\
        --ack-log acks.txt --out result.json [--device cuda] [--die-at 17]

With ``--world N --rank R --rendezvous FILE`` it is rank R of an N-rank job (gloo;
each rank's state is seeded by its rank): the Snapshotter then writes one part per
rank and a commit record, and every rank acknowledges the committed steps.

``--profile large`` adds :data:`LARGE` tensors to the state (about 190 MiB): frozen
weights that never change, a cache of which one slice changes every step and
moments rewritten every step, so a checkpoint after the first writes tens of MiB.
They cross the sizes where agck changes what it does (chunk grids, parallel reads,
multipart uploads, direct writes, the listing probe, SQL chunk rows).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import xxhash

VOCAB, DIM, DOC_LEN, BATCH = 512, 64, 32, 8
PROFILES = ("small", "large")
# the large profile's tensors: name -> (dtype, shape); about 190 MiB in all
LARGE = {"frozen.proj": (torch.float32, (4096, 4096)),      # 64 MiB
         "frozen.embed": (torch.bfloat16, (8192, 2048)),    # 32 MiB
         "frozen.codes": (torch.int8, (4096, 4096)),        # 16 MiB
         "cache": (torch.float32, (16, 1 << 20)),           # 64 MiB: one row (4 MiB) changes a step
         "moments": (torch.float32, (1 << 22,))}            # 16 MiB: rewritten every step
LARGE_BYTES = sum(dtype.itemsize * int(np.prod(shape)) for dtype, shape in LARGE.values())


def large_state(device: str = "cpu", seed: int = 1234) -> dict:
    """The large profile's tensors, made in a fraction of a second: floats from an arange
    (exact below 2**24), integers from a period of 251 bytes; either way every 1 MiB differs
    from every other, so content addressing finds nothing to share inside them."""
    out = {}
    for j, (name, (dtype, shape)) in enumerate(LARGE.items()):
        n = 1
        for d in shape:
            n *= d
        if dtype.is_floating_point:
            x = torch.arange(n, dtype=torch.float32).mul_(1e-6).add_(seed % 97 + j).to(dtype)
        else:
            x = torch.arange(251, dtype=torch.uint8).add_(seed + j).to(dtype).repeat(n // 251 + 1)[:n]
        out[name] = x.reshape(shape).to(device)
    return out


def state_bytes(state) -> int:
    """Bytes of tensor and array data in ``state`` (what the profile's size is)."""
    from agck.snapshot import capture
    total = 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, np.ndarray):
            total += x.nbytes
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(capture(state))
    return total


def build_state(steps: int, device: str = "cpu", seed: int = 1234, profile: str = "small") -> dict:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    embed = torch.nn.Embedding(VOCAB, DIM)
    layer = torch.nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
    encoder = torch.nn.Sequential()
    encoder.add_module("embed", embed)
    encoder.add_module("layer", layer)
    encoder = encoder.to(device).eval()
    adapter = torch.nn.Linear(DIM, DIM).to(device)
    opt = torch.optim.Adam(adapter.parameters(), lr=1e-3)
    state = {
        "encoder": encoder, "adapter": adapter, "opt": opt,
        "embeddings": torch.zeros(steps, BATCH, DIM, device=device),
        "summaries": [],
        "rng": np.random.default_rng(seed),
        "stats": {"tokens": 0, "loss": 0.0},
    }
    if profile == "large":
        state["large"] = large_state(device, seed)
    elif profile != "small":
        raise ValueError(f"profile must be one of {PROFILES}, not {profile!r}")
    return state


def run_step(state: dict, i: int) -> dict:
    enc, adapter, opt = state["encoder"], state["adapter"], state["opt"]
    device = state["embeddings"].device
    # documents depend on the numpy Generator in the state and the torch global RNG
    offsets = torch.from_numpy(state["rng"].integers(0, VOCAB, size=(BATCH, 1))).to(device)
    docs = (torch.randint(0, VOCAB, (BATCH, DOC_LEN), device=device) + offsets) % VOCAB
    with torch.no_grad():
        hidden = enc(docs)
        emb = hidden.mean(dim=1)
        probs = torch.softmax(hidden[:, -1] @ enc.embed.weight.T, dim=-1)
        summary = torch.multinomial(probs, 4, generator=None)
    state["embeddings"][i] = emb
    state["summaries"].append(summary.cpu().tolist())
    # one online adapter step
    pred = adapter(emb)
    loss = torch.nn.functional.mse_loss(pred, emb.roll(1, dims=0))
    opt.zero_grad()
    loss.backward()
    opt.step()
    state["stats"]["tokens"] += BATCH * DOC_LEN
    state["stats"]["loss"] = float(loss.item())
    big = state.get("large")
    if big is not None:     # from this step's output, so a wrong restore shows in the hash
        with torch.no_grad():
            big["cache"][i % big["cache"].shape[0]].add_(emb.sum())
            big["moments"].add_(pred.detach().mean())
    return state


def state_hash(state) -> str:
    """A digest of everything the pipeline's future depends on and has produced."""
    from agck.snapshot import capture
    h = xxhash.xxh3_64()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())     # no copy: large states are hashed often
        elif isinstance(x, np.ndarray):
            h.update(str((x.dtype, x.shape)).encode())
            h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
        elif isinstance(x, dict):
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(capture(state))
    return h.hexdigest()


class AckLog:
    """Append-only, fsync'd: a line is on disk before the pipeline continues."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, step: int, ref: str) -> None:
        os.write(self.fd, f"{step}\n".encode())
        os.fsync(self.fd)


def read_acks(path: str) -> list[int]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f if line.strip().isdigit()]


def main(argv=None) -> int:
    from agck import checkpoint_every, open_store
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--run", default="pipeline")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--profile", default="small", choices=PROFILES, help="the state's size (module docstring)")
    p.add_argument("--mode", default="auto")
    p.add_argument("--ack-log")
    p.add_argument("--out")
    p.add_argument("--die-at", type=int, help="SIGKILL self right after this step completes")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pause-at", type=int, help="inside this step, print 'paused STEP' and wait for stdin to "
                   "close: a signal sent meanwhile lands in this step, however slow the machine")
    p.add_argument("--hashes", help="write the state hash after every step (reference runs)")
    p.add_argument("--full-hashes", help="write, after every step, the hash of the whole tree a snapshot "
                   "at that step holds (state, step, RNG states): what the crash checker compares")
    p.add_argument("--world", type=int, default=1, help="ranks of a torch.distributed job (gloo)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--rendezvous", help="the job's rendezvous file (init_method file://)")
    a = p.parse_args(argv)
    if a.world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{a.rendezvous}", rank=a.rank, world_size=a.world)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    acks = AckLog(a.ack_log) if a.ack_log else None
    store = open_store(a.store)

    @checkpoint_every(a.every, store=store, run=a.run, mode=a.mode, on_durable=acks)
    def step(state, i):
        state = run_step(state, i)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if a.pause_at is not None and i + 1 == a.pause_at:
            print(f"paused {i + 1}", flush=True)
            # wait for stdin's end a tenth of a second at a time: a signal the kernel hands to
            # another thread (gloo's, the writer's) interrupts no blocking read here, and its
            # Python handler runs only once this thread is back in the interpreter
            import select
            while not select.select([0], [], [], 0.1)[0] or os.read(0, 1 << 16):
                pass
        return state

    state = build_state(a.steps, a.device, seed=1234 + a.rank, profile=a.profile)
    hashes, full_hashes = {}, {}
    for i in range(a.steps):
        state = step(state, i)
        if a.hashes:
            hashes[i + 1] = state_hash(state)
        if a.full_hashes:
            from agck.snapshot import rng_state
            full_hashes[i + 1] = state_hash({"state": state, "step": i + 1, "rng": rng_state()})
        if a.die_at is not None and i + 1 == a.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
    step.close()
    result = {"final_hash": state_hash(state), "steps": a.steps,
              "resumed_from": step.snapshotter.start_step if step.snapshotter else 0}
    if a.hashes:
        with open(a.hashes, "w") as f:
            json.dump(hashes, f)
    if a.full_hashes:
        with open(a.full_hashes, "w") as f:
            json.dump(full_hashes, f)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)
    store.close()
    if a.world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
