"""The device check (benchmarks/device.sh) stays runnable without a GPU: its host-sync and
profile sections on the CPU, in a subprocess as on the device machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_on_the_cpu(tmp_path):
    run = subprocess.run(
        ["bash", "benchmarks/device.sh", str(tmp_path), "--device", "cpu", "--quick",
         "--sections", "syncs,profile"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    out = json.loads((tmp_path / "device_check.json").read_text())
    rows = out["sections"]["syncs"]["rows"]
    # One host read per meta-step, stacked or looped (tests/test_host_reads.py in full).
    assert [r["host_reads_per_step"] for r in rows] == [1, 1, 1]
    # The profile: every implementation's operators, in time that adds up by kind.
    profile = out["sections"]["profile"]["rows"]
    assert [r["implementation"][:7] for r in profile] == ["metaddp", "torch.f", "floor: "]
    for r in profile:
        assert r["ms_per_step"] > 0 and len(r["top"]) == 10
        # Rounded to 1 microsecond per kind, at most 7 kinds.
        assert abs(sum(r["ms_by_kind"].values()) - r["ms_per_step"]) < 0.01
    assert (tmp_path / "device_check.md").read_text().startswith("# Device check")
