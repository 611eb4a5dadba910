"""LoRA on the real model (issue #32): SmolLM2-135M-Instruct (Q4_1 GGUF), transformers loading
the same file as the reference, an adapter made by peft on it (random A and B, rank 16 on
attention + MLP), and PageKV's engine serving the GGUF with that adapter: greedy tokens
equal, cold and from the prefix cache."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from pagekv.kvnode.engine.engine import Engine  # noqa: E402
from pagekv.kvnode.engine.sampling_params import SamplingParams  # noqa: E402
from tests.unit.smollm2_reference import PRESET, SYSTEM, hf_model, hf_tokenizer, smollm2_file  # noqa: E402
from tests.unit.test_lora import EVERYWHERE  # noqa: E402


def test_an_adapter_on_smollm2_gives_peft_s_greedy_tokens(tmp_path) -> None:
    path = smollm2_file()
    tok = hf_tokenizer(path)
    base = hf_model(path)
    torch.manual_seed(5)
    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=EVERYWHERE, lora_dropout=0.0,
                          init_lora_weights=False)
    model = peft.get_peft_model(base, cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    model.save_pretrained(str(tmp_path / "adapter"))
    engine = Engine(model=PRESET, num_gpu_blocks=64, max_model_len=256,
                    lora_modules=(f"helper={tmp_path / 'adapter'}",))
    ids = tok(SYSTEM + " What is the capital of France?")["input_ids"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        t = torch.tensor([ids])
        want = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        with model.disable_adapter():
            plain = model.generate(input_ids=t, attention_mask=torch.ones_like(t),
                                   max_new_tokens=8, min_new_tokens=8,
                                   do_sample=False)[0, len(ids):].tolist()
    assert want != plain  # the adapter changes the answer

    def run() -> tuple[int, list[int]]:
        rid = engine.add_request(None, ids, params, lora_id="helper")
        tokens, cached = [], 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    tokens += out.outputs[0].token_ids
                    cached = out.num_cached_tokens
        return cached, tokens

    assert run() == (0, want)
    cached, again = run()
    assert cached == len(ids) // 16 * 16 and again == want
