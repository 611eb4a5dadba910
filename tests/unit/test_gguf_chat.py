"""Chat templates: rendered like transformers' apply_chat_template (sandboxed jinja2, trim and
lstrip blocks, the template's own variables), clear errors, and LLM.chat on a tiny GGUF
model."""

from __future__ import annotations

import pytest

from pagekv.kvnode.model import ByteTokenizer
from pagekv.proto.model_files.chat import ChatTemplateError, apply_chat_template, render_chat

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
# Uses bos_token, eos_token, loop controls, tojson, and block trimming.
TEMPLATE = """{{ bos_token }}
{% for m in messages %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
  [{{ m['role'] | upper }}] {{ m['content'] | tojson }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""


def test_template_variables_and_whitespace_control():
    text = render_chat(TEMPLATE, CONV, bos_token="<s>", eos_token="</s>")
    # A newline after a block tag is dropped, and the indent before one; not around {{ }}.
    assert text == '<s>\n  [USER] "Hi"\n  [ASSISTANT] "Hello."</s>\n  [USER] "Bye"\n[ASSISTANT]'
    assert not render_chat(TEMPLATE, CONV, add_generation_prompt=False).endswith("[ASSISTANT]")


def test_transformers_renders_the_same():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, "[UNK]")),
        bos_token="<s>", eos_token="</s>")
    for gen in (True, False):
        ref = tok.apply_chat_template(CONV, chat_template=TEMPLATE, tokenize=False,
                                      add_generation_prompt=gen)
        assert render_chat(TEMPLATE, CONV, add_generation_prompt=gen, bos_token="<s>",
                           eos_token="</s>") == ref


def test_extra_keywords_reach_the_template():
    assert render_chat("{{ greeting }} {{ messages | length }}", CONV, greeting="hey") == "hey 4"


@pytest.mark.parametrize("template, match", [
    ("{{ ''.__class__.__mro__ }}", "failed: access to attribute '__class__'"),
    ("{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}",
     "refused the conversation: one message only"),
    ("{% for m in messages %}", "does not parse"),
])
def test_unsafe_or_failing_templates_are_clear_errors(template, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(template, CONV)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\]\['content'\] must be a string"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] is a str"),
])
def test_malformed_messages(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(TEMPLATE, messages)


def test_a_model_without_template():
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        apply_chat_template(ByteTokenizer(), CONV)
    assert apply_chat_template(ByteTokenizer(), CONV, chat_template="{{ bos_token }}") == "<s>"


def test_llm_chat_renders_each_conversation(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from pagekv.kvnode.engine.llm import LLM
    from pagekv.kvnode.engine.sampling_params import SamplingParams
    from tests.unit.gguf_fixtures import CHAT_TEMPLATE, write_tiny_llama

    _, path = write_tiny_llama(tmp_path / "t.gguf")
    llm = LLM(str(path), num_gpu_blocks=32, max_model_len=128, max_num_batched_tokens=128)
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    convs = [[{"role": "user", "content": "the world"}],
             [{"role": "system", "content": "in order"}, {"role": "user", "content": "he"}]]
    outs = llm.chat(convs, p)
    for conv, out in zip(convs, outs, strict=True):
        # The template writes its own special tokens: no BOS added in front.
        assert out.prompt_token_ids == llm.tokenizer.encode(render_chat(CHAT_TEMPLATE, conv),
                                                            add_bos=False)
        assert len(out.outputs[0].token_ids) == 3
    one = llm.chat(convs[0], p)  # a single conversation, not a list of them
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    custom = llm.chat(convs[0], p, chat_template="{{ messages[0]['content'] }}",
                      add_generation_prompt=False)
    assert custom[0].prompt_token_ids == llm.tokenizer.encode("the world", add_bos=False)


def test_llm_chat_on_a_model_without_template():
    from pagekv.kvnode.engine.llm import LLM

    llm = LLM("pagekv-tiny", num_gpu_blocks=16, max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        llm.chat(CONV)


def test_a_model_directorys_template(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json, whose chat_template is a string
    or a list of named templates (the "default" one is used)."""
    import json

    from pagekv.proto.model_files import chat_template_of

    assert chat_template_of(tmp_path) is None
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ 'plain' }}"}))
    assert chat_template_of(tmp_path) == "{{ 'plain' }}"
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "t"},
                                                    {"name": "default", "template": "d"}]}))
    assert chat_template_of(tmp_path) == "d"
    (tmp_path / "chat_template.jinja").write_text("j")
    assert chat_template_of(tmp_path) == "j"
