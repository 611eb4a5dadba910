"""A GGUF model whose tensors are k-quants and i-quants (the files people download: Q4_K_M
and the like), end to end: its weights are random valid blocks written as raw bytes (gguf-py
cannot quantize to most of these types), and the model PageKV loads gives the logits and greedy
tokens of transformers' model loaded from the same file (transformers dequantizes with gguf-py).
Without gguf-py the same file is one clear error; a file of PageKV's own types never imports it."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from pagekv.kvnode.engine.llm import LLM  # noqa: E402
from pagekv.kvnode.engine.sampling_params import SamplingParams  # noqa: E402
from pagekv.kvnode.model.runner import SeqBatchItem  # noqa: E402
from tests.unit.gguf_fixtures import (  # noqa: E402
    gguf_tensors,
    llama_metadata,
    random_blocks,
    tiny_llama,
    write_gguf,
    write_tiny_llama,
)

ROOT = Path(__file__).resolve().parents[2]
TEXT = "the world in order, <|im_start|>user\nhe said 42<|im_end|>"
WEIGHT_STD = 0.08
NEW = 8

# llama.cpp's Q4_K_M recipe, roughly: Q4_K, with Q6_K for attn_v, ffn_down and the output.
Q4_K_M = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
          "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
          "ffn_down": "Q6_K"}
# Every k-quant and a spread of i-quants and TQ2_0, next to PageKV's own Q8_0 and F16.
MIXED = {"token_embd": "Q5_K", "output": "Q3_K", "attn_q": "Q2_K", "attn_k": "IQ4_XS",
         "attn_v": "IQ3_S", "attn_output": "IQ2_XS", "ffn_gate": "IQ4_NL", "ffn_up": "TQ2_0",
         "ffn_down": "Q8_0", "blk.1.attn_q": "IQ3_XXS", "blk.1.ffn_up": "F16",
         "blk.1.ffn_gate": "IQ2_S", "blk.1.ffn_down": "IQ1_M"}
RECIPES = {"Q4_K_M": Q4_K_M, "mixed": MIXED}


def weight_blocks(qtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """[rows, row bytes] random blocks whose values have about WEIGHT_STD: drawn once with
    unit scales, then again (the same bytes) with the scales set to give that spread."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n_blocks = int(np.prod(shape)) // block
    unit = random_blocks(qtype, n_blocks, np.random.default_rng(seed), scale=1.0)
    spread = float(gguf.quants.dequantize(unit, gguf.GGMLQuantizationType[qtype]).std())
    blocks = random_blocks(qtype, n_blocks, np.random.default_rng(seed),
                           scale=WEIGHT_STD / spread)
    return blocks.reshape(shape[0], -1)


def recipe_type(recipe: dict[str, str], name: str) -> str:
    """The type a recipe gives a llama.cpp tensor name (blk.N.x.weight, or token_embd...)."""
    stem = name.removesuffix(".weight")
    return recipe.get(stem, recipe.get(stem.split(".")[-1], "F32"))


def write_quantized(path: Path, recipe: dict[str, str], seed: int = 5) -> Path:
    model = tiny_llama(seed=seed)
    tensors = {}
    for i, (name, (values, qtype)) in enumerate(gguf_tensors(model).items()):
        if qtype == "F32" and values.ndim == 2:  # a weight (norms stay F32)
            kind = recipe_type(recipe, name)
            tensors[name] = ((weight_blocks(kind, values.shape, seed * 100 + i), kind)
                             if kind not in ("F32", "F16") else (values, kind))
        else:
            tensors[name] = (values, qtype)
    return write_gguf(path, llama_metadata(model), tensors)


@pytest.fixture(scope="module", params=sorted(RECIPES))
def quantized(request, tmp_path_factory):
    """(the file, transformers' model of it): each recipe written once for its tests."""
    folder = tmp_path_factory.mktemp(request.param)
    path = write_quantized(folder / f"tiny-{request.param}.gguf", RECIPES[request.param])
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=path.name, dtype=torch.float32).eval()
    return request.param, path, ref


def test_logits_and_greedy_tokens_equal_transformers(quantized, caplog):
    recipe, path, ref = quantized
    caplog.set_level(logging.INFO, logger="pagekv.kvnode.model.gguf_loader")
    llm = LLM(str(path), device="cpu", max_model_len=128, num_gpu_blocks=16,
              attention_backend="torch")
    ids = llm.tokenizer.encode(TEXT, add_bos=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                           min_new_tokens=NEW, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)
    greedy = out.sequences[0, len(ids):].tolist()
    steps = torch.cat(out.logits).float()  # the raw logits of each step, before any masking
    assert steps.argmax(-1).tolist() == greedy  # (min_new_tokens masked no EOS that won)
    top2 = steps.topk(2, dim=-1).values
    # fp32 on both sides: the logits differ by ~1e-5; these margins are 0.07 and up, so the
    # greedy equality below is no accident of a tie.
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-2
    first = steps[0]
    runner = llm.engine.runner
    ours = runner.execute([SeqBatchItem(ids, 0, [5, 2, 9, 0])])[0]
    torch.testing.assert_close(ours, first, atol=1e-4, rtol=1e-4)
    got = llm.generate([ids], SamplingParams(max_tokens=NEW, temperature=0.0,
                                             ignore_eos=True))[0].outputs[0].token_ids
    assert got == greedy
    llm.engine.close()
    expected = {"Q4_K_M": "16 tensors dequantized by gguf-py 0.19.0: 11 Q4_K, 5 Q6_K",
                "mixed": "14 tensors dequantized by gguf-py 0.19.0: 1 IQ1_M, 1 IQ2_S, 2 IQ2_XS, "
                         "2 IQ3_S, 1 IQ3_XXS, 1 IQ4_NL, 2 IQ4_XS, 1 Q2_K, 1 Q3_K, 1 Q5_K, "
                         "1 TQ2_0"}[recipe]
    logged = [r.getMessage() for r in caplog.records if "by gguf-py" in r.getMessage()]
    assert len(logged) == 1 and expected.replace("0.19.0", version("gguf")) in logged[0], logged


WITHOUT_GGUF = """
import sys
if sys.argv[2] == "blocked":
    sys.modules["gguf"] = None  # as if gguf-py were not installed
from pagekv.kvnode.model.config import ModelLoadError
from pagekv.kvnode.model.runner import ModelRunner
try:
    ModelRunner(sys.argv[1], num_gpu_blocks=4, device="cpu", max_model_len=32,
                attention_backend="torch")
    print("loaded", sys.modules.get("gguf") is not None)
except ModelLoadError as exc:
    print("refused", exc)
"""


def _load_in_fresh_interpreter(path: Path, gguf_state: str) -> str:
    r = subprocess.run([sys.executable, "-c", WITHOUT_GGUF, str(path), gguf_state], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_without_gguf_py_a_k_quant_file_is_refused_before_the_model_is_built(tmp_path):
    path = write_quantized(tmp_path / "q4km.gguf", Q4_K_M)
    out = _load_in_fresh_interpreter(path, "blocked")
    assert out.startswith("refused tensor 'token_embd.weight' is Q4_K, which PageKV does not "
                          "dequantize itself"), out
    assert "`pip install 'pagekv[model]'`" in out and "\n" not in out


def test_a_file_of_pageKVs_own_types_loads_without_importing_gguf(tmp_path):
    _, path = write_tiny_llama(tmp_path / "q8.gguf", qtype="Q8_0")
    assert _load_in_fresh_interpreter(path, "installed") == "loaded False"
    assert _load_in_fresh_interpreter(path, "blocked") == "loaded False"
