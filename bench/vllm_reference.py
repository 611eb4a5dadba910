"""vLLM 0.33's own KV cache manager, fetched and imported for the block-manager benchmark.

    .venv/bin/python -m bench.vllm_reference      # fetch once (~340 MB download), then import

`load()` gives the modules of vLLM 0.33.0's `vllm.v1.core.kv_cache_manager` path, its code
unchanged. The first call fetches vLLM's wheel with pip into `.venv/vllm-ref/` (git-ignored;
nothing of vLLM is committed), keeps only its Python sources (the CUDA extension is never
imported), and installs with pip, into the same folder, the pure-Python modules on that import
path that PageKV's venv lacks (torch, transformers, msgspec, pyzmq, cbor2 come from the venv).

One stand-in, and why: `vllm.v1.request` imports `StructuredOutputRequest` from
`vllm.v1.structured_output.request`, whose package `__init__` imports the grammar backends
(xgrammar, which needs a native TVM runtime). A block manager never calls them, so that package
is registered without running its `__init__`; its submodules load from vLLM's files as usual.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.33.0"
CACHE = Path(__file__).resolve().parent.parent / ".venv" / "vllm-ref"
SRC = CACHE / f"vllm-{VLLM_VERSION}"  # vllm/**/*.py and the dist-info, from the wheel
DEPS = CACHE / "deps"
# Pinned: the versions this benchmark was run with (vLLM 0.33's lower bounds hold for them).
IMPORT_DEPS = (
    "aiohttp==3.14.5", "multidict==7.2.1", "yarl==1.25.1", "propcache==0.5.4",
    "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0",
    "openai-harmony==0.0.8", "pybase64==1.5.1", "cachetools==8.0.2", "cloudpickle==3.1.3",
    "uvloop==0.23.0", "py-cpuinfo==9.0.0",
)
_BARE_PACKAGES = ("vllm.v1.structured_output",)
_DONE = CACHE / f".ready-{VLLM_VERSION}"


@dataclass(frozen=True)
class VllmModules:
    """The pieces of vLLM the benchmark drives (names as vLLM spells them)."""

    version: str
    KVCacheManager: type
    Request: type
    RequestStatus: type
    SamplingParams: type
    KVCacheConfig: type
    KVCacheGroupSpec: type
    FullAttentionSpec: type
    get_request_block_hasher: object
    init_none_hash: object
    hash_fns: dict  # "sha256" -> vllm.utils.hashing.sha256, ...
    float16: object  # torch.float16, for the attention spec


def fetch() -> None:
    """Download vLLM's wheel and the import-path modules into CACHE (once)."""
    if _DONE.exists():
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = CACHE / "wheel"
    subprocess.run([*pip, "download", f"vllm=={VLLM_VERSION}", "--no-deps", "--only-binary",
                    ":all:", "-d", str(wheels)], check=True)
    (wheel,) = wheels.glob(f"vllm-{VLLM_VERSION}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        keep = [n for n in zf.namelist()
                if (n.startswith("vllm/") and n.endswith(".py"))
                or n.startswith(f"vllm-{VLLM_VERSION}.dist-info/")]
        zf.extractall(SRC, keep)
    wheel.unlink()  # only the sources are needed
    subprocess.run([*pip, "install", "--no-deps", "--target", str(DEPS), *IMPORT_DEPS],
                   check=True)
    _DONE.touch()


def load(allow_fetch: bool = True) -> VllmModules | str:
    """vLLM's modules, or a sentence saying why they cannot be imported here."""
    try:
        if allow_fetch:
            fetch()
        elif not _DONE.exists():
            return f"vLLM {VLLM_VERSION} is not fetched (run python -m bench.vllm_reference)"
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        return f"could not fetch vLLM {VLLM_VERSION} with pip: {e}"
    for p in (SRC, DEPS):  # after the venv's own packages, so those win
        if str(p) not in sys.path:
            sys.path.append(str(p))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in _BARE_PACKAGES:
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(SRC.joinpath(*name.split(".")))]
            sys.modules[name] = pkg
    try:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils import hashing
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request, RequestStatus
        from vllm.version import __version__
    except Exception as e:  # any import failure means: no comparison, said plainly
        return f"vLLM {VLLM_VERSION} could not be imported: {type(e).__name__}: {e}"
    return VllmModules(
        __version__, KVCacheManager, Request, RequestStatus, SamplingParams, KVCacheConfig,
        KVCacheGroupSpec, FullAttentionSpec, kv_cache_utils.get_request_block_hasher,
        kv_cache_utils.init_none_hash,
        {"sha256": hashing.sha256, "sha256_cbor": hashing.sha256_cbor,
         "xxhash": hashing.xxhash, "xxhash_cbor": hashing.xxhash_cbor},
        torch.float16,
    )


if __name__ == "__main__":
    got = load()
    print(got if isinstance(got, str) else f"vLLM {got.version}: {got.KVCacheManager}")
