"""What a model's files say, read without torch, so the router and clients read it as the pod
does: the GGUF container (gguf), ggml's type sizes (ggml_types), the tokenizers (tokenizer,
gguf_tokenizer), the file presets (presets) and the one load error (errors).

`prompt_tokenizer(model)` is how the router and the demo turn text into the token ids a pod
would produce: the byte tokenizer for a built-in preset, the vocabulary inside a GGUF file,
a directory's tokenizer.json — each with the model's chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagekv.proto.model_files.errors import ModelLoadError
from pagekv.proto.model_files.presets import BUILTIN_PREFIX, FILE_PRESETS, model_path
from pagekv.proto.model_files.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["ModelLoadError", "Tokenizer", "chat_template_of", "directory_tokenizer",
           "prompt_tokenizer"]


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
        return directory_tokenizer(path)
    raise ModelLoadError(
        f"model {model!r} is neither a built-in preset ({BUILTIN_PREFIX}*), a file preset "
        f"({', '.join(FILE_PRESETS)}), a .gguf file nor a local model directory"
    )


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
