"""A GGUF load's peak host memory against what `moectl inspect` says it is (issue 45).

Builds a random Mixtral-shaped GGUF (Q4_0 experts, repacked for the CPU int4 kernel in place; Q6_K dense tensors,
whose dequantisation holds the most temporaries; a vocabulary large enough for the row blocks to matter), then
loads it in a fresh process with every library imported first and samples anonymous RSS every 0.5 ms. Prints
`inspect --device cpu`'s "host RAM peak while loading" beside the measured growth; the measured figure must not
exceed the reported one by more than the allocator's slack (a few MB).

Usage: python bench/gguf_load_peak.py [--hidden 1024 --intermediate 2048 --experts 16 --layers 2 --vocab 32000]
(~1 min and ~1 GB of RAM at the defaults; never under other load: the RSS samples are this process's alone.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys, threading, time
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
import torch
torch.set_num_threads(1)
from moectl.runtime.engine import Engine
from moectl.store.facts import offloaded_skeleton
offloaded_skeleton(sys.argv[1])                        # transformers' model code imported before the baseline
base, peak, done = anon(), [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], anon()); time.sleep(0.0005)
t = threading.Thread(target=sample); t.start()
eng = Engine.load(sys.argv[1], threads=1, progress=False)
done[0] = True; t.join()
print(json.dumps({"peak_growth": peak[0] - base, "kept": anon() - base}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 1024), ("intermediate", 2048), ("experts", 16), ("layers", 2), ("vocab", 32000)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf_build import write_gguf
    from model_factory import save_tokenizer
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="moectl-gguf-peak-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        cfg = MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                            num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                            num_local_experts=a.experts, num_experts_per_tok=2, max_position_embeddings=256,
                            bos_token_id=0, eos_token_id=0, pad_token_id=1)
        torch.manual_seed(0)
        MixtralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(ckpt)
        save_tokenizer(ckpt, vocab_size=a.vocab)
        gguf = write_gguf(ckpt, Path(tmp) / "m.gguf", expert_encoding=T.Q4_0, dense_encoding=T.Q6_K)
        env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MOECTL_HOME": str(Path(tmp) / "home")}
        info = json.loads(subprocess.run([sys.executable, "-c", "import sys; from moectl.cli import main; "
                                          "sys.argv[0] = 'moectl'; main()", "inspect", "--model", str(gguf),
                                          "--device", "cpu", "--json"], capture_output=True, text=True, check=True,
                                         env=env).stdout)
        got = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(gguf)], capture_output=True, text=True,
                                        check=True, env=env).stdout)
    p = info["memory"]["load_peak"]
    print(json.dumps({"inspect_host_ram_needed": info["memory"]["host"]["total"], "inspect_load_peak": p,
                      "measured_peak_growth": got["peak_growth"], "measured_kept": got["kept"],
                      "measured_over_reported": round(got["peak_growth"] / p["total"], 3)}, indent=1))


if __name__ == "__main__":
    main()
