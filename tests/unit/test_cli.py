"""`pagekv` command-line conventions: positional model, --config YAML, --version, global
flags anywhere, enumerated values checked by argparse, one error line and no traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagekv import cli
from pagekv.kvnode.engine.config import CHOICES
from pagekv.kvnode.pod.engine_flags import engine_args_from

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str):
    argv = list(argv)
    parser = cli.build_parser(argv[0])
    return parser.parse_args(cli.with_config(argv, parser, argv[0]))


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert re.match(r"pagekv \S+", capsys.readouterr().out)


def test_positional_model_like_vllm_serve() -> None:
    assert engine_args_from(parse("node", "/models/llama")).model == "/models/llama"
    assert engine_args_from(parse("node", "--model", "pagekv-small")).model == "pagekv-small"
    assert engine_args_from(parse("node")).model == "pagekv-tiny"


def test_global_flags_before_or_after_the_subcommand() -> None:
    p = cli.build_parser("node")
    assert p.parse_args(["--log-level", "debug", "node"]).log_level == "DEBUG"
    assert p.parse_args(["node", "--log-level", "debug"]).log_level == "DEBUG"


def test_config_file_with_flags_winning(tmp_path: Path) -> None:
    cfg = tmp_path / "pod.yaml"
    cfg.write_text("block-size: 32\nkv_cache_dtype: fp8\nenable-prefix-caching: false\n"
                   "cpu-offload-bytes: 2GiB\nmodel: pagekv-small\nport: 50099\n")
    ns = parse("node", "--config", str(cfg), "--block-size", "64")
    args = engine_args_from(ns)
    assert (args.block_size, args.kv_cache_dtype, args.enable_prefix_caching) == (64, "fp8", False)
    assert args.cpu_offload_bytes == 2 * 2**30 and args.model == "pagekv-small"
    assert ns.port == 50099
    ns = parse("node", "--config", str(cfg), "pagekv-tiny")
    assert engine_args_from(ns).model == "pagekv-tiny"  # the positional wins too


@pytest.mark.parametrize("argv, says", [
    (["node", "--block-size", "7"], "invalid choice: 7"),
    (["node", "--kv-cache-dtype", "fp4"], "invalid choice: 'fp4'"),
    (["node", "--hash-algo", "md5"], "invalid choice: 'md5'"),
    (["node", "--attention-backend", "cuda-graphs"], "invalid choice"),
    (["node", "--cpu-offload-bytes", "lots"], "not a size in bytes"),
    (["node", "--max-num-seqs", "many"], "invalid int value"),
    (["node", "--log-level", "loud"], "invalid choice"),
])
def test_bad_values_are_one_argparse_error(argv: list[str], says: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize("text, says", [
    ("block-size: [\n", "--config"),
    ("no-such-flag: 1\n", "unknown option 'no-such-flag'"),
    ("- a list\n", "expected a mapping"),
    ("enable-prefix-caching: maybe\n", "must be true or false"),
    ("block-size: 7\n", "invalid choice: 7"),
])
def test_bad_config_files_are_one_error(tmp_path: Path, text: str, says: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        cli.main(["node", "--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_value_only_the_model_can_judge_is_one_line_too() -> None:
    """--max-model-len past the model's limit is found at load time: still one line."""
    r = subprocess.run([sys.executable, "-m", "pagekv", "node", "--max-model-len",
                        "100000000", "--port", "0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pagekv node: error:") and "max_model_len" in last


def test_help_shows_each_default_once() -> None:
    text = cli.build_parser("node")._subparsers._group_actions[0].choices["node"].format_help()
    assert "(default: None)" not in text
    blocks = re.split(r"\n  (?=-)", text)
    assert blocks and all(b.count("default") <= 1 for b in blocks), \
        [b for b in blocks if b.count("default") > 1]
    assert "{8,16,32,64,128}" in text  # the choices are in the help


def test_top_level_help_says_what_pagekv_is_and_names_every_subcommand() -> None:
    r = subprocess.run([sys.executable, "-m", "pagekv", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # The description: the paragraph between the usage lines and the subcommands' list.
    description = " ".join(r.stdout.split("\n\n")[1].split())
    assert description.endswith("."), description  # a whole text, not one cut mid-list
    assert "router" in description and "KV" in description
    listed = re.search(r"Subcommands: ([^;]+);", description)
    assert listed is not None, description
    assert [s.strip() for s in listed.group(1).split(",")] == list(cli.SUBCOMMANDS)


def test_kv_dtype_choices_match_the_kv_cache() -> None:
    from pagekv.kvnode.model.attention.kv_cache import KV_CACHE_DTYPES

    assert tuple(CHOICES["kv_cache_dtype"]) == KV_CACHE_DTYPES


def test_python_dash_m_pagekv_is_the_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "pagekv", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("pagekv "), r.stderr


def test_bench_cluster_says_in_one_line_why_a_request_failed() -> None:
    """A refused or failed call (here: nothing listens) is one line, not a gRPC traceback."""
    from pagekv.deploy.redis_server import free_port

    r = subprocess.run([sys.executable, "-m", "pagekv", "bench-cluster", "--router",
                        f"127.0.0.1:{free_port()}", "--groups", "1", "--per-group", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pagekv bench-cluster: error: the cold request of group 0 failed: "
                           "UNAVAILABLE"), last
