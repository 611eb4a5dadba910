"""SmolLM2-135M-Instruct served by the engine gives transformers' greedy tokens (same GGUF,
fp32) for chat prompts, whichever way the KV gets there: computed cold, a prefix hit in the
pool, reloaded from DRAM, reloaded from SSD, recomputed after preemption, prefilled in chunks;
block sizes 16 and 32, attention backends torch and cpp. First-token logits agree with
transformers' to LOGITS_ATOL."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagekv.kvnode.engine.llm import LLM  # noqa: E402
from pagekv.kvnode.engine.sampling_params import SamplingParams  # noqa: E402
from pagekv.kvnode.model.attention import cpu_kernel  # noqa: E402
from pagekv.kvnode.model.runner import SeqBatchItem  # noqa: E402
from tests.unit.smollm2_reference import (  # noqa: E402
    PRESET,
    conversations,
    hf_model,
    hf_tokenizer,
    smollm2_file,
)

NEW = 12  # new tokens per prompt
MAX_LEN = 256
# fp32 on both sides, so only summation order differs: measured at most 3.4e-5 over logits
# that reach 35, while the greedy margins of these prompts are at least 0.029 (so greedy
# equality is no accident of ties). 5e-4 leaves headroom and still catches a wrong op.
LOGITS_ATOL = 5e-4
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0)
FILLER = ("Paged attention stores keys and values in fixed-size blocks, and a block table maps "
          "each sequence to its blocks, so memory grows with the sequence. ")

# One torch thread: on a busy 2-core machine a second thread mostly waits at barriers (15 s
# against 1 s for a short generation, measured); the conftest fixture restores the count.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.workload]
needs_cpp = pytest.mark.skipif(not cpu_kernel.available(),
                               reason="C++ paged attention extension could not be built")


@pytest.fixture(scope="module")
def reference(one_thread):
    """Prompt ids (transformers' template and tokenizer) -> (greedy tokens, first logits)."""
    path = smollm2_file()
    tok, model = hf_tokenizer(path), hf_model(path)
    prompts, greedy, logits = [], [], []
    with torch.no_grad():
        for conv in conversations():
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False).input_ids
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            prompts.append(ids)
            greedy.append(out.sequences[0, len(ids):].tolist())
            logits.append(out.logits[0][0].float())
    return prompts, greedy, logits


def _llm(block_size: int, backend: str, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", MAX_LEN)
    return LLM(PRESET, block_size=block_size, attention_backend=backend, max_model_len=MAX_LEN,
               **kw)


def _check_logits(llm: LLM, reference) -> None:
    """Before any request, no pool block holds anything: prefill each prompt straight on the
    runner (blocks in reverse order) and compare the last position's logits."""
    prompts, _, ref_logits = reference
    bs, top = llm.engine.args.block_size, llm.engine.runner.num_blocks
    for ids, ref in zip(prompts, ref_logits, strict=True):
        table = list(range(top - 1, top - 1 - -(-len(ids) // bs), -1))
        ours = llm.engine.runner.execute([SeqBatchItem(ids, 0, table)])[0]
        torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def _run(llm: LLM, i: int, reference):
    prompts, greedy, _ = reference
    out = llm.generate([prompts[i]], GREEDY)[0]
    tokens = out.outputs[0].token_ids
    assert tokens == greedy[i], f"prompt {i}"
    if tokens[-1] == 2:  # <|im_end|>: the end of the assistant's turn ends generation
        assert out.outputs[0].finish_reason == "stop"
    return out


def _fill(llm: LLM, n: int) -> None:
    """Distinct prompts that take the whole pool, pushing cached blocks down a tier."""
    for k in range(n):
        ids = llm.tokenizer.encode(f"Note {k}: " + FILLER * 6, add_bos=False)[: MAX_LEN - 8]
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))


@pytest.mark.parametrize("block_size, backend, tier", [
    (16, "torch", "CPU"), pytest.param(32, "cpp", "DISK", marks=needs_cpp),
])
def test_cold_hit_and_tier_reload(reference, tmp_path, block_size, backend, tier):
    offload = ({"cpu_offload_bytes": 256 << 20} if tier == "CPU" else
               {"disk_offload_bytes": 256 << 20, "disk_offload_dir": str(tmp_path)})
    llm = _llm(block_size, backend, num_gpu_blocks=MAX_LEN // block_size, **offload)
    _check_logits(llm, reference)
    cold = _run(llm, 0, reference)
    assert cold.num_cached_tokens == 0
    shared = _run(llm, 1, reference)  # the system prompt is shared with prompt 0
    assert shared.cached_tokens_by_tier.get("GPU", 0) >= block_size
    again = _run(llm, 0, reference)
    n0 = len(reference[0][0])
    assert again.cached_tokens_by_tier.get("GPU", 0) == (n0 - 1) // block_size * block_size
    _fill(llm, 2)
    reloaded = _run(llm, 0, reference)
    assert reloaded.cached_tokens_by_tier.get(tier, 0) >= block_size, reloaded.cached_tokens_by_tier
    llm.engine.close()


@pytest.mark.parametrize("block_size, backend", [
    (32, "torch"), pytest.param(16, "cpp", marks=needs_cpp),
])
def test_preempted_and_chunked(reference, block_size, backend):
    prompts, greedy, _ = reference
    max_len = max(len(p) for p in prompts) + NEW
    # Room for one request of max_model_len and a block: the others wait or get preempted.
    llm = LLM(PRESET, block_size=block_size, attention_backend=backend, max_model_len=max_len,
              num_gpu_blocks=-(-max_len // block_size) + 1, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    runner, continued = llm.engine.runner, []
    execute = runner.execute

    def recording(items):  # a later chunk of a prompt: several tokens on top of computed ones
        continued.extend(len(it.token_ids) > 1 and it.num_computed_tokens > 0 for it in items)
        return execute(items)

    runner.execute = recording
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == greedy
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(continued)
