"""The tokenizer a GGUF file describes, rebuilt with the ``tokenizers`` library.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary under llama.cpp's keys
(``tokenizer.ggml.*``). Byte-level BPE (``tokenizer.ggml.model == "gpt2"``, the GPT-2 /
SmolLM / Qwen family) is rebuilt here: the tokens (already in GPT-2's byte-to-unicode
spelling), the merges, the control tokens (token type 3) as special tokens that are never split,
user-defined ones (type 4) as plain added tokens, and a BOS in front when
``tokenizer.ggml.add_bos_token`` says so.

How text is split before BPE is named by ``tokenizer.ggml.pre``, llama.cpp's pre-tokenizer
id. Only the splits reproduced exactly are accepted: a wrong split silently yields different
token ids, so an unknown one is refused. ``smollm`` isolates every digit first, as SmolLM2's
own ``tokenizer.json`` does (``Digits(individual_digits=True)`` then byte-level); transformers'
GGUF reader falls back on plain GPT-2 splitting there, which differs on a whitespace run before
a digit (tests/unit/test_gguf_tokenizer.py shows the case).
"""

from __future__ import annotations

from typing import Any

from pagekv.proto.model_files.errors import ModelLoadError
from pagekv.proto.model_files.tokenizer import HFTokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
SUPPORTED_MODELS = ("gpt2",)
SUPPORTED_PRE = ("default", "gpt2", "smollm")
# The end-of-turn markers of the common chat templates: when the file's template writes one,
# generation stops there too (the file's eos may be another token, e.g. <|endoftext|>).
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre == "smollm":
        digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        return pre_tokenizers.Sequence([digits, byte_level])
    return byte_level


def _token_id(meta: dict[str, Any], key: str, n_tokens: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n_tokens:
        raise ModelLoadError(f"tokenizer.ggml.{key}={value!r} is not a token id in [0, {n_tokens})")
    return value


def _merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    raw = meta.get("tokenizer.ggml.merges")
    if not isinstance(raw, list):
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.merges, which BPE needs")
    pairs = []
    for i, merge in enumerate(raw):
        parts = merge.split(" ") if isinstance(merge, str) else ()
        if len(parts) != 2:
            raise ModelLoadError(f"tokenizer.ggml.merges[{i}]={merge!r} is not two tokens")
        pairs.append((parts[0], parts[1]))
    return pairs


def end_of_turn_ids(meta: dict[str, Any], tokens: list[str]) -> list[int]:
    """The ids that end generation: eos, the file's eot/eom ids, and the end-of-turn marker
    tokens its chat template writes."""
    ids = [i for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (i := _token_id(meta, key, len(tokens))) is not None]
    template = meta.get("tokenizer.chat_template") or ""
    index = {t: i for i, t in enumerate(tokens) if t in END_OF_TURN_MARKERS}
    ids += [index[m] for m in END_OF_TURN_MARKERS if m in template and m in index]
    return list(dict.fromkeys(ids))


def gguf_tokenizer(meta: dict[str, Any]) -> HFTokenizer:
    """The file's tokenizer; ModelLoadError naming the key that is missing or unsupported."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise ModelLoadError(
            f"unsupported tokenizer.ggml.model={model!r} in the GGUF metadata; supported: "
            f"{', '.join(SUPPORTED_MODELS)} (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE:
        raise ModelLoadError(
            f"unsupported tokenizer.ggml.pre={pre!r} (how text is split before BPE); "
            f"supported: {', '.join(SUPPORTED_PRE)}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens list of strings")
    types = meta.get("tokenizer.ggml.token_type") or []
    if types and len(types) != len(tokens):
        raise ModelLoadError(f"tokenizer.ggml.token_type has {len(types)} entries for "
                             f"{len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(meta), fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre, bool(meta.get("tokenizer.ggml.add_space_prefix")))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=False) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED])
    bos = _token_id(meta, "bos_token_id", len(tokens))
    eos = _token_id(meta, "eos_token_id", len(tokens))
    pieces = ["$A"]
    specials = []
    for flag, tid, at_end in (("add_bos_token", bos, False), ("add_eos_token", eos, True)):
        if meta.get(f"tokenizer.ggml.{flag}"):
            if tid is None:
                raise ModelLoadError(f"tokenizer.ggml.{flag} is set but the file names no id")
            pieces.insert(len(pieces) if at_end else 0, tokens[tid])
            specials.append((tokens[tid], tid))
    if specials:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(pieces), special_tokens=list(dict.fromkeys(specials)))
    chat_template = meta.get("tokenizer.chat_template")
    return HFTokenizer(tok, bos_token_id=bos, eos_token_id=eos,
                       chat_template=chat_template if isinstance(chat_template, str) else None)
