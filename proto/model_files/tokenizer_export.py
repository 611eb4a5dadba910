"""`pagekv export-tokenizer MODEL DIR`: a model's tokenizer as a directory that transformers'
``AutoTokenizer.from_pretrained(DIR)`` loads (what guidellm, aiperf and genai-perf ask for),
encoding, decoding and rendering chat exactly as PageKV's own tokenizer for MODEL does.

What is written, by the kind of model (the same dispatch as ``prompt_tokenizer``):

- a GGUF file, or a file preset such as ``smollm2-135m-instruct``: the tokenizer PageKV rebuilds
  from the file's vocabulary (gguf_tokenizer) serialized as ``tokenizer.json``; BOS, EOS, chat
  template and context length from the file's metadata.
- a model directory (a safetensors checkpoint): its ``tokenizer.json`` copied byte for byte; BOS
  and EOS from ``config.json``, as the pod's loader reads them; the chat template PageKV finds
  there (``chat_template.jinja`` or ``tokenizer_config.json``).
- a built-in preset (``pagekv-tiny``...): the byte tokenizer as an equivalent byte-level BPE with
  no merges, so every UTF-8 byte is its own token (ids 0..255), ``<s>`` (256) in front and
  ``</s>`` (257) special. ``split_special_tokens`` makes transformers encode the text ``<s>`` as
  its three bytes, as PageKV does. No chat template: PageKV has none for these presets either.

``tokenizer_config.json`` names ``PreTrainedTokenizerFast``, so transformers loads
``tokenizer.json`` as written instead of rebuilding it through a model-specific class
(``GPT2Tokenizer`` would drop SmolLM2's digit split), and turns ``clean_up_tokenization_spaces``
off (PageKV decodes without that clean-up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from pagekv.proto.command_line import CliError
from pagekv.proto.model_files import directory_tokenizer, special_token_ids
from pagekv.proto.model_files.errors import ModelLoadError
from pagekv.proto.model_files.presets import BUILTIN_PREFIX, FILE_PRESETS, model_path
from pagekv.proto.model_files.tokenizer import ByteTokenizer, Tokenizer

# The built-in presets and their context length (kvnode.model.presets.PRESETS is the
# registry; it imports torch, and tests/unit/test_tokenizer_export.py keeps the two equal).
BYTE_PRESET_CONTEXT = {"pagekv-tiny": 4096, "pagekv-small": 4096}
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def gpt2_byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode map, as a list indexed by byte: printable Latin-1 bytes stand
    for themselves, the others are shifted past U+0100 (what ByteLevel pre-tokenizes into)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in chars)
    for n, b in enumerate(shifted):
        chars[b] = chr(256 + n)
    return [chars[b] for b in range(256)]


def byte_tokenizer_json() -> str:
    """ByteTokenizer as a ``tokenizers`` tokenizer: the same ids for every text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in enumerate(gpt2_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges every byte is a token whatever the words are.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = ByteTokenizer().bos_token, ByteTokenizer().eos_token
    assert bos is not None and eos is not None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (bos, eos)])
    if (tok.token_to_id(bos), tok.token_to_id(eos)) != (ByteTokenizer.BOS, ByteTokenizer.EOS):
        raise AssertionError("the byte vocabulary did not give BOS and EOS their ids")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, ByteTokenizer.BOS)])
    return str(tok.to_str())


def tokenizer_config(tokenizer: Tokenizer, max_length: int | None,
                     split_special_tokens: bool = False) -> str:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    if max_length is not None:
        config["model_max_length"] = max_length
    if split_special_tokens:
        config["split_special_tokens"] = True
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"


def _byte_preset_files(name: str) -> dict[str, str]:
    if name not in BYTE_PRESET_CONTEXT:
        raise ModelLoadError(f"unknown built-in preset {name!r}; built-in: "
                             f"{', '.join(BYTE_PRESET_CONTEXT)}")
    return {TOKENIZER_FILE: byte_tokenizer_json(),
            CONFIG_FILE: tokenizer_config(ByteTokenizer(), BYTE_PRESET_CONTEXT[name],
                                          split_special_tokens=True)}


def _gguf_files(path: Path) -> dict[str, str]:
    from pagekv.proto.model_files.gguf import GGUFFile
    from pagekv.proto.model_files.gguf_tokenizer import gguf_tokenizer

    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    with GGUFFile(path) as gguf:
        meta = gguf.metadata
        tokenizer = gguf_tokenizer(meta)
    context = meta.get(f"{meta.get('general.architecture')}.context_length")
    max_length = context if isinstance(context, int) else None
    return {TOKENIZER_FILE: tokenizer.to_json(), CONFIG_FILE: tokenizer_config(tokenizer, max_length)}


def _json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} does not read as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _directory_files(path: Path) -> dict[str, str]:
    config = _json_file(path / "config.json") if (path / "config.json").is_file() else {}
    if not (path / TOKENIZER_FILE).is_file():
        raise ModelLoadError(f"{path} has no {TOKENIZER_FILE} (a Hugging Face fast tokenizer)")
    try:
        tokenizer = directory_tokenizer(path, *special_token_ids(config))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ModelLoadError(f"{path / TOKENIZER_FILE} does not load: {e}") from e
    max_pos = config.get("max_position_embeddings")
    text = tokenizer_config(tokenizer, max_pos if isinstance(max_pos, int) else None)
    return {TOKENIZER_FILE: (path / TOKENIZER_FILE).read_text(encoding="utf-8"), CONFIG_FILE: text}


def tokenizer_files(model: str) -> dict[str, str]:
    """File name -> text of the directory `model`'s tokenizer exports to; ModelLoadError when
    the model is unknown or its files do not say how it tokenizes."""
    if model.startswith(BUILTIN_PREFIX):
        return _byte_preset_files(model)
    path = model_path(model)
    if path.suffix.lower() == ".gguf":
        return _gguf_files(path)
    if path.is_dir():
        return _directory_files(path)
    raise ModelLoadError(
        f"unknown model {model!r}: neither a built-in preset ({', '.join(BYTE_PRESET_CONTEXT)}), "
        f"a file preset ({', '.join(FILE_PRESETS)}), a .gguf file nor a local model directory"
    )


def write_directory(files: dict[str, str], out: Path) -> None:
    """The files in `out`, a new or empty directory, all at once: they are written into a
    sibling first and renamed into place, so a failure leaves no half-written tokenizer."""
    if out.exists() and not out.is_dir():
        raise CliError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise CliError(f"{out} exists and is not empty: export into a new or empty directory")
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():  # mkdir would say "File exists" of a file up the path
        raise CliError(f"cannot write {out}: {above} is a file, not a directory")
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        staging.replace(out)  # POSIX renames a directory onto a missing or empty one
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise CliError(f"cannot write {out}: {e.strerror or e}") from e


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a built-in preset (pagekv-tiny), a file preset "
                        f"({', '.join(FILE_PRESETS)}), a .gguf file or a model directory")
    parser.add_argument("dir", metavar="DIR",
                        help="where to write tokenizer.json and tokenizer_config.json "
                             "(a new or empty directory)")


def main(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    try:
        files = tokenizer_files(args.model)
    except ModelLoadError as e:
        raise CliError(str(e)) from e
    write_directory(files, out)
    print(f"wrote {args.model}'s tokenizer to {out} ({', '.join(files)}); "
          f"load it with AutoTokenizer.from_pretrained({str(out)!r}), "
          f"or give it to guidellm (--tokenizer kind=huggingface_auto,model={out}) "
          f"or aiperf / genai-perf (--tokenizer {out})")
    return 0
