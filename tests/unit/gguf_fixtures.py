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


# Where each block type keeps its fp16 scales (byte offsets), as gguf-py's dequantize_blocks
# splits the block; every other byte (quants, packed sub-scales, signs) may be any byte.
FP16_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}
_IQ1_M_SCALES = 48  # IQ1_M: its fp16 scale is the top nibbles of the four uint16 from here


def _finite_bits(rng: np.random.Generator, n: int, dtype: str, exponent: int,
                 flip: int) -> np.ndarray:
    """n random floats' bit patterns of any sign and magnitude, subnormals included; a
    pattern whose exponent is all ones (inf, NaN) has one exponent bit cleared."""
    info = np.iinfo(dtype)
    bits = rng.integers(0, int(info.max) + 1, n, dtype=dtype)
    return np.where((bits & exponent) == exponent, bits ^ flip, bits).astype(dtype)


def fp16_field(rng: np.random.Generator, n: int, scale: float | None) -> np.ndarray:
    """[n, 2] bytes of fp16 values: any finite ones, or uniform in (-scale, scale)."""
    if scale is None:
        halves = _finite_bits(rng, n, "<u2", 0x7C00, 0x4000)
    else:
        halves = rng.uniform(-scale, scale, n).astype("<f2").view("<u2")
    return halves.view(np.uint8).reshape(n, 2)


def random_blocks(qtype: str, n_blocks: int, rng: np.random.Generator,
                  scale: float | None = None) -> np.ndarray:
    """[n_blocks, type size] uint8: random blocks of a ggml type whose values are all finite
    (random bytes, with the float fields kept finite: any finite value, or for a model's
    weights within ``scale`` for the fp16 scales)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = n_blocks
    if qtype == "F32":
        return _finite_bits(rng, n, "<u4", 0x7F800000, 0x40000000).view(np.uint8).reshape(n, 4)
    if qtype == "BF16":
        return _finite_bits(rng, n, "<u2", 0x7F80, 0x4000).view(np.uint8).reshape(n, 2)
    if qtype == "F16":
        return fp16_field(rng, n, scale)
    out = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if qtype in FP16_SCALES:
        for at in FP16_SCALES[qtype]:
            out[:, at : at + 2] = fp16_field(rng, n, scale)
    elif qtype == "IQ1_M":  # nibble k of the fp16 in the top nibble of uint16 k
        d = fp16_field(rng, n, scale).view("<u2")[:, 0]
        at = _IQ1_M_SCALES
        words = out[:, at : at + 8].copy().view("<u2") & 0x0FFF
        for k in range(4):
            words[:, k] |= ((d >> (4 * k)) & 0xF) << 12
        out[:, at : at + 8] = words.view(np.uint8)
    elif qtype == "MXFP4":  # an E8M0 exponent: 2**(e - 128) times at most 12 stays finite
        out[:, 0] = rng.integers(0, 250, n, dtype=np.uint8)
    elif qtype != "NVFP4":  # NVFP4's E4M3 scales are finite whatever their bytes
        raise ValueError(f"no block layout for {qtype}")
    return out
