#!/usr/bin/env python3
"""Chunk compression (agck/chunkcodec.py): what each method saves on the contents a
checkpoint holds, how fast it compresses and decompresses, and how fast the disk
writes, so the default method and level, and when storing raw is faster, can be chosen.

Contents, all made here (nothing downloaded):

- an MLP (about 10.5M parameters) trained for 200 steps with AdamW on synthetic
  regression data, so its weights have moved from their initialization as trained
  weights do: its weights in bf16, its weights in fp32, and its AdamW state
  (exp_avg and exp_avg_sq, fp32);
- a LangGraph-like conversation state of 100 turns as JSON text (messages with
  ids, roles, metadata and tool calls; English-like text from a Zipf-weighted
  word list);
- random bytes (incompressible).

Each content is cut into chunks as the file, SQLite and Postgres stores cut a
container (``chunking.split``: a tensor of 4 MiB or more on a 1 MiB grid from its
start, smaller ones in content-defined chunks of 16-256 KiB), and again on the
8 MiB grid s3 stores use. The float contents are encoded with their element size
as ``itemsize`` (chunks of small tensors are cut by content, so their planes may
start inside an element: as a store would see them).

For each content and method: the ratio (raw bytes / stored bytes, frames
included), and compress and decompress MB/s of raw bytes, on one thread and on
two threads over the chunks (zstd releases the GIL). "zstd-N" and "planes-N" are
the bare frames at level N (``chunkcodec.frame``, not verified); "auto-N" is
``chunkcodec.encode`` as a store would call it (its choice, its verification: a
decode and a BLAKE3 of each compressed chunk; the chunk's address given, as a
store has it from chunking). Decompression is ``decode_into`` the chunk's place
in a buffer, without the address check (a store that verifies reads hashes every
chunk either way; BLAKE3's speed is printed for reference). Every time is the
median of ``--repeats`` runs.

The disk: 512 MiB of random bytes written to ``--dir`` and fsync'd (buffered
writes, and O_DIRECT), median of the repeats. Compression makes a write faster
only while the compressor outruns the disk: the crossover is printed.

    python scripts/bench_compress.py [--repeats 3] [--dir /var/tmp] [--disk-mib 512] [--no-disk]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import benchio  # noqa: F401  (puts the checkout on sys.path)
from agck import chunkcodec, chunking, thresholds
from agck.chunkcodec import Method

MB = 1e6
LEVELS = (1, 3)
TARGETS = {"weights bf16": 1.4, "weights fp32": 1.15, "AdamW state fp32": 1.15}


# -- contents -------------------------------------------------------------------------

def trained_mlp(steps: int, log):
    """An MLP trained ``steps`` steps with AdamW: (bf16 weight parts, fp32 weight parts,
    AdamW state parts), each a list of byte buffers in state_dict order."""
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(2)
    d, hidden = 512, 2048
    model = torch.nn.Sequential(
        torch.nn.Linear(d, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, d))
    teacher = [torch.randn(d, 256) / 16, torch.randn(256, d) / 16]   # a fixed target function to fit
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    t0 = time.perf_counter()
    for _ in range(steps):
        x = torch.randn(256, d)
        y = torch.tanh(x @ teacher[0]) @ teacher[1]
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"MLP: {n_params / 1e6:.1f}M parameters, {steps} AdamW steps in {time.perf_counter() - t0:.0f} s, "
        f"final loss {loss.item():.4f}")
    params = [p.detach() for p in model.parameters()]
    bf16 = [p.to(torch.bfloat16).view(torch.int16).numpy().tobytes() for p in params]
    fp32 = [p.numpy().tobytes() for p in params]
    adam = [opt.state[p][k].numpy().tobytes() for k in ("exp_avg", "exp_avg_sq") for p in model.parameters()]
    return bf16, fp32, adam


COMMON = ("the of and to a in is that it for you was with on as have be at this are from by not or but what all "
          "were when we there can an your which their said if do will each about how up out them then she many "
          "some so these would other into has more her two like him see time could no make than first been its "
          "who now people my made over did down only way find use may water long little very after words called "
          "just where most know get through back much before go good new write our used me man too any day same "
          "right look think also around another came come work three word must because does part").split()


def word_list(rng, n: int) -> list[str]:
    """English-like words: the commonest English words, then made-up ones from syllables."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "pl",
              "ch", "sh", "th", "gr", "br", "cl"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "io", "ai"]
    codas = ["", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck", "m", "x", "rt"]
    made = set()
    while len(made) < n - len(COMMON):
        syllables = rng.integers(1, 4)
        made.add("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
                         + codas[rng.integers(len(codas))] for _ in range(syllables)))
    return COMMON + sorted(made)


def conversation(turns: int, seed: int = 0) -> bytes:
    """A LangGraph-like thread state: ``turns`` human/assistant turns, some with a tool call, as JSON."""
    rng = np.random.default_rng(seed)
    words = word_list(rng, 5000)
    weights = 1 / np.arange(1, len(words) + 1) ** 1.1   # Zipf: a few words are most of the text
    weights /= weights.sum()

    def sentence() -> str:
        picked = rng.choice(len(words), rng.integers(5, 25), p=weights)
        text = " ".join(words[i] for i in picked)
        return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!"])

    def paragraph(sentences: int) -> str:
        return " ".join(sentence() for _ in range(sentences))

    def msg_id() -> str:
        h = rng.integers(0, 256, 16, dtype=np.uint8).tobytes().hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    messages = [{"type": "system", "content": paragraph(4), "id": msg_id()}]
    for turn in range(turns):
        messages.append({"type": "human", "content": paragraph(int(rng.integers(1, 5))), "id": msg_id(),
                         "additional_kwargs": {}, "response_metadata": {}})
        calls = []
        if rng.random() < 0.3:
            call_id = "call_" + rng.integers(0, 256, 12, dtype=np.uint8).tobytes().hex()
            calls = [{"name": rng.choice(["search", "lookup_order", "get_weather", "run_sql"]),
                      "args": {"query": sentence(), "limit": int(rng.integers(1, 50))}, "id": call_id,
                      "type": "tool_call"}]
        messages.append({
            "type": "ai", "content": "\n\n".join(paragraph(int(rng.integers(2, 6))) for _ in range(rng.integers(1, 4))),
            "id": msg_id(), "tool_calls": calls, "additional_kwargs": {},
            "response_metadata": {"model_name": "gpt-4o-2024-08-06", "finish_reason": "tool_calls" if calls else "stop",
                                  "system_fingerprint": "fp_" + rng.integers(0, 256, 5, dtype=np.uint8).tobytes().hex()},
            "usage_metadata": {"input_tokens": int(rng.integers(100, 9000)), "output_tokens": int(rng.integers(20, 800)),
                               "total_tokens": int(rng.integers(200, 9800))}})
        for call in calls:
            messages.append({"type": "tool", "content": json.dumps({"rows": [paragraph(1) for _ in range(3)]}),
                             "tool_call_id": call["id"], "name": call["name"], "id": msg_id(), "status": "success"})
    state = {"v": 4, "ts": "2025-06-01T12:00:00.000000+00:00", "id": msg_id(),
             "channel_values": {"messages": messages, "turn": turns},
             "channel_versions": {"__start__": 2, "messages": turns * 2 + 1},
             "versions_seen": {"agent": {"messages": turns * 2}}}
    return json.dumps(state, indent=1).encode()


def chunks_of(parts, grid: int) -> list[memoryview]:
    """``parts`` cut as a store cuts a container's blobs: large ones on ``grid``, runs of
    small ones by content (``chunking.split`` with that grid)."""
    views = [memoryview(p).cast("B") for p in parts]
    chunker = chunking.Chunker(remember=False)
    large = (grid, grid, grid)
    out = []
    for key, members, sizes in chunking.pieces([v.nbytes for v in views], large=large):
        out += [c.view() for c in chunker.split_piece(key, [views[i] for i in members], sizes)[0]]
    return out


# -- measuring ------------------------------------------------------------------------

def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def over_chunks(fn, items, threads: int):
    if threads == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def measure(chunks, itemsize, method_name: str, level: int, repeats: int, threads_list) -> dict:
    """Ratio and MB/s (per thread count) of one method over one content's chunks."""
    raw_bytes = sum(c.nbytes for c in chunks)
    addresses = [chunking.address(c) for c in chunks]
    if method_name == "auto":
        def compress_one(i):
            return chunkcodec.encode(chunks[i], itemsize=itemsize, level=level, address=addresses[i])
        encoded = [compress_one(i) for i in range(len(chunks))]
        stored = [(e.stored, e.encoded) for e in encoded]
        kinds = {m.name: sum(e.method is m for e in encoded) for m in Method}
        assert not any(e.mismatch for e in encoded)
    else:
        method = Method.ZSTD if method_name == "zstd" else Method.PLANES_ZSTD

        def compress_one(i):
            return chunkcodec.frame(chunks[i], method, itemsize=itemsize, level=level)
        stored = [(compress_one(i), True) for i in range(len(chunks))]
        kinds = {method.name: len(chunks)}
    stored_bytes = sum(len(s) for s, _ in stored)
    buffer = bytearray(raw_bytes)
    places, pos = [], 0
    for c in chunks:
        places.append(memoryview(buffer)[pos:pos + c.nbytes])
        pos += c.nbytes

    def decompress_one(i):
        s, encoded = stored[i]
        chunkcodec.decode_into(s, places[i], encoded=encoded)

    over_chunks(decompress_one, range(len(chunks)), 1)
    assert all(chunking.address(p) == a for p, a in zip(places, addresses)), "a round trip changed a chunk"
    result = {"ratio": raw_bytes / stored_bytes, "kinds": kinds}
    for threads in threads_list:
        tc = median_time(lambda: over_chunks(compress_one, range(len(chunks)), threads), repeats)
        td = median_time(lambda: over_chunks(decompress_one, range(len(chunks)), threads), repeats)
        result[threads] = (raw_bytes / tc / MB, raw_bytes / td / MB)
    return result


def disk_speed(directory: str, mib: int, repeats: int, log) -> dict:
    data = benchio.aligned_copy(np.random.default_rng(1).integers(0, 256, mib << 20, dtype=np.uint8))
    out = {}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = os.path.join(tmp, "disk-speed")
        for name, write in (("buffered write + fsync", benchio.raw_write_fsync),
                            ("O_DIRECT write + fsync", benchio.raw_direct_fsync)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                try:
                    write(path, data)
                except OSError as e:   # O_DIRECT is refused by some filesystems (tmpfs)
                    log(f"{name}: {e}")
                    break
                times.append(time.perf_counter() - t0)
                os.unlink(path)
            if times:
                out[name] = data.nbytes / statistics.median(times) / MB
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="AdamW steps of the MLP")
    ap.add_argument("--turns", type=int, default=100, help="turns of the conversation")
    ap.add_argument("--dir", default="/var/tmp", help="where the disk's write speed is measured")
    ap.add_argument("--disk-mib", type=int, default=512)
    ap.add_argument("--no-disk", action="store_true")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    bf16, fp32, adam = trained_mlp(args.steps, log)
    text = conversation(args.turns)
    noise = np.random.default_rng(2).integers(0, 256, 32 << 20, dtype=np.uint8).tobytes()
    contents = [("weights bf16", bf16, 2), ("weights fp32", fp32, 4), ("AdamW state fp32", adam, 4),
                (f"conversation JSON ({args.turns} turns)", [text], None), ("random bytes", [noise], None)]
    threads_list = (1, 2)
    grid_1 = thresholds.LARGE_GRID
    rows = []
    for name, parts, itemsize in contents:
        chunks = chunks_of(parts, grid_1)
        # a content smaller than a few MiB is timed over copies of its chunks, so its times are not noise
        copies = max(1, (16 << 20) // max(1, sum(c.nbytes for c in chunks))) 
        chunks = chunks * copies
        sizes = sorted(c.nbytes for c in chunks)
        log(f"{name}: {sum(sizes) / MB / copies:.1f} MB in {len(sizes) // copies} chunks "
            f"(median {sizes[len(sizes) // 2] / 1024:.0f} KiB)" + (f", timed over {copies} copies" if copies > 1 else ""))
        methods = [("zstd", lv) for lv in LEVELS]
        if itemsize:
            methods += [("planes", lv) for lv in LEVELS]
        methods += [("auto", lv) for lv in LEVELS]
        for method_name, level in methods:
            r = measure(chunks, itemsize, method_name, level, args.repeats, threads_list)
            rows.append((name, f"{method_name}-{level}", r))
            log(f"  {method_name}-{level}: {r['ratio']:.3f}x  {r[1][0]:.0f}/{r[1][1]:.0f} MB/s  "
                f"(2 threads {r[2][0]:.0f}/{r[2][1]:.0f})  {r['kinds']}")

    # the s3 grid: the same contents in 8 MiB chunks, the default only
    grid_8 = thresholds.OBJECT_GRID
    rows_8 = []
    for name, parts, itemsize in contents[:3]:
        r = measure(chunks_of(parts, grid_8), itemsize, "auto", chunkcodec.DEFAULT_LEVEL, args.repeats, (1,))
        rows_8.append((name, r))

    blob = np.random.default_rng(3).integers(0, 256, 64 << 20, dtype=np.uint8)
    blake3_mbs = blob.nbytes / median_time(lambda: chunking.address(blob), args.repeats) / MB
    disk = {} if args.no_disk else disk_speed(args.dir, args.disk_mib, args.repeats, log)

    print(f"\n### Chunk compression (chunks of a {grid_1 >> 20} MiB grid; MB/s of raw bytes, median of "
          f"{args.repeats})\n")
    print("| content | method | ratio | compress MB/s | decompress MB/s | compress, 2 threads | decompress, 2 threads |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, _, _ in contents:
        print(f"| {name} | raw | 1.000 | — | — | — | — |")
        for n2, method, r in rows:
            if n2 == name:
                print(f"| {name} | {method} | {r['ratio']:.3f} | {r[1][0]:.0f} | {r[1][1]:.0f} | {r[2][0]:.0f} | "
                      f"{r[2][1]:.0f} |")
    print(f"\nOn the {grid_8 >> 20} MiB grid (s3), auto-{chunkcodec.DEFAULT_LEVEL}: "
          + "; ".join(f"{n}: {r['ratio']:.3f}x, {r[1][0]:.0f}/{r[1][1]:.0f} MB/s" for n, r in rows_8))
    print(f"\nBLAKE3 of a chunk's address (one thread): {blake3_mbs:.0f} MB/s")
    if disk:
        print(f"Disk ({args.dir}, {args.disk_mib} MiB, then fsync): "
              + "; ".join(f"{k}: {v:.0f} MB/s" for k, v in disk.items()))

    print("\nTargets (auto, default level):")
    auto = {n: r for n, m, r in rows if m == f"auto-{chunkcodec.DEFAULT_LEVEL}"}
    for name, target in TARGETS.items():
        got = auto[name]["ratio"]
        print(f"- {name}: {got:.3f}x (target {target}x): {'met' if got >= target else 'MISSED'}")
    if disk:
        d = max(disk.values())
        print(f"\nCrossover against the disk's {d:.0f} MB/s (auto-{chunkcodec.DEFAULT_LEVEL}, compress MB/s C, "
              "ratio r; compression speeds a write only while C > D when compression and writing overlap, "
              "C > D / (1 - 1/r) when they take turns):")
        for name, _, _ in contents:
            r = auto[name]
            for threads in threads_list:
                c, ratio = r[threads][0], r["ratio"]
                serial = c * (1 - 1 / ratio) if ratio > 1.001 else 0.0
                print(f"- {name}, {threads} thread(s): C = {c:.0f} MB/s, r = {ratio:.3f}: pays below a disk of "
                      f"{c:.0f} MB/s (overlapped), {serial:.0f} MB/s (in turns): "
                      + ("compressing is faster here" if c > d and ratio > 1.001 else "raw is as fast or faster here"))
    log(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
