"""The ``triton`` attention backend: when it is available, and its paged_attention (decodes
to the decode kernel, longer queries to the prefill kernel) and write_kv_cache against the
torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagekv.kvnode.model.attention.paged import write_kv_cache
from tests.unit.triton.prefill_cases import MIXED, make_case

PREFIX = "pagekv.kvnode.model.attention."
KERNELS = ("triton_formats", "triton_cache", "triton_decode", "triton_prefill")


@pytest.fixture(scope="module")
def tb(kernel_module):
    for name in KERNELS:  # helpers before the modules that use them
        kernel_module(PREFIX + name)
    return kernel_module(PREFIX + "triton_backend")


@pytest.fixture
def calls(tb, monkeypatch):
    """Which kernel got which sequences: {"decode": [num_seqs...], "prefill": [...]}."""
    import importlib

    seen: dict[str, list[int]] = {"decode": [], "prefill": []}
    for kind, mod, fn in (("decode", "triton_decode", "paged_decode"),
                          ("prefill", "triton_prefill", "paged_prefill")):
        module = importlib.import_module(PREFIX + mod)
        real = getattr(module, fn)

        def spy(*args, _real=real, _kind=kind, **kwargs):
            seen[_kind].append(int(args[4].shape[0]))  # seq_lens
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, fn, spy)
    return seen


def check(tb, case) -> None:
    out = tb.paged_attention(**case.kernel_args())
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    torch.testing.assert_close(out.cpu(), case.reference(), atol=1e-4, rtol=1e-4)


def test_available_here(tb, triton_device, monkeypatch):
    assert tb.available(triton_device) == (True, "")
    if triton_device == "cpu":
        assert tb.available("cuda")[0] is False
        monkeypatch.delenv("TRITON_INTERPRET")
        ok, why = tb.available("cpu")
        assert not ok and "TRITON_INTERPRET" in why
    assert tb.available("meta") == (False, "no triton kernels for device type 'meta'")


_LATE_INTERPRETER = """
import os
from pagekv.kvnode.model.attention import triton_backend as tb
ok, why = tb.available("cpu")
assert not ok and "TRITON_INTERPRET=1" in why, why
os.environ["TRITON_INTERPRET"] = "1"  # too late: triton and the kernels are imported
ok, why = tb.available("cpu")
assert not ok and "was set after triton" in why, why
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="about CPU without the interpreter")
def test_unavailable_on_cpu_without_the_interpreter_from_the_start():
    """In a fresh process: no TRITON_INTERPRET, then one set after the imports (triton's own
    jit helpers, tl.sum and co., were built for the GPU then: the kernels could not run)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _LATE_INTERPRETER], env=env,
                          cwd=Path(__file__).resolve().parents[3], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_backend_fields(tb):
    b = tb.backend()
    assert b.name == "triton"
    assert b.paged_attention is tb.paged_attention and b.write_kv_cache is tb.write_kv_cache


def test_mixed_batch(tb, triton_device, calls):
    """Decodes (one at context 1), prefills from scratch, chunks on a cached prefix and a row
    without new tokens: each row equals the reference, and each phase went to its kernel."""
    check(tb, make_case(MIXED, kv_heads=2, group=4, device=triton_device))
    assert calls == {"decode": [3], "prefill": [4]}


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_mixed_batch_window_and_quantised_cache(tb, triton_device, cache_dtype):
    scales = dict(k_scale=0.05, v_scale=0.125) if cache_dtype != torch.bfloat16 else {}
    check(tb, make_case(MIXED, cache_dtype=cache_dtype, sliding_window=20, block_size=8,
                        device=triton_device, **scales))


def test_decodes_only(tb, triton_device, calls):
    check(tb, make_case([(0, 1), (15, 1), (99, 1)], kv_heads=2, group=4, device=triton_device))
    assert calls == {"decode": [3], "prefill": []}


def test_decodes_and_an_empty_row(tb, triton_device, calls):
    check(tb, make_case([(4, 1), (9, 0), (30, 1)], device=triton_device))
    assert calls == {"decode": [2], "prefill": []}


def test_prefills_only(tb, triton_device, calls):
    check(tb, make_case([(0, 17), (5, 0), (40, 3)], device=triton_device))
    assert calls == {"decode": [], "prefill": [3]}  # whole batch, empty row included


def test_no_tokens_and_bad_lengths(tb, triton_device):
    case = make_case([(3, 0)], device=triton_device)
    assert tb.paged_attention(**case.kernel_args()).shape == (0, 2, 64)
    case = make_case([(3, 2)], device=triton_device)
    args = case.kernel_args()
    with pytest.raises(ValueError, match="seq_len 1 < query_len 2"):
        tb.paged_attention(**{**args, "seq_lens": torch.ones_like(args["seq_lens"])})


def test_write_kv_cache(tb, triton_device):
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(2, 6, 2, 64, generator=gen)
    slots = torch.tensor([0, 9, -1, 17, 3, 30])
    ref_k, ref_v = torch.zeros(2, 4, 8, 2, 64, dtype=torch.float8_e5m2)
    write_kv_cache(key, value, ref_k, ref_v, slots, 0.5, 2.0)
    kc = torch.zeros(4, 8, 2, 64, dtype=torch.float8_e5m2, device=triton_device)
    vc = torch.zeros_like(kc)
    tb.backend().write_kv_cache(key.to(triton_device), value.to(triton_device), kc, vc,
                                slots.to(triton_device), 0.5, 2.0)
    assert torch.equal(kc.cpu().view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), ref_v.view(torch.uint8))
