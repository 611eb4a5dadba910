"""vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info) on a pod and on the
router (which answers with its own tokenizer), real HTTP: the ids are the ones a generation
with the same prompt is served with (the byte tokenizer of the contract cluster, and the real
chat model's BPE and chat template), vLLM's request and reply fields, refusals naming the
field; the chat completion's echo of the last message."""

from __future__ import annotations

import json

import openai
import pytest

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.proto.model_files import prompt_tokenizer
from tests.integration.contract_fixtures import MAX_MODEL_LEN
from tests.integration.openai_fixtures import (
    CHAT_MODEL,
    MODEL,
    HttpTarget,
    complete,
    error_of,
)

pytestmark = pytest.mark.integration

TEXT = "Tokens, as the server counts them: é and 日本."
CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "The colour of the sky?"}]


def post(base: str, path: str, body: object) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, error_of(exc.read())


def root(target: HttpTarget) -> str:
    return target.base_url.removesuffix("/v1")


def test_tokenize_gives_the_ids_a_generation_is_served_with(http_target: HttpTarget) -> None:
    base = root(http_target)
    status, out = post(base, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert status == 200, out
    want = [256, *TEXT.encode()]  # the byte tokenizer: BOS, then the UTF-8 bytes
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["token_strs"] is None
    # The router has no model of its own: no context length to report.
    assert out["max_model_len"] == (MAX_MODEL_LEN if http_target.name == "pod" else None)
    gen = complete(http_target.client(), model=MODEL, prompt=TEXT, max_tokens=1)
    assert gen.usage.prompt_tokens == out["count"]
    status, bare = post(base, "/tokenize", {"prompt": TEXT, "add_special_tokens": False,
                                            "return_token_strs": True})
    assert bare["tokens"] == want[1:]
    assert bare["token_strs"][:3] == ["T", "o", "k"]
    assert "\ufffd" in bare["token_strs"]  # a byte of a multi-byte character, alone
    status, back = post(base, "/detokenize", {"tokens": want})
    assert status == 200 and back == {"prompt": "<s>" + TEXT}  # special tokens kept


def test_tokenizer_routes_refuse_by_field(http_target: HttpTarget) -> None:
    base = root(http_target)
    for path, body, param in (
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": [1, 2]}, "prompt"),
            ("/tokenize", {"messages": []}, "messages"),
            ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
            ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                           "chat_template": "{{ x }}"}, "chat_template"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
            ("/detokenize", {"tokens": [1, 258]}, "tokens"),  # outside the vocabulary
            ("/detokenize", {"tokens": [-1]}, "tokens")):
        status, err = post(base, path, body)
        assert status == 400 and err["param"] == param, (path, body, err)
    status, err = post(base, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and err["code"] == "model_not_found"
    # The byte tokenizer has no chat template: a 400 that says so.
    status, err = post(base, "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and "chat template" in err["message"]


def test_tokenizer_info_is_what_lm_eval_reads(http_target: HttpTarget) -> None:
    import urllib.request

    with urllib.request.urlopen(root(http_target) + "/tokenizer_info", timeout=30) as resp:
        info = json.loads(resp.read())
    assert info["tokenizer_class"] == "ByteTokenizer" and info["vocab_size"] == 258
    assert (info["bos_token"], info["eos_token"]) == ("<s>", "</s>")
    assert "chat_template" not in info  # the byte tokenizer has none


# -- the real chat model: BPE, special tokens, the chat template ------------------------------

@pytest.fixture(params=["pod", "router"])
def chat_base(request: pytest.FixtureRequest, chat_cluster: LocalCluster) -> str:
    child = chat_cluster.pods[0] if request.param == "pod" else chat_cluster.router
    return f"http://127.0.0.1:{child.http_port}"


def test_a_conversation_tokenizes_as_the_chat_route_serves_it(chat_base: str) -> None:
    client = openai.OpenAI(base_url=chat_base + "/v1", api_key="unused", max_retries=0)
    status, out = post(chat_base, "/tokenize", {"messages": CHAT})
    assert status == 200, out
    chat = client.chat.completions.create(model=CHAT_MODEL, messages=CHAT, max_tokens=6,
                                          temperature=0)
    assert chat.usage.prompt_tokens == out["count"]
    # The ids as a completion's prompt: the very answer of the chat route.
    same = client.completions.create(model=CHAT_MODEL, prompt=out["tokens"], max_tokens=6,
                                     temperature=0)
    assert same.choices[0].text == chat.choices[0].message.content
    tok = prompt_tokenizer(CHAT_MODEL)
    status, text = post(chat_base, "/detokenize", {"tokens": out["tokens"]})
    assert text["prompt"].startswith("<|im_start|>system\nYou answer in one word.<|im_end|>")
    assert tok.encode(text["prompt"], add_bos=False) == out["tokens"]
    status, plain = post(chat_base, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert plain["tokens"] == tok.encode(TEXT)
    ascii_text = "Tokens, as the server counts them."
    status, plain = post(chat_base, "/tokenize", {"prompt": ascii_text,
                                                  "return_token_strs": True})
    assert plain["token_strs"][:2] == ["To", "kens"] and "".join(plain["token_strs"]) == \
        ascii_text
    # A special token's text is that token (lm-evaluation-harness finds EOS's id this way).
    status, eos = post(chat_base, "/tokenize", {"prompt": tok.eos_token,
                                                "add_special_tokens": False})
    assert eos["tokens"] == [tok.eos_token_id]


def test_chat_echo_prepends_the_last_assistant_message(chat_base: str) -> None:
    """vLLM's chat echo: a conversation ending in the assistant's words continues them
    (add_generation_prompt false), and the answer comes back with them in front."""
    client = openai.OpenAI(base_url=chat_base + "/v1", api_key="unused", max_retries=0)
    start = "The sky is"
    conv = [*CHAT, {"role": "assistant", "content": start}]
    kw: dict = dict(model=CHAT_MODEL, messages=conv, max_tokens=4, temperature=0)
    cont = {"add_generation_prompt": False}
    plain = client.chat.completions.create(**kw, extra_body=cont)
    echoed = client.chat.completions.create(**kw, extra_body={**cont, "echo": True})
    assert echoed.choices[0].message.content == start + plain.choices[0].message.content
    deltas = [c.choices[0].delta.content for c in client.chat.completions.create(
        **kw, stream=True, extra_body={**cont, "echo": True}) if c.choices]
    assert deltas[0].startswith(start) and "".join(deltas) == echoed.choices[0].message.content
    # The user's turn last, a generation prompt after it: nothing of it is echoed.
    asked = client.chat.completions.create(model=CHAT_MODEL, messages=CHAT, max_tokens=4,
                                           temperature=0, extra_body={"echo": True})
    alone = client.chat.completions.create(model=CHAT_MODEL, messages=CHAT, max_tokens=4,
                                           temperature=0)
    assert asked.choices[0].message.content == alone.choices[0].message.content


def test_fuzzed_tokenizer_bodies_get_4xx_with_a_reason(http_target: HttpTarget) -> None:
    import random

    rng = random.Random(26)
    values = [None, True, -1, 0, 2**70, 1e308, "", "x" * 300, [], {}, [None], [[1, 2]],
              [{"role": "user"}], [{"role": "user", "content": 5}], {"a": []}, [2**40]]
    fields = ["prompt", "messages", "tokens", "add_special_tokens", "return_token_strs",
              "add_generation_prompt", "chat_template_kwargs"]
    seen = set()
    for _ in range(60):
        body = {name: rng.choice(values) for name in rng.sample(fields, rng.randint(1, 3))}
        for path in ("/tokenize", "/detokenize"):
            status, out = post(root(http_target), path, body)  # an error: error_of checked
            assert status in (200, 400), (path, body, out)
            seen.add(status)
    assert seen == {200, 400}, seen  # both outcomes drawn: the pass is not vacuous
