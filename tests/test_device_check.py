"""The device check (benchmarks/device.sh) stays runnable without a GPU: its host-sync section
on the CPU, in a subprocess as on the device machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_on_the_cpu(tmp_path):
    run = subprocess.run(
        ["bash", "benchmarks/device.sh", str(tmp_path), "--device", "cpu", "--quick",
         "--sections", "syncs"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = json.loads((tmp_path / "device_check.json").read_text())
    rows = out["sections"]["syncs"]["rows"]
    # One host read per meta-step, stacked or looped (tests/test_host_reads.py in full).
    assert [r["host_reads_per_step"] for r in rows] == [1, 1, 1]
    assert (tmp_path / "device_check.md").read_text().startswith("# Device check")
