"""bench.agentic on the tiny model at a tiny size: the three configurations run, the tokens
agree, and retention keeps the sessions that plain LRU loses."""

from __future__ import annotations

from bench.agentic import LRU, RETENTION, SESSIONS, main, run


def test_retention_keeps_what_lru_loses(capsys) -> None:
    argv = ["--model", "pagekv-tiny", "--pool-blocks", "64", "--max-model-len", "1024",
            "--sessions", "2", "--system", "128", "--task", "96", "--turn", "16",
            "--output", "4", "--one-shot", "256", "--rounds", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| retention |" in out and "equal in all three: True" in out


def test_the_figures(tmp_path) -> None:
    import argparse

    args = argparse.Namespace(model="pagekv-tiny", pool_blocks=64, max_model_len=1024,
                              sessions=2, system=128, task=96, turn=16, output=4,
                              one_shot=256, rounds=3, session_idle_s=600.0, threads=None,
                              seed=1)
    result = run(args)
    rows = result["rows"]
    assert result["same_tokens"]
    assert rows[RETENTION]["hit_rate"] > 0.8 > rows[LRU]["hit_rate"]
    assert rows[SESSIONS]["hit_rate"] > rows[LRU]["hit_rate"]
