"""Load a model: a built-in preset name, a local Hugging Face directory (``config.json``,
``*.safetensors`` single or sharded, ``tokenizer.json``) or a GGUF file (kvnode.model.gguf_loader)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagekv.kvnode.model.config import ModelConfig, ModelLoadError, config_from_hf_dict
from pagekv.kvnode.model.llama import LlamaForCausalLM
from pagekv.kvnode.model.presets import (
    FILE_PRESETS,
    PRESETS,
    init_dummy_weights,
    preset_config,
)
from pagekv.proto.model_files import directory_tokenizer, prompt_tokenizer
from pagekv.proto.model_files.presets import model_path
from pagekv.proto.model_files.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
# Checkpoint entries that carry no weights we need (older Llama exports ship inv_freq).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer


def load_model(name_or_path: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Build the model on ``device`` in ``dtype`` and fill its weights."""
    if name_or_path in PRESETS:
        cfg = preset_config(name_or_path)
        model = LlamaForCausalLM(cfg, dtype, device)
        init_dummy_weights(model, PRESETS[name_or_path][1])
        return LoadedModel(model.eval(), cfg, ByteTokenizer())
    path = model_path(name_or_path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {name_or_path!r} does not exist")
        from pagekv.kvnode.model.gguf_loader import load_gguf  # imports this module

        model, cfg, tokenizer = load_gguf(path, dtype, device)
        return LoadedModel(model.eval(), cfg, tokenizer)
    if not path.is_dir():
        raise ModelLoadError(
            f"{name_or_path!r} is neither a built-in preset "
            f"({', '.join([*PRESETS, *FILE_PRESETS])}), a local model directory nor a .gguf file"
        )
    cfg = load_config(path)
    tokenizer = _load_tokenizer(path, cfg)
    model = LlamaForCausalLM(cfg, dtype, device)
    load_safetensors(model, path)
    return LoadedModel(model.eval(), cfg, tokenizer)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer (with its chat template) of a model, without building the model; for a
    model directory with the BOS/EOS ids of its config.json (they decide where output stops)."""
    path = Path(name_or_path)
    if path.is_dir():
        return _load_tokenizer(path, load_config(path))
    return prompt_tokenizer(name_or_path)


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ModelLoadError(f"missing file {path.name} ({what}) in {path.parent}")
    return path


def load_config(path: Path) -> ModelConfig:
    raw = json.loads(_require(path / "config.json", "model configuration").read_text())
    cfg = config_from_hf_dict(raw, name=path.name)
    # generation_config.json may list extra stop ids (Llama 3 instruct: <|eot_id|>).
    gen = path / "generation_config.json"
    if gen.is_file():
        extra = json.loads(gen.read_text()).get("eos_token_id")
        ids = [extra] if isinstance(extra, int) else list(extra or [])
        cfg.eos_token_ids += [int(i) for i in ids if int(i) not in cfg.eos_token_ids]
    return cfg


def _load_tokenizer(path: Path, cfg: ModelConfig) -> HFTokenizer:
    return directory_tokenizer(path, cfg.bos_token_id, cfg.eos_token_id)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            _require(f, f"shard listed in {_INDEX_FILE}")
        return files
    # A lone model.safetensors is the checkpoint even when other files sit next to it
    # (Mistral releases also ship consolidated.safetensors, the same weights renamed).
    single = path / "model.safetensors"
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(other)}; only safetensors is supported)" if other else ""
        raise ModelLoadError(f"missing file model.safetensors (weights) in {path}{hint}")
    return files


def weight_targets(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Checkpoint tensor name -> the (view of the) parameter it fills. Fused projections
    are filled slice by slice: q|k|v rows of qkv_proj, gate|up rows of gate_up_proj."""
    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    targets: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed_tokens.data,
        "model.norm.weight": model.norm.weight.data,
    }
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = model.lm_head.data
    for i, layer in enumerate(model.decoder_layers()):
        pre = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        targets[pre + "input_layernorm.weight"] = layer.input_layernorm.weight.data
        targets[pre + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
        for kind in ("weight", "bias"):
            fused = getattr(attn.qkv_proj, kind)
            if fused is not None:
                targets[pre + f"self_attn.q_proj.{kind}"] = fused.data[:q]
                targets[pre + f"self_attn.k_proj.{kind}"] = fused.data[q : q + kv]
                targets[pre + f"self_attn.v_proj.{kind}"] = fused.data[q + kv :]
            if getattr(attn.o_proj, kind) is not None:
                targets[pre + f"self_attn.o_proj.{kind}"] = getattr(attn.o_proj, kind).data
            gate_up = getattr(mlp.gate_up_proj, kind)
            if gate_up is not None:
                targets[pre + f"mlp.gate_proj.{kind}"] = gate_up.data[:inter]
                targets[pre + f"mlp.up_proj.{kind}"] = gate_up.data[inter:]
            if getattr(mlp.down_proj, kind) is not None:
                targets[pre + f"mlp.down_proj.{kind}"] = getattr(mlp.down_proj, kind).data
    return targets


def load_safetensors(model: LlamaForCausalLM, path: Path) -> None:
    from safetensors import safe_open

    targets = weight_targets(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    stored_head: torch.Tensor | None = None
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for raw_name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                name = raw_name if raw_name in targets else _normalise(raw_name)
                target = targets.get(name)
                if target is None and name == "lm_head.weight":
                    # Tied, yet the file stores a head: settled once everything is loaded.
                    stored_head = _checked(f.get_tensor(raw_name), model.embed_tokens, raw_name,
                                           file)
                    continue
                if target is None:
                    if not _IGNORED.search(raw_name):
                        unexpected.append(raw_name)
                    continue
                tensor = _checked(f.get_tensor(raw_name), target, raw_name, file)
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                loaded.add(name)
    if stored_head is not None:
        _settle_tied_head(model, stored_head, loaded)
    check_loaded(targets, loaded, unexpected, f"checkpoint in {path}")


def check_loaded(targets: dict, loaded: set[str], unexpected: list[str], source: str) -> None:
    """Every weight the model needs was filled (ModelLoadError naming the first missing ones);
    tensors it does not use are a warning."""
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source} is missing tensors: {shown}")
    if unexpected:
        logger.warning("ignored %d tensors of %s the model does not use, e.g. %s",
                       len(unexpected), source, unexpected[:3])


def _checked(tensor: torch.Tensor, target: torch.Tensor, name: str, file: Path) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelLoadError(
            f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(target.shape)} from config.json"
        )
    return tensor


def _settle_tied_head(model: LlamaForCausalLM, head: torch.Tensor, loaded: set[str]) -> None:
    """tie_word_embeddings, and the file has an lm_head anyway: do what transformers 5 does.
    No embedding stored: the head fills it. Both stored and equal: tied. Both stored and
    different: the config is wrong about the file, so they are used untied."""
    embed = "model.embed_tokens.weight"
    head = head.to(device=model.embed_tokens.device, dtype=model.dtype)
    with torch.no_grad():
        if embed not in loaded:
            model.embed_tokens.copy_(head)
            loaded.add(embed)
        elif not torch.equal(head, model.embed_tokens):
            logger.warning("tie_word_embeddings is set but the checkpoint stores a different "
                           "lm_head.weight: using it untied, as transformers does")
            model.lm_head = torch.nn.Parameter(head, requires_grad=False)


def _normalise(name: str) -> str:
    """Accept bare ``LlamaModel`` exports (no ``model.`` prefix)."""
    if not name.startswith("model.") and name != "lm_head.weight":
        return "model." + name
    return name
