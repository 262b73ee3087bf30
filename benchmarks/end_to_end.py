"""Time to accuracy over emulated slow links: real data-parallel training runs.

One JAX process per network namespace, each with one CPU device, joined by
jax.distributed (gloo) over a bridge whose links are shaped with tbf in both
directions: the test bed of benchmarks/collectives.py, whose helpers this
script imports. Every row trains the same model from the same seed with the
same data stream and schedule for the same number of steps; only the
gradient all-reduce differs: a float32 ``lax.pmean``, or
``jc.optax.compress_gradients(codec, "data")`` with error feedback and
``algorithm="auto"``, or ``jc.optax.powersgd``. The step is
``jc.data_parallel(loss_fn, optax.chain(all_reduce, sgd), mesh)``, the
jitted step users run (forward, backward, all-reduce, update).

The model: the teacher-student task of the accuracy study
(examples/teacher, docs/accuracy.md) with a wide student, a 2048-2048 ReLU
MLP (4.25 million parameters, 17 MB of float32 gradient), 32 fresh samples
per process per step. Its compute per parameter is small (a 32-sample
batch), so at 100 Mbit a float32 all-reduce (about 2 s) costs several
times the forward and backward pass: the communication-bound regime that
gradient compression is for (docs/end_to_end.md says why that is
representative).

Per row and link: the step time (median over the run), the compute time
(the same step with the all-reduce replaced by the identity, timed before
the run), the communication (the difference: encode, decode and the
wire), the alpha-beta step time (compute + the bytes each device sends,
``jc.optax.telemetry``'s ``wire_bytes``, over the link rate), steps and
wall-clock time of the training steps to the target (float32's final
held-out accuracy less the accuracy study's parity margin, 0.5 pp), the
final held-out accuracy and loss, and the speedup in time to target over
float32, measured and alpha-beta. The parameters are kept every
``--eval-every`` steps and evaluated after the run, outside the clock:
the start, the end, every ``--coarse-every``-th snapshot and, where the
target is first passed, the snapshots in between (``--eval-all``: all).

    sudo python benchmarks/end_to_end.py                      # both links, every row
    sudo python benchmarks/end_to_end.py --rates 100mbit --rows float32 topk:fraction=0.01
    python benchmarks/end_to_end.py --smoke --json /tmp/e2e.json   # 2 processes, loopback

``--smoke``: two processes on 127.0.0.1, no namespaces and no shaping, a
tiny model and a few steps (the CI smoke test). Needs root, iproute2 and
tbf otherwise (skips with a message where they are missing). Writes
benchmarks/results/end_to_end.json, and, when both links ran, the table
in docs/end_to_end.md and docs/end_to_end_<link>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
# The examples from the checkout, after the installed jaxcomp (a source tree
# without an in-tree build has no kernels).
sys.path.append(str(ROOT))

import collectives as testbed  # noqa: E402  (benchmarks/collectives.py: the test bed)

ROWS = [
    "float32",
    "bfloat16",
    "qsgd:bits=4",
    "onebit",
    "threelc",
    "topk:fraction=0.01",
    "powersgd:rank=4",
]
LABELS = {
    "float32": "float32 (lax.pmean)",
    "bfloat16": "bf16 cast",
    "qsgd:bits=4": "QSGD-4",
    "onebit": "OneBit",
    "threelc": "3LC (s=1.0)",
    "topk:fraction=0.01": "TopK 1%",
    "powersgd:rank=4": "PowerSGD rank 4",
}
# The accuracy study's parity margin (docs/accuracy.md): at most 0.5 pp
# below float32 in held-out accuracy, at most 2% above it in held-out loss.
ACC_MARGIN, LOSS_MARGIN = 0.005, 0.02
BEGIN, END = "<!-- end-to-end:begin -->", "<!-- end-to-end:end -->"
DOC = ROOT / "docs" / "end_to_end.md"


# ---------------------------------------------------------------------------
# One process of the job
# ---------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import jax

    mesh = testbed.join(args, "data")  # the bed, or loopback with --coordinator
    import jaxcomp as jc

    if not args.twins and not jc.cpu_available():
        raise SystemExit("jaxcomp's CPU kernels are not importable in this process")
    out = {row: train_row(args, mesh, row) for row in args.rows}
    pathlib.Path(args.out).write_text(json.dumps(out))
    jax.distributed.shutdown()


def train_row(args: argparse.Namespace, mesh, row: str) -> dict:
    """Trains one row; returns this process's timings and the held-out
    metrics (the same on every process)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils

    import jaxcomp as jc
    from examples import common
    from examples.teacher import train as teacher

    p = args.procs
    config = teacher.Config(
        codec=row, hidden=tuple(args.hidden), test_size=args.test_size, num_devices=p
    )
    task = teacher.Teacher(config)
    model = teacher.MLP(hidden=config.hidden, num_classes=config.num_classes)
    spec = common.parse_codec(row)

    def loss_fn(params, batch, key):
        del batch  # the data are drawn inside the step, as the teacher example does
        x, y = task.sample(key, args.batch)
        return teacher._loss_and_accuracy(model.apply({"params": params}, x), y)

    sgd = optax.sgd(optax.cosine_decay_schedule(args.lr, args.steps), momentum=config.momentum)
    reduce = common.gradient_transformation(spec, error_feedback=True, algorithm="auto")
    step = jc.data_parallel(loss_fn, optax.chain(reduce, sgd), mesh, has_aux=True)
    # The compute alone: the same step, each device applying its own gradient.
    local = jc.data_parallel(
        loss_fn, optax.chain(optax.identity(), sgd), mesh, has_aux=True, require_all_reduce=False
    )

    init_key, data_key = jax.random.split(jax.random.key(args.seed))
    params0 = model.init(init_key, jnp.zeros((1, config.input_dim)))["params"]
    num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params0))
    batch = step.shard_batch(np.zeros((1,), np.float32))  # one placeholder row per device

    # This process's quarter of the held-out set (the accuracy study's, smaller).
    test_key = jax.random.fold_in(jax.random.key(config.task_seed), 1)
    x_test, y_test = jax.jit(task.sample, static_argnums=1)(test_key, args.test_size)
    part = slice(args.pid * args.test_size // p, (args.pid + 1) * args.test_size // p)
    x_test, y_test = x_test[part], y_test[part]

    @jax.jit
    def local_sums(params):
        logits = model.apply({"params": params}, x_test)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y_test)
        return jnp.stack([losses.sum(), (jnp.argmax(logits, -1) == y_test).sum()])

    def evaluate(local_params):
        sums = multihost_utils.process_allgather(np.asarray(local_sums(local_params))).sum(0)
        return float(sums[1] / args.test_size), float(sums[0] / args.test_size)

    def run(dp, params, state, i):
        return dp(params, state, batch, jax.random.fold_in(data_key, i))

    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))

    # Compile both steps and time the compute alone (on copies: a step
    # donates its inputs), all processes at once, as in training.
    lp, ls = local.init(params0)
    jax.block_until_ready(run(local, *copy((lp, ls)), 0))
    compute = []
    for i in range(args.compute_iters):
        multihost_utils.sync_global_devices("compute")
        t0 = time.perf_counter()
        lp, ls, _ = run(local, lp, ls, i)
        jax.block_until_ready((lp, ls))
        compute.append(time.perf_counter() - t0)
    del lp, ls
    params, state = step.init(params0)
    jax.block_until_ready(run(step, *copy((params, state)), 0))

    if spec.uncompressed:
        wire = jc.collectives.uncompressed_send_nbytes(4 * num_params, p)
    else:
        wire = None  # read from the telemetry after the first step

    # Training, timed step by step; the parameters are kept (on the host)
    # every eval_every steps and evaluated after the run, outside the clock.
    snapshots = {0: (0.0, jax.device_get(jax.tree.map(lambda a: a.addressable_data(0), params)))}
    times: list[float] = []
    multihost_utils.sync_global_devices("train")
    last = args.steps
    for i in range(last):
        t0 = time.perf_counter()
        params, state, (train_loss, _) = run(step, params, state, i)
        jax.block_until_ready((params, state, train_loss))
        times.append(time.perf_counter() - t0)
        if wire is None:
            wire = float(jc.optax.telemetry(state)["wire_bytes"])
        if (i + 1) % args.eval_every == 0 or i + 1 == last:
            mine = jax.tree.map(lambda a: a.addressable_data(0), params)
            snapshots[i + 1] = (sum(times), jax.device_get(mine))
    history = evaluate_snapshots(args, row, snapshots, evaluate)
    return {
        "num_params": num_params,
        "wire_bytes": wire,
        "compute_times": compute,
        "step_times": times,
        "history": history,
        "train_loss": float(train_loss),
    }


def evaluate_snapshots(args: argparse.Namespace, row: str, snapshots: dict, evaluate) -> list:
    """The held-out metrics of the snapshots that decide the result: the
    start, the end, every ``coarse_every``-th one, and, between the last
    coarse point below the target and the first at or above it, every one
    up to the first that reaches it. (The float32 row sets the target:
    its final accuracy less the parity margin.) With ``--eval-all``,
    every snapshot."""
    steps = sorted(snapshots)
    done: dict[int, dict] = {}

    def ev(s: int) -> float:
        if s not in done:
            acc, loss = evaluate(snapshots[s][1])
            done[s] = {
                "step": s,
                "seconds": snapshots[s][0],
                "test_accuracy": acc,
                "test_loss": loss,
            }
            if args.pid == 0:
                print(f"{row}: step {s} {snapshots[s][0]:.1f} s acc {acc:.4f} loss {loss:.4f}")
                sys.stdout.flush()
        return done[s]["test_accuracy"]

    final = ev(steps[-1])
    target = args.target if args.target is not None else final - ACC_MARGIN
    coarse = [s for j, s in enumerate(steps) if args.eval_all or j % args.coarse_every == 0]
    below = steps[0]
    for s in coarse:
        if ev(s) >= target:
            for t in steps:  # the first snapshot past the last coarse miss that reaches it
                if below < t < s and ev(t) >= target:
                    break
            break
        below = s
    return [done[s] for s in sorted(done)]


# ---------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------
def launch(args: argparse.Namespace, rows: list[str], hosts: list[str] | None) -> dict:
    """Runs ``rows`` in one job of ``args.procs`` processes (in the test
    bed's namespaces ``hosts``, or on loopback for None), every process
    under ``timeout``; returns each row's per-process results."""
    flags = ["--rows", *rows, *worker_flags(args)]
    outs = testbed.run_workers(__file__, args.procs, flags, hosts, args.timeout, "jc-e2e-")
    return {row: [o[row] for o in outs] for row in rows}


def worker_flags(args: argparse.Namespace) -> list[str]:
    flags = [
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--batch",
        str(args.batch),
        "--lr",
        str(args.lr),
        "--test-size",
        str(args.test_size),
        "--compute-iters",
        str(args.compute_iters),
        "--seed",
        str(args.seed),
        "--coarse-every",
        str(args.coarse_every),
        "--hidden",
        *map(str, args.hidden),
    ]
    if args.target is not None:
        flags += ["--target", repr(args.target)]
    return flags + (["--twins"] if args.twins else []) + (["--eval-all"] if args.eval_all else [])


TAG = "e2e"  # this script's own test bed, beside benchmarks/collectives.py's


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------
def summarize(runs: dict, procs: int, rate_bps: float | None) -> list[dict]:
    """One record per row of a link: the slowest process's times, the
    metrics, the target (float32's final accuracy less the parity margin)
    and the speedups over float32."""
    recs = []
    for row, per_proc in runs.items():
        steps = len(per_proc[0]["step_times"])
        # Wall-clock: the slowest process at every evaluation.
        hist = [dict(h) for h in per_proc[0]["history"]]
        for j, h in enumerate(hist):
            h["seconds"] = max(pp["history"][j]["seconds"] for pp in per_proc)
        step_s = max(statistics.median(pp["step_times"]) for pp in per_proc)
        compute_s = max(statistics.median(pp["compute_times"]) for pp in per_proc)
        wire = per_proc[0]["wire_bytes"]
        ideal = compute_s + 8 * wire / rate_bps if rate_bps else None
        recs.append(
            {
                "row": row,
                "label": LABELS.get(row, row),
                "num_params": per_proc[0]["num_params"],
                "steps": steps,
                "step_s": step_s,
                "compute_s": compute_s,
                "comm_s": step_s - compute_s,
                "wire_bytes": wire,
                "ideal_step_s": ideal,
                "total_s": hist[-1]["seconds"],
                "final_accuracy": hist[-1]["test_accuracy"],
                "final_loss": hist[-1]["test_loss"],
                "history": hist,
            }
        )
    base = next((r for r in recs if r["row"] == "float32"), None)
    if base is None:
        return recs
    target = base["final_accuracy"] - ACC_MARGIN
    for r in recs:
        hit = next((h for h in r["history"] if h["test_accuracy"] >= target), None)
        r["target_accuracy"] = target
        r["steps_to_target"] = hit["step"] if hit else None
        r["time_to_target_s"] = hit["seconds"] if hit else None
        r["parity"] = r["final_accuracy"] >= base["final_accuracy"] - ACC_MARGIN and r[
            "final_loss"
        ] <= base["final_loss"] * (1 + LOSS_MARGIN)
    b_steps, b_time = base["steps_to_target"], base["time_to_target_s"]
    for r in recs:
        ok = r["steps_to_target"] is not None and b_time
        r["speedup"] = b_time / r["time_to_target_s"] if ok else None
        r["step_speedup"] = base["step_s"] / r["step_s"]
        if rate_bps and ok:
            # Alpha-beta: every step at its ideal time, the same steps to target.
            r["ideal_speedup"] = (b_steps * base["ideal_step_s"]) / (
                r["steps_to_target"] * r["ideal_step_s"]
            )
        else:
            r["ideal_speedup"] = None
    return recs


def fmt(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def table(results: dict) -> list[str]:
    lines = [
        "| link | row | step s | compute s | comm s | alpha-beta step s | MB sent/step "
        "| steps to target | time to target s | final acc % | final loss | parity "
        "| speedup (measured) | speedup (alpha-beta) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for link, recs in results.items():
        for r in recs:
            lines.append(
                f"| {link} | {r['label']} | {r['step_s']:.3f} | {r['compute_s']:.3f} "
                f"| {r['comm_s']:.3f} | {fmt(r['ideal_step_s'], '.3f')} "
                f"| {r['wire_bytes'] / 1e6:.2f} "
                f"| {fmt(r.get('steps_to_target'), 'd', 'not reached')} "
                f"| {fmt(r.get('time_to_target_s'), '.1f', 'not reached')} "
                f"| {100 * r['final_accuracy']:.2f} | {r['final_loss']:.4f} "
                f"| {'yes' if r.get('parity') else 'no'} "
                f"| {fmt(r.get('speedup'), '.2f')} | {fmt(r.get('ideal_speedup'), '.2f')} |"
            )
    return lines


def plot(results: dict, procs: int, path_for) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for link, recs in results.items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in recs:
            h = [x for x in r["history"] if x["step"] > 0]  # a log axis has no 0
            ax.plot(
                [x["seconds"] for x in h],
                [100 * x["test_accuracy"] for x in h],
                marker=".",
                label=r["label"],
            )
        if recs and "target_accuracy" in recs[0]:
            ax.axhline(100 * recs[0]["target_accuracy"], color="gray", ls="--", lw=1)
            ax.text(
                0.01,
                100 * recs[0]["target_accuracy"],
                "target",
                va="bottom",
                color="gray",
                transform=ax.get_yaxis_transform(),
            )
        ax.set_xscale("log")
        ax.set_xlabel("wall-clock seconds of training steps (log scale)")
        ax.set_ylabel("held-out accuracy (%)")
        lo = min(100 * x["test_accuracy"] for r in recs for x in r["history"][1:])
        ax.set_ylim(max(lo - 2, 0), None)
        ax.set_title(f"P = {procs} processes, {link} links")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path_for(link), dpi=110)
        plt.close(fig)
        print(f"wrote {path_for(link)}")


def write_doc(lines: list[str]) -> None:
    if not DOC.exists():
        return
    text = DOC.read_text()
    if BEGIN not in text:
        return
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(head + "\n".join([BEGIN, *lines, END]) + rest.split(END, 1)[1])
    print(f"updated {DOC}")


def render(data: dict, *, docs: bool) -> None:
    results = data["links"]
    lines = table(results)
    print("\n".join(lines))
    if docs:
        plot(results, data["procs"], lambda link: ROOT / "docs" / f"end_to_end_{link}.png")
        write_doc(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"], choices=list(testbed.RATES))
    ap.add_argument("--rows", nargs="+", default=ROWS, help=f"default: {' '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="samples per process per step")
    ap.add_argument("--lr", type=float, default=0.2, help="SGD peak learning rate (cosine decay)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 2048])
    ap.add_argument("--test-size", type=int, default=4096)
    ap.add_argument(
        "--coarse-every",
        type=int,
        default=5,
        help="evaluate every this many snapshots, then refine where the target is crossed",
    )
    ap.add_argument("--eval-all", action="store_true", help="evaluate every snapshot")
    ap.add_argument("--target", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--compute-iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=1500, help="seconds per process (one row)")
    ap.add_argument("--json", help="default: benchmarks/results/end_to_end.json")
    ap.add_argument(
        "--merge", action="store_true", help="keep the JSON's other rows (rerun some rows)"
    )
    ap.add_argument("--render", action="store_true", help="the table and plots from the JSON")
    ap.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    ap.add_argument("--twins", action="store_true", help="time the pure-JAX twins")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="2 processes on loopback, no shaping, a tiny model, a few steps",
    )
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    testbed.add_worker_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    # A SIGTERM ends the run through its finally blocks (the test bed's teardown).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.twins:
        os.environ["JAXCOMP_BACKEND"] = "xla"  # inherited by the workers
    out = pathlib.Path(args.json or ROOT / "benchmarks" / "results" / "end_to_end.json")
    if args.render:
        render(json.loads(out.read_text()), docs=not args.no_docs)
        return 0
    import jaxcomp as jc

    if not args.twins and not jc.cpu_available():
        print(
            "benchmarks/end_to_end.py: jaxcomp's CPU kernels are not loaded "
            f"({jc._ffi.why_not_loaded('_jaxcomp_cpu')}); or pass --twins",
            file=sys.stderr,
        )
        return 2
    if args.smoke:
        args.procs, args.hidden, args.steps, args.eval_every = 2, [64], 4, 2
        args.test_size, args.compute_iters, args.batch = 256, 2, 8
        args.timeout, args.eval_all, args.target = min(args.timeout, 120), True, None
        if args.rows == ROWS:
            args.rows = ["float32", "qsgd:bits=4"]
        runs = launch(args, args.rows, None)
        data = {
            "procs": args.procs,
            "smoke": True,
            "links": {"loopback": summarize(runs, args.procs, None)},
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
        print("\n".join(table(data["links"])))
        return 0
    why = testbed.probe()
    if why:
        print(f"skipped: the emulated-link test bed {why}")
        return 0
    if "float32" not in args.rows and not args.merge:
        args.rows = ["float32", *args.rows]  # the target and the speedups come from it
    data = json.loads(out.read_text()) if args.merge and out.exists() else {"links": {}}
    raw = data.setdefault("raw", {})
    data.update(
        procs=args.procs,
        command=f"python benchmarks/end_to_end.py {' '.join(sys.argv[1:])}".strip(),
        config={k: getattr(args, k) for k in ("steps", "eval_every", "batch", "lr", "hidden")},
    )
    for rate in args.rates:
        for row in args.rows:
            print(f"== {rate}: {row}", flush=True)
            base = raw.get(rate, {}).get("float32")
            # float32's final accuracy (the slowest process's record: all agree)
            # less the margin: the worker evaluates around where it is crossed.
            args.target = (
                base[0]["history"][-1]["test_accuracy"] - ACC_MARGIN
                if base and row != "float32"
                else None
            )
            with testbed.free_bed(TAG, args.procs, rate, wait=args.timeout) as hosts:
                raw.setdefault(rate, {}).update(launch(args, [row], hosts))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1))  # after every row: a rerun can merge
        order = [r for r in ROWS if r in raw[rate]] + [r for r in raw[rate] if r not in ROWS]
        runs = {r: raw[rate][r] for r in order}
        data["links"][rate] = summarize(runs, args.procs, testbed.RATES[rate][2])
        out.write_text(json.dumps(data, indent=1))
    render(data, docs=not args.no_docs and len(data["links"]) == len(testbed.RATES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
