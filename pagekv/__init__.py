"""PageKV: a distributed paged KV-cache service for LLM generation.

The public API, vLLM's shape::

    from pagekv import LLM, SamplingParams
    llm = LLM(model="pagekv-tiny")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8))

    from pagekv import Client          # a pod or the router over gRPC
    Client("127.0.0.1:50050").generate("Hello", max_tokens=8)

The repository's folders are this package's subpackages: `pagekv.kvnode` (a pod),
`pagekv.tiers`, `pagekv.router`, `pagekv.proto` (the contract), `pagekv.deploy`. In a checkout
they are symlinks here (`pagekv/kvnode -> ../kvnode`...), so an IDE, a type checker and an
import-graph tool resolve `pagekv.X` as Python does; the wheel maps them in (pyproject's
package-dir). Exports load on first use, so `import pagekv` (and the router, and the client)
never imports torch. `pagekv.cli` is the `pagekv` command.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

try:
    __version__ = metadata.version("pagekv")
except metadata.PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

__all__ = sorted(["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs",
                  "Client", "TlsFiles", "__version__"])


def __getattr__(name: str) -> Any:
    """Each export imported on first use: `import pagekv` must not load torch."""
    match name:
        case "LLM":
            from pagekv.kvnode.engine.llm import LLM
            return LLM
        case "SamplingParams":
            from pagekv.kvnode.engine.sampling_params import SamplingParams
            return SamplingParams
        case "RequestOutput" | "CompletionOutput":
            from pagekv.kvnode.engine import outputs
            return getattr(outputs, name)
        case "EngineArgs":
            from pagekv.kvnode.engine.config import EngineArgs
            return EngineArgs
        case "Client":
            from pagekv.kvnode.pod.client import Client
            return Client
        case "TlsFiles":  # Client(..., tls=TlsFiles(ca=...))
            from pagekv.proto.credentials import TlsFiles
            return TlsFiles
    raise AttributeError(f"module 'pagekv' has no attribute {name!r}")
