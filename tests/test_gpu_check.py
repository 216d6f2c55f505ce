"""The GPU check's dry run (issue 43): benchmarks/gpu/check.sh with `--device cpu --quick` runs
every step the GPU run does but on the CPU: the carried wheels fetched and unpacked for Python
3.12, the default model's stand-in made from its carried files, the tests that read it, and
the benchmark at a small size. So the script is known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "benchmarks/gpu/check.sh", "--device", "cpu", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = (tmp_path / "check.log").read_text() if (tmp_path / "check.log").exists() else ""
    assert run.returncode == 0, log[-4000:] + run.stderr[-2000:]
    steps = json.loads((tmp_path / "check.json").read_text())["steps"]
    assert all(v.startswith("ok") for v in steps.values()), steps
    suite = ET.parse(tmp_path / "tests.xml").getroot().find("testsuite")
    assert int(suite.get("tests")) >= 1 and int(suite.get("failures")) == 0
    assert int(suite.get("errors")) == 0
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert bench["copy_bandwidth_Bps"] > 0 and bench["matmul_bf16_flops"] > 0
    for figures in bench["decode"].values():
        assert figures["step_s_median"] > 0 and figures["x_weight_read_floor"] > 0
    assert bench["prefill"]["ttft_s"] > 0
