"""Sharded training over emulated slow links: the step time of
``jc.data_parallel(shard_params=jc.fsdp.ShardParams(...))``, float32
against compressed collectives.

One JAX process per network namespace, each with one CPU device, joined by
jax.distributed (gloo) over a bridge whose links are shaped with tbf in both
directions: the test bed of benchmarks/collectives.py, whose helpers this
script imports. Every row runs the same sharded train step (forward,
backward, the parameters all-gathered and the gradients reduce-scattered
inside it, ``optax.adam`` on each device's shards) on the same model and
batch; only the codecs of the two collectives differ:

- float32: ``ShardParams(gradients=None, parameters=None)``, lax's
  all-gather and reduce-scatter;
- int8 + QSGD-4: the parameters all-gathered as ``jc.codecs.Int8()``, the
  gradients reduce-scattered as ``jc.codecs.QSGD(bits=4)`` with error
  feedback;
- bf16: ``jc.codecs.Cast("bfloat16")`` both ways, with error feedback;
- QSGD-4 gradients: the reduce-scatter compressed, the all-gather float32.

The replicated rows (``--rows dp-...``) run ``jc.data_parallel`` without
``shard_params`` on the same model: ``optax.chain(compress_gradients(codec),
optax.adam)`` (``uncompressed_mean`` for float32), its buckets reduced from
inside the backward pass (``dp-qsgd4``), after it (``dp-qsgd4-post``:
``overlap=False``), or on a loss whose gradient is the batch repeated
(``dp-qsgd4-comm``: the collectives, codecs and adam alone), against the
compute alone; for QSGD-4, OneBit and bf16 (docs/training-loop.md).

XLA:CPU's float32 reduce-scatter over gloo is gloo's recursive
halving-doubling; on 4 ranks the tc counters show ranks 1 and 2 sending
about a quarter of the gradient more per step than ranks 0 and 3 (which
send what the HLO count says), so the float32 row's busiest link carries
more than that count. The compressed reduce-scatter is an
all-to-all, over several processes of the CPU backend a pairwise exchange
of ``collective-permute``s (jaxcomp/collectives/_exchange.py), and every
host sends the same bytes.

The model: a stack of dense layers (4 of 1024 x 1024 by default, tanh
between them, 4.2 million parameters, 16.8 MB of float32), a regression
loss, 16 samples per process: little compute per parameter, so that at
100 Mbit the float32 step is mostly link. "compute alone" shows it: the
same model's step (forward, backward, adam) on each process's own device,
no sharding and no collectives, run by all processes at once as in the
job, so it sees the same share of the CPU.

Per row and link: the step time (median of the slowest process over
``--steps`` steps after ``--warmup`` warm-up steps, each step started
together on every process), the bytes each device sends per step (read
from the compiled step's HLO: every collective's result bytes, counted as
what a device sends: (P-1)/P of an all-gather's or all-to-all's result,
P-1 times a reduce-scatter's, a collective-permute's whole, 2(P-1)/P of an
all-reduce's), the bytes the tc counters saw each host send per step, the
alpha-beta step time (the row's step on unshaped loopback, i.e. its compute
and codec work, plus the bytes sent over the link rate) and the speedup
over float32.

    sudo python benchmarks/fsdp_links.py                 # 100 Mbit and 1 Gbit, every row
    sudo python benchmarks/fsdp_links.py --rates 100mbit --rows float32 int8+qsgd4
    sudo python benchmarks/fsdp_links.py --render --docs # table from the JSON into docs/fsdp.md
    python benchmarks/fsdp_links.py --smoke --json /tmp/f.json   # 2 processes, loopback

``--smoke``: two processes on 127.0.0.1, no namespaces and no shaping, a
tiny model, two steps (the CI smoke test). Needs root, iproute2 and tbf
otherwise (skips with a message where they are missing). Imports jaxcomp
from this checkout. Writes benchmarks/results/fsdp_links.json and
benchmarks/results/fsdp_links.md; ``--docs`` puts the table, the command
and the date in docs/fsdp.md, at the line ``<!-- links: filled by
benchmarks/fsdp_links.py -->`` (or between the markers that replace it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import signal
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # this checkout's jaxcomp (jaxcomp.fsdp)

import collectives as testbed  # noqa: E402  (benchmarks/collectives.py: the test bed)

# row -> (parameters codec, gradients codec), as jc.codecs.get specs; None: float32.
ROWS = {
    "float32": (None, None),
    "int8+qsgd4": ("int8", "qsgd:bits=4"),
    "int8+qsgd4-b64": ("int8:bucket_size=64", "qsgd:bits=4,bucket_size=64"),
    "bf16": ("cast:dtype=bfloat16", "cast:dtype=bfloat16"),
    "qsgd4-grads": (None, "qsgd:bits=4"),
}
LABELS = {
    "compute": "compute alone (one device, no collectives)",
    "float32": "sharded float32",
    "int8+qsgd4": "int8 all-gather + QSGD-4 reduce-scatter (EF)",
    "int8+qsgd4-b64": "int8 all-gather + QSGD-4 reduce-scatter (EF), 64-value buckets",
    "bf16": "bf16 all-gather + bf16 reduce-scatter (EF)",
    "qsgd4-grads": "float32 all-gather + QSGD-4 reduce-scatter (EF)",
}
# Replicated rows: jc.data_parallel without shard_params, the chain
# compress_gradients(codec) (uncompressed_mean for float32) + adam, its
# buckets reduced from inside the backward pass ("overlap"), after it
# ("post", overlap=False), or on a loss whose gradient is the batch repeated
# ("comm": the collectives', the codecs' and adam's time alone; a gradient
# that is a broadcast would let XLA all-reduce the scalar instead).
# row -> (codec spec or None, mode)
DP_ROWS = {
    "dp-float32": (None, "post"),
    "dp-float32-comm": (None, "comm"),
    **{
        f"dp-{name}{suffix}": (spec, mode)
        for name, spec in [
            ("qsgd4", "qsgd:bits=4"),
            ("onebit", "onebit"),
            ("bf16", "cast:dtype=bfloat16"),
        ]
        for suffix, mode in [("", "overlap"), ("-post", "post"), ("-comm", "comm")]
    },
}
_MODES = {
    "overlap": "in the backward pass",
    "post": "after the backward pass",
    "comm": "comm alone",
}
LABELS.update(
    {
        row: f"replicated {row[3:].removesuffix('-post').removesuffix('-comm')}, {_MODES[mode]}"
        for row, (_, mode) in DP_ROWS.items()
    }
)
MARKER = "<!-- links: filled by benchmarks/fsdp_links.py -->"
BEGIN, END = "<!-- fsdp-links:begin -->", "<!-- fsdp-links:end -->"
DOC = ROOT / "docs" / "fsdp.md"
TAG = "fsdp"  # this script's own namespaces, beside the other benchmarks' beds
LOOPBACK = "unshaped"


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------
def make_model(width: int, layers: int, batch: int, pid: int):
    """``(params, loss_fn, local_batch)``: a stack of dense layers, numpy
    parameters (the same on every process) and this process's batch."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = {
        f"layer{i}": {
            "w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
            "b": np.zeros((width,), np.float32),
        }
        for i in range(layers)
    }
    data = np.random.default_rng(1 + pid)
    x = data.standard_normal((batch, width)).astype(np.float32)
    y = np.tanh(x[:, ::-1]).astype(np.float32)

    def loss_fn(p, b):
        h, target = b
        for i in range(layers):
            h = h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"]
            if i + 1 < layers:
                h = jnp.tanh(h)
        return jnp.mean((h - target) ** 2)

    return params, loss_fn, (x, y)


# ---------------------------------------------------------------------------
# Bytes on the wire, from the compiled program
# ---------------------------------------------------------------------------
_ITEM = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "u32": 4, "s32": 4, "u16": 2, "s16": 2}
_ITEM.update({"u8": 1, "s8": 1, "pred": 1, "u64": 8, "s64": 8})
# What one device sends, as a multiple of a collective's result bytes, over P devices.
_SENT = {
    "all-gather": lambda p: (p - 1) / p,
    "all-to-all": lambda p: (p - 1) / p,
    "reduce-scatter": lambda p: p - 1,
    "collective-permute": lambda p: 1.0,
    "all-reduce": lambda p: 2 * (p - 1) / p,
}


def _result_bytes(result: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", result):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += _ITEM[dtype] * n
    return total


def sent_bytes(hlo_text: str, procs: int) -> dict[str, int]:
    """Bytes one device sends per call of the compiled program, per kind of
    collective (over one axis of ``procs`` devices). An async ``*-start``
    returns (operand, result): its result is the last element of the tuple."""
    out: dict[str, int] = {}
    for kind, scale in _SENT.items():
        total = 0
        for result in re.findall(rf"= (.*?) {kind}\(", hlo_text):
            total += _result_bytes(result)
        for result in re.findall(rf"= \((.*?)\) {kind}-start\(", hlo_text):
            parts = re.findall(r"\b[a-z]+\d*\[[\d,]*\]", result)
            total += _result_bytes(parts[-1]) if parts else 0
        if total:
            out[kind] = round(total * scale(procs))
    return out


# ---------------------------------------------------------------------------
# One process of the job
# ---------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import jax

    mesh = testbed.join(args, "fsdp")  # the bed, or loopback with --coordinator
    import jaxcomp as jc

    if not args.twins and not jc.cpu_available():
        raise SystemExit("jaxcomp's CPU kernels are not importable in this process")
    out = {}
    for row in args.rows:
        if row == "compute":
            out[row] = compute_row(args)
        elif row in DP_ROWS:
            out[row] = replicated_row(args, mesh, row)
        else:
            out[row] = sharded_row(args, mesh, row)
        if args.pid == 0:
            t = statistics.median(out[row]["step_times"])
            print(f"{row}: median step {t:.3f} s (process 0)", flush=True)
    pathlib.Path(args.out).write_text(json.dumps(out))
    jax.distributed.shutdown()


def _timed(call, warmup: int, steps: int) -> dict:
    """``step_times``: seconds of ``steps`` calls after ``warmup`` (at
    least one: the first compiles), each started together on every process
    (the test bed's ``time_calls``; ``call`` returns what to wait for);
    ``cpu_s``: the CPU seconds this process's threads spent per timed step."""
    import time

    import jax

    for _ in range(warmup - 1):
        jax.block_until_ready(call())
    jax.block_until_ready(call())  # time_calls' own warm-up call, outside the CPU count
    cpu = time.process_time()
    times = testbed.time_calls(call, steps)
    return {"step_times": times, "cpu_s": (time.process_time() - cpu) / (steps + 1)}


def compute_row(args: argparse.Namespace) -> dict:
    """The step's compute alone: the whole model's forward, backward and
    adam update on this process's device and batch, no collectives."""
    import jax
    import optax

    params, loss_fn, batch = make_model(args.width, args.layers, args.batch, args.pid)
    tx = optax.adam(args.lr)
    dev = jax.local_devices()[0]
    params = jax.device_put(params, dev)
    carry = [params, jax.device_put(tx.init(params), dev)]
    batch = jax.device_put(batch, dev)

    def step(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    step = jax.jit(step, donate_argnums=(0, 1))

    def call():
        carry[0], carry[1], loss = step(carry[0], carry[1], batch)
        return loss

    timed = _timed(call, args.warmup, args.steps)
    return {**timed, "calls": args.warmup + 1 + args.steps, "sent": {}}


def sharded_row(args: argparse.Namespace, mesh, row: str) -> dict:
    import optax

    import jaxcomp as jc

    gather_spec, scatter_spec = ROWS[row]
    cfg = jc.fsdp.ShardParams(
        axis="fsdp",
        parameters=None if gather_spec is None else jc.codecs.get(gather_spec),
        gradients=None if scatter_spec is None else jc.codecs.get(scatter_spec),
        error_feedback=True,
        seed=0,
    )
    params, loss_fn, local_batch = make_model(args.width, args.layers, args.batch, args.pid)
    step = jc.data_parallel(loss_fn, optax.adam(args.lr), mesh, shard_params=cfg)
    return _steps(args, step, params, local_batch)


def replicated_row(args: argparse.Namespace, mesh, row: str) -> dict:
    import warnings

    import jax
    import jax.numpy as jnp
    import optax

    import jaxcomp as jc

    spec, mode = DP_ROWS[row]
    params, loss_fn, local_batch = make_model(args.width, args.layers, args.batch, args.pid)
    if mode == "comm":  # each gradient is this device's batch, repeated: no compute to speak of

        def loss_fn(p, b):
            leaves = enumerate(jax.tree.leaves(p))  # + i: no two leaves share a gradient
            return 1e-3 * sum(jnp.vdot(x, jnp.resize(b[0] + i, x.shape)) for i, x in leaves)

    axis = mesh.axis_names[0]
    first = (
        jc.optax.uncompressed_mean(axis)
        if spec is None
        else jc.optax.compress_gradients(spec, axis)
    )
    tx = optax.chain(first, optax.adam(args.lr))
    step = jc.data_parallel(loss_fn, tx, mesh, axis, overlap=mode == "overlap")
    with warnings.catch_warnings():  # a codec under 8 bits before adam: this run only times it
        warnings.simplefilter("ignore", RuntimeWarning)
        return _steps(args, step, params, local_batch)


def _steps(args: argparse.Namespace, step, params, local_batch) -> dict:
    """A row's timed steps of ``step`` from ``params``, its bytes and losses."""
    params, state = step.init(params)
    batch = step.shard_batch(local_batch)
    carry = [params, state]
    losses = []

    def call():
        carry[0], carry[1], loss = step(carry[0], carry[1], batch)
        losses.append(loss)
        return loss

    timed = _timed(call, args.warmup, args.steps)
    # The bytes, from the compiled program the calls ran (its executable is cached).
    text = step.lower(carry[0], carry[1], batch).compile().as_text()
    sent = sent_bytes(text, args.procs)
    if args.profile:
        timed["profile"] = concurrency(call, text, args.profile)
    return {
        **timed,
        "calls": args.warmup + 1 + args.steps + args.profile,  # every call sent its bytes
        "sent": sent,
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
    }


_COLLECTIVE_OPS = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")


def _kinds(hlo_text: str) -> dict[str, str]:
    """Each instruction of a compiled module: "collective", "matmul" (a dot,
    or a fusion whose computation holds one: XLA:CPU fuses its matrix
    products) or "other"."""
    bodies, calls, ops, cur = {}, {}, {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            cur = head.group(1)
            bodies[cur] = ""
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][a-z\-]*)\(", line)
        if m and cur is not None:
            bodies[cur] += line
            ops[m.group(1)] = m.group(2)
            calls[m.group(1)] = re.findall(r"calls=%?([\w.\-]+)", line)

    def kind(name):
        op = ops[name]
        if any(op.startswith(c) for c in _COLLECTIVE_OPS):
            return "collective"
        if op == "dot" or any(" dot(" in bodies.get(c, "") for c in calls[name]):
            return "matmul"
        return "other"

    return {name: kind(name) for name in ops}


def concurrency(call, hlo_text: str, steps: int) -> dict:
    """ms per step, from ``jax.profiler``'s trace of ``steps`` calls (the
    executor's events, one per operation of the compiled program): the time
    some collective ran, some matrix product, any other operation, and a
    collective beside a matrix product or beside anything else (intervals
    merged over the executor's threads)."""
    import gzip
    import tempfile

    import jax

    kinds = _kinds(hlo_text)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(steps):
            jax.block_until_ready(call())
        jax.profiler.stop_trace()
        (trace,) = pathlib.Path(tmp).rglob("*.trace.json.gz")
        events = json.loads(gzip.open(trace).read())["traceEvents"]
    spans: dict[str, list] = {"collective": [], "matmul": [], "other": []}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in kinds:
            spans[kinds[e["name"]]].append((e["ts"], e["ts"] + e["dur"]))

    def merged(xs):
        out = []
        for a, b in sorted(xs):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def overlap(xs, ys):
        return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)

    coll, mm = merged(spans["collective"]), merged(spans["matmul"])
    work = merged(spans["matmul"] + spans["other"])
    ms = 1e-3 / steps  # trace microseconds to ms per step
    return {
        "collective": sum(b - a for a, b in coll) * ms,
        "matmul": sum(b - a for a, b in mm) * ms,
        "other": sum(b - a for a, b in merged(spans["other"])) * ms,
        "collective_and_matmul": overlap(coll, mm) * ms,
        "collective_and_work": overlap(coll, work) * ms,
    }


# ---------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------
def launch(args: argparse.Namespace, rows: list[str], hosts: list[str] | None) -> list[dict]:
    """Runs ``rows`` in one job of ``args.procs`` processes (in the test
    bed's namespaces ``hosts``, or on loopback for None), every process
    under ``timeout``; returns each process's results."""
    flags = ["--rows", *rows, *worker_flags(args)]
    return testbed.run_workers(__file__, args.procs, flags, hosts, args.timeout, "jc-fsdp-")


def worker_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    flags += ["--width", str(args.width), "--layers", str(args.layers), "--lr", str(args.lr)]
    flags += ["--profile", str(args.profile)] if args.profile else []
    return flags + (["--twins"] if args.twins else [])


def tc_stats(hosts: list[str]) -> list[dict]:
    """Per host: its shaping (tbf on both ends of its link) and the bytes
    its link has carried so far, each way (sent: its own end's qdisc;
    received: the bridge end's)."""
    out = []
    for i, ns in enumerate(hosts):
        host = testbed.run("tc", "-s", "-n", ns, "qdisc", "show", "dev", f"veth{i}").stdout
        bridge = testbed.run(
            "tc", "-s", "-n", testbed.BRIDGE_NS + TAG, "qdisc", "show", "dev", f"vbr{i}"
        ).stdout
        sent = re.search(r"Sent (\d+) bytes", host)
        received = re.search(r"Sent (\d+) bytes", bridge)
        out.append(
            {
                "shaped": "tbf" in host and "tbf" in bridge,
                "rate": (re.findall(r"rate (\S+)", host) or ["?"])[0],
                "sent": int(sent.group(1)) if sent else 0,
                "received": int(received.group(1)) if received else 0,
            }
        )
    return out


def run_shaped(args: argparse.Namespace, rate: str, row: str) -> dict:
    """One row on a fresh bed at ``rate``: the processes' results and the
    tc counters of every host's link before and after."""
    with testbed.free_bed(TAG, args.procs, rate, wait=args.timeout) as hosts:
        before = tc_stats(hosts)
        unshaped = [h for h in before if not h["shaped"]]
        if unshaped:
            raise RuntimeError(f"links not shaped with tbf: {before}")
        load = os.getloadavg()[0]
        per_proc = launch(args, [row], hosts)
        after = tc_stats(hosts)
    return {
        "procs": [r[row] for r in per_proc],
        "load": [load, os.getloadavg()[0]],
        "tc_rate": before[0]["rate"],
        "tc_sent": [a["sent"] - b["sent"] for a, b in zip(after, before, strict=True)],
        "tc_received": [a["received"] - b["received"] for a, b in zip(after, before, strict=True)],
    }


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------
def summarize(raw: dict, procs: int) -> list[dict]:
    """One record per (link, row): the slowest process's median step, the
    bytes, the alpha-beta step time and the speedup over float32."""

    def slowest(run) -> float:
        return max(statistics.median(pp["step_times"]) for pp in run["procs"])

    unshaped = raw.get(LOOPBACK, {})
    compute_s = slowest(unshaped["compute"]) if "compute" in unshaped else None
    recs = []
    for link, rows in raw.items():
        rate = testbed.RATES[link][2] if link in testbed.RATES else None
        for row, run in rows.items():
            per_proc = run["procs"]
            sent = sum(per_proc[0]["sent"].values())
            rec = {
                "link": link,
                "row": row,
                "label": LABELS[row],
                "step_s": slowest(run),
                "unshaped_s": slowest(unshaped[row]) if row in unshaped else None,
                "compute_s": compute_s,
                "sent_bytes": sent,
                "sent_by_kind": per_proc[0]["sent"],
                "steps": len(per_proc[0]["step_times"]),
                "cpu_s": sum(pp["cpu_s"] for pp in per_proc) if "cpu_s" in per_proc[0] else None,
                "profile": per_proc[0].get("profile"),
                "alpha_beta_s": compute_s + 8 * sent / rate if rate and compute_s else None,
                "first_loss": per_proc[0].get("first_loss"),
                "last_loss": per_proc[0].get("last_loss"),
            }
            if run.get("tc_sent"):
                # Every step the job ran sent its bytes (warm-up and timed);
                # nothing else but the barriers crossed the links.
                calls = per_proc[0]["calls"]
                rec["tc_sent_per_step"] = max(run["tc_sent"]) / calls
                rec["tc_sent_per_step_by_host"] = [b / calls for b in run["tc_sent"]]
                if run.get("tc_received"):
                    rec["tc_received_per_step_by_host"] = [b / calls for b in run["tc_received"]]
                rec["tc_rate"] = run["tc_rate"]
            recs.append(rec)
    for r in recs:
        base = "dp-float32" if r["row"] in DP_ROWS else "float32"
        f32 = next((x for x in recs if x["link"] == r["link"] and x["row"] == base), None)
        real = f32 is not None and r["row"] != "compute"
        r["speedup"] = f32["step_s"] / r["step_s"] if real else None
        ok = real and r["alpha_beta_s"] and f32["alpha_beta_s"]
        r["alpha_beta_speedup"] = f32["alpha_beta_s"] / r["alpha_beta_s"] if ok else None
        r["bytes_ratio"] = f32["sent_bytes"] / r["sent_bytes"] if real and r["sent_bytes"] else None
    return recs


def fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(recs: list[dict]) -> list[str]:
    lines = [
        "| link | row | step s | unshaped s | alpha-beta s | MB sent/step (HLO) "
        "| MB sent/step (tc, busiest host) | float32 bytes / row bytes | speedup "
        "| speedup (alpha-beta) | CPU s/step, all processes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        tc = r.get("tc_sent_per_step")
        lines.append(
            f"| {r['link']} | {r['label']} | {r['step_s']:.3f} | {fmt(r['unshaped_s'], '.3f')} "
            f"| {fmt(r['alpha_beta_s'], '.3f')} | {r['sent_bytes'] / 1e6:.2f} "
            f"| {fmt(tc and tc / 1e6, '.2f')} | {fmt(r['bytes_ratio'], '.2f')} "
            f"| {fmt(r['speedup'], '.2f')} | {fmt(r['alpha_beta_speedup'], '.2f')} "
            f"| {fmt(r.get('cpu_s'), '.3f')} |"
        )
    profiled = [r for r in recs if r.get("profile")]
    if profiled:
        lines += [
            "",
            "Process 0's profile (`--profile`, ms per step): how long a collective ran, "
            "a matrix product, any other operation, and a collective beside a matrix "
            "product or beside any other work.",
            "",
            "| link | row | collective | matmul | other | collective + matmul "
            "| collective + any work |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in profiled:
            p = r["profile"]
            lines.append(
                f"| {r['link']} | {r['label']} | {p['collective']:.1f} | {p['matmul']:.1f} "
                f"| {p['other']:.1f} | {p['collective_and_matmul']:.1f} "
                f"| {p['collective_and_work']:.1f} |"
            )
    return lines


def render(data: dict, out: pathlib.Path, *, docs: bool) -> list[str]:
    recs = data["records"]
    cfg = data["config"]
    n = cfg["layers"] * cfg["width"] * (cfg["width"] + 1)
    lines = [
        f"{data['procs']} processes, one CPU device each; {cfg['layers']} dense layers of "
        f"{cfg['width']} x {cfg['width']} ({n / 1e6:.2f} M parameters, "
        f"{4 * n / 1e6:.1f} MB float32), {cfg['batch']} samples per process, adam; "
        f"median of the slowest process over {cfg['steps']} steps after {cfg['warmup']} "
        "warm-up steps. unshaped: the same step with the processes on loopback, no "
        "shaping (compute, codecs and local transport); alpha-beta: the compute alone "
        "plus the bytes sent over the link rate; tc: the bytes the busiest host's link "
        "carried, per step; CPU s/step: the CPU time of every process's threads per "
        f"timed step, summed ({os.cpu_count()} cores give {os.cpu_count()} CPU s a second).",
        "",
        *table(recs),
    ]
    loads = [
        x for rows in data["raw"].values() for run in rows.values() for x in run.get("load", [])
    ]
    if loads:
        lines += [
            "",
            f"The machine's 1-minute load average over the jobs: {min(loads):.1f} to "
            f"{max(loads):.1f} on {os.cpu_count()} cores (the codecs' work, and at 1 Gbit the "
            "whole step, slow down as it rises).",
        ]
    if data.get("command"):
        lines += ["", f"`{data['command']}` ({data.get('date', '')})"]
    print("\n".join(lines))
    if not data.get("smoke"):
        md = out.with_suffix(".md")
        md.write_text("\n".join(lines) + "\n")
        print(f"wrote {md}")
    if docs:
        write_doc(lines)
    return lines


def write_doc(lines: list[str]) -> None:
    if not DOC.exists():
        print(f"{DOC} does not exist: the table is in benchmarks/results/fsdp_links.md")
        return
    text = DOC.read_text()
    block = "\n".join([BEGIN, *lines, END])
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    elif MARKER in text:
        text = text.replace(MARKER, block, 1)
    else:
        print(f"{DOC} has neither {MARKER!r} nor the markers {BEGIN!r}: left alone")
        return
    DOC.write_text(text)
    print(f"updated {DOC}")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument(
        "--rates",
        nargs="*",
        default=["100mbit", "1gbit"],
        choices=list(testbed.RATES),
        help="shaped links (the rows also run once on unshaped loopback)",
    )
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=["compute", *ROWS, *DP_ROWS])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (>= 1)")
    ap.add_argument("--batch", type=int, default=16, help="samples per process per step")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per process (one job)")
    ap.add_argument("--json", help="default: benchmarks/results/fsdp_links.json")
    ap.add_argument("--merge", action="store_true", help="keep the JSON's other rows")
    ap.add_argument("--render", action="store_true", help="the table from the JSON")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/fsdp.md")
    ap.add_argument("--twins", action="store_true", help="time the pure-JAX twins")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="trace this many more steps of every row and report how long its collectives "
        "and matrix products ran at once",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="2 processes on loopback, a tiny model, 2 steps"
    )
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    testbed.add_worker_args(ap)
    args = ap.parse_args()
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the first step compiles)")
    if args.worker:
        worker(args)
        return 0
    # A SIGTERM ends the run through its finally blocks (the test bed's teardown).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.twins:
        os.environ["JAXCOMP_BACKEND"] = "xla"  # inherited by the workers
    out = pathlib.Path(args.json or ROOT / "benchmarks" / "results" / "fsdp_links.json")
    if args.render:
        data = json.loads(out.read_text())
        data["records"] = summarize(data["raw"], data["procs"])
        render(data, out, docs=args.docs)
        return 0
    import jaxcomp as jc

    if not args.twins and not jc.cpu_available():
        print(
            "benchmarks/fsdp_links.py: jaxcomp's CPU kernels are not loaded; or pass --twins",
            file=sys.stderr,
        )
        return 2
    rows = ["compute", *[r for r in args.rows if r != "compute"]]
    config = {k: getattr(args, k) for k in ("steps", "warmup", "batch", "width", "layers", "lr")}
    if args.smoke:
        args.procs, args.width, args.layers, args.batch = 2, 64, 2, 4
        args.steps, args.warmup, args.timeout = 2, 1, min(args.timeout, 120)
        if args.rows == list(ROWS):
            rows = ["compute", "float32", "int8+qsgd4", "dp-float32", "dp-qsgd4"]
        config = {k: getattr(args, k) for k in config}
        per_proc = launch(args, rows, None)
        raw = {LOOPBACK: {row: {"procs": [p[row] for p in per_proc]} for row in rows}}
        data = {"procs": args.procs, "smoke": True, "config": config, "raw": raw}
        data["records"] = summarize(raw, args.procs)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
        render(data, out, docs=False)
        return 0
    why = testbed.probe()
    if why:
        print(f"skipped: the emulated-link test bed {why}")
        return 0
    data = json.loads(out.read_text()) if args.merge and out.exists() else {}
    raw = data.setdefault("raw", {})
    data.update(
        procs=args.procs,
        config=config,
        command=f"python benchmarks/fsdp_links.py {' '.join(sys.argv[1:])}".strip(),
        date=datetime.date.today().isoformat(),
    )
    # Every row on unshaped loopback, in one job: its compute and codec work.
    print(f"== {LOOPBACK}: {' '.join(rows)}", flush=True)
    load = os.getloadavg()[0]
    per_proc = launch(args, rows, None)
    load = [load, os.getloadavg()[0]]
    raw[LOOPBACK] = {row: {"procs": [p[row] for p in per_proc], "load": load} for row in rows}
    for rate in args.rates:
        for row in [r for r in rows if r != "compute"]:
            print(f"== {rate}: {row}", flush=True)
            raw.setdefault(rate, {})[row] = run_shaped(args, rate, row)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1))  # after every row: a rerun can merge
    data["records"] = summarize(raw, args.procs)
    out.write_text(json.dumps(data, indent=1))
    render(data, out, docs=args.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
