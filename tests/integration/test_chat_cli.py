"""`pagekv generate --chat` against a pod and the router serving the real chat model: the
client renders the model's template itself (no torch), the answer stops at the end of turn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagekv.deploy.local_cluster import LocalCluster
from tests.integration.openai_fixtures import CHAT_MODEL as MODEL

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(chat_cluster: LocalCluster) -> LocalCluster:
    return chat_cluster


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


def test_generate_flags_for_stop_strings_and_logprobs(cluster: LocalCluster) -> None:
    import json

    r = generate(cluster.router.address, "--chat", "What is the capital of France?",
                 "--system", "You are a helpful assistant. Answer in one short sentence.",
                 "--max-tokens", "40", "--stop", "France is", "--logprobs", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    completion = json.loads(r.stdout)["completions"][0]
    assert completion["stopString"] == "France is" and "France is" not in completion["text"]
    assert len(completion["logprobs"]) == len(completion["tokenIds"])
    assert all(len(t["top"]) == 2 for t in completion["logprobs"])
