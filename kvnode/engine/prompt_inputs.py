"""The prompts `LLM.generate` takes, as vLLM's LLM takes them.

One prompt is a string, a list of token ids, or a dict: vLLM's TextPrompt
``{"prompt": str}`` or TokensPrompt ``{"prompt_token_ids": [int, ...]}`` (which may carry the
text as ``"prompt"`` too), either with an optional ``"cache_salt"``. ``prompts`` is one of
those or a list of them, mixed freely. Multimodal keys are refused by name (PageKV serves
text-only models); any other key is refused, so that a dict is never read as text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TEXT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
MULTIMODAL_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})


@dataclass(slots=True)
class PromptInput:
    token_ids: list[int] | None  # None: tokenize `text`
    text: str | None
    cache_salt: str | None = None


def _is_token_list(x: object) -> bool:
    return isinstance(x, list | tuple) and bool(x) and all(type(t) is int for t in x)


def parse_prompt(prompt: Any, where: str = "prompt") -> PromptInput:
    """One prompt; a ValueError or TypeError that names what is wrong with it (at `where`)."""
    if isinstance(prompt, str):
        return PromptInput(None, prompt)
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt, where)
    if isinstance(prompt, list | tuple):
        if not _is_token_list(prompt):
            raise TypeError(f"{where} must be a non-empty list of int token ids")
        return PromptInput(list(prompt), None)
    raise TypeError(f"{where} is a {type(prompt).__name__}: a prompt is a str, a list of "
                    "token ids, or a dict with 'prompt' or 'prompt_token_ids'")


def _parse_dict(prompt: Mapping[Any, Any], where: str) -> PromptInput:
    mm = sorted(str(k) for k in prompt if k in MULTIMODAL_KEYS)
    if mm:
        raise ValueError(f"{where}: {', '.join(mm)} is not supported: PageKV serves text-only "
                         "models")
    unknown = sorted(repr(k) for k in prompt if k not in TEXT_KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {', '.join(unknown)}: a prompt dict "
                         "takes 'prompt' (text) or 'prompt_token_ids', and 'cache_salt'")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"{where}['prompt'] must be a str")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"{where}['cache_salt'] must be a str")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not _is_token_list(ids):
            raise TypeError(f"{where}['prompt_token_ids'] must be a non-empty list of int "
                            "token ids")
        return PromptInput(list(ids), text, salt)
    if text is None:
        raise ValueError(f"{where} needs 'prompt' (text) or 'prompt_token_ids'")
    return PromptInput(None, text, salt)


def parse_prompts(prompts: Any) -> list[PromptInput]:
    """`prompts`: one prompt or a list of them (a list of ints is one prompt of token ids)."""
    if isinstance(prompts, str | Mapping) or _is_token_list(prompts):
        return [parse_prompt(prompts)]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts is a {type(prompts).__name__}: pass a prompt or a list of "
                        "prompts")
    return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
