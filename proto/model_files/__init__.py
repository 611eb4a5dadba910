"""What a model's files say, read without torch, so the router and clients read it as the pod
does: the GGUF container (gguf), ggml's type sizes (ggml_types), the tokenizers (tokenizer,
gguf_tokenizer), the file presets (presets) and the one load error (errors).

`prompt_tokenizer(model)` is how the router and the demo turn text into the token ids a pod
would produce: the byte tokenizer for a built-in preset, the vocabulary inside a GGUF file,
a directory's tokenizer.json — each with the model's chat template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagekv.proto.model_files.errors import ModelLoadError
from pagekv.proto.model_files.presets import BUILTIN_PREFIX, FILE_PRESETS, model_path
from pagekv.proto.model_files.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["ModelLoadError", "Tokenizer", "chat_template_of", "directory_tokenizer",
           "prompt_tokenizer", "special_token_ids"]

# BOS and EOS of transformers' config classes when config.json leaves them out (the pod's
# loader, kvnode/model/config.py's HF_DEFAULTS, uses the same; a test keeps the two equal).
DEFAULT_SPECIAL_IDS: dict[str, tuple[int | None, int | None]] = {
    "LlamaForCausalLM": (1, 2), "MistralForCausalLM": (1, 2), "Qwen2ForCausalLM": (None, None)}
_ARCHITECTURE_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "qwen2": "Qwen2ForCausalLM"}


def prompt_tokenizer(model: str) -> Tokenizer:
    """The tokenizer pods serving `model` encode prompts with; ModelLoadError if none is found.
    (A directory's BOS/EOS ids come from its config.json in the pod's loader: they decide where
    output stops, not how a prompt is encoded.)"""
    if model.startswith(BUILTIN_PREFIX):
        return ByteTokenizer()
    path = model_path(model)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {model!r} does not exist")
        from pagekv.proto.model_files.gguf import GGUFFile
        from pagekv.proto.model_files.gguf_tokenizer import gguf_tokenizer

        with GGUFFile(path) as gguf:
            return gguf_tokenizer(gguf.metadata)
    if path.is_dir():
        # The ids as the pod reads them: a template's {{ bos_token }} renders the same here.
        config = path / "config.json"
        try:
            raw = json.loads(config.read_text()) if config.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{config} does not read as JSON: {e}") from e
        return directory_tokenizer(path, *special_token_ids(raw if isinstance(raw, dict) else {}))
    raise ModelLoadError(
        f"model {model!r} is neither a built-in preset ({BUILTIN_PREFIX}*), a file preset "
        f"({', '.join(FILE_PRESETS)}), a .gguf file nor a local model directory"
    )


def special_token_ids(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """config.json's BOS id and first EOS id, as the pod's loader reads them: a field saved as
    null is none, one left out is its architecture's default (transformers')."""
    archs = config.get("architectures")
    arch = (archs[0] if isinstance(archs, list) and archs else
            _ARCHITECTURE_OF_TYPE.get(str(config.get("model_type")), ""))
    default_bos, default_eos = DEFAULT_SPECIAL_IDS.get(str(arch), (None, None))

    def first_id(name: str, default: int | None) -> int | None:
        value = config.get(name, default)
        if isinstance(value, list):  # several EOS ids: the first is the tokenizer's
            value = value[0] if value else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return first_id("bos_token_id", default_bos), first_id("eos_token_id", default_eos)


def directory_tokenizer(path: Path, bos_token_id: int | None = None,
                        eos_token_id: int | None = None) -> HFTokenizer:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(f"missing file tokenizer.json (Hugging Face fast tokenizer) in {path}")
    return HFTokenizer(tok_file, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       chat_template=chat_template_of(path))


def chat_template_of(path: Path) -> str | None:
    """chat_template.jinja (transformers >= 4.43 saves it apart), else tokenizer_config.json's
    chat_template (a string, or a list of named ones: the "default")."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = path / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None
