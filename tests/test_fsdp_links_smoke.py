"""A two-process smoke run of benchmarks/fsdp_links.py: loopback, no
namespaces and no shaping, a tiny model, two steps of the compute alone,
the float32 sharded step and the int8 + QSGD-4 one (the measurement over
emulated links is not in CI)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_two_processes_on_loopback(tmp_path):
    out = tmp_path / "fsdp_links.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # The script bounds every process (timeout) and kills what is left;
    # this bounds the script.
    r = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "fsdp_links.py", "--smoke", "--json", out],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["procs"] == 2
    rows = {rec["row"]: rec for rec in data["records"]}
    assert set(rows) == {"compute", "float32", "int8+qsgd4"}
    for rec in rows.values():
        assert rec["link"] == "unshaped" and rec["steps"] == 2 and rec["step_s"] > 0
    # The compute alone runs no collective; the sharded steps train.
    assert rows["compute"]["sent_bytes"] == 0
    for row in ("float32", "int8+qsgd4"):
        assert math.isfinite(rows[row]["first_loss"]) and math.isfinite(rows[row]["last_loss"])
    # float32 (2 processes): each device sends half of every parameter's
    # float32 bytes in the all-gather and half in the reduce-scatter, as
    # the compiled program says.
    cfg = data["config"]
    n = cfg["layers"] * cfg["width"] * (cfg["width"] + 1)
    f32 = rows["float32"]["sent_by_kind"]
    assert f32["all-gather"] == f32["reduce-scatter"] == 4 * n // 2
    # Compressed: no float32 reduce-scatter is left, and the step sends
    # under a third of float32's bytes (bucket padding of the tiny
    # biases keeps it above the large model's fifth).
    c = rows["int8+qsgd4"]["sent_by_kind"]
    assert "reduce-scatter" not in c
    assert 0 < rows["int8+qsgd4"]["sent_bytes"] < rows["float32"]["sent_bytes"] / 3
