"""benchmarks/fsdp_links.py: a two-process smoke run (loopback, no
namespaces and no shaping, a tiny model, two steps of the compute alone,
the float32 sharded step and the int8 + QSGD-4 one, the replicated float32
and QSGD-4 steps; the measurement over
emulated links is not in CI), its byte count of a compiled program and
the table it writes into docs/fsdp.md."""

import importlib.util
import json
import math
import pathlib
import sys

import pytest
from helpers import run_benchmark_smoke

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    """The script as a module, sys.path left as it was (the script puts the
    checkout first for its own processes)."""
    spec = importlib.util.spec_from_file_location(
        "fsdp_links", ROOT / "benchmarks" / "fsdp_links.py"
    )
    mod = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path
    return mod


def test_bytes_sent_per_kind_of_collective():
    """What one of 4 devices sends, from result shapes as XLA:CPU prints
    them (an all-to-all's tuple of per-peer arrays summed)."""
    hlo = """
      %ag = f32[1024,256]{1,0} all-gather(f32[256,256]{1,0} %p), dimensions={0}
      %rs = f32[256,256]{1,0} reduce-scatter(f32[1024,256]{1,0} %g), dimensions={0}
      %a2a = (u8[100]{0}, u8[100]{0}, u8[100]{0}, u8[100]{0}) all-to-all(u8[100] %a, ...)
      %cp = u8[300]{0} collective-permute(u8[300]{0} %b), source_target_pairs={{0,1}}
      %ar = f32[]{:T(128)} all-reduce(f32[] %l), to_apply=%sum
    """
    sent = _script().sent_bytes(hlo, 4)
    assert sent == {
        "all-gather": 3 * 256 * 256 * 4,
        "reduce-scatter": 3 * 256 * 256 * 4,
        "all-to-all": 300,
        "collective-permute": 300,
        "all-reduce": 6,
    }


def test_table_goes_into_docs_at_the_marker(tmp_path, monkeypatch):
    mod = _script()
    doc = tmp_path / "fsdp.md"
    monkeypatch.setattr(mod, "DOC", doc)
    mod.write_doc(["| a |"])  # no page: nothing written
    assert not doc.exists()
    doc.write_text(f"# Sharded\n\n{mod.MARKER}\n\nAfter.\n")
    mod.write_doc(["| first |"])
    mod.write_doc(["| second |"])  # a rerun replaces the table between the markers
    text = doc.read_text()
    assert mod.MARKER not in text and "| first |" not in text
    assert text == f"# Sharded\n\n{mod.BEGIN}\n| second |\n{mod.END}\n\nAfter.\n"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_on_loopback(tmp_path):
    out = tmp_path / "fsdp_links.json"
    run_benchmark_smoke("fsdp_links.py", out)
    data = json.loads(out.read_text())
    assert data["procs"] == 2
    rows = {rec["row"]: rec for rec in data["records"]}
    assert set(rows) == {"compute", "float32", "int8+qsgd4", "dp-float32", "dp-qsgd4"}
    for rec in rows.values():
        assert rec["link"] == "unshaped" and rec["steps"] == 2 and rec["step_s"] > 0
    # The compute alone runs no collective; the sharded steps train.
    assert rows["compute"]["sent_bytes"] == 0
    for row in ("float32", "int8+qsgd4", "dp-float32", "dp-qsgd4"):
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
    # Replicated: float32 is one all-reduce of the gradient (2(P-1)/P = 1
    # of its bytes per device); QSGD-4's buckets send under a third of it.
    assert rows["dp-float32"]["sent_by_kind"]["all-reduce"] >= 4 * n
    assert 0 < rows["dp-qsgd4"]["sent_bytes"] < rows["dp-float32"]["sent_bytes"] / 3
