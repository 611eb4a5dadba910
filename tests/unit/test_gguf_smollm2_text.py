"""SmolLM2's tokenizer and chat template as PageKV rebuilds them from the GGUF metadata,
against transformers loading the same file: token ids for a few hundred varied strings, and
the rendered template for multi-turn conversations."""

from __future__ import annotations

import random

import pytest

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.workload

from pagekv.proto.model_files.chat import apply_chat_template  # noqa: E402
from pagekv.proto.model_files.gguf import GGUFFile  # noqa: E402
from pagekv.proto.model_files.gguf_tokenizer import gguf_tokenizer  # noqa: E402
from tests.unit.smollm2_reference import (  # noqa: E402
    SYSTEM,
    conversations,
    hf_tokenizer,
    smollm2_file,
)

HANDWRITTEN = [
    "Hello, world!", "hello world", "HELLO WORLD", " leading space", "trailing space ",
    "  two leading", "a  b   c    d", "tabs\tand\t\ttabs", "line\nbreaks\n\n\nhere", "\r\n\r\n",
    "\u00a0non-breaking\u00a0space", "ideographic\u3000space", "zero\u200bwidth", "",
    " ", "\n", "naïve café résumé", "Ünïcödé ÀÉÎÕÜ", "日本語のテキストです。", "中文测试，标点！",
    "한국어 문장", "Русский текст", "العربية من اليمين", "हिन्दी वाक्य", "emoji 🎉🚀 👨‍👩‍👧",
    "e\u0301 combining", "don't I'M we'll they've she'd it's", "3.14159 and 1,000,000",
    "2nd 3rd 21st", "½ ² ³ Ⅻ ٣", "123456789", "version 1.2.3-rc4", "x=1;y=22;z=333",
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, {"nested": null}], "ok": true}', "$ ls -la | grep '^d' > out.txt",
    "https://example.com/path?q=1&r=two#frag", "user.name+tag@example.org",
    "# Title\n\n- item one\n- item two\n\n**bold** _it_ `code`",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nBe brief.<|im_end|>", "text<|im_end|>more<|endoftext|>",
    "<|im_start", "im_start|>", "<|unknown|>", "<repo_name>pagekv<file_sep>x.py",
    "a  1", "x\n\n2", "tab\t\t3 items", "  42", "\u3000\u30007",
]
FRAGMENTS = [
    "the", "The", "quick", "brown fox", "jumps", "ÜBER", "naïve", "東京", "😀", "42", "3.5",
    "2024", "x", "(", ")", "{", "}", "::", "->", "==", "'s", "n't", "<|im_start|>", "<|im_end|>",
    "assistant", "user", "def", "return", "import numpy as np", "€100", "¿Qué?", "ok!", "...",
]
SEPARATORS = ["", " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "\u00a0"]


def varied_strings(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = list(HANDWRITTEN)
    while len(out) < n:
        pieces = [rng.choice(FRAGMENTS) for _ in range(rng.randint(2, 6))]
        text = pieces[0]
        for p in pieces[1:]:
            text += rng.choice(SEPARATORS) + p
        out.append(rng.choice(["", " ", "\n"]) + text + rng.choice(["", " ", "\n", "  "]))
    return out


@pytest.fixture(scope="module")
def toks():
    path = smollm2_file()
    with GGUFFile(path) as f:
        ours = gguf_tokenizer(f.metadata)
    return ours, hf_tokenizer(path)


def _tokenizer_json_split(hf):
    """transformers' tokenizer with the split SmolLM2's own tokenizer.json declares (every
    digit apart, then byte-level), which llama.cpp's "smollm" pre-tokenizer reproduces."""
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tok


def _splits_differ(hf, split, text: str) -> bool:
    """Whether GPT-2's split (transformers') and the digit-first split cut ``text`` apart
    differently: a whitespace run before a digit, a space before a non-ASCII one ("²")."""
    def cut(pre):
        return [piece for piece, _ in pre.pre_tokenize_str(text)]

    return cut(hf.backend_tokenizer.pre_tokenizer) != cut(split.pre_tokenizer)


def test_token_ids_equal_transformers(toks):
    ours, hf = toks
    split = _tokenizer_json_split(hf)
    strings = varied_strings()
    assert len(strings) >= 300
    diverging = 0
    for s in strings:
        ids = ours.encode(s)
        assert ids == split.encode(s).ids, repr(s)
        if _splits_differ(hf, split, s):
            diverging += 1
        else:
            assert ids == hf(s).input_ids, repr(s)
        assert ours.decode(ids, skip_special_tokens=False) == s
    assert 0 < diverging < len(strings) // 2  # both kinds were checked


def test_whitespace_run_before_a_digit_splits_like_the_models_own_tokenizer(toks):
    """transformers' GGUF reader does not know llama.cpp's "smollm" split and falls back on
    GPT-2's, which cuts "a  1" as a|Ġ|Ġ1; SmolLM2 was trained on a|ĠĠ|1."""
    ours, hf = toks
    ids = ours.encode("a  1")
    assert [ours._tok.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1"]
    assert [hf.convert_ids_to_tokens(i) for i in hf("a  1").input_ids] == ["a", "Ġ", "Ġ", "1"]


def test_special_tokens_and_bos(toks):
    ours, hf = toks
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token) == ("<|im_start|>",
                                                                                 "<|im_end|>")
    assert ours.vocab_size == len(hf) == 49152
    # add_bos_token is false in this file: no BOS either way, as in transformers.
    assert ours.encode("hi", add_bos=True) == ours.encode("hi", add_bos=False) == hf("hi").input_ids
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_chat_template_equals_transformers(toks):
    ours, hf = toks
    convs = conversations() + [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi  there 42 times"},
         {"role": "assistant", "content": "Hello!\n\nHow can I help?"},
         {"role": "user", "content": "日本語で答えて"}],
    ]
    for conv in convs:
        for gen in (True, False):
            text = apply_chat_template(ours, conv, add_generation_prompt=gen)
            ref = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert text == ref
            assert ours.encode(text, add_bos=False) == hf(ref, add_special_tokens=False).input_ids
    # The template adds SmolLM's own system prompt when the conversation has none.
    text = apply_chat_template(ours, convs[3])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
