"""bench.attention's case builders, on CPU: the paged copy and the contiguous SDPA bar it is
timed against hold the same attention (else the benchmark's ratios compare different work).
The CUDA report's row builders run here with the reference backend and a wall-clock timer."""

from __future__ import annotations

import time

import pytest
import torch

from bench import attention_cuda, attention_prefill
from pagekv.kvnode.model.attention import REFERENCE_BACKEND
from pagekv.kvnode.model.attention.paged import paged_attention


@pytest.mark.parametrize("seqs", [[(0, 24)], [(30, 8)], [(17, 1), (0, 9), (40, 3)]])
def test_prefill_bar_equals_the_paged_reference(seqs):
    batch = attention_prefill.build_batch(seqs, 16, 4, 2, 16, seed=3)
    want = paged_attention(**batch["paged"])
    torch.testing.assert_close(attention_prefill.sdpa_contiguous(batch), want,
                               atol=1e-5, rtol=1e-5)


@pytest.fixture
def wall_clock(monkeypatch):
    def median_ms(fn, quick):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    monkeypatch.setattr(attention_cuda, "median_ms", median_ms)
    monkeypatch.setattr(attention_cuda, "_decode_kernel_ms", lambda *a: None)


def test_cuda_decode_row_on_cpu(wall_clock):
    gen = torch.Generator().manual_seed(0)
    row = attention_cuda.decode_case(REFERENCE_BACKEND, 3, 70, torch.float32,
                                     torch.device("cpu"), gen, copy_gbs=10.0, quick=True)
    assert row["max_abs_err"] < 1e-5
    assert row["kv_bytes"] == 2 * 3 * 70 * attention_cuda.KV_HEADS * attention_cuda.HEAD * 4
    assert row["kernel_ms"] is None and row["triton_gbs"] > 0


@pytest.mark.parametrize("seqs", [[(0, 40)], [(50, 6)], [(0, 16), (0, 16)]])
def test_cuda_prefill_row_on_cpu(wall_clock, seqs):
    gen = torch.Generator().manual_seed(1)
    row = attention_cuda.prefill_case(REFERENCE_BACKEND, seqs, torch.float32, torch.float32,
                                      torch.device("cpu"), gen, quick=True)
    assert row["max_abs_err"] < 1e-5
    assert row["triton_tflops"] > 0


def test_causal_flops_count_visible_pairs():
    per_pair = 4 * attention_cuda.HEADS * attention_cuda.HEAD
    assert attention_cuda._causal_flops(0, 3) == per_pair * 6  # 1 + 2 + 3 keys
    assert attention_cuda._causal_flops(10, 2) == per_pair * (11 + 12)
