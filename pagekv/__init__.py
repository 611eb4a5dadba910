"""PageKV: a distributed paged KV-cache service for LLM generation.

The public API, vLLM's shape::

    from pagekv import LLM, SamplingParams
    llm = LLM(model="pagekv-tiny")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8))

    from pagekv import Client          # a pod or the router over gRPC
    Client("127.0.0.1:50050").generate("Hello", max_tokens=8)

Installed, the repository's folders are this package's subpackages: `pagekv.kvnode` (a pod),
`pagekv.tiers`, `pagekv.router`, `pagekv.proto` (the contract), `pagekv.deploy`. Exports load
on first use, so `import pagekv` (and the router, and the client) never imports torch.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from pathlib import Path
from typing import Any

# In a source checkout this folder sits beside kvnode/, router/, ...: let them resolve as
# pagekv.kvnode, pagekv.router, ... without an install. (A wheel has them inside this folder.)
_here = Path(__file__).resolve().parent
if not (_here / "kvnode").is_dir() and (_here.parent / "kvnode" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821 - a package's __path__

try:
    __version__ = metadata.version("pagekv")
except metadata.PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "LLM": "pagekv.kvnode.engine.llm",
    "SamplingParams": "pagekv.kvnode.engine.sampling_params",
    "RequestOutput": "pagekv.kvnode.engine.outputs",
    "CompletionOutput": "pagekv.kvnode.engine.outputs",
    "EngineArgs": "pagekv.kvnode.engine.config",
    "Client": "pagekv.kvnode.pod.client",
    "TlsFiles": "pagekv.proto.credentials",  # Client(..., tls=TlsFiles(ca=...))
}
__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagekv' has no attribute {name!r}")
