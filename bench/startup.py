"""Start-up benchmark: `pagekv node` from exec to SERVING (grpc.health.v1), side by side.

Rows, each the median of --repeat starts of the tiny preset on this machine:
* prebuilt kernel   — the C++ kernel built ahead of time (`pagekv build-kernels`): the normal
                      warm start of an installed pod;
* pure-torch path   — `--attention-backend torch`: no kernel at all, the floor;
* JIT compile       — an empty kernel cache (a fresh TORCH_EXTENSIONS_DIR): what every start
                      cost when the cache was keyed wrongly (skipped with --quick).

    python -m bench.startup [--quick] [--repeat 3] [--model pagekv-tiny]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import machine_info  # noqa: E402
from pagekv.deploy.local_cluster import pagekv_cmd, spawn, stop_child, wait_healthy  # noqa: E402
from pagekv.deploy.redis_server import free_port  # noqa: E402


def start_once(run_dir: Path, model: str, extra: list[str], env: dict[str, str]) -> float:
    """Seconds from exec to SERVING for one pod (no Redis: the index is not on this path)."""
    port = free_port()
    argv = pagekv_cmd("node", "--model", model, "--host", "127.0.0.1", "--port", str(port),
                      "--metrics-port", "0", *extra)
    t0 = time.perf_counter()
    child = spawn(f"pod-{port}", argv, run_dir, env)
    try:
        wait_healthy(f"127.0.0.1:{port}", timeout=600, proc=child.proc)
        return time.perf_counter() - t0
    except BaseException:
        print(child.log_tail(), file=sys.stderr)
        raise
    finally:
        stop_child(child)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the JIT row")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default="pagekv-tiny")
    args = ap.parse_args(argv)
    run_dir = Path(tempfile.mkdtemp(prefix="pagekv-bench-startup-"))
    rows = [("prebuilt kernel", ["--attention-backend", "cpp"], {}),
            ("pure-torch path", ["--attention-backend", "torch"], {})]
    if not args.quick:
        rows.append(("JIT compile (empty cache)", ["--attention-backend", "cpp"], "fresh"))
    times: dict[str, float] = {}
    for name, extra, env in rows:
        runs = []
        for _ in range(args.repeat if env != "fresh" else 1):
            e = {"TORCH_EXTENSIONS_DIR": tempfile.mkdtemp(dir=run_dir)} if env == "fresh" else {}
            runs.append(start_once(run_dir, args.model, extra, e))
        times[name] = statistics.median(runs)
    print(f"# pod start to SERVING, {args.model} ({machine_info()})")
    print("| start | median s | x pure-torch |")
    print("|---|---|---|")
    floor = times["pure-torch path"]
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {t / floor:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
