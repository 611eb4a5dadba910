"""Small GGUF files for the loader's tests, written with the ``gguf`` package (llama.cpp's own
writer, independent of our reader): a tiny random Llama from transformers, its Q/K rows
permuted the way llama.cpp's converter does, and a byte-level BPE vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode spelling of the 256 bytes, in byte order (restated from its
    definition: printable Latin-1 bytes stand for themselves, the rest map to U+0100...)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and llama.cpp token types (3 = control, 1 = normal)."""
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = SPECIALS + byte_alphabet() + merged
    return tokens, [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj / k_proj rows (its LlamaModel
    permute): within each head, (i, i + d/2) become (2i, 2i + 1)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_llama(tie: bool = False, seed: int = 0):
    import torch
    import transformers

    tokens, _ = vocabulary()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        # rows of 256: whole blocks of every ggml type, k-quants included
        vocab_size=len(tokens), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def gguf_tensors(model, qtype: str = "F32") -> dict[str, tuple[np.ndarray, str]]:
    """llama.cpp name -> (values, ggml type) of a transformers Llama."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out: dict[str, tuple[np.ndarray, str]] = {
        "token_embd.weight": (sd["model.embed_tokens.weight"], qtype),
        "output_norm.weight": (sd["model.norm.weight"], "F32"),
    }
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (sd["lm_head.weight"], qtype)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, cpp in names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if cpp == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif cpp == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{cpp}.weight"] = (w, "F32" if "norm" in cpp else qtype)
    return out


def llama_metadata(model) -> dict[str, Any]:
    cfg = model.config
    tokens, types = vocabulary()
    return {
        "llama.context_length": cfg.max_position_embeddings,
        "llama.embedding_length": cfg.hidden_size,
        "llama.block_count": cfg.num_hidden_layers,
        "llama.feed_forward_length": cfg.intermediate_size,
        "llama.attention.head_count": cfg.num_attention_heads,
        "llama.attention.head_count_kv": cfg.num_key_value_heads,
        "llama.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
        "llama.vocab_size": cfg.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_gguf(path: Path, metadata: dict[str, Any],
               tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama") -> Path:
    """Write a GGUF with llama.cpp's writer; metadata types follow the Python values (ints
    as uint32, floats as float32, lists of str/int/float as arrays). Tensors are quantized
    to their type by gguf-py, or written as given when they are uint8 (raw blocks)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, (values, qtype) in tensors.items():
        kind = gguf.GGMLQuantizationType[qtype]
        if values.dtype == np.uint8:  # raw blocks, written as they are
            w.add_tensor(name, values, raw_dtype=kind)
        elif kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, gguf.quants.quantize(values, kind))
        else:
            w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama(path: Path, qtype: str = "F32", tie: bool = False, seed: int = 0,
                     metadata: dict[str, Any] | None = None):
    """(the transformers model, the GGUF path) of a tiny random Llama."""
    model = tiny_llama(tie=tie, seed=seed)
    write_gguf(path, llama_metadata(model) | (metadata or {}), gguf_tensors(model, qtype))
    return model, path
