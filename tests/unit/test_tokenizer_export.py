"""`pagekv export-tokenizer MODEL DIR`, run as a user runs it (the real CLI in a subprocess),
then loaded by transformers' AutoTokenizer and compared with the tokenizer PageKV's pods use for
MODEL: encode (with and without special tokens), decode (skipping them or not) and chat
templates, on the real SmolLM2 GGUF, the byte tokenizer of the built-in presets and checkpoint
directories with their own tokenizer.json (byte-level BPE and SentencePiece-style)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from pagekv.kvnode.model.loader import load_tokenizer  # noqa: E402
from pagekv.proto.model_files.chat import ChatTemplateError, apply_chat_template  # noqa: E402
from tests.unit.smollm2_reference import PRESET, conversations, smollm2_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello world",
    "The capital of France is Paris. It has 2,148,271 inhabitants (2020).",
    "  leading, trailing and   inner   spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "    12345   678 9",  # a whitespace run before digits: SmolLM2 splits every digit
    "héllo wörld, naïve café, Ærøskøbing",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🎉👩‍👩‍👧‍👦🇫🇷 and a zero-width joiner\u200d here",
    "combining e\u0301 and o\u0308, RTL שלום عربى, nbsp\u00a0and\u3000ideographic space",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<s>not a BOS</s> <|endoftext|> <repo_name> <unk>",
    "def f(x):\n    return x ** 2  # code\n",
    "",
    " ",
    "a",
]
CHATS = [*conversations(), [{"role": "user", "content": "Say <|im_end|> and é 日本 🎉"}]]


def random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x590, 0x6FF), (0x3040, 0x30FF),
              (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x1F300, 0x1F64F), (0x2000, 0x206F),
              (0x300, 0x36F), (0x0, 0x1F)]
    return ["".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 80)))
            for _ in range(n)]


def export(model: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pagekv", "export-tokenizer", model, str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def exported(model: str, out: Path):
    done = export(model, out)
    assert done.returncode == 0, done.stderr
    assert str(out) in done.stdout
    return transformers.AutoTokenizer.from_pretrained(str(out))


def byte_level_checkpoint(path: Path) -> None:
    """A Llama-3-style checkpoint: byte-level BPE trained here, BOS added by the
    post-processor, a template that writes bos_token and eos_token, ids from config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*TEXTS, *random_texts(1, 200)] * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    save_checkpoint(path, tok, bos=0, eos=[4, 1])
    template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
                "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                "\n\n{% else %}{{ eos_token }}{% endif %}")
    # PageKV reads chat_template.jinja before tokenizer_config.json, as transformers does.
    (path / "chat_template.jinja").write_text(template)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "chat_template": "{{ 'not this one' }}"}))


def sentencepiece_style_checkpoint(path: Path) -> None:
    """A Llama-2 / Mistral-style tokenizer.json: Metaspace, byte fallback, <s> in front."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>",
                                                                  *bytes_])
    tok.train_from_iterator([t for t in TEXTS if t.isascii()] * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    save_checkpoint(path, tok, bos=1, eos=2)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
        "{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}")}))


def save_checkpoint(path: Path, tok, bos: int, eos) -> None:
    """A tiny random Llama saved as transformers saves it (config.json, model.safetensors)."""
    import torch

    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=512, bos_token_id=bos,
                                   eos_token_id=eos)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    """model -> (PageKV's tokenizer as the pod loads it, transformers' from the export)."""
    root = tmp_path_factory.mktemp("export")
    models = {"pagekv-tiny": "pagekv-tiny", "pagekv-small": "pagekv-small"}
    for name, build in (("byte-level-dir", byte_level_checkpoint),
                        ("sentencepiece-dir", sentencepiece_style_checkpoint)):
        (root / name).mkdir()
        build(root / name)
        models[name] = str(root / name)
    out = {}
    for name, model in models.items():
        out[name] = (load_tokenizer(model), exported(model, root / "out" / name))
    return out


def ids_of(encoding) -> list[int]:  # transformers 5 returns a BatchEncoding from chat templates
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


def check_same(ours, theirs, texts: list[str], vocab: int, seed: int) -> None:
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_bos=special)
            assert theirs.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert (theirs.decode(ids, skip_special_tokens=skip)
                        == ours.decode(ids, skip_special_tokens=skip)), (text, skip)
    rng = random.Random(seed)  # id streams no text makes: cut characters, specials inside
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            assert (theirs.decode(ids, skip_special_tokens=skip)
                    == ours.decode(ids, skip_special_tokens=skip)), (ids, skip)


def check_chats(ours, theirs) -> None:
    for chat in CHATS:
        for gen in (True, False):
            text = apply_chat_template(ours, chat, add_generation_prompt=gen)
            assert theirs.apply_chat_template(chat, tokenize=False,
                                              add_generation_prompt=gen) == text
            # PageKV tokenizes a rendered chat without adding BOS, as transformers does.
            assert ids_of(theirs.apply_chat_template(chat, add_generation_prompt=gen)) \
                == ours.encode(text, add_bos=False)


def test_the_smollm2_gguf_tokenizes_and_chats_like_pagekv(tmp_path: Path) -> None:
    smollm2_file()
    theirs = exported(PRESET, tmp_path / "smollm2")
    ours = load_tokenizer(PRESET)
    check_same(ours, theirs, TEXTS + random_texts(7, 60), ours.vocab_size, seed=3)
    check_chats(ours, theirs)
    assert (theirs.bos_token, theirs.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert theirs.model_max_length == 8192  # the file's llama.context_length


@pytest.mark.parametrize("name", ["byte-level-dir", "sentencepiece-dir"])
def test_a_checkpoint_directory_tokenizes_and_chats_like_its_pod(exports, name: str) -> None:
    ours, theirs = exports[name]
    texts = TEXTS + random_texts(11, 60) if name == "byte-level-dir" else \
        [t for t in TEXTS if t.isascii()] + ["ünïcödé by byte fallback 🎉"]
    check_same(ours, theirs, texts, ours.vocab_size, seed=5)
    check_chats(ours, theirs)
    assert theirs.bos_token == ours.bos_token and theirs.eos_token == ours.eos_token
    assert theirs.model_max_length == 512


@pytest.mark.parametrize("name", ["pagekv-tiny", "pagekv-small"])
def test_the_byte_tokenizer_is_exported_as_an_equal_byte_level_bpe(exports, name: str) -> None:
    ours, theirs = exports[name]
    check_same(ours, theirs, TEXTS + random_texts(13, 100), ours.vocab_size, seed=9)
    rng = random.Random(17)  # raw bytes: invalid UTF-8 decodes to the same U+FFFD runs
    for _ in range(200):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        assert theirs.decode(ids) == ours.decode(ids)
    assert theirs.encode("<s>x</s>") == [256, *b"<s>x</s>"]  # text, not special tokens
    # No chat template on either side: both refuse rather than invent one.
    with pytest.raises(ChatTemplateError):
        apply_chat_template(ours, CHATS[0])
    with pytest.raises(ValueError):
        theirs.apply_chat_template(CHATS[0], tokenize=False)


def test_the_byte_presets_named_here_are_the_pods(exports) -> None:
    from pagekv.kvnode.model.presets import PRESETS
    from pagekv.proto.model_files.tokenizer_export import BYTE_PRESET_CONTEXT

    assert BYTE_PRESET_CONTEXT == {n: c.max_position_embeddings for n, (c, _) in PRESETS.items()}
    assert exports["pagekv-tiny"][1].model_max_length == 4096


def one_error_line(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("pagekv export-tokenizer: error: ") and says in lines[0], lines


def test_a_non_empty_directory_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "tok"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    one_error_line(export("pagekv-tiny", out), "is not empty")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    (out / "mine.txt").unlink()  # an empty one is fine
    assert export("pagekv-tiny", out).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("model, says", [
    ("pagekv-tinny", "unknown built-in preset 'pagekv-tinny'"),
    ("no-such-model", "unknown model 'no-such-model'"),
    ("missing.gguf", "does not exist"),
])
def test_an_unknown_model_is_one_line(tmp_path: Path, model: str, says: str) -> None:
    one_error_line(export(model, tmp_path / "tok"), says)
    assert not (tmp_path / "tok").exists()


def test_a_directory_without_a_tokenizer_or_with_a_broken_one_is_one_line(
        tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    one_error_line(export(str(model), tmp_path / "a"), "has no tokenizer.json")
    (model / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    one_error_line(export(str(model), tmp_path / "b"), "tokenizer.json does not load")
    (model / "config.json").write_text("{not json")
    one_error_line(export(str(model), tmp_path / "c"), "config.json does not read as JSON")


def test_an_unwritable_place_is_one_line_and_leaves_nothing_behind(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    one_error_line(export("pagekv-tiny", tmp_path / "file"), "exists and is not a directory")
    one_error_line(export("pagekv-tiny", tmp_path / "file" / "tok"), "is a file, not a directory")
    # /proc takes no new directories, even for root (who may write anywhere else).
    one_error_line(export("pagekv-tiny", Path("/proc/pagekv-tokenizer")), "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("build", [byte_level_checkpoint, sentencepiece_style_checkpoint])
def test_the_routers_tokenizer_renders_a_checkpoints_chat_as_its_pod(tmp_path: Path,
                                                                     build) -> None:
    """The router tokenizes chat with prompt_tokenizer (no torch); it read a directory without
    config.json's BOS/EOS, so a template's {{ bos_token }} rendered empty there and the router
    hashed (and sent) other ids than the pod would have made."""
    from pagekv.proto.model_files import prompt_tokenizer
    from pagekv.proto.model_files.chat import apply_chat_template

    build(tmp_path)
    pod, router = load_tokenizer(str(tmp_path)), prompt_tokenizer(str(tmp_path))
    assert (router.bos_token, router.eos_token) == (pod.bos_token, pod.eos_token)
    assert pod.bos_token is not None
    for prompt in (True, False):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        assert (apply_chat_template(router, messages, add_generation_prompt=prompt)
                == apply_chat_template(pod, messages, add_generation_prompt=prompt))


@pytest.mark.parametrize("config, ids", [
    ({"architectures": ["LlamaForCausalLM"]}, (1, 2)),  # left out: the class's defaults
    ({"model_type": "mistral"}, (1, 2)),
    ({"architectures": ["Qwen2ForCausalLM"], "eos_token_id": 7}, (None, 7)),
    ({"architectures": ["LlamaForCausalLM"], "bos_token_id": None, "eos_token_id": [9, 3]},
     (None, 9)),  # null is none; the first of several EOS ids is the tokenizer's
    ({"bos_token_id": True, "eos_token_id": "2"}, (None, None)),  # not ids
])
def test_special_ids_are_read_as_the_pods_loader_reads_them(config, ids) -> None:
    from pagekv.kvnode.model.config import HF_DEFAULTS
    from pagekv.proto.model_files import DEFAULT_SPECIAL_IDS, special_token_ids

    assert special_token_ids(config) == ids
    assert DEFAULT_SPECIAL_IDS == {arch: (d["bos_token_id"], d["eos_token_id"])
                                   for arch, d in HF_DEFAULTS.items()}
