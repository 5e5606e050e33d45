"""Peak host memory while loading: moectl vs transformers from_pretrained.

Builds a ~400 MB (fp32) Mixtral checkpoint in 2 shards, then loads it in fresh processes and samples
anonymous RSS (heap; transformers' memory-mapped shards count as file pages, not here) every few ms.
Goal: moectl's peak stays near the model size (+ at most one shard), never 2x.
Usage: python bench/load_memory.py [--hidden 512 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, threading, time
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
    return 0
import torch, transformers
from moectl.runtime.engine import Engine
base, peak, done = anon(), [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], anon()); time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
if sys.argv[2] == 'moectl':
    m = Engine.load(sys.argv[1], progress=False)
else:
    m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
done[0] = True; t.join()
peak[0] = max(peak[0], anon())
print(json.dumps({"peak": peak[0] - base, "after": anon() - base}))
"""


def main() -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    cfg = MixtralConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=2)
    path = tempfile.mkdtemp(prefix="moectl-mem-")
    model = MixtralForCausalLM(cfg)
    size = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(path, max_shard_size=f"{size // 2 // 10**6 + 1}MB")
    del model
    print(f"checkpoint: {size / 1e6:.0f} MB fp32 in 2 shards")
    for who in ("transformers", "moectl"):
        out = subprocess.run([sys.executable, "-c", CHILD, path, who], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{who:>12}: peak +{r['peak'] / 1e6:.0f} MB ({r['peak'] / size:.2f}x model), "
              f"after load +{r['after'] / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
