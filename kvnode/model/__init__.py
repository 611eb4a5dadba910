"""The Llama-family model (Llama, Mistral, Qwen2), its loader, presets and tokenizers."""

from pagekv.kvnode.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    RopeConfig,
    config_from_hf_dict,
)
from pagekv.kvnode.model.layers import AttentionMetadata
from pagekv.kvnode.model.llama import LlamaForCausalLM
from pagekv.kvnode.model.loader import LoadedModel, load_model
from pagekv.kvnode.model.presets import PRESETS
from pagekv.proto.model_files.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

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
