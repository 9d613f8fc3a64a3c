#!/usr/bin/env python3
"""Writes profiles/data/gemm/<gpu>-bf16.csv from OpenXLA's measured matmul table.

    scripts/gemm_tables.py HEADER REPO COMMIT

HEADER is `xla/service/gpu/model/matmul_interpolator_data.h` (`kDefaultMatmulPTable`, a
textproto of measured FLOP/s per (batch, m, n, k) and dtype, per GPU) at commit COMMIT of the
GitHub repository REPO (openxla/xla or a fork of it), read for instance with `git show
COMMIT:xla/service/gpu/model/matmul_interpolator_data.h > /tmp/table.h` in a clone. For each GPU below, the batch-1
"bf16xbf16->bf16" entries become rows `m,n,k,tflops` (rounded to 0.1 TFLOP/s), sorted by
FLOPs, under a header that cites the file and the commit. Files are written atomically.
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# OpenXLA's key -> (flatpipe's file, the GPU's name and datasheet peak as the header cites it).
GPUS = {
    "sm_90": ("h100-sxm-bf16.csv", "an NVIDIA H100 SXM (sm_90)", "989 TFLOP/s dense bf16 (NVIDIA H100 datasheet)"),
    "sm_100_B200": ("b200-bf16.csv", "an NVIDIA B200 (sm_100)", "2,250 TFLOP/s dense bf16 (NVIDIA B200 datasheet)"),
}


def entries(text: str) -> dict[str, list[tuple[int, int, int, int, float]]]:
    """Per GPU key, its entries as (b, m, n, k, bf16 FLOP/s)."""
    out: dict[str, list] = {}
    key = None
    entry: dict = {}
    for line in text.splitlines():
        line = line.strip()
        if m := re.fullmatch(r'key: "((?:sm|gfx)[^"]*)"', line):
            key = m.group(1)
            out[key] = []
        elif m := re.fullmatch(r"([bmnk]): (\d+)", line):
            entry[m.group(1)] = int(m.group(2))
        elif m := re.fullmatch(r'flops \{ key: "bf16xbf16->bf16" value: (\d+) \}', line):
            if key is not None and set(entry) == {"b", "m", "n", "k"}:
                out[key].append((entry["b"], entry["m"], entry["n"], entry["k"], float(m.group(1))))
            entry = {}
    return out


def main() -> int:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    header, repo, commit = sys.argv[1:]
    with open(header) as f:
        table = entries(f.read())
    for key, (name, gpu, peak) in GPUS.items():
        rows = sorted((m * n * k, m, n, k, fl) for b, m, n, k, fl in table.get(key, []) if b == 1)
        if not rows:
            sys.exit(f"{header}: no batch-1 bf16 entries under key {key!r}")
        lines = [
            f"# Achieved dense bf16 GEMM throughput on {gpu}, by shape: C[m, n] = A[m, k] B[k, n],",
            "# one GEMM (batch 1), TFLOP/s = 2mnk / time. Source: OpenXLA's measured matmul table,",
            "# xla/service/gpu/model/matmul_interpolator_data.h (`kDefaultMatmulPTable`, key",
            f'# "{key}", "bf16xbf16->bf16") in {repo} at commit',
            f"# {commit}: every batch-1 entry, rounded to 0.1 TFLOP/s,",
            f"# written by scripts/gemm_tables.py. Peak: {peak}.",
            "m,n,k,tflops",
            *[f"{m},{n},{k},{fl / 1e12:.1f}" for _, m, n, k, fl in rows],
        ]
        out = os.path.join(ROOT, "profiles", "data", "gemm", name)
        with open(out + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(out + ".tmp", out)
        print(f"{out}: {len(rows)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
