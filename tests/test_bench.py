"""The bench/ scripts run at their smallest setting, so a refactor cannot break one unnoticed.

The numbers they print are not asserted here (timings belong to the
benchmarks, run side by side on a quiet machine); only that each script
runs to the end and prints its summary line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(script: str, *args: str, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_dp_overhead_smallest(ci_base_cache):
    from privcode.config import BaseConfig
    from privcode.models.base import build_base

    model = build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]
    # Two of its modes (a subprocess each): the DP step and the secure mode's extra draws;
    # nondp, functorch and ghost differ from hooks by one argument.
    out = _run("dp_overhead.py", "--model", model, "--batch", "2", "--length", "8",
               "--steps", "1", "--rounds", "1", "--records", "64", "--threads", "1",
               "--modes", "hooks", "secure")
    rows = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert {"hooks", "secure"} <= rows
    assert "secure mode" in out and "/ standard hooks: step time" in out
