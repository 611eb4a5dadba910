"""KV pool sizing: which setting decides, the start-up log lines, the too-small error."""

from __future__ import annotations

import logging
import re

import pytest

import pagekv.kvnode.model.memory_planning as mp
from pagekv.kvnode.model.memory_planning import cpu_available_bytes, plan_kv_cache
from pagekv.kvnode.model.runner import ModelRunner

TINY = "pagekv-tiny"


def test_startup_logs_three_lines_in_order(caplog):
    caplog.set_level(logging.INFO)
    r = ModelRunner(TINY, num_gpu_blocks=100, max_model_len=256, device="cpu",
                    attention_backend="torch")
    lines = [rec.getMessage() for rec in caplog.records]
    patterns = [
        r"^Model loading took \d+\.\d+ GiB and \d+\.\d+ seconds$",
        r"^KV cache size: (\d+) tokens$",
        r"^Maximum concurrency for (\d+) tokens per request: (\d+\.\d\d)x$",
    ]
    found = []
    for pat in patterns:
        idx = [i for i, line in enumerate(lines) if re.match(pat, line)]
        assert len(idx) == 1, (pat, lines)
        found.append(idx[0])
    assert found == sorted(found)
    assert f"KV cache size: {100 * 16} tokens" in lines
    assert "Maximum concurrency for 256 tokens per request: 6.25x" in lines
    assert r.num_blocks == 100


def test_kv_cache_memory_decides_in_bytes():
    r = ModelRunner(TINY, kv_cache_memory=1_000_000, max_model_len=256, device="cpu",
                    attention_backend="torch")
    assert r.num_blocks == 1_000_000 // r.block_bytes
    assert r.kv_cache.nbytes <= 1_000_000
    assert r.memory_plan.num_tokens == r.num_blocks * 16


def test_fp8_doubles_blocks_for_same_budget():
    kw = dict(kv_cache_memory=2_000_000, device="cpu", max_model_len=256,
              attention_backend="torch")
    f16 = ModelRunner(TINY, kv_cache_dtype="fp16", **kw)
    f8 = ModelRunner(TINY, kv_cache_dtype="fp8", **kw)
    assert f8.block_bytes * 2 == f16.block_bytes
    assert f8.num_blocks == 2 * f16.num_blocks


def test_too_small_pool_is_a_clear_startup_error():
    with pytest.raises(ValueError) as err:
        ModelRunner(TINY, num_gpu_blocks=3, max_model_len=100, device="cpu")
    msg = str(err.value)
    assert "3 blocks" in msg and "max_model_len=100" in msg and "7 blocks" in msg
    assert "num_gpu_blocks" in msg and "lower max_model_len" in msg


def test_cpu_utilization_and_default_use_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:  100 kB\nMemAvailable:   8000000 kB\n")
    assert cpu_available_bytes(meminfo) == 8_000_000 * 1024
    monkeypatch.setattr(mp, "cpu_available_bytes", lambda: 8_000_000 * 1024)
    plan = plan_kv_cache(block_size=16, block_bytes=4096, max_model_len=64, device="cpu",
                         gpu_memory_utilization=0.5)
    assert plan.num_blocks == 4_000_000 * 1024 // 4096
    monkeypatch.setattr(mp, "cpu_available_bytes", lambda: 20 * mp.GiB)
    default = plan_kv_cache(block_size=16, block_bytes=4096, max_model_len=64, device="cpu")
    assert default.kv_cache_bytes == mp.DEFAULT_CPU_KV_CAP_BYTES  # 0.1 x 20 GiB > 1 GiB cap
    monkeypatch.setattr(mp, "cpu_available_bytes", lambda: 100 * 4096 * 10)
    small = plan_kv_cache(block_size=16, block_bytes=4096, max_model_len=64, device="cpu")
    assert small.num_blocks == 100
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_kv_cache(block_size=16, block_bytes=4096, max_model_len=64, device="cpu",
                      gpu_memory_utilization=1.5)


def test_num_gpu_blocks_wins_over_memory():
    plan = plan_kv_cache(block_size=8, block_bytes=100, max_model_len=16, device="cpu",
                         num_gpu_blocks=10, kv_cache_memory=10**9)
    assert plan.num_blocks == 10 and plan.max_concurrency == 5.0


# -- CUDA: the profile's arithmetic, with injected measurements (runs anywhere) --------------
def profile(**kw) -> mp.CudaMemoryProfile:
    fields = dict(total=80 * mp.GiB, free=60 * mp.GiB, weights=16 * mp.GiB,
                  activation_peak=3 * mp.GiB, non_torch=mp.GiB // 2, reserved=64 << 20)
    fields.update(kw)
    return mp.CudaMemoryProfile(**fields)


def test_cuda_budget_is_the_share_less_weights_peak_non_torch_and_staging():
    # 0.9 x 80 GiB = 72 GiB; minus 16 + 3 + 0.5 GiB and 64 MiB of staging.
    want = 72 * mp.GiB - 16 * mp.GiB - 3 * mp.GiB - mp.GiB // 2 - (64 << 20)
    assert mp.cuda_kv_budget(profile(), 0.9) == want
    assert mp.cuda_kv_budget(profile(), 0.5) == 40 * mp.GiB - 19 * mp.GiB - mp.GiB // 2 - (64 << 20)


def test_cuda_budget_never_exceeds_free_memory_and_never_goes_negative(caplog):
    caplog.set_level(logging.WARNING)
    # Another process holds most of the device: the share would overrun what is free.
    tight = profile(free=10 * mp.GiB)
    assert mp.cuda_kv_budget(tight, 0.9) == 10 * mp.GiB - (64 << 20)
    assert any("only" in r.getMessage() and "free" in r.getMessage() for r in caplog.records)
    assert mp.cuda_kv_budget(profile(weights=75 * mp.GiB), 0.9) == 0


def test_cuda_plan_from_an_injected_profile_logs_the_three_lines(caplog):
    caplog.set_level(logging.INFO)
    calls = []

    def measure():
        calls.append(1)
        return profile()

    bb = 16 * 131072  # a block of 16 tokens at 128 KiB per token (an 8B-class model)
    plan = plan_kv_cache(block_size=16, block_bytes=bb, max_model_len=8192, device="cuda",
                         gpu_memory_utilization=0.9, profile=measure)
    budget = 72 * mp.GiB - 16 * mp.GiB - 3 * mp.GiB - mp.GiB // 2 - (64 << 20)
    assert calls == [1]
    assert plan.num_blocks == budget // bb and plan.profile == profile()
    assert plan.source == "gpu_memory_utilization=0.9"
    lines = [r.getMessage() for r in caplog.records]
    assert f"KV cache size: {budget // bb * 16} tokens" in lines
    assert f"Maximum concurrency for 8192 tokens per request: {budget // bb / 512:.2f}x" in lines
    assert any(line.startswith("Memory profiling: 80.00 GiB x 0.90 = 72.00 GiB") for line in lines)
    # The default utilization is 0.9 there too.
    assert plan_kv_cache(block_size=16, block_bytes=bb, max_model_len=8192, device="cuda",
                         profile=measure).num_blocks == plan.num_blocks


def test_cuda_profile_runs_only_when_the_utilization_decides():
    def measure():
        raise AssertionError("no profile needed")

    kw = dict(block_size=16, block_bytes=4096, max_model_len=64, device="cuda", profile=measure)
    assert plan_kv_cache(num_gpu_blocks=10, **kw).num_blocks == 10
    assert plan_kv_cache(kv_cache_memory=40960, **kw).num_blocks == 10


def test_cuda_profile_too_small_for_one_request_is_the_startup_error():
    with pytest.raises(ValueError, match="KV cache too small"):
        plan_kv_cache(block_size=16, block_bytes=1 << 20, max_model_len=4096, device="cuda",
                      profile=lambda: profile(weights=64 * mp.GiB, activation_peak=8 * mp.GiB))


def test_copy_staging_is_whole_blocks():
    assert mp.copy_staging_bytes(1000) == (64 << 20) // 1000 * 1000
    assert mp.copy_staging_bytes(100 << 20) == 100 << 20  # one block even when larger
