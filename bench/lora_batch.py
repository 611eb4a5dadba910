"""Decode throughput with LoRA adapters (issue #32): one batch mixing 8 adapters vs the base
model alone, and vs serving each adapter from a merged copy of the weights, one at a time —
in the same run, on the model runner itself (no scheduler: the forward step is what differs).

Adapters are written as PEFT's files (random A and B, rank `--rank`, on all seven
projections of every layer) and read by PageKV's loader, so the bench measures the served
path. Configurations, their order rotating by round:

- base: `--seqs` sequences, no adapter;
- mixed: the same, sequence i with adapter i % 8 (each row its own adapter: the delta runs
  per adapter on its rows, vLLM's multi-LoRA);
- merged, one at a time: per adapter, W + scaling·B·A merged into the weights (not timed),
  its own sequences decoded as a batch, the weights restored — what a server without
  multi-LoRA does, adapter after adapter.

Each configuration prefills its prompts, then decodes `--steps` steps; output tokens/s over
the decode steps only, and the ratios to base. The greedy tokens of mixed and merged agree
(the same adapter either way; fp32 rounding aside).

    python -m bench.lora_batch [--quick] [--model M] [--seqs N] [--rank R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.machine import machine_info
from pagekv.kvnode.model.lora import FUSED, LoraWeights, load_adapter, projection_sizes
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem

ADAPTERS = 8
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
               "down_proj": "mlp"}


def write_adapter(directory: Path, runner: ModelRunner, rank: int, seed: int) -> None:
    from safetensors.torch import save_file

    cfg = runner.model_config
    sizes = projection_sizes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, parent in PROJECTIONS.items():
            fan_in, fan_out = sizes[module]
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS), "bias": "none"}))


def merge(runner: ModelRunner, adapter: LoraWeights, sign: float) -> None:
    """W += sign · B·A (scaling folded in B) for each fused projection the adapter targets."""
    with torch.no_grad():
        for layer, module in enumerate(runner.model.decoder_layers()):
            projections = {"qkv": module.self_attn.qkv_proj, "o": module.self_attn.o_proj,
                           "gate_up": module.mlp.gate_up_proj, "down": module.mlp.down_proj}
            for fused in FUSED:
                pair = adapter.layers[layer].get(fused)
                if pair is not None:
                    projections[fused].weight.add_((pair.a_t @ pair.b_t).t(), alpha=sign)


def decode(runner: ModelRunner, prompts: list[list[int]], loras: list[LoraWeights | None],
           steps: int) -> tuple[float, list[list[int]]]:
    """Prefill, then `steps` batched decode steps; (decode seconds, each sequence's tokens)."""
    per = runner.num_blocks // len(prompts)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    logits = runner.execute([SeqBatchItem(p, 0, t, lo) for p, t, lo
                             in zip(prompts, tables, loras, strict=True)])
    outs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        batch = []
        for i, (p, t, lo) in enumerate(zip(prompts, tables, loras, strict=True)):
            outs[i].append(nxt[i])
            batch.append(SeqBatchItem([nxt[i]], len(p) + len(outs[i]) - 1, t, lo))
        logits = runner.execute(batch)
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="pagekv-tiny, 2 rounds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.steps = "pagekv-tiny", 2, 8
    max_len = args.prompt + args.steps + 16
    blocks = args.seqs * (-(-max_len // 16) + 1)
    runner = ModelRunner(args.model, block_size=16, num_gpu_blocks=blocks, device="cpu",
                         max_model_len=max_len)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for k in range(ADAPTERS):
            write_adapter(Path(tmp) / f"a{k}", runner, args.rank, 100 + k)
            adapters.append(load_adapter(f"a{k}", Path(tmp) / f"a{k}", runner.model_config,
                                         runner.dtype, runner.device, 256))
    vocab = runner.model_config.vocab_size
    prompts = [[(i * (7 + 2 * s) + s) % (vocab - 1) + 1 for i in range(args.prompt)]
               for s in range(args.seqs)]
    mixed_loras: list[LoraWeights | None] = [adapters[s % ADAPTERS] for s in range(args.seqs)]
    seconds = {"base": 0.0, "mixed": 0.0, "merged": 0.0}
    tokens: dict[str, list[list[int]]] = {}
    decode(runner, prompts[:2], [None, None], 2)  # warm-up
    for r in range(args.rounds):
        order = ["base", "mixed", "merged"]
        order = order[r % 3:] + order[:r % 3]
        for config in order:
            if config == "base":
                s, out = decode(runner, prompts, [None] * args.seqs, args.steps)
            elif config == "mixed":
                s, out = decode(runner, prompts, mixed_loras, args.steps)
            else:
                s, out = 0.0, [[] for _ in prompts]
                for k, adapter in enumerate(adapters):
                    rows = [i for i in range(args.seqs) if i % ADAPTERS == k]
                    if not rows:
                        continue
                    merge(runner, adapter, 1.0)
                    try:
                        part, got = decode(runner, [prompts[i] for i in rows],
                                           [None] * len(rows), args.steps)
                    finally:
                        merge(runner, adapter, -1.0)
                    s += part
                    for i, toks in zip(rows, got, strict=True):
                        out[i] = toks
            seconds[config] += s
            tokens[config] = out
    produced = args.seqs * args.steps * args.rounds
    rate = {k: produced / v for k, v in seconds.items()}
    agree = sum(a == b for a, b in zip(tokens["mixed"], tokens["merged"], strict=True))
    result = {"model": args.model, "machine": machine_info(), "seqs": args.seqs,
              "adapters": ADAPTERS, "rank": args.rank, "prompt": args.prompt,
              "steps": args.steps, "rounds": args.rounds,
              "tokens_per_s": rate,
              "mixed_vs_base": rate["mixed"] / rate["base"],
              "mixed_vs_merged": rate["mixed"] / rate["merged"],
              "greedy_agree": f"{agree}/{args.seqs}"}
    print(f"model {args.model}; {args.seqs} sequences, {ADAPTERS} adapters of rank "
          f"{args.rank} on all 7 projections; {args.steps} decode steps x {args.rounds} "
          f"rounds; {machine_info()}")
    print("| configuration | output tokens/s | vs base |")
    print("|---|---|---|")
    for name, label in (("base", "base model alone"), ("mixed", "one batch mixing 8 adapters"),
                        ("merged", "merged weights, one adapter at a time")):
        print(f"| {label} | {rate[name]:.1f} | {rate[name] / rate['base']:.2f}x |")
    print(f"mixed / merged one at a time: {result['mixed_vs_merged']:.2f}x; greedy tokens "
          f"of mixed and merged agree on {agree} of {args.seqs} sequences; goal mixed >= "
          f"0.7x base: {'met' if result['mixed_vs_base'] >= 0.7 else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
