"""The checkpoint shapes real models ship, each written by transformers' ``save_pretrained``
and read back by transformers' ``from_pretrained`` as the reference: our loader + paged model
must give its logits (1e-4, fp32) at every prompt and decode position and its greedy tokens,
with prompts spanning several KV blocks and decodes crossing block boundaries. Here: every
case, the C++ kernel, the offline engine, and checkpoint layouts (sharded, no ``model.``
prefix, a stray safetensors file, a stored head with tied embeddings), and chunked prefill
inside a sliding window. Cases and helpers: model_shapes_cases.py; fixtures: conftest.py.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pagekv.kvnode.model.runner import SeqBatchItem  # noqa: E402
from tests.unit.model_shapes_cases import (  # noqa: E402
    BLOCK,
    CASES,
    PROMPTS,
    STEPS,
    assert_matches_hf,
    reference,
    runner,
    save_case,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_transformers(saved, case):
    path = saved(case)
    _, overrides, opts = CASES[case]
    if overrides.get("tie_word_embeddings"):
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in set(f.keys())  # tied: the head is not stored
    assert_matches_hf(reference(path), runner(path))


@pytest.mark.parametrize("case", ["llama_head_dim_32", "llama_gqa_8_to_2", "qwen2_yarn_mqa"])
def test_cpp_kernel_matches_transformers(saved, case):
    from pagekv.kvnode.model.attention import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("C++ attention kernel unavailable")
    path = saved(case)
    assert_matches_hf(reference(path), runner(path, backend="cpp"))


@pytest.mark.parametrize("case", ["qwen2_yarn_mqa", "mistral_window_12"])
def test_offline_llm_matches_transformers_and_prefix_hits(saved, case):
    """Through the engine (scheduler, prefix cache, default attention backend): greedy
    tokens equal HF's, and a second pass that continues cached blocks gives the same."""
    from pagekv.kvnode.engine.llm import LLM
    from pagekv.kvnode.engine.sampling_params import SamplingParams

    path = saved(case)
    hf = reference(path)
    llm = LLM(str(path), block_size=BLOCK, num_gpu_blocks=40, max_model_len=64, device="cpu")
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    with torch.no_grad():
        for p, a, b in zip(PROMPTS, first, again, strict=True):
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                              do_sample=False)[0, len(p):].tolist()
            assert a.outputs[0].token_ids == gen
            assert b.outputs[0].token_ids == gen
    assert again[2].num_cached_tokens >= 2 * BLOCK


def test_sharded_tied_checkpoint_with_index(tmp_path):
    save_case(tmp_path, "qwen2_tied_bf16", max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" not in index["weight_map"]
    assert_matches_hf(reference(tmp_path), runner(tmp_path), steps=3)


def test_weights_without_model_prefix(tmp_path):
    from safetensors.torch import load_file, save_file

    save_case(tmp_path, "llama_bias")
    hf = reference(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = {k.removeprefix("model."): v for k, v in load_file(str(file)).items()}
    assert "layers.0.self_attn.q_proj.bias" in tensors and "lm_head.weight" in tensors
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert_matches_hf(hf, runner(tmp_path), steps=3)


def test_stray_safetensors_next_to_model_safetensors_is_ignored(tmp_path):
    from safetensors.torch import save_file

    save_case(tmp_path, "llama")
    # A second export of the same model under other names (Mistral's consolidated file),
    # and a tensor that would clobber a real one if it were read.
    save_file({"model.norm.weight": torch.zeros(64), "tok_embeddings.weight": torch.zeros(2, 2)},
              str(tmp_path / "consolidated.safetensors"))
    assert_matches_hf(reference(tmp_path), runner(tmp_path), steps=2)


def test_chunked_prefill_inside_a_sliding_window(saved):
    """Prompt chunks on top of their own cached prefix, window shorter than the context:
    HF's logits at each chunk's last position."""
    path = saved("mistral_window_12")
    hf = reference(path)
    r = runner(path)
    p = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].float()
    table, done = [7, 3, 11, 0], 0
    for size in (3, 7, 1, 9, 1):
        logits = r.execute([SeqBatchItem(p[done : done + size], done, table)])
        done += size
        torch.testing.assert_close(logits[0], ref[done - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("stored", ["different_head", "head_only"])
def test_tied_config_with_a_stored_head(tmp_path, stored):
    """transformers 5: a head that differs from the stored embedding is used untied; a head
    without an embedding fills both."""
    from safetensors.torch import load_file, save_file

    save_case(tmp_path, "llama_tied")
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    embed = tensors["model.embed_tokens.weight"]
    if stored == "head_only":
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    else:
        tensors["lm_head.weight"] = torch.randn_like(embed) * 0.2
    save_file(tensors, str(file), metadata={"format": "pt"})
    assert_matches_hf(reference(tmp_path), runner(tmp_path), steps=2)
