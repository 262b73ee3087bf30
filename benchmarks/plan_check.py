"""The planner (``jaxcomp.planning``, ``python -m jaxcomp plan``) against
every measured row of the project's emulated-link test bed.

    python benchmarks/plan_check.py
    python benchmarks/plan_check.py --rows benchmarks/results/measured_rows.json \
        --compute benchmarks/results/codecs.json \
        --gpu-compute benchmarks/results/gpu-h200/codecs-gpu.json

Prints, per table of benchmarks/results/measured_rows.json (the rows of
docs/benchmarks.md), each measured time beside the model's prediction with
the stored codec figures; "claimed" rows (one all-reduce as ``plan`` ranks
it) are held to :data:`CLAIM` by tests/test_planning.py. The bed's links,
as the model's :class:`~jaxcomp.planning.Link`, are :func:`testbed_link`
(benchmarks/collectives.py builds the bed itself; docs/choosing.md, "The
test bed's link").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
from collections.abc import Mapping, Sequence

from jaxcomp import codecs
from jaxcomp.codecs.base import Codec
from jaxcomp.collectives import choose_algorithm
from jaxcomp.planning import (
    TRAFFIC_MAX_DEVICES,
    Cluster,
    Compute,
    Link,
    Sharding,
    load_compute,
    predict,
    predict_sharded,
    predict_step,
)

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def testbed_link(rate: str) -> Link:
    """The project's emulated link (/work/shared/testbed.md): tbf on both
    ends of every veth, no delay.

    - bandwidth and goodput: ``tc ... tbf rate`` and the measured goodput,
      946-963 Mbit/s of 1 Gbit and 98.1 of 100 Mbit (testbed.md);
    - latency 0: tbf emulates no delay (testbed.md); what a tiny collective
      costs there is the processes' scheduling on shared cores
      (docs/choosing.md);
    - the all-to-all: XLA's CPU all-to-all over gloo took 0.387 s for a
      model of 0.201 s at 1 Gbit and 3.291 s for 2.013 s at 100 Mbit
      (benchmarks/links.py, 8 MiB per destination; docs/benchmarks.md);
      the queue holds ``rate * latency + burst`` of tbf (1gbit: 5 ms and
      256 KiB, 100mbit: 20 ms and 32 KiB; testbed.md): an all-to-all that
      posts less than that at once loses no packet (tc's counters,
      docs/choosing.md). That is XLA's all-to-all, with which the rows
      this model is checked against were measured; jaxcomp's collectives
      now run the all-to-all as ``ppermute`` rounds between CPU processes
      (``_exchange.pairwise``), faster there than this term says.
    """
    if rate == "1gbit":
        return Link(1e9, 0.0, 0.955, 0.387 / 0.201, 1e9 / 8 * 0.005 + (256 << 10))
    if rate == "100mbit":
        return Link(1e8, 0.0, 0.981, 3.291 / 2.013, 1e8 / 8 * 0.020 + (32 << 10))
    raise ValueError(f"testbed_link: rate must be '1gbit' or '100mbit', got {rate!r}")


# The test bed runs four processes on two cores, and the CPU figures were
# measured by one process whose kernels used both: every encode and decode
# there runs at about a quarter of the measured speed (docs/benchmarks.md:
# "every encode and decode runs at about half a core's speed").
TESTBED_SHARE = 4.0
# What the model claims for one all-reduce as `plan` ranks it: within 30%.
CLAIM = 0.30


@dataclasses.dataclass(frozen=True)
class Check:
    """One measured row beside its prediction."""

    table: str
    label: str
    measured: float
    predicted: float
    claimed: bool  # within what the model predicts (an all-reduce as `plan` ranks it)
    why: str = ""  # for rows it does not claim

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


def _codec(spec: str) -> Codec | None:
    return None if spec == "float32" else codecs.get(spec)


def _check_collectives(table: Mapping, compute: Compute) -> list[Check]:
    n = table["values_per_process"]
    out = []
    for r in table["rows"]:
        cluster = Cluster(r["procs"], 1, testbed_link(r["link"]))
        e = predict(_codec(r["codec"]), r["algorithm"], n, cluster, compute)
        depth = r.get("pipeline_depth", 1)
        alg = r["algorithm"] + (f", {depth} segments" if depth > 1 else "")
        label = f"{r['link']} | {r['codec']} | {alg} | {r['run']}"
        why = "" if depth == 1 else "pipelined: not modelled"
        out.append(Check("collectives", label, r["seconds"], e.seconds, depth == 1, why))
    return out


def _sgd_seconds(compute: Compute, shapes) -> float:
    """The sgd update after the all-reduce: read the parameters and the
    mean gradient, write the parameters (12 bytes per element)."""
    return compute.memory_seconds(12 * sum(math.prod(s) for s in shapes))


def _check_optimizer_step(table: Mapping, compute: Compute) -> list[Check]:
    shapes = [tuple(s) for s in table["leaves"]]
    out = []
    for r in table["rows"]:
        cluster = Cluster(r["procs"], 1, testbed_link(r["link"]))
        codec = _codec(r["codec"])
        if r["update"] == "bare jc.pmean + sgd":
            parts = []
            for s in shapes:
                m = math.prod(s)
                alg = r["algorithm"]
                alg = choose_algorithm(codec, m, cluster.devices) if alg == "auto" else alg
                parts.append(predict(codec, alg, m, cluster, compute))
        else:
            ef = r["update"].startswith("compress_gradients")
            parts = predict_step(codec, shapes, cluster, compute, error_feedback=ef)
        t = sum(e.seconds for e in parts) + _sgd_seconds(compute, shapes)
        why = "4 all-reduces + update in one program"
        label = f"{r['link']} | {r['codec']}@{r['algorithm']} | {r['update']}"
        out.append(Check("optimizer step", label, r["seconds"], t, False, why))
    return out


def _check_end_to_end(table: Mapping, compute: Compute) -> list[Check]:
    shapes = [tuple(s) for s in table["leaves"]]
    out = []
    for r in table["rows"]:
        label = f"{r['link']} | {r['row']} | {r['run']}"
        if r["codec"].startswith("powersgd"):
            continue  # a transformation of its own, not a codec: not ranked
        codec = _codec(r["codec"])
        cluster = Cluster(table["procs"], 1, testbed_link(r["link"]))
        parts = predict_step(codec, shapes, cluster, compute, error_feedback=codec is not None)
        t = r["compute_s"] + sum(e.seconds for e in parts)
        why = "a whole training step"
        out.append(Check("end to end", label, r["step_s"], t, False, why))
    return out


def _check_sharded(table: Mapping, compute: Compute) -> list[Check]:
    """benchmarks/fsdp_links.py's step: the compute alone as measured,
    plus the predicted parameter all-gather and gradient reduce-scatter of
    each layer (``plan --shard-params``'s terms). Its loss uses the whole
    model, so nothing is gathered again in the backward pass."""
    per_layer = sum(math.prod(s) for s in table["layer_leaves"])
    n = per_layer * table["layers"]
    out = []
    for r in table["rows"]:
        cluster = Cluster(table["procs"], 1, testbed_link(r["link"]))
        s = Sharding(_codec(r["gradients"]), _codec(r["parameters"]))
        if any(
            c is not None and repr(c) not in compute.kernels for c in (s.gradients, s.parameters)
        ):
            continue  # no stored speed for the codec (the 64-value buckets)
        e = predict_sharded(
            s,
            n,
            cluster,
            compute,
            regather=False,
            error_feedback=r["error_feedback"],
            bucket=per_layer,
        )
        label = f"{r['link']} | {r['row']}"
        why = "a whole training step"
        out.append(
            Check("sharded step", label, r["step_s"], r["compute_s"] + e.seconds, False, why)
        )
    return out


def _check_gpu(table: Mapping, compute: Compute) -> list[Check]:
    shapes = [tuple(s) for s in table["leaves"]]
    cluster = Cluster(table["devices"], 1, Link(math.inf))
    out = []
    for r in table["rows"]:
        parts = predict_step(_codec(r["codec"]), shapes, cluster, compute)
        t = 1e3 * sum(e.seconds for e in parts)
        why = "one-GPU training step"
        out.append(
            Check("gpu train step", f"{table['device']} | {r['row']}", r["extra_ms"], t, False, why)
        )
    return out


def check(rows: Mapping, cpu: Compute, gpu: Compute | None = None) -> list[Check]:
    """Every row of ``rows`` (the layout of
    benchmarks/results/measured_rows.json) beside its prediction: the
    emulated-link rows with the CPU figures ``cpu`` at the test bed's share
    (:data:`TESTBED_SHARE`), the GPU step with ``gpu``."""
    cpu = dataclasses.replace(cpu, share=TESTBED_SHARE)
    out = _check_collectives(rows["collectives"], cpu)
    out += _check_optimizer_step(rows["optimizer_step"], cpu)
    out += _check_end_to_end(rows["end_to_end"], cpu)
    out += _check_sharded(rows["sharded_step"], cpu)
    if gpu is not None:
        out += _check_gpu(rows["gpu_train_step"], gpu)
    return out


# The columns of each table's labels (``Check.label`` joins them with " | ").
_LABEL_COLUMNS = {
    "collectives": "link | codec | algorithm | run",
    "optimizer step": "link | codec@algorithm | update",
    "end to end": "link | row | run",
    "gpu train step": "device | row",
    "sharded step": "link | row",
}


def check_table(checks: Sequence[Check], unit: str = "s") -> str:
    """A markdown table of one table's measured rows beside their
    predictions."""
    cols = _LABEL_COLUMNS[checks[0].table]
    lines = [
        f"| {cols} | measured {unit} | predicted {unit} | error | claimed |",
        "|" + "---|" * (cols.count("|") + 5),
    ]
    for c in checks:
        claimed = "yes" if c.claimed else f"no: {c.why}"
        lines.append(
            f"| {c.label} | {c.measured:.3f} | {c.predicted:.3f} | {100 * c.error:+.0f}% | {claimed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", default=str(RESULTS / "measured_rows.json"))
    ap.add_argument("--compute", default=str(RESULTS / "codecs.json"), help="CPU bench JSON")
    ap.add_argument(
        "--gpu-compute",
        default=str(RESULTS / "gpu-h200" / "codecs-gpu.json"),
        help="GPU bench JSON for the GPU rows ('' to leave them out)",
    )
    args = ap.parse_args(argv)
    import jax

    # The memory terms compile the all-reduce on a CPU mesh of that many devices.
    jax.config.update("jax_num_cpu_devices", TRAFFIC_MAX_DEVICES)
    with open(args.rows) as f:
        rows = json.load(f)
    gpu = load_compute(args.gpu_compute) if args.gpu_compute else None
    checks = check(rows, load_compute(args.compute), gpu)
    for table in dict.fromkeys(c.table for c in checks):
        part = [c for c in checks if c.table == table]
        unit = "ms" if table == "gpu train step" else "s"
        print(f"\n{table}:\n")
        print(check_table(part, unit))
    claimed = [abs(c.error) for c in checks if c.claimed]
    print(f"\nclaimed rows: {len(claimed)}, largest error {100 * max(claimed):.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
