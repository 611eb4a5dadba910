"""One line naming the machine a benchmark ran on (benchmarks always say where)."""

import os
import platform


def machine_info() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        torch_v = f", torch {torch.__version__}"
    except ImportError:
        torch_v = ""
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}{torch_v}"
