"""A two-process smoke run of benchmarks/end_to_end.py: loopback, no
namespaces and no shaping, a tiny model, a few steps of the float32 row and
a compressed one (the full benchmark, over emulated links, is not in CI)."""

import json

import pytest
from helpers import run_benchmark_smoke

pytestmark = pytest.mark.multiprocess


def test_two_processes_on_loopback(tmp_path):
    out = tmp_path / "end_to_end.json"
    run_benchmark_smoke("end_to_end.py", out)
    data = json.loads(out.read_text())
    rows = {rec["row"]: rec for rec in data["links"]["loopback"]}
    assert set(rows) == {"float32", "qsgd:bits=4"}
    for rec in rows.values():
        assert rec["steps"] == 4 and len(rec["history"]) == 3  # step 0, 2 and 4
        assert rec["step_s"] > 0 and rec["compute_s"] > 0
        assert 0 <= rec["final_accuracy"] <= 1 and rec["final_loss"] > 0
    # The compressed row sends fewer bytes than float32's ring all-reduce.
    assert 0 < rows["qsgd:bits=4"]["wire_bytes"] < rows["float32"]["wire_bytes"]
    # The target is float32's final accuracy less a margin: float32 reaches it.
    assert rows["float32"]["steps_to_target"] is not None
    assert rows["float32"]["speedup"] == 1.0
