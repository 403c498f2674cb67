"""The CPU a figure was measured on, for every bench to print beside its figures: the model
name, the cores this process may use, the vector extensions kernels choose from (AVX, AVX2,
FMA, F16C, AVX-512 and its VNNI/BF16 parts, AVX-VNNI, AMX) and the load average."""

from __future__ import annotations

import os
import platform

VECTOR_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "neon", "asimd", "sve")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The first CPU's model name and its vector flags, sorted, from /proc/cpuinfo (Linux);
    elsewhere the platform's processor string and no flags."""
    model, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return model, sorted(f for f in flags if f.startswith(VECTOR_PREFIXES))


def cpu_kind() -> str:
    """One line: model; cores; vector flags; load average."""
    model, flags = cpu_model_and_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU {model}; {cores} cores; flags: {' '.join(flags) or 'none'}; load average {load}"


if __name__ == "__main__":
    print(cpu_kind())
