"""lm-evaluation-harness (PyPI's lm_eval[api]) against a pod and against the router, offline:
its `local-completions` model with the server's own tokenizer behind vLLM's routes
(`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize; no tokenizer files), a
loglikelihood task (multiple choice: echo with logprobs, max_tokens 1, token-id prompts) and
a generate_until task, both from local JSONL files through a task YAML in a temporary
directory (--include_path). Each loglikelihood equals the offline engine's (LLM with
prompt_logprobs) for the same tokens to 1e-4, is_greedy agrees, and each generation is the
offline greedy one. With the contract cluster's pagekv-tiny (byte tokenizer), and once with
the real chat model (BPE) through the router."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.kvnode.engine.llm import LLM
from pagekv.kvnode.engine.sampling_params import SamplingParams
from pagekv.proto.model_files import prompt_tokenizer
from tests.integration.contract_fixtures import MAX_MODEL_LEN, MAX_N
from tests.integration.openai_fixtures import CHAT_MODEL, MODEL, HttpTarget

pytestmark = pytest.mark.integration

CHOICES = [
    {"context": "The capital of France is", "choices": [" Paris", " Rome", " a city"],
     "label": 0},
    {"context": "Two plus two equals ", "choices": ["four", "five"], "label": 0},
    {"context": "Colours: red, green,", "choices": [" blue", " loud", " seven"], "label": 0},
]
QUESTIONS = [{"question": "Name a colour:", "answer": " red"},
             {"question": "Q: What is 2 + 2?\nA:", "answer": " 4"}]
MAX_GEN_TOKS = 8
UNTIL = ["\n"]

LL_TASK = """task: pagekv_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: pagekv_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def task_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, rows, template in (("ll", CHOICES, LL_TASK), ("gen", QUESTIONS, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"pagekv_{name}.yaml").write_text(template.format(
            data=data, until=json.dumps(UNTIL), max_gen_toks=MAX_GEN_TOKS))
    return root


def run_lm_eval(base_url: str, model: str, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    """`lm_eval` as a user runs it, offline; its logged samples by task."""
    out = tmp / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp / "hf"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           f"base_url={base_url}/completions,model={model},tokenizer_backend=remote,"
           f"max_retries=1,timeout=120", "--tasks", "pagekv_ll,pagekv_gen",
           "--include_path", str(task_dir(tmp / "tasks")), "--log_samples",
           "--output_path", str(out), "--seed", "0"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    samples: dict[str, list[dict[str, Any]]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(samples) == {"pagekv_ll", "pagekv_gen"}, list(out.rglob("*"))
    return samples


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str
                ) -> tuple[list[int], list[int]]:
    """lm_eval's split of a request into context and continuation tokens (TemplateLM)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, ctx = encode(context + continuation), encode(context)
    return ctx, whole[len(ctx):]


def check_against_offline(samples: dict[str, list[dict[str, Any]]], offline: LLM,
                          encode: Callable[[str], list[int]], eos: str | None) -> None:
    requests = [(args["arg_0"], args["arg_1"], resp)
                for doc in samples["pagekv_ll"]
                for args, resp in zip(doc["arguments"].values(), doc["resps"], strict=True)]
    assert len(requests) == sum(len(c["choices"]) for c in CHOICES)
    pairs = [encode_pair(encode, ctx, cont) for ctx, cont, _ in requests]
    outs = offline.generate([c + t for c, t in pairs],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    for (ctx, cont, resp), (ctx_ids, cont_ids), out in zip(requests, pairs, outs, strict=True):
        assert out.prompt_logprobs is not None
        scored = out.prompt_logprobs[len(ctx_ids):]
        assert [e.token_id for e in scored if e is not None] == cont_ids
        loglik, greedy = float(resp[0][0]), resp[0][1] == "True"
        want = sum(e.logprob for e in scored if e is not None)
        assert loglik == pytest.approx(want, abs=1e-4), (ctx, cont)
        assert greedy == all(e is not None and e.top[0][0] == e.token_id for e in scored)
    stops = [*UNTIL, *([eos] if eos else [])]  # lm_eval adds the EOS text to `until`
    for doc in samples["pagekv_gen"]:
        context = doc["arguments"]["gen_args_0"]["arg_0"]
        want = offline.generate([encode(context)], SamplingParams(
            max_tokens=MAX_GEN_TOKS, temperature=0, stop=stops))[0].outputs[0]
        assert doc["resps"][0][0] == want.text, context


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, num_gpu_blocks=320, max_model_len=MAX_MODEL_LEN, max_n=MAX_N)


def test_lm_eval_loglikelihood_and_generation_match_the_engine(
        http_target: HttpTarget, offline: LLM, tmp_path: Path) -> None:
    samples = run_lm_eval(http_target.base_url, MODEL, tmp_path)
    tok = prompt_tokenizer(MODEL)
    check_against_offline(samples, offline, lambda s: tok.encode(s, add_bos=False),
                          tok.eos_token)


def test_lm_eval_with_the_real_chat_model_through_the_router(
        chat_cluster: LocalCluster, tmp_path: Path) -> None:
    """The BPE tokenizer, its special tokens and the server's detokenizer, end to end."""
    base = f"http://127.0.0.1:{chat_cluster.router.http_port}/v1"
    samples = run_lm_eval(base, CHAT_MODEL, tmp_path)
    tok = prompt_tokenizer(CHAT_MODEL)
    offline = LLM(CHAT_MODEL, num_gpu_blocks=64, max_model_len=512)
    check_against_offline(samples, offline, lambda s: tok.encode(s, add_bos=False),
                          tok.eos_token)
