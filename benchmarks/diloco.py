"""DiLoCo against data parallelism on the byte-level LM, at equal tokens.

    python benchmarks/diloco.py                       # 4 devices, 400 steps
    python benchmarks/diloco.py --steps 800 --rows dp diloco:50 diloco:50:int8

Every replica draws its own batches (the same keys in every row), so each
row sees the same tokens. Rows: ``dp`` is the data-parallel step
(``lax.pmean`` of the gradients, then AdamW); ``diloco:H[:codec[:ef]]`` is
``jc.optax.diloco(AdamW, sync_every=H, codec=..., error_feedback=...)``
with the paper's outer optimizer (SGD, Nesterov 0.9, lr 0.7; ``--outer-lr``
changes the lr), the parameters laid out per replica. ``sparseloco:H[:k]``
is SparseLoCo (arXiv 2508.15706) through the same transformation: the top
``k`` (default 2) of every 64 values of the pseudo-gradient plus its
residual, as 2-bit QSGD values, error feedback decayed by 0.95 in place of
the outer momentum, outer SGD with lr 1. ``streaming:H:F:tau:alpha[:codec]``
is Streaming DiLoCo (arXiv 2501.18512): F fragments, the merge tau steps
after each fragment's synchronization with mixing factor alpha. The
"peak" column is the bytes of the largest single synchronization (a whole
model for DiLoCo, one fragment for Streaming DiLoCo). The inner AdamW is the data-parallel
one's, schedule included. Reported: the bytes a device sends per inner step
(a ring all-reduce of float32 gradients for ``dp``; for DiLoCo, one
synchronization's bytes over H) and the ratio to ``dp``, the held-out loss
(nats per byte) of the anchor (DiLoCo) or the parameters (``dp``) at the
end, and the wall time on this machine's simulated devices (no link: the
bytes are the figure that a slow network turns into time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument(
        "--rows",
        nargs="+",
        default=["dp", "diloco:10", "diloco:50", "diloco:50:int8", "diloco:50:qsgd-bits=4:ef"],
    )
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from examples.lm import train as lm
    from examples.lm.configs import default

    config = default.get_config()
    n = args.devices
    mesh = jax.make_mesh(
        (n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
    )
    corpus = lm.load_corpus()
    train_bytes = jnp.asarray(corpus["train"], jnp.int32)
    ctx, local_batch = config.context, config.global_batch_size // n
    test = corpus["test"]
    windows = np.stack(
        [test[i * ctx : i * ctx + ctx + 1] for i in range(min(256, (len(test) - 1) // ctx))]
    ).astype(np.int32)
    model = lm.ByteLM(config.width, config.num_layers, config.num_heads, ctx)
    params0 = model.init(jax.random.key(args.seed), jnp.zeros((1, ctx), jnp.int32))["params"]
    num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params0))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, min(config.warmup, args.steps - 1), args.steps
    )
    inner = optax.adamw(schedule, weight_decay=config.weight_decay)

    def loss_fn(params, key):
        starts = jax.random.randint(key, (local_batch, 1), 0, train_bytes.shape[0] - ctx - 1)
        w = train_bytes[starts + jnp.arange(ctx + 1)]
        logits = model.apply({"params": params}, w[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, w[:, 1:]).mean()

    @jax.jit
    def evaluate(params):
        logits = model.apply({"params": params}, windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    def device_key(t):
        return jax.random.fold_in(
            jax.random.fold_in(jax.random.key(args.seed + 1), t), lax.axis_index("data")
        )

    def run_dp():
        tx = inner
        state = tx.init(params0)

        def body(params, state, t):
            g = lax.pmean(jax.grad(loss_fn)(params, device_key(t)), "data")
            u, state = tx.update(g, state, params)
            return optax.apply_updates(params, u), state

        step = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()), check_vma=False
            )
        )
        params = params0
        for t in range(args.steps):
            params, state = step(params, state, jnp.int32(t))
        wire = jc.collectives.uncompressed_send_nbytes(4 * num_params, n)
        return evaluate(params), wire

    def peak(codec, fragments=1):
        """Bytes a device sends in the largest synchronization."""
        leaves = jax.tree.leaves(params0)
        sizes = [sum(a.size for a in leaves[f::fragments]) for f in range(fragments)]
        if codec is None:
            return max(jc.collectives.uncompressed_send_nbytes(4 * m, n) for m in sizes)
        codec = jc.codecs.get(codec) if isinstance(codec, str) else codec
        return max(jc.collectives.send_nbytes(codec, m, jnp.float32, n) for m in sizes)

    def run_diloco(h, **options):
        tx = jc.optax.diloco(inner, "data", sync_every=h, **options)
        state = jc.optax.init(tx, params0, mesh, "data")
        specs = jc.optax.state_specs(state, "data")

        def body(params, state, t):
            p = jax.tree.map(lambda a: a[0], params)
            u, state = tx.update(jax.grad(loss_fn)(p, device_key(t)), state, p)
            return jax.tree.map(lambda a: a[None], optax.apply_updates(p, u)), state

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("data"), specs, P()),
                out_specs=(P("data"), specs),
                check_vma=False,
            )
        )
        params = jax.device_put(
            jax.tree.map(lambda a: jnp.stack([a] * n), params0), NamedSharding(mesh, P("data"))
        )
        for t in range(args.steps):
            params, state = step(params, state, jnp.int32(t))
        anchor = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), state.anchor)
        wire = float(jc.optax.telemetry(state)["wire_bytes"])
        return evaluate(anchor), wire, peak(options.get("codec"), options.get("fragments", 1))

    print(
        f"byte-level LM: {num_params:,} parameters, {n} devices, {args.steps} steps, "
        f"global batch {config.global_batch_size} x {ctx} bytes; jax {jax.__version__}"
    )
    print(
        f"{'row':28s} {'bytes/step/device':>18s} {'x fewer':>8s} {'peak':>10s} "
        f"{'test loss':>10s} {'s':>6s}"
    )
    dp_wire = jc.collectives.uncompressed_send_nbytes(4 * num_params, n)
    for row in args.rows:
        t0 = time.perf_counter()
        if row == "dp":
            loss, wire = run_dp()
            top = wire
        elif row.startswith("sparseloco:"):
            parts = row.split(":")
            k = int(parts[2]) if len(parts) > 2 else 2
            codec = jc.codecs.TopK(
                k_per_bucket=(k, 64), value_codec=jc.codecs.QSGD(bits=2, bucket_size=128)
            )
            loss, wire, top = run_diloco(
                int(parts[1]),
                codec=codec,
                error_feedback=True,
                error_decay=0.95,
                outer=optax.sgd(1.0),
            )
        elif row.startswith("streaming:"):
            parts = row.split(":")
            loss, wire, top = run_diloco(
                int(parts[1]),
                fragments=int(parts[2]),
                overlap_steps=int(parts[3]),
                alpha=float(parts[4]),
                codec=parts[5].replace("-", ":") if len(parts) > 5 else None,
                outer=optax.sgd(args.outer_lr, momentum=0.9, nesterov=True),
            )
        else:
            parts = row.split(":")
            loss, wire, top = run_diloco(
                int(parts[1]),
                codec=parts[2].replace("-", ":") if len(parts) > 2 else None,
                error_feedback=len(parts) > 3 and parts[3] == "ef",
                outer=optax.sgd(args.outer_lr, momentum=0.9, nesterov=True),
            )
        dt = time.perf_counter() - t0
        print(
            f"{row:28s} {wire:18,.0f} {dp_wire / wire:8.1f} {top:10,.0f} "
            f"{float(loss):10.4f} {dt:6.1f}"
        )


if __name__ == "__main__":
    main()
