"""An algorithmic task trained to a low loss, for the sharded step's
accuracy table (docs/fsdp.md): a 4-block transformer encoder learns to sort
sequences of digits, its layers stacked and applied with ``lax.scan``, each
layer gathered where it is used (``ShardParams(layers=...)``), trained with
the LM recipe's optimizer (global-norm clipping and AdamW with a weight
decay mask and a warm-up cosine schedule).

    python benchmarks/sort_task.py                     # float32, one seed, prints the loss
    python benchmarks/sort_task.py --codec qsgd:bits=4,bucket_size=64 --no-error-feedback

``train(config)`` is what benchmarks/fsdp.py's ``--task sort`` runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import dataclasses
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32  # the tokens
    length: int = 12  # tokens per sequence
    width: int = 64
    heads: int = 4
    blocks: int = 4
    batch: int = 128  # sequences per step, over every device
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    codec: str | None = None  # the gradient reduce-scatter's
    param_codec: str | None = None  # the parameter all-gather's
    error_feedback: bool = True
    replicas: int = 1  # HSDP: replicas x (8 / replicas)
    min_compress_size: int = 0
    eval_size: int = 1024


def init_params(c: Config, key):
    import jax
    import jax.numpy as jnp

    d, n = c.width, c.blocks
    ks = iter(jax.random.split(key, 16))

    def normal(shape, fan_in):
        return jax.random.normal(next(ks), shape) / np.sqrt(fan_in)

    return {
        "embed": normal((c.vocab, d), 1.0) * 0.5,
        "pos": normal((c.length, d), 1.0) * 0.5,
        "layers": {
            "ln1": jnp.ones((n, d)),
            "wq": normal((n, d, d), d),
            "wk": normal((n, d, d), d),
            "wv": normal((n, d, d), d),
            "wo": normal((n, d, d), d),
            "ln2": jnp.ones((n, d)),
            "w1": normal((n, d, 4 * d), d),
            "b1": jnp.zeros((n, 4 * d)),
            "w2": normal((n, 4 * d, d), 4 * d),
            "b2": jnp.zeros((n, d)),
        },
        "ln": jnp.ones((d,)),
        "head": normal((d, c.vocab), d),
    }


def _norm(x, scale):
    import jax.numpy as jnp

    x = x - x.mean(-1, keepdims=True)
    return x * (scale / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-6))


def logits_fn(c: Config):
    """``logits(params, digits)``: the model; each layer's parameters pass
    through ``jc.fsdp.gather`` (a no-op for whole arrays)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxcomp import fsdp

    def block(h, layer):
        p = {k: fsdp.gather(v) for k, v in layer.items()}
        b, t, d = h.shape
        x = _norm(h, p["ln1"])

        def heads(w):
            return (x @ w).reshape(b, t, c.heads, d // c.heads)

        q, k, v = heads(p["wq"]), heads(p["wk"]), heads(p["wv"])
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // c.heads), -1)
        h = h + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d) @ p["wo"]
        x = _norm(h, p["ln2"])
        return h + jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], None

    def logits(params, digits):
        g = {k: fsdp.gather(v) for k, v in params.items() if k != "layers"}
        h = g["embed"][digits] + g["pos"]
        h, _ = lax.scan(jax.checkpoint(block), h, params["layers"])
        return _norm(h, g["ln"]) @ g["head"]

    return logits


def batch(c: Config, rng: np.random.Generator, n: int):
    """``(digits, sorted digits)``, int32 ``[n, length]`` each."""
    x = rng.integers(0, c.vocab, (n, c.length), dtype=np.int32)
    return x, np.sort(x, axis=1)


def make_tx(c: Config):
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, c.lr, c.warmup, c.steps, c.lr * 0.1)
    return optax.chain(
        optax.clip_by_global_norm(c.clip),
        optax.adamw(
            schedule,
            weight_decay=c.weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim > 1 and x.shape[-1] > 1, p),
        ),
    )


def train(c: Config) -> dict:
    """Trains the sharded step on 8 devices; ``{"test_loss", "test_accuracy",
    "steps", "train_seconds"}`` on a held-out set."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxcomp as jc
    from jaxcomp import fsdp

    logits = logits_fn(c)

    def loss_fn(params, b):
        x, y = b
        return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()

    if c.replicas > 1:
        mesh = jax.make_mesh((c.replicas, 8 // c.replicas), ("replica", "fsdp"))
    else:
        mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(
        "fsdp",
        gradients=c.codec,
        parameters=c.param_codec,
        error_feedback=c.error_feedback,
        replicate_over="replica" if c.replicas > 1 else None,
        layers=lambda path, _: path[0].key == "layers",
        # The layers' dimension 0 is the layer, the positions' the sequence.
        shard_dim=lambda path, _: 1 if path[0].key in ("layers", "pos") else 0,
        seed=c.seed,
        min_compress_size=c.min_compress_size,
    )
    step = jc.data_parallel(loss_fn, make_tx(c), mesh, shard_params=cfg)
    params, state = step.init(init_params(c, jax.random.key(c.seed)))
    rng = np.random.default_rng(c.seed)
    t0 = time.time()
    for _ in range(c.steps):
        params, state, loss = step(params, state, step.shard_batch(batch(c, rng, c.batch)))
    jax.block_until_ready(loss)
    seconds = time.time() - t0
    x, y = batch(c, np.random.default_rng(10_000 + c.seed), c.eval_size)
    out = jax.jit(logits)(jax.device_get(params), jnp.asarray(x))
    test_loss = float(optax.softmax_cross_entropy_with_integer_labels(out, jnp.asarray(y)).mean())
    test_acc = float((out.argmax(-1) == jnp.asarray(y)).mean())
    return {
        "test_loss": test_loss,
        "test_accuracy": test_acc,
        "steps": c.steps,
        "train_seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codec", default=None)
    p.add_argument("--param-codec", default=None)
    p.add_argument("--no-error-feedback", action="store_true")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    c = Config(
        codec=a.codec,
        param_codec=a.param_codec,
        error_feedback=not a.no_error_feedback,
        replicas=a.replicas,
        steps=a.steps,
        seed=a.seed,
    )
    print(train(c))


if __name__ == "__main__":
    main()
