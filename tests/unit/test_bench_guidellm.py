"""bench/guidellm_run.py without guidellm: the two workloads send prompts of one length, the
command names the exported tokenizer and the router, the run is offline, and figures are read
from guidellm's report as it writes them (a missing one is NaN, never a crash)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.guidellm_run import data_arg, guidellm_argv, offline_env, stat


def fields(arg: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in arg.split(","))


def args(**kw: int) -> argparse.Namespace:
    base = {"prefixes": 4, "prefix_tokens": 512, "suffix_tokens": 64, "osl": 32,
            "concurrency": 4, "requests": 24}
    return argparse.Namespace(**(base | kw))


def test_shared_and_unique_prompts_are_as_long() -> None:
    shared, unique = fields(data_arg(args(), True)), fields(data_arg(args(), False))
    assert int(shared["prompt_tokens"]) + int(shared["prefix_tokens"]) \
        == int(unique["prompt_tokens"]) == 576
    assert shared["prefix_count"] == "4" and "prefix_count" not in unique
    assert shared["output_tokens"] == unique["output_tokens"] == "32"


def test_the_command_uses_the_exported_tokenizer_offline(tmp_path: Path) -> None:
    argv = guidellm_argv(Path("/venv/bin/guidellm"), args(), "http://127.0.0.1:9",
                         tmp_path / "tok", True, tmp_path / "out.json")
    joined = " ".join(argv)
    assert f"--tokenizer kind=huggingface_auto,model={tmp_path / 'tok'}" in joined
    assert "target=http://127.0.0.1:9,model=smollm2-135m-instruct" in joined
    assert "kind=max_requests,count=24" in joined and "streams=4" in joined
    assert offline_env()["HF_HUB_OFFLINE"] == "1"


def test_figures_come_from_guidellms_successful_requests() -> None:
    report = {"metrics": {"time_to_first_token_ms": {"successful": {
        "mean": 12.5, "percentiles": {"p50": 10.0, "p90": 20.0}}}}}
    assert stat(report, "time_to_first_token_ms", "mean") == 12.5
    assert stat(report, "time_to_first_token_ms", "p90") == 20.0
    assert math.isnan(stat(report, "time_to_first_token_ms", "p99"))
    assert math.isnan(stat(report, "inter_token_latency_ms", "p50"))
