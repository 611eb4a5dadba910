"""The Llama-family model (Llama, Mistral, Qwen2), its loader, presets and tokenizers."""

from kvnode.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    RopeConfig,
    config_from_hf_dict,
)
from kvnode.model.layers import AttentionMetadata
from kvnode.model.llama import LlamaForCausalLM
from kvnode.model.loader import LoadedModel, load_model
from kvnode.model.presets import PRESETS
from kvnode.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "ByteTokenizer",
    "HFTokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "RopeConfig",
    "Tokenizer",
    "config_from_hf_dict",
    "load_model",
]
