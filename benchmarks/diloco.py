"""DiLoCo against data parallelism on the byte-level LM, at equal tokens.

    python benchmarks/diloco.py                       # 4 devices, 400 steps
    python benchmarks/diloco.py --steps 4000 --eval-every 250 --rows dp diloco:50:int8 sparseloco:50
    sudo python benchmarks/diloco.py --links 100mbit 1gbit   # step times, 4 processes

Every replica draws its own batches (the same keys in every row), so each
row sees the same tokens. Rows: ``dp`` is the data-parallel step
(``lax.pmean`` of the gradients, then AdamW); ``diloco:H[:codec[:ef]]`` is
``jc.optax.diloco(AdamW, sync_every=H, codec=..., error_feedback=...)``
with the paper's outer optimizer (SGD, Nesterov 0.9, lr 0.7; ``--outer-lr``
changes the lr), the parameters laid out per replica. ``sparseloco:H[:k]``
is SparseLoCo (arXiv 2508.15706) through the same transformation: the top
``k`` (default 2) of every 64 values of the pseudo-gradient plus its
residual, as 2-bit QSGD values (``sparseloco:H:k:codec`` picks another
value codec, e.g. ``mx-element=e2m1``), error feedback decayed by 0.95 in place of
the outer momentum, outer SGD with lr 1. ``streaming:H:F:tau:alpha[:codec]``
is Streaming DiLoCo (arXiv 2501.18512): F fragments, the merge tau steps
after each fragment's synchronization with mixing factor alpha. The inner
AdamW is the data-parallel one's, schedule included. ``codec:CODEC`` is a
per-step codec instead: ``optax.chain(jc.optax.compress_gradients(CODEC),
AdamW)`` with error feedback, every step (``-`` for ``:`` in the spec).

The losses (the default mode): 4 simulated devices of one process. Per
row: the bytes a device sends per inner step (a ring all-reduce of float32
gradients for ``dp``; for DiLoCo, one round's bytes over H) and the ratio
to ``dp``, the peak (the bytes of the largest single synchronization: a
whole model for DiLoCo, one fragment for Streaming DiLoCo), the held-out
loss (nats per byte) of the anchor (DiLoCo) or the parameters (``dp``) at
the end, and every ``--eval-every`` steps into benchmarks/results/diloco.json.

The step times (``--links``): one process per network namespace on the
emulated-link test bed of benchmarks/collectives.py (root; tbf in both
directions), one CPU device each, the same steps, ``--time-steps`` of them
per row after one to compile. Reported: the mean step time (every step of
the run, synchronizations included, the slowest process), the median (a
step within a round, where DiLoCo runs no collective), the slowest step
(a synchronization's, whose all-reduce the step waits for), the alpha-beta
prediction (the compute, the smallest median of the rows, plus the bytes
per inner step over the link rate), and, from the losses of benchmarks/results/diloco.json,
the time to data parallel's final loss within 2% (steps to reach it times
the mean step time). Writes benchmarks/results/diloco_links.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import collectives as testbed  # noqa: E402  (the emulated-link test bed)

ROWS = ["dp", "diloco:10", "diloco:50", "diloco:50:int8", "diloco:50:qsgd-bits=4:ef"]
LINK_ROWS = ["dp", "diloco:50", "diloco:50:int8", "streaming:50:5:5:0.5:int8", "sparseloco:50"]
LOSSES = ROOT / "benchmarks" / "results" / "diloco.json"
LINKS = ROOT / "benchmarks" / "results" / "diloco_links.json"
WITHIN = 1.02  # "data parallel's final loss, or within 2% of it"


def diloco_options(row: str, outer_lr: float) -> dict | None:
    """``jc.optax.diloco``'s keyword arguments for ``row`` (None: ``dp``)."""
    import optax

    import jaxcomp as jc

    if row == "dp":
        return None
    kind, *parts = row.split(":")
    if kind == "codec":  # a per-step codec: no DiLoCo
        return {"per_step": parts[0].replace("-", ":")}
    nesterov = optax.sgd(outer_lr, momentum=0.9, nesterov=True)
    if kind == "sparseloco":
        k = int(parts[1]) if len(parts) > 1 else 2
        values = parts[2].replace("-", ":") if len(parts) > 2 else "qsgd:bits=2,bucket_size=128"
        codec = jc.codecs.TopK(k_per_bucket=(k, 64), value_codec=jc.codecs.get(values))
        return dict(
            sync_every=int(parts[0]),
            codec=codec,
            error_feedback=True,
            error_decay=0.95,
            outer=optax.sgd(1.0),
        )
    if kind == "streaming":
        return dict(
            sync_every=int(parts[0]),
            fragments=int(parts[1]),
            overlap_steps=int(parts[2]),
            alpha=float(parts[3]),
            codec=parts[4].replace("-", ":") if len(parts) > 4 else None,
            outer=nesterov,
        )
    if kind == "diloco":
        return dict(
            sync_every=int(parts[0]),
            codec=parts[1].replace("-", ":") if len(parts) > 1 else None,
            error_feedback=len(parts) > 2 and parts[2] == "ef",
            outer=nesterov,
        )
    raise SystemExit(f"unknown row {row!r}")


class LM:
    """The byte-level LM of examples/lm at its default size, on ``mesh``."""

    def __init__(self, mesh, steps: int, seed: int):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax
        from jax import lax

        from examples.lm import train as lm
        from examples.lm.configs import default

        config = default.get_config()
        self.mesh, self.n, self.seed = mesh, mesh.shape["data"], seed
        corpus = lm.load_corpus()
        train_bytes = jnp.asarray(corpus["train"], jnp.int32)
        ctx, local_batch = config.context, config.global_batch_size // self.n
        test = corpus["test"]
        self.windows = np.stack(
            [test[i * ctx : i * ctx + ctx + 1] for i in range(min(256, (len(test) - 1) // ctx))]
        ).astype(np.int32)
        model = lm.ByteLM(config.width, config.num_layers, config.num_heads, ctx)
        self.params0 = model.init(jax.random.key(seed), jnp.zeros((1, ctx), jnp.int32))["params"]
        self.num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(self.params0))
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, config.learning_rate, min(config.warmup, steps - 1), steps
        )
        self.inner = optax.adamw(schedule, weight_decay=config.weight_decay)
        self.model, self.config = model, config

        def loss_fn(params, key):
            starts = jax.random.randint(key, (local_batch, 1), 0, train_bytes.shape[0] - ctx - 1)
            w = train_bytes[starts + jnp.arange(ctx + 1)]
            logits = model.apply({"params": params}, w[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:]).mean()

        def device_key(t):
            return jax.random.fold_in(
                jax.random.fold_in(jax.random.key(seed + 1), t), lax.axis_index("data")
            )

        self.grad = lambda params, t: jax.grad(loss_fn)(params, device_key(t))

    def evaluate(self, params) -> float:
        import optax

        logits = self.model.apply({"params": params}, self.windows[:, :-1])
        return float(
            optax.softmax_cross_entropy_with_integer_labels(logits, self.windows[:, 1:]).mean()
        )

    def dp(self):
        """``(step, params, state)`` of data parallelism."""
        import jax
        import optax
        from jax import lax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        tx = self.inner

        def body(params, state, t):
            g = lax.pmean(self.grad(params, t), "data")
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(P(), P(), P()),
                out_specs=(P(), P()),
                check_vma=False,
            )
        )
        params = jax.device_put(self.params0, NamedSharding(self.mesh, P()))
        state = jax.jit(tx.init, out_shardings=NamedSharding(self.mesh, P()))(params)
        return step, params, state

    def per_step(self, codec: str):
        """``(step, params, state)`` of ``compress_gradients(codec)`` then
        AdamW, the gradients averaged through the codec at every step."""
        import jax
        import optax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import jaxcomp as jc

        tx = optax.chain(jc.optax.compress_gradients(codec, "data"), self.inner)
        params = jax.device_put(self.params0, NamedSharding(self.mesh, P()))
        state = jc.optax.init(tx, params, self.mesh, "data")
        specs = jc.optax.state_specs(state, "data")

        def body(params, state, t):
            u, state = tx.update(self.grad(params, t), state, params)
            return optax.apply_updates(params, u), state

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(P(), specs, P()),
                out_specs=(P(), specs),
                check_vma=False,
            )
        )
        return step, params, state

    def start(self, options: dict | None):
        """``(step, params, state)`` of a row."""
        if options is None:
            return self.dp()
        if "per_step" in options:
            return self.per_step(options["per_step"])
        return self.diloco(options)

    def diloco(self, options: dict):
        """``(step, params, state)`` of ``jc.optax.diloco(inner, **options)``,
        the parameters one copy per replica."""
        import jax
        import numpy as np
        import optax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import jaxcomp as jc

        tx = jc.optax.diloco(self.inner, "data", **options)
        params = jax.device_put(self.params0, NamedSharding(self.mesh, P()))
        state = jc.optax.init(tx, params, self.mesh, "data")
        specs = jc.optax.state_specs(state, "data")

        def body(params, state, t):
            p = jax.tree.map(lambda a: a[0], params)
            u, state = tx.update(self.grad(p, t), state, p)
            return jax.tree.map(lambda a: a[None], optax.apply_updates(p, u)), state

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=(P("data"), specs, P()),
                out_specs=(P("data"), specs),
                check_vma=False,
            )
        )
        # One copy per replica: each process gives its devices' rows.
        sharding = NamedSharding(self.mesh, P("data"))
        local = len(self.mesh.local_devices)
        params = jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(
                sharding, np.stack([np.asarray(a)] * local)
            ),
            self.params0,
        )
        return step, params, state

    def peak(self, options: dict | None) -> float:
        """Bytes a device sends in the largest single synchronization (of
        ``dp`` or a DiLoCo row)."""
        import jax
        import jax.numpy as jnp

        import jaxcomp as jc

        if options is None:
            return jc.collectives.uncompressed_send_nbytes(4 * self.num_params, self.n)
        fragments = options.get("fragments", 1)
        leaves = jax.tree.leaves(self.params0)
        sizes = [sum(a.size for a in leaves[f::fragments]) for f in range(fragments)]
        codec = options.get("codec")
        if codec is None:
            return max(jc.collectives.uncompressed_send_nbytes(4 * m, self.n) for m in sizes)
        codec = jc.codecs.get(codec) if isinstance(codec, str) else codec
        return max(jc.collectives.send_nbytes(codec, m, jnp.float32, self.n) for m in sizes)

    def wire(self, options: dict | None, state) -> float:
        """Bytes a device sends per inner step."""
        import jaxcomp as jc

        if options is None:
            return jc.collectives.uncompressed_send_nbytes(4 * self.num_params, self.n)
        return float(jc.optax.telemetry(state)["wire_bytes"])


# ---------------------------------------------------------------------------
# The losses: one process, simulated devices
# ---------------------------------------------------------------------------
def losses(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = args.devices
    mesh = jax.make_mesh(
        (n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
    )
    lm = LM(mesh, args.steps, args.seed)
    c = lm.config
    print(
        f"byte-level LM: {lm.num_params:,} parameters, {n} devices, {args.steps} steps, "
        f"global batch {c.global_batch_size} x {c.context} bytes; jax {jax.__version__}"
    )
    print(
        f"{'row':28s} {'bytes/step/device':>18s} {'x fewer':>8s} {'peak':>10s} "
        f"{'test loss':>10s} {'s':>6s}"
    )
    dp_wire = lm.wire(None, None)
    path = pathlib.Path(args.json)
    results = json.loads(path.read_text()) if args.merge and path.exists() else {}
    for row in args.rows:
        options = diloco_options(row, args.outer_lr)
        t0 = time.perf_counter()
        step, params, state = lm.start(options)

        def model(params, state, options=options):
            if options is None or "per_step" in options:
                return params
            return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), state.anchor)

        history = [(0, lm.evaluate(model(params, state)))]
        for t in range(args.steps):
            params, state = step(params, state, jnp.int32(t))
            if args.eval_every and (t + 1) % args.eval_every == 0 and t + 1 < args.steps:
                history.append((t + 1, lm.evaluate(model(params, state))))
        history.append((args.steps, lm.evaluate(model(params, state))))
        dt = time.perf_counter() - t0
        wire, loss = lm.wire(options, state), history[-1][1]
        top = wire if options and "per_step" in options else lm.peak(options)
        print(
            f"{row:28s} {wire:18,.0f} {dp_wire / wire:8.1f} {top:10,.0f} {loss:10.4f} {dt:6.1f}",
            flush=True,
        )
        record = {"wire_bytes": wire, "peak_bytes": top, "loss": loss, "history": history}
        results.setdefault(f"{args.steps}", {}).setdefault(f"seed{args.seed}", {})[row] = record
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))  # after every row


# ---------------------------------------------------------------------------
# The step times: one process per namespace of the emulated-link test bed
# ---------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    mesh = testbed.join(args, "data")
    lm = LM(mesh, args.steps, args.seed)
    out = {}
    for row in args.rows:
        options = diloco_options(row, args.outer_lr)
        step, params, state = lm.start(options)
        params, state = step(params, state, jnp.int32(0))  # compiles
        jax.block_until_ready((params, state))
        times = []
        multihost_utils.sync_global_devices(row)
        for t in range(1, args.time_steps + 1):
            t0 = time.perf_counter()
            params, state = step(params, state, jnp.int32(t))
            jax.block_until_ready((params, state))
            times.append(time.perf_counter() - t0)
        out[row] = {"times": times, "wire_bytes": lm.wire(options, state)}
    pathlib.Path(args.out).write_text(json.dumps(out))
    jax.distributed.shutdown()


def launch(args: argparse.Namespace, hosts: list[str]) -> list[dict]:
    """Runs the rows in ``args.procs`` processes, one per namespace of
    ``hosts``; returns each process's results."""
    port = random.randrange(20000, 60000)
    with tempfile.TemporaryDirectory(prefix="jc-diloco-") as tmp:
        procs = []
        for i, host in enumerate(hosts):
            cmd = ["ip", "netns", "exec", host, "timeout", "-k", "10", str(args.timeout)]
            cmd += [sys.executable, __file__, "--worker", "--port", str(port)]
            cmd += ["--procs", str(args.procs), "--pid", str(i), "--out", f"{tmp}/{i}.json"]
            cmd += ["--steps", str(args.steps), "--time-steps", str(args.time_steps)]
            cmd += [
                "--seed",
                str(args.seed),
                "--outer-lr",
                str(args.outer_lr),
                "--rows",
                *args.rows,
            ]
            env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
            env.pop("PYTHONPATH", None)
            log = open(f"{tmp}/{i}.log", "w")  # the child's output, closed below
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
        for p, log in procs:
            p.wait()
            log.close()
        for i, (p, _) in enumerate(procs):
            if p.returncode:
                text = pathlib.Path(f"{tmp}/{i}.log").read_text()
                raise RuntimeError(f"process {i} failed ({p.returncode}):\n{text[-3000:]}")
        return [json.loads(pathlib.Path(f"{tmp}/{i}.json").read_text()) for i in range(args.procs)]


def steps_to(history: list, target: float) -> int | None:
    """The first evaluated step whose loss is at most ``target``."""
    return next((s for s, loss in history if loss <= target), None)


def link_table(args: argparse.Namespace, rate: str, runs: list[dict]) -> dict:
    import numpy as np

    bps = testbed.RATES[rate][2]
    runs_losses = json.loads(LOSSES.read_text()) if LOSSES.exists() else {}
    curves = runs_losses.get(str(args.loss_steps), {}).get(f"seed{args.seed}", {})
    target = curves["dp"]["loss"] * WITHIN if "dp" in curves else None
    print(f"\n{rate}, {args.procs} processes, {args.time_steps} steps per row")
    print(
        f"{'row':28s} {'bytes/step':>11s} {'mean ms':>8s} {'median ms':>9s} {'max ms':>7s} "
        f"{'alpha-beta':>10s} {'to dp loss, s':>14s}"
    )
    table = {}
    # The compute of a step: the fastest row's median step (a DiLoCo step
    # within a round runs the same forward, backward and AdamW, and no
    # collective).
    compute = min(max(float(np.median(r[row]["times"])) for r in runs) for row in args.rows)
    for row in args.rows:
        per = [r[row] for r in runs]
        mean = max(float(np.mean(r["times"])) for r in per)  # the slowest process
        median = max(float(np.median(r["times"])) for r in per)
        slowest = max(float(np.max(r["times"])) for r in per)  # a synchronization's step
        wire = per[0]["wire_bytes"]
        model = compute + 8 * wire / bps
        reach = steps_to(curves[row]["history"], target) if target and row in curves else None
        seconds = reach * mean if reach is not None else None
        table[row] = {
            "wire_bytes": wire,
            "mean_s": mean,
            "median_s": median,
            "max_s": slowest,
            "alpha_beta_s": model,
            "steps_to_target": reach,
            "seconds_to_target": seconds,
        }
        shown = f"{seconds:14.1f}" if seconds is not None else f"{'not reached':>14s}"
        print(
            f"{row:28s} {wire:11,.0f} {1e3 * mean:8.1f} {1e3 * median:9.1f} "
            f"{1e3 * slowest:7.1f} {1e3 * model:10.1f} {shown}",
            flush=True,
        )
    return {"target_loss": target, "compute_s": compute, "rows": table}


def links(args: argparse.Namespace) -> int:
    why = testbed.probe()
    if why:
        print(f"skipped: the emulated-link test bed {why}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data = json.loads(LINKS.read_text()) if LINKS.exists() else {}
    data["command"] = f"python benchmarks/diloco.py {' '.join(sys.argv[1:])}"
    for rate in args.links:
        with testbed.bed(args.procs, rate, tag="dlc") as hosts:
            runs = launch(args, hosts)
        data[rate] = link_table(args, rate, runs)
        LINKS.parent.mkdir(parents=True, exist_ok=True)
        LINKS.write_text(json.dumps(data, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400, help="inner steps (the schedule's length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--rows", nargs="+")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every this many steps")
    ap.add_argument("--json", default=str(LOSSES), help="the losses' file")
    ap.add_argument("--merge", action="store_true", help="add to the losses' file")
    ap.add_argument("--links", nargs="+", choices=list(testbed.RATES), help="time over these")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--time-steps", type=int, default=200, help="steps timed per row (--links)")
    ap.add_argument(
        "--loss-steps", type=int, default=4000, help="the run of diloco.json to reach (--links)"
    )
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per process (--links)")
    testbed.add_worker_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.links:
        args.rows = args.rows or LINK_ROWS
        return links(args)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    args.rows = args.rows or ROWS
    losses(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
