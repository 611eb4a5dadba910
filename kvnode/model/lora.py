"""LoRA adapters for the Llama family: PEFT's files read, and the per-row delta a batch adds.

An adapter is the directory `peft` writes (`save_pretrained`): `adapter_config.json` and
`adapter_model.safetensors` (or `.bin` is refused: a pickle runs code). Each targeted
projection W of a layer gains `(x @ A.T) @ B.T * scaling`, where A is [r, in], B [out, r]
and scaling is `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`), r each module's
own (PEFT's `rank_pattern` saves other ranks for some modules: read off the tensors' shapes).
The targets are the seven projections of a Llama layer: q/k/v/o_proj of attention and
gate/up/down_proj of the MLP. Anything else an adapter may carry (biases, DoRA, embeddings,
`modules_to_save`, `alpha_pattern`) is refused with a reason: serving it with the base
model's weights would answer wrongly, silently.

This model fuses q/k/v into one matrix and gate/up into another (kvnode/model/layers.py), so
an adapter's A matrices of one fused projection are stacked and its B matrices laid block-
diagonally into the fused output, the scaling folded into B: one delta of two matmuls per
fused projection, zero for the outputs the adapter does not target.

`LoraBatch` is one step's assignment of adapters to the batch's tokens: for each adapter in
the batch, the rows (token positions) it owns (None: every row, the common case of a batch of
one adapter). Rows of no adapter get no delta: base and adapters mix in one batch, as vLLM's
multi-LoRA does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagekv.kvnode.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The fused projection each module's delta lands in, in the fused output's order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: one line naming the file and the problem."""


@dataclass(frozen=True, slots=True)
class LoraPair:
    """A fused projection's delta, stored transposed (contiguous) for `x @ a_t @ b_t`: a
    decode step's small matmuls take ~30% less than through `.t()` views."""

    a_t: torch.Tensor  # [in, sum of ranks]
    b_t: torch.Tensor  # [sum of ranks, out], scaling folded in


@dataclass(slots=True)
class LoraWeights:
    name: str
    path: str
    rank: int  # the largest of its modules'
    targets: tuple[str, ...]  # the modules it adapts
    layers: list[dict[str, LoraPair]] = field(default_factory=list)  # fused name -> pair
    nbytes: int = 0


def projection_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter may target."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}


def read_adapter_config(path: str | Path) -> dict:
    """The adapter's config, checked for what this model can serve; AdapterError."""
    directory = Path(path)
    try:
        cfg = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"adapter {directory}: no {CONFIG_FILE} (a PEFT adapter directory "
                           "holds adapter_config.json and adapter_model.safetensors)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {directory}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {directory}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {directory}: peft_type {cfg.get('peft_type')!r}; only "
                           "LORA adapters are served")
    refusals = [
        (cfg.get("bias", "none") != "none", f"bias={cfg.get('bias')!r}"),
        (bool(cfg.get("use_dora")), "use_dora"),
        (bool(cfg.get("fan_in_fan_out")), "fan_in_fan_out"),
        (bool(cfg.get("modules_to_save")), "modules_to_save"),
        (bool(cfg.get("alpha_pattern")), "alpha_pattern"),
    ]
    unsupported = [what for bad, what in refusals if bad]
    if unsupported:
        raise AdapterError(f"adapter {directory}: {', '.join(unsupported)} not supported "
                           "(plain LoRA on q/k/v/o and gate/up/down projections only)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if type(r) is not int or r <= 0 or not isinstance(alpha, int | float):
        raise AdapterError(f"adapter {directory}: r must be a positive int and lora_alpha a "
                           f"number (got r={r!r}, lora_alpha={alpha!r})")
    return cfg


def load_adapter(name: str, path: str | Path, model_cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, max_rank: int) -> LoraWeights:
    """Read a PEFT adapter for this model; AdapterError (one line) for anything wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path)
    cfg = read_adapter_config(directory)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError(f"adapter {directory}: no {WEIGHTS_FILE} (a .bin adapter is a "
                           "pickle and is refused: save it with safe_serialization=True)")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"adapter {directory}: cannot read {WEIGHTS_FILE}: {exc}") from None
    sizes = projection_sizes(model_cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter {directory}: tensor {key!r} is not a LoRA A/B of a "
                               f"layer's {', '.join(MODULES)}")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in sizes or not 0 <= layer < model_cfg.num_hidden_layers:
            raise AdapterError(f"adapter {directory}: {key!r} targets no projection of this "
                               f"{model_cfg.num_hidden_layers}-layer model")
        found.setdefault((layer, module), {})[which] = tensor
    if not found:
        raise AdapterError(f"adapter {directory}: {WEIGHTS_FILE} holds no LoRA weights")
    alpha = float(cfg.get("lora_alpha", cfg["r"]))
    rslora = bool(cfg.get("use_rslora"))
    out = LoraWeights(name, str(directory), 0, tuple(sorted({mod for _, mod in found})),
                      [{} for _ in range(model_cfg.num_hidden_layers)])
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
        {} for _ in range(model_cfg.num_hidden_layers)]
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {directory}: layer {layer} {module} lacks its lora_"
                               f"{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = sizes[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise AdapterError(f"adapter {directory}: layer {layer} {module}: A {tuple(a.shape)}"
                               f" and B {tuple(b.shape)} do not fit a [{fan_out} x {fan_in}] "
                               "projection of this model (an adapter of another base model?)")
        if r > max_rank:
            raise AdapterError(f"adapter {directory}: rank {r} is over --max-lora-rank "
                               f"{max_rank}")
        out.rank = max(out.rank, r)
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        per_layer[layer][module] = (a.to(torch.float32), b.to(torch.float32) * scaling)
    for layer, modules in enumerate(per_layer):
        for fused, parts in FUSED.items():
            pair_ = _fuse(modules, parts, sizes, dtype, device)
            if pair_ is not None:
                out.layers[layer][fused] = pair_
                out.nbytes += pair_.a_t.numel() * pair_.a_t.element_size() + \
                    pair_.b_t.numel() * pair_.b_t.element_size()
    return out


def _fuse(modules: dict[str, tuple[torch.Tensor, torch.Tensor]], parts: Sequence[str],
          sizes: dict[str, tuple[int, int]], dtype: torch.dtype, device: torch.device
          ) -> LoraPair | None:
    """Stack the A's of a fused projection's parts and lay their B's block-diagonally."""
    present = [p for p in parts if p in modules]
    if not present:
        return None
    ranks = {p: modules[p][0].shape[0] for p in present}
    total = sum(ranks.values())
    a = torch.cat([modules[p][0] for p in present], dim=0)
    b = torch.zeros(sum(sizes[p][1] for p in parts), total, dtype=torch.float32)
    row = col = 0
    for p in parts:
        out_size = sizes[p][1]
        if p in modules:
            b[row:row + out_size, col:col + ranks[p]] = modules[p][1]
            col += ranks[p]
        row += out_size
    return LoraPair(a.t().to(dtype=dtype, device=device).contiguous(),
                    b.t().to(dtype=dtype, device=device).contiguous())


@dataclass(slots=True)
class LoraBatch:
    """One step's adapters: (weights, first token row, end row) for each run of consecutive
    rows of one adapter (the runner orders the batch so each adapter's rows are one run)."""

    runs: list[tuple[LoraWeights, int, int]]

    @classmethod
    def of(cls, adapters: Sequence[LoraWeights | None], q_lens: Sequence[int]
           ) -> LoraBatch | None:
        """The batch's items' adapters (None: the base model) and their new-token counts;
        None when no item has an adapter (the base model's step costs nothing more)."""
        runs: list[tuple[LoraWeights, int, int]] = []
        start = 0
        for adapter, n in zip(adapters, q_lens, strict=True):
            if adapter is not None:
                if runs and runs[-1][0] is adapter and runs[-1][2] == start:
                    runs[-1] = (adapter, runs[-1][1], start + n)
                else:
                    runs.append((adapter, start, start + n))
            start += n
        return cls(runs) if runs else None

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`) plus each adapter's delta on its own rows: two
        matmuls per run, the second accumulating into `out` in place."""
        for adapter, start, end in self.runs:
            pair = adapter.layers[layer].get(fused)
            if pair is not None:
                rows = out[start:end]
                rows.addmm_(x[start:end] @ pair.a_t, pair.b_t)
        return out
