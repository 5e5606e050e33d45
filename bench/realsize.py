"""The data path at Mixtral-8x7B's real expert size: load, prefill, decode, memory, per-expert load time.

Builds (or reuses) a 2-layer Mixtral-shaped bf16 checkpoint with random weights -- hidden 4096,
intermediate 14336, 8 experts, top-2, vocab 32000: 16 experts x 352 MB + 0.69 GB dense = 6.3 GB, in
the released per-expert layout -- then runs `generate` (7-token prompt, 8 greedy tokens) for
--offload ram / disk x --cache-experts 2 / 8 / 16 with a warm and a cold page cache, each in its own
process (one at a time: peak RSS is sampled every 5 ms from /proc/self/status), plus the
`--emulate-device` slots (ram) and the transformers bf16 reference. Cold = the shard files' pages
dropped from the page cache with posix_fadvise(POSIX_FADV_DONTNEED) before the run (no root needed,
touches no other process's cache); fincore confirms what is left cached. The VM's disk is shared and its
speed moves several-fold within minutes, so every cold disk run is judged against the shards' sequential read
speed measured just before and just after it; and, independent of that speed, one expert's cold demand read
(the runtime's `ExpertStore.load_into`) is timed against a plain sequential read of the same bytes in
alternating pairs (`--cold-pairs`). `--repeat K` runs every configuration K times (cold ones too) and keeps each
one's fastest decode. "Never slower with a bigger cache" is checked where N means slots (disk, emulate): in
place (ram without --emulate-device) N changes nothing.

Usage: python bench/realsize.py [--ckpt /work/realsize-ckpt] [--only ram-2-warm,disk-8-cold] [--json out.json]
The checkpoint is a build artifact: never commit it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = [1, 415, 2936, 9060, 285, 1142, 28747]          # 7 fixed token ids
NEW_TOKENS = 8
GB = 1e9


def build(path: Path) -> None:
    """Config from transformers, tensor names and shapes from transformers' own (meta) model, random bf16
    values written one shard at a time (~2 GB each) so building never holds the model twice."""
    import torch
    from safetensors.torch import save_file
    from transformers import MixtralConfig, MixtralForCausalLM

    if (path / "model.safetensors.index.json").exists():
        return
    cfg = MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=1e6, dtype="bfloat16",
                        tie_word_embeddings=False)
    with torch.device("meta"):
        meta = MixtralForCausalLM(cfg)
    tensors: dict[str, tuple[int, ...]] = {}
    for name, p in meta.state_dict().items():          # released names: block_sparse_moe, w1/w3/w2 per expert
        if ".mlp.experts." in name:
            continue
        tensors[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = tuple(p.shape)
    H, I = cfg.hidden_size, cfg.intermediate_size
    for l in range(cfg.num_hidden_layers):
        for e in range(cfg.num_local_experts):
            for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                tensors[f"model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"] = shape
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    gen = torch.Generator().manual_seed(0)
    shard, shard_bytes, shards, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        shards.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, shape in tensors.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= 2 * GB:
            flush()
    if shard:
        flush()
    total = sum(2 * __import__("math").prod(s) for s in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


# --- one configuration, in a child process ------------------------------------------------

CHILD = r"""
import json, os, sys, threading, time
cfg = json.loads(sys.argv[1])
import torch
torch.set_num_threads(cfg["threads"])
def status():
    out = {}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('VmRSS', 'RssAnon', 'RssFile', 'RssShmem'):
            out[k] = int(v.split()[0]) * 1024
    return out
peak, done = {'rss': 0, 'anon': 0, 'file': 0}, [False]
def sample():
    while not done[0]:
        s = status()
        if s['VmRSS'] > peak['rss']:
            peak.update(rss=s['VmRSS'], anon=s['RssAnon'], file=s['RssFile'] + s.get('RssShmem', 0))
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
prompt = torch.tensor([cfg["prompt"]])
t0 = time.perf_counter()
if cfg["mode"] == "transformers":
    from transformers import AutoModelForCausalLM, DynamicCache
    from moectl.models.kv_cache import cache_kwargs
    model = AutoModelForCausalLM.from_pretrained(cfg["ckpt"], dtype=torch.bfloat16).eval()
    load_s = time.perf_counter() - t0
    ids, step, pkv, times = [], prompt, DynamicCache(config=model.config), []
    with torch.inference_mode():
        for _ in range(cfg["tokens"]):
            t = time.perf_counter()
            out = model(input_ids=step, **cache_kwargs(model, pkv), use_cache=True)
            nxt = int(out.logits[0, -1].float().argmax())
            times.append(time.perf_counter() - t)
            ids.append(nxt)
            step = torch.tensor([[nxt]])
    stats = {"prefill_ms": times[0] * 1000, "ttft_ms": times[0] * 1000,
             "decode_ms_per_token": 1000 * sum(times[1:]) / len(times[1:]), "misses": 0, "bytes_loaded": 0,
             "load_wait_s": 0.0, "tokens": len(ids)}
    step_ms = [t * 1000 for t in times]
else:
    from moectl.runtime.engine import Engine
    eng = Engine.load(cfg["ckpt"], offload=cfg["offload"], cache_experts=cfg["n"], prefetch="none",
                      emulate_device=cfg["mode"] == "emulate", progress=False)
    load_s = time.perf_counter() - t0
    res = eng.generate(input_ids=cfg["prompt"], max_new_tokens=cfg["tokens"], greedy=True, stop_at_eos=False)
    ids, stats = res.token_ids, res.stats
    step_ms = [p["ms"] for p in res.per_token]
done[0] = True
time.sleep(0.02)
s = status()
if s['VmRSS'] > peak['rss']:
    peak.update(rss=s['VmRSS'], anon=s['RssAnon'], file=s['RssFile'] + s.get('RssShmem', 0))
decode = sorted(step_ms[1:])
stats["decode_ms_median"] = decode[len(decode) // 2]
print(json.dumps({"ids": ids, "load_s": load_s, "stats": stats, "peak": peak, "step_ms": step_ms}))
"""


# Decode of several caches over ONE model and store, in one process, steps interleaved (order rotating), so
# all see the same moments of a shared machine: ram = in place vs every expert in its own slot
# (`--emulate-device`, N = all); disk = N = 2 / 8 / 16. Each variant keeps its own KV cache and tokens.
PAIRED = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
import torch
torch.set_num_threads(cfg["threads"])
from moectl.policies.base import LRU
from moectl.core.cache_model import split_slots
from moectl.runtime.device_cache import DeviceCache
from moectl.runtime.engine import Engine
eng = Engine.load(cfg["ckpt"], offload=cfg["offload"], cache_experts=2, prefetch="none", progress=False)
L, E = eng.store.num_layers, eng.store.num_experts
if cfg["offload"] == "ram":
    slots = DeviceCache(eng.store, [E] * L, eng.device, LRU())
    for l in range(L):
        for e in range(E):
            slots.acquire(l, e)                                               # all resident, copied once
    caches = {"in_place": eng.cache, "slots_all": slots}
else:
    caches = {f"disk_{n}": DeviceCache(eng.store, split_slots(n, L, E), eng.device, LRU()) for n in (2, 8, 16)}
runtime = eng.adapter.moe_blocks(eng.model)[0][1].experts.runtime
names = list(caches)
state = {k: [torch.tensor([cfg["prompt"]]), None, [], []] for k in names}
for i in range(cfg["tokens"]):
    for name in names[i % len(names):] + names[:i % len(names)]:
        st = state[name]
        eng.cache = runtime.cache = caches[name]
        t0 = time.perf_counter()
        logits, st[1] = eng.forward(st[0], st[1])
        nxt = int(logits[0, -1].argmax())
        st[2].append((time.perf_counter() - t0) * 1000)
        st[3].append(nxt)
        st[0] = torch.tensor([[nxt]])
med = lambda v: sorted(v)[len(v) // 2]
first = names[0]
out = {"decode_ms_median": {k: med(state[k][2][1:]) for k in names},
       "ratio_to_first_median": {k: med([x / y for x, y in zip(state[k][2][1:], state[first][2][1:])]) for k in names},
       "same_ids": all(state[k][3] == state[first][3] for k in names),
       "misses": {k: caches[k].snapshot()["misses"] for k in names}}
print(json.dumps(out))
"""


def run_paired(ckpt: Path, offload: str, threads: int, tokens: int) -> dict:
    cfg = {"ckpt": str(ckpt), "offload": offload, "threads": threads, "prompt": PROMPT, "tokens": tokens}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", PAIRED, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(files: list[Path]) -> int:
    """Bytes of `files` in the page cache (fincore), or -1 if fincore is missing."""
    try:
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                             capture_output=True, text=True, check=True).stdout
        return sum(int(x) for x in out.split())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return -1


def warm(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def sequential_read_gbps(files: list[Path]) -> float:
    """Cold sequential read speed of the shards (64 MB reads after dropping them from the page cache)."""
    drop_page_cache(files)
    n, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            buf = bytearray(64 * 2**20)
            while (k := fh.readinto(buf)):
                n += k
    return n / (time.perf_counter() - t0) / GB


def memcpy_ms(nbytes: int, threads: int) -> float:
    """Median time of a same-size copy between two touched buffers with `threads` torch threads."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    b = torch.zeros_like(a)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1000


COLD_AB = r"""
import json, os, random, sys, time
cfg = json.loads(sys.argv[1])
for f in cfg["files"]:                    # cold, as a cold run starts: dropped before the engine loads
    fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
import torch
torch.set_num_threads(cfg["threads"])
from moectl.runtime.engine import Engine
eng = Engine.load(cfg["ckpt"], offload="disk", cache_experts=16, prefetch="none", progress=False)
store, cache = eng.store, eng.cache
plain = bytearray(64 * 2**20)
def sequential(l, e):                      # the same bytes, 64 MB plain reads front to back, into one reused buffer
    for r in store.ranges[l][e]:
        with open(r.file, "rb", buffering=0) as fh:
            fh.seek(r.offset); left = r.nbytes
            while left:
                left -= fh.readinto(memoryview(plain)[:min(left, len(plain))])
experts = [(l, e) for l in range(store.num_layers) for e in range(store.num_experts)]
random.Random(0).shuffle(experts)          # each expert read once (still cold), the two ways alternating
times = {"moectl": [], "sequential": []}
for i, (l, e) in enumerate(experts[:2 * cfg["pairs"]]):
    k = ("moectl", "sequential")[(i + i // 2) % 2]      # moectl first in even pairs, second in odd ones
    t0 = time.perf_counter()
    store.load_into(l, e, cache.pool[l][e], parallel=True) if k == "moectl" else sequential(l, e)
    times[k].append((time.perf_counter() - t0) * 1000)
print(json.dumps(times))
"""


def cold_read_ab(ckpt: Path, files: list[Path], threads: int, pairs: int) -> dict:
    """The runtime's demand read of one expert into its slot from a cold page cache (`ExpertStore.load_into`, as
    a miss does it) against a plain sequential read of another expert's bytes, alternating, in one process that
    loaded the engine cold (as a cold run does): both see the same moments of the shared disk and the same kernel
    memory state (after a cold load, page-cache allocation costs the kernel ~3x the CPU time it does right after a
    big eviction, for any reader), so their ratio is the read path's own cost."""
    cfg = {"ckpt": str(ckpt), "files": [str(f) for f in files], "threads": threads, "pairs": min(pairs, 8)}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", COLD_AB, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    times = json.loads(out.stdout.strip().splitlines()[-1])
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ratios = sorted(a / b for a, b in zip(times["moectl"], times["sequential"]))
    return {"ms": times, "median_ms": med, "median_ratio": ratios[len(ratios) // 2]}


def run_one(ckpt: Path, mode: str, offload: str, n: int, threads: int) -> dict:
    cfg = {"ckpt": str(ckpt), "mode": mode, "offload": offload, "n": n, "threads": threads, "prompt": PROMPT,
           "tokens": NEW_TOKENS}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/work/realsize-ckpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma list of run names, e.g. ram-2-warm,disk-16-cold")
    ap.add_argument("--json", default="", help="also write every figure to this file")
    ap.add_argument("--paired", type=int, default=0, metavar="TOKENS",
                    help="only the paired runs (decode steps interleaved in one process, TOKENS tokens): in place vs "
                         "all experts in slots (needs the checkpoint twice in RAM), and disk N=2/8/16")
    ap.add_argument("--cold-pairs", type=int, default=8,
                    help="pairs of cold reads of one expert (moectl's read vs plain sequential reads, alternating; at most "
                         "8: each of the 16 experts is read once) "
                         "that judge the cold read path independently of the disk's speed of the moment")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the list this many times round-robin and keep each run's fastest decode (the machine "
                         "is shared: the minimum is the least disturbed figure)")
    args = ap.parse_args()
    ckpt = Path(args.ckpt)
    t0 = time.perf_counter()
    build(ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"checkpoint {ckpt}: {size / GB:.2f} GB in {len(files)} shards (ready in {time.perf_counter() - t0:.0f} s)")
    expert = 3 * 4096 * 14336 * 2
    dense = size - 16 * expert
    if args.paired:
        warm(files)
        for offload in ("ram", "disk"):
            r = run_paired(ckpt, offload, args.threads, args.paired)
            print(f"paired {offload}: {json.dumps(r)}", flush=True)
        return
    seq = sequential_read_gbps(files)
    mcpy, mcpy1 = memcpy_ms(expert, args.threads), memcpy_ms(expert, 1)
    print(f"expert {expert / 1e6:.0f} MB, dense {dense / GB:.2f} GB; memcpy of one expert {mcpy:.1f} ms with "
          f"{args.threads} threads, {mcpy1:.1f} ms with 1; "
          f"cold sequential read {seq:.2f} GB/s = {expert / seq / 1e6:.0f} ms per expert")
    ab = cold_read_ab(ckpt, files, args.threads, args.cold_pairs) if args.cold_pairs else None
    if ab and "error" not in ab:
        print(f"cold read of one expert, {args.cold_pairs} alternating pairs: moectl's demand read median "
              f"{ab['median_ms']['moectl']:.0f} ms, plain sequential read {ab['median_ms']['sequential']:.0f} ms, "
              f"median ratio {ab['median_ratio']:.2f}", flush=True)
    elif ab:
        print(f"cold read pairs: error: {ab['error']}")
    runs = [("transformers", "transformers", "ram", 16, "warm")]
    for offload in ("ram", "disk"):
        for cache in ("warm", "cold"):
            for n in (2, 8, 16):
                runs.append((f"{offload}-{n}-{cache}", "moectl", offload, n, cache))
    runs += [(f"emulate-{n}-warm", "emulate", "ram", n, "warm") for n in (2, 8, 16)]
    only = set(filter(None, args.only.split(",")))
    results = {"checkpoint_gb": size / GB, "expert_mb": expert / 1e6, "dense_gb": dense / GB,
               "memcpy_ms": mcpy, "memcpy_1thread_ms": mcpy1, "seq_read_gbps": seq, "cold_read_pairs": ab, "runs": {}}
    print(f"{'run':<18} {'decode ms/tok (median)':>22} {'prefill ms':>10} {'ttft ms':>8} {'peak RSS GB (anon+file)':>24} "
          f"{'GB loaded/tok':>13} {'ms/expert load':>14} {'load s':>7} {'cached GB before':>16}  ids")
    ref_ids = None
    for rnd, (name, mode, offload, n, cache) in enumerate(runs * args.repeat):
        if only and name not in only:
            continue
        if cache == "cold" and offload == "disk":
            # the VM's disk is shared: its speed moves 4x within minutes, so each cold run is judged against
            # sequential reads of the same shards taken just before and just after it
            seq_before = sequential_read_gbps(files)
        if cache == "cold":
            drop_page_cache(files)
        else:
            warm(files)
        before = cached_bytes(files)
        r = run_one(ckpt, mode, offload, n, args.threads)
        r["cached_before_gb"] = before / GB
        if cache == "cold" and offload == "disk" and "error" not in r:
            r["seq_read_gbps_around"] = [seq_before, sequential_read_gbps(files)]
        old = results["runs"].get(name)
        if old and "error" not in old and "error" not in r:
            r["decode_ms_runs"] = old["decode_ms_runs"] + [r["stats"]["decode_ms_median"]]
            if old["stats"]["decode_ms_median"] < r["stats"]["decode_ms_median"]:
                r = old | {"decode_ms_runs": r["decode_ms_runs"]}
        elif "error" not in r:
            r["decode_ms_runs"] = [r["stats"]["decode_ms_median"]]
        results["runs"][name] = r
        if "error" in r:
            print(f"{name:<18} error: {r['error']}")
            continue
        st, pk = r["stats"], r["peak"]
        if mode == "transformers":
            ref_ids = r["ids"]
        per_load = 1000 * st["load_wait_s"] / st["misses"] if st["misses"] else float("nan")
        r["ms_per_expert_load"] = per_load
        r["gb_loaded_per_token"] = st["bytes_loaded"] / st["tokens"] / GB if st["tokens"] else 0.0
        same = "=" if ref_ids is None or r["ids"] == ref_ids else "DIFFER"
        print(f"{name:<18} {st['decode_ms_per_token']:>13.0f} ({st['decode_ms_median']:>5.0f}) {st['prefill_ms']:>10.0f} {st['ttft_ms']:>8.0f} "
              f"{pk['rss'] / GB:>8.2f} ({pk['anon'] / GB:.2f} + {pk['file'] / GB:.2f}) "
              f"{r['gb_loaded_per_token']:>13.2f} {per_load:>14.1f} {r['load_s']:>7.1f} {before / GB:>16.2f}  {same}",
              flush=True)
    results["targets"] = targets(results)
    for line in results["targets"]:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def targets(res: dict) -> list[str]:
    """The issue's targets, each with its figures and met / NOT met."""
    runs = {k: v for k, v in res["runs"].items() if "error" not in v}
    out, ck, ex, dense = [], res["checkpoint_gb"], res["expert_mb"] / 1000, res["dense_gb"]

    def line(ok: bool, text: str):
        out.append(f"[{'met' if ok else 'NOT met'}] {text}")

    dec = {k: v["stats"]["decode_ms_median"] for k, v in runs.items()}
    for k, v in runs.items():
        if k.startswith("ram-"):
            line(v["peak"]["rss"] / GB <= 1.15 * ck, f"{k}: peak RSS {v['peak']['rss'] / GB:.2f} GB <= 1.15 x "
                 f"{ck:.2f} GB checkpoint")
    base = dec.get("emulate-16-warm")
    if base:
        for k in sorted(dec):
            if k.startswith("ram-") and k.endswith("warm"):
                line(dec[k] <= 1.1 * base, f"{k}: decode {dec[k]:.0f} ms/token <= 1.1 x all-resident "
                     f"(emulate-16-warm) {base:.0f}")
    for k, v in runs.items():
        if k.startswith("disk-") and v.get("ms_per_expert_load") == v.get("ms_per_expert_load"):
            ms = v["ms_per_expert_load"]
            if k.endswith("warm"):
                line(ms <= 1.5 * res["memcpy_ms"], f"{k}: {ms:.0f} ms per expert load <= 1.5 x memcpy "
                     f"{res['memcpy_ms']:.0f} ms ({res['memcpy_1thread_ms']:.0f} ms with one thread)")
            else:
                around = v.get("seq_read_gbps_around", [res["seq_read_gbps"]])
                seq_ms = res["expert_mb"] / (sum(around) / len(around))           # MB / (GB/s) = ms
                # information, not the judgement: the reads around the run are taken by this process right after
                # an eviction, the fast kernel state; the run loads cold, the slow one (`cold_read_ab`)
                out.append(f"[info] {k}: {ms:.0f} ms per expert load; {1.2 * seq_ms:.0f} ms = 1.2 x a sequential read "
                           f"measured around the run (disk {' / '.join(f'{g:.2f}' for g in around)} GB/s, read right "
                           f"after an eviction); the cold read path line judges the read in the run's own state")
        if k.startswith(("disk-", "ram-")):
            n = int(k.split("-")[1])
            cache = n * ex if k.startswith("disk-") else 16 * ex      # in place the store is the cache
            anon = v["peak"]["anon"] / GB
            line(anon <= cache + dense + 0.5, f"{k}: anon {anon:.2f} GB <= cache {cache:.2f} + dense {dense:.2f} + 0.5")
    ab = res.get("cold_read_pairs")
    if ab and "error" not in ab:
        line(ab["median_ratio"] <= 1.2, f"cold read path: moectl's demand read of an expert takes {ab['median_ratio']:.2f}x "
             f"a plain sequential read of as many bytes (median of {len(ab['ms']['moectl'])} alternating pairs; "
             f"{ab['median_ms']['moectl']:.0f} vs {ab['median_ms']['sequential']:.0f} ms) <= 1.2")
    # N is the number of slots; in place (ram without --emulate-device) there are none, so N changes nothing there
    for mode in ("disk", "emulate"):
        for cache in ("warm", "cold"):
            seq = [dec.get(f"{mode}-{n}-{cache}") for n in (2, 8, 16)]
            if None not in seq:
                line(seq[0] * 1.05 >= seq[1] and seq[1] * 1.05 >= seq[2],
                     f"{mode} {cache}: decode ms/token at N=2/8/16 = {seq[0]:.0f} / {seq[1]:.0f} / {seq[2]:.0f} "
                     f"never rises with N (5% noise allowed)")
    return out


if __name__ == "__main__":
    main()
