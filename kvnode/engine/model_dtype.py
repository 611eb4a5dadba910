"""`dtype=` as vLLM names it, checked against the one dtype PageKV computes in on a device.

PageKV picks the model's dtype per device (kvnode.model.runner.model_dtype_for: float32 on
CPU, where its C++ attention kernel is float32; bfloat16 on CUDA, float16 on a GPU without
bf16). A request for that dtype, or "auto", is accepted; any other is refused before the
model loads, naming what the device computes in.
"""

from __future__ import annotations

import torch

from pagekv.kvnode.model.runner import default_device, model_dtype_for

# vLLM's dtype names (and torch's) -> the torch dtype.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}


def check_dtype(dtype: str | torch.dtype, device: str | None) -> None:
    """Refuse a `dtype` the model would not run in on `device` (None: the default one)."""
    dev = torch.device(device or default_device())
    actual = model_dtype_for(dev)
    if isinstance(dtype, torch.dtype):
        wanted: torch.dtype | None = dtype
    elif isinstance(dtype, str) and dtype.lower() == "auto":
        return
    else:
        wanted = DTYPE_NAMES.get(dtype.lower()) if isinstance(dtype, str) else None
        if wanted is None:
            raise ValueError(f"dtype={dtype!r} is not a dtype: use 'auto' or one of "
                             f"{sorted(DTYPE_NAMES)}")
    if wanted != actual:
        name = str(actual).removeprefix("torch.")
        raise ValueError(
            f"dtype={dtype!r} is not supported on {dev.type}: PageKV computes in float32 on "
            f"CPU and in bfloat16 on CUDA (float16 on a GPU without bf16), here {name}; use "
            f"dtype='auto' or {name!r}")
