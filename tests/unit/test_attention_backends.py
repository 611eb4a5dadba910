"""Which attention backend the dispatcher picks (torch / cpp / triton / auto) and why, with
stand-in kernel modules. The numerics of the phase-dispatched cpp backend:
test_attention_phase_dispatch.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pagekv.kvnode.model.attention import (
    BACKEND_CHOICES,
    REFERENCE_BACKEND,
    AttentionBackend,
    get_attention_backend,
    write_kv_cache,
)
from pagekv.kvnode.model.attention.phase_dispatch import AVX512_LIMITS, PORTABLE_LIMITS
from tests.unit.attention_stand_in import stand_in

KERNEL = "pagekv.kvnode.model.attention.cpu_kernel"
TRITON = "pagekv.kvnode.model.attention.triton_backend"


def _fake_kernel(available: bool) -> types.ModuleType:
    """A C++ kernel stand-in whose output marks each sequence's rows with its seq_len."""
    mod = types.ModuleType(KERNEL)
    mod.available = lambda: available  # type: ignore[attr-defined]
    mod.calls = []  # type: ignore[attr-defined]

    def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, qsl, *rest):
        mod.calls.append((seq_lens.tolist(), qsl.tolist()))
        per_token = torch.repeat_interleave(seq_lens.float(), qsl.diff())
        return per_token[:, None, None].expand(query.shape).clone()

    mod.paged_attention = paged_attention  # type: ignore[attr-defined]
    return mod


def _fake_triton(ok: bool, why: str = "") -> types.ModuleType:
    mod = types.ModuleType(TRITON)
    mod.asked = []  # type: ignore[attr-defined]
    backend = AttentionBackend("triton", lambda *a, **k: "triton", write_kv_cache)

    def available(device: str) -> tuple[bool, str]:
        mod.asked.append(device)
        return ok, why

    mod.available = available  # type: ignore[attr-defined]
    mod.backend = lambda: backend  # type: ignore[attr-defined]
    return mod


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("PAGEKV_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_torch_by_env(monkeypatch):
    stand_in(monkeypatch, KERNEL, _fake_kernel(True))
    monkeypatch.setenv("PAGEKV_ATTENTION_BACKEND", "torch")
    assert get_attention_backend() is REFERENCE_BACKEND


def test_auto_on_cpu_is_the_phase_dispatched_kernel(monkeypatch, caplog):
    fake = _fake_kernel(True)
    stand_in(monkeypatch, KERNEL, fake)
    stand_in(monkeypatch, TRITON, _fake_triton(True))
    caplog.set_level("INFO", logger="pagekv.kvnode.model.attention")
    backend = get_attention_backend()
    assert backend.name == "cpp" and backend.describe() == PORTABLE_LIMITS.describe()
    assert "attention: cpp decode and short prefill (<= 8 new tokens" in caplog.text
    assert "torch SDPA longer prefill (backend cpp, device cpu)" in caplog.text
    assert backend.write_kv_cache is write_kv_cache  # kernel without its own writer
    assert not sys.modules[TRITON].asked  # auto never considers triton on CPU
    # A pure decode batch goes to the kernel whole.
    q = torch.zeros(2, 4, 8)
    cache = torch.zeros(4, 16, 2, 8)
    out = backend.paged_attention(q, cache, cache, torch.tensor([[0], [1]], dtype=torch.int32),
                                  torch.tensor([5, 9], dtype=torch.int32),
                                  torch.tensor([0, 1, 2], dtype=torch.int32), 0.3)
    assert fake.calls == [([5, 9], [0, 1, 2])]
    assert out[:, 0, 0].tolist() == [5.0, 9.0]


def test_the_kernels_avx512_path_raises_its_limits(monkeypatch):
    fake = _fake_kernel(True)
    fake.has_avx512_path = lambda: True  # type: ignore[attr-defined]
    stand_in(monkeypatch, KERNEL, fake)
    assert get_attention_backend("cpp").describe() == AVX512_LIMITS.describe()
    assert AVX512_LIMITS.max_query_len > PORTABLE_LIMITS.max_query_len


@pytest.mark.parametrize("kernel", [None, "unavailable"])
def test_falls_back_to_reference_without_the_kernel(monkeypatch, kernel):
    # None in sys.modules makes the import raise ImportError.
    stand_in(monkeypatch, KERNEL, None if kernel is None else _fake_kernel(False))
    monkeypatch.setenv("PAGEKV_ATTENTION_BACKEND", "auto")
    assert get_attention_backend() is REFERENCE_BACKEND
    with pytest.raises(RuntimeError, match="attention backend 'cpp' requested but"):
        get_attention_backend("cpp")


def test_cpp_on_cuda_is_an_error(monkeypatch):
    stand_in(monkeypatch, KERNEL, _fake_kernel(True))
    with pytest.raises(RuntimeError, match="CPU kernel; device is cuda:0"):
        get_attention_backend("cpp", "cuda:0")


def test_auto_on_cuda_prefers_triton(monkeypatch):
    fake = _fake_triton(True)
    stand_in(monkeypatch, TRITON, fake)
    stand_in(monkeypatch, KERNEL, _fake_kernel(True))
    backend = get_attention_backend(device="cuda:0")
    assert backend.name == "triton" and backend.paged_attention() == "triton"
    assert fake.asked == ["cuda:0"]
    assert get_attention_backend("triton", "cuda") is backend


def test_auto_on_cuda_without_triton_is_the_reference(monkeypatch):
    stand_in(monkeypatch, TRITON, None)  # the module does not import
    assert get_attention_backend(device="cuda:0") is REFERENCE_BACKEND
    stand_in(monkeypatch, TRITON, _fake_triton(False, "no GPU"))
    assert get_attention_backend(device="cuda") is REFERENCE_BACKEND


def test_triton_module_that_raises_does_not_break_auto(monkeypatch):
    broken = types.ModuleType(TRITON)

    def available(device):
        raise OSError("driver gone")

    broken.available = available  # type: ignore[attr-defined]
    stand_in(monkeypatch, TRITON, broken)
    assert get_attention_backend(device="cuda") is REFERENCE_BACKEND
    with pytest.raises(RuntimeError, match="OSError: driver gone"):
        get_attention_backend("triton", "cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    fake = _fake_triton(True)
    stand_in(monkeypatch, TRITON, fake)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton")
    assert not fake.asked  # refused before the module is even asked
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_attention_backend("triton").name == "triton"
    assert fake.asked == ["cpu"]


def test_named_triton_reports_why_it_is_unusable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    stand_in(monkeypatch, TRITON, None)
    with pytest.raises(RuntimeError, match="triton_backend does not import"):
        get_attention_backend("triton")
    stand_in(monkeypatch, TRITON, _fake_triton(False, "triton is not installed"))
    with pytest.raises(RuntimeError, match="is False: triton is not installed"):
        get_attention_backend("triton", "cuda:1")


def test_rejects_unknown_name(monkeypatch):
    assert BACKEND_CHOICES == ("auto", "torch", "cpp", "triton")
    monkeypatch.setenv("PAGEKV_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="'flash' .*auto, torch, cpp, triton"):
        get_attention_backend()
    with pytest.raises(ValueError, match="from argument"):
        get_attention_backend("cuda")


def test_engine_args_offer_every_backend():
    from pagekv.kvnode.engine.config import CHOICES, HELP

    assert CHOICES["attention_backend"] == BACKEND_CHOICES
    assert all(name in HELP["attention_backend"] for name in BACKEND_CHOICES)
