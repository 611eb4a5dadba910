"""Engine throughput: PageKV's continuous batching vs. Hugging Face `generate`, same weights.

1. The same requests (prompt 64–1,024 tokens, output 16–256) on `--model` (`pagekv-small`, or
   a real model: `smollm2-135m-instruct`, a .gguf file): output tokens/s of PageKV's engine vs.
   `transformers` `generate` with static padded batches of the same model and weights (a GGUF
   file is loaded by transformers itself; greedy, ignore EOS; only each request's own tokens
   count).
2. With 40% of requests sharing a 1,024-token system prompt: prefix caching on vs. off.
3. Scheduler overhead per step (everything but the forward pass) as a share of step time;
   `--profile` adds a pyinstrument profile of one run.

    python -m bench.throughput [--quick] [--json PATH] [--profile] [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.machine import machine_info
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams

MODEL = "pagekv-small"


def workload(n: int, seed: int = 0, shared_fraction: float = 0.0, system_len: int = 1024):
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_len)]
    reqs = []
    for _ in range(n):
        if rng.random() < shared_fraction:
            prompt = system + [rng.randrange(256) for _ in range(rng.randint(16, 128))]
        else:
            prompt = [rng.randrange(256) for _ in range(rng.randint(64, 1024))]
        reqs.append((prompt, rng.randint(16, 256)))
    return reqs


def run_pagekv(reqs, enable_prefix_caching: bool = True, profile: bool = False) -> dict:
    llm = LLM(MODEL, max_model_len=2048, num_gpu_blocks=4096, max_num_seqs=64,
              max_num_batched_tokens=2048, enable_prefix_caching=enable_prefix_caching)
    eng = llm.engine
    timings = {"execute": 0.0, "steps": 0}
    real_execute = eng.runner.execute

    def timed_execute(batch):
        t0 = time.perf_counter()
        out = real_execute(batch)
        timings["execute"] += time.perf_counter() - t0
        timings["steps"] += 1
        return out

    eng.runner.execute = timed_execute
    params = [SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True) for _, out in reqs]
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler()
        profiler.start()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.stop()
        print(profiler.output_text(unicode=True, color=False, show_all=False)[:6000])
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    overhead = wall - timings["execute"]
    return {
        "wall_s": wall,
        "output_tokens": n_out,
        "tokens_per_s": n_out / wall,
        "steps": timings["steps"],
        "overhead_ms_per_step": overhead / max(1, timings["steps"]) * 1e3,
        "overhead_share": overhead / wall,
        "cached_tokens": cached,
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def hf_model(name: str):
    """transformers' model of `name`: a GGUF file (or file preset) loaded by transformers
    itself, else a LlamaForCausalLM holding exactly the preset's weights."""
    from pagekv.proto.model_files.presets import model_path

    path = model_path(name)
    if path.suffix == ".gguf":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    torch_dtype=torch.float32).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagekv.kvnode.model.loader import load_model, weight_targets

    ours = load_model(name, torch.float32, torch.device("cpu"))
    c = ours.config
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope.theta, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_ids[0], pad_token_id=0,
    )
    model = LlamaForCausalLM(hf_cfg).eval()
    state = {k: v.detach().clone() for k, v in weight_targets(ours.model).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"weight transfer failed: missing {missing}, unexpected {unexpected}")
    return model


@torch.inference_mode()
def run_hf(reqs, batch_size: int) -> dict:
    model = hf_model(MODEL)
    outputs = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (p, _) in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        new = max(out for _, out in batch)  # a static batch runs until its longest member
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        for j, (_, out) in enumerate(batch):
            outputs.append(gen[j, width : width + out].tolist())
    wall = time.perf_counter() - t0
    n_out = sum(out for _, out in reqs)
    return {"wall_s": wall, "output_tokens": n_out, "tokens_per_s": n_out / wall,
            "outputs": outputs}


def main() -> None:
    global MODEL  # --model replaces the default the helpers read
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="pyinstrument profile of PageKV")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--model", default=MODEL)
    args = ap.parse_args()
    MODEL = args.model
    torch.set_num_threads(2)
    n = 48 if args.quick else 256
    info = machine_info()
    print(f"# Throughput benchmark ({MODEL}) — {info}")

    reqs = workload(n)
    ours = run_pagekv(reqs, profile=args.profile)
    hf = run_hf(reqs, args.hf_batch)
    agree = sum(a == b for a, b in zip(ours["outputs"], hf["outputs"], strict=True)) / n
    print(f"\n## {n} requests, prompt 64–1,024, output 16–256 (greedy)")
    print("| engine | wall s | output tokens/s | ratio |")
    print("|---|---|---|---|")
    print(f"| HF generate, static batches of {args.hf_batch} | {hf['wall_s']:.1f} | "
          f"{hf['tokens_per_s']:.1f} | 1.00x |")
    print(f"| PageKV engine | {ours['wall_s']:.1f} | {ours['tokens_per_s']:.1f} | "
          f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x |")
    print(f"identical greedy outputs: {agree:.0%} of requests")

    shared = workload(n, seed=1, shared_fraction=0.4)
    on = run_pagekv(shared, enable_prefix_caching=True)
    off = run_pagekv(shared, enable_prefix_caching=False)
    print("\n## 40% of requests share a 1,024-token system prompt")
    print("| prefix caching | wall s | output tokens/s | cached prompt tokens | ratio |")
    print("|---|---|---|---|---|")
    print(f"| off | {off['wall_s']:.1f} | {off['tokens_per_s']:.1f} | 0 | 1.00x |")
    print(f"| on | {on['wall_s']:.1f} | {on['tokens_per_s']:.1f} | "
          f"{on['cached_tokens']:,} of {on['prompt_tokens']:,} | "
          f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x |")

    print("\n## Scheduler overhead (step time outside the forward pass)")
    print("| run | steps | overhead ms/step | share of wall time |")
    print("|---|---|---|---|")
    for name, r in (("mixed", ours), ("shared, caching on", on)):
        print(f"| {name} | {r['steps']} | {r['overhead_ms_per_step']:.2f} | "
              f"{r['overhead_share']:.1%} |")
    if args.json:
        drop = ("outputs",)
        with open(args.json, "w") as f:
            json.dump({"machine": info,
                       **{k: {kk: vv for kk, vv in v.items() if kk not in drop}
                          for k, v in (("pagekv", ours), ("hf", hf), ("caching_on", on),
                                       ("caching_off", off))}}, f, indent=2)


if __name__ == "__main__":
    main()
