"""vLLM `LLM(...)` options PageKV does not implement, refused by name with the reason.

A script written for vLLM often passes these; each is accepted at the value that asks for
nothing PageKV lacks (vLLM's default), and any other value is refused saying why, instead of
the generic "unknown option". Anything neither here nor an EngineArgs field stays unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UnsupportedOption:
    accepted: tuple[object, ...]  # values that ask for nothing PageKV lacks
    reason: str


SCALE_OUT = ("a PageKV pod runs one model on one device; serve more with more pods behind "
             "the router (`pagekv up --nodes N`)")

VLLM_ONLY_OPTIONS: Mapping[str, UnsupportedOption] = {
    "tensor_parallel_size": UnsupportedOption((1,), SCALE_OUT),
    "pipeline_parallel_size": UnsupportedOption((1,), SCALE_OUT),
    "quantization": UnsupportedOption(
        (None,), "weights load as they are stored (safetensors in their dtype, a GGUF file "
                 "dequantized on load): pass a quantized model as its .gguf file"),
    "trust_remote_code": UnsupportedOption(
        (False,), "PageKV runs its own implementation of the Llama family and never a "
                  "checkpoint's Python code"),
    "tokenizer": UnsupportedOption(
        (None,), "the model's own tokenizer is used (its tokenizer.json, or a GGUF file's "
                 "vocabulary)"),
    "enable_lora": UnsupportedOption((True, False), ""),  # adapters: lora_modules
    # Always true of PageKV (it captures no CUDA graphs), so any value is accepted.
    "enforce_eager": UnsupportedOption((True, False), ""),
}


def check_vllm_options(model: str, options: Mapping[str, object]) -> None:
    """Refuse, naming the option and why, each of `options` (all of them vLLM-only) set to a
    value PageKV cannot honour; `tokenizer` may also name the model itself."""
    for name, value in options.items():
        opt = VLLM_ONLY_OPTIONS[name]
        if name == "tokenizer" and value == model:
            continue
        # (`is` first: 1 == True would let tensor_parallel_size=True through as 1)
        if not any(value is a or (type(value) is type(a) and value == a) for a in opt.accepted):
            raise ValueError(f"LLM({name}={value!r}) is not supported: {opt.reason}")
