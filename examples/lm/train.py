"""Data-parallel training of a small byte-level transformer language model.

The corpus is the English help text that ships with every Python
(``pydoc_data.topics``, ~490 KB: the language reference's topics as shown by
``help()``), read as UTF-8 bytes (vocabulary 256). The last 10% is held out.
Each of ``num_devices`` devices (8 simulated CPU devices by default) draws its
own random windows, and the gradients are all-reduced by the first stage of
an optax chain: a float32 ``lax.pmean`` for ``--codec float32``, else
``jc.optax.compress_gradients``. The loss is the mean next-byte cross entropy
(nats per byte); perplexity is its exponential. With ``shard_params`` the
parameters, AdamW's state and the residuals are sharded over the devices
instead (:class:`ShardedTrainer`, docs/fsdp.md).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import common

HELD_OUT = 0.1
# HSDP's mesh axes: the replicas (slow links), then the shards (fast ones).
REPLICA_AXES = ("replica", common.AXIS)


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of one training run."""

    codec: str = "float32"  # a common.parse_codec spec
    error_feedback: bool = True  # only for compressed codecs
    algorithm: str = "auto"  # jc.pmean's algorithm
    # compress_gradients: smaller leaves (biases, norms) go in float32;
    # onebit_adam compresses every leaf's momentum (its default)
    min_compress_size: int = 1024
    steps: int = 400
    global_batch_size: int = 64  # windows per step, summed over the devices
    context: int = 64  # bytes per window
    width: int = 64
    num_layers: int = 2
    num_heads: int = 4
    learning_rate: float = 3e-3  # Adam; linear warm-up, then cosine decay
    warmup: int = 20
    weight_decay: float = 1e-4
    # "adamw": compress_gradients, then optax.adamw; "onebit_adam":
    # jc.optax.onebit_adam (Adam's momentum sent compressed after a warm-up
    # of freeze_steps exact steps; 0: 30% of the steps, docs/training.md).
    optimizer: str = "adamw"
    freeze_steps: int = 0
    send: str = "auto"  # onebit_adam's send: "auto", "momentum" or "gradient"
    # DiLoCo (docs/diloco.md): sync_every > 0 runs jc.optax.diloco with the
    # AdamW above as the inner optimizer and the codec on the pseudo-gradient
    # (error_feedback as set); outer SGD with Nesterov momentum 0.9 at
    # outer_lr. fragments, overlap_steps and alpha: Streaming DiLoCo.
    sync_every: int = 0
    outer_lr: float = 0.7
    fragments: int = 1
    overlap_steps: int = 0
    alpha: float = 0.0
    eval_windows: int = 256  # held-out windows evaluated (fixed, non-overlapping)
    log_every: int = 100
    seed: int = 0
    num_devices: int | None = None  # None: every GPU, else the 8 simulated CPU devices
    # Sharded training (docs/fsdp.md): parameters, optimizer state and
    # residuals sharded over the devices (jc.data_parallel(shard_params=...)),
    # the gradient reduce-scatter compressed with ``codec`` and the parameter
    # all-gather with ``param_codec`` ("float32": exact). replicas > 1: HSDP,
    # a (replicas x devices/replicas) mesh, the shards replicated over the
    # first axis, whose traffic alone is compressed.
    shard_params: bool = False
    param_codec: str = "float32"
    replicas: int = 1


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    width: int
    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return x + h


class ByteLM(nn.Module):
    """Token + learned position embeddings, ``num_layers`` blocks, a 256-way head."""

    width: int = 64
    num_layers: int = 2
    num_heads: int = 4
    context: int = 64

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(256, self.width)(tokens)
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (self.context, self.width))
        x = x + pos[: tokens.shape[-1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.num_layers):
            x = Block(self.width, self.num_heads)(x, mask)
        return nn.Dense(256)(nn.LayerNorm()(x))


@functools.cache
def load_corpus() -> dict[str, np.ndarray]:
    """The help topics, sorted by name and joined, as uint8 bytes; 90/10 split."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    cut = int(len(data) * (1 - HELD_OUT))
    return {"train": data[:cut], "test": data[cut:]}


def _loss_and_accuracy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, (jnp.argmax(logits, -1) == targets).mean()


class Trainer:
    """The compiled pieces of a configuration, reusable across seeds."""

    def __init__(self, config: Config):
        self.config = config
        self.spec = common.parse_codec(config.codec)
        self.mesh = common.make_mesh(config.num_devices, config.global_batch_size)
        corpus = load_corpus()
        self.train_bytes = jnp.asarray(corpus["train"], jnp.int32)
        ctx = config.context
        n_test = min(config.eval_windows, (len(corpus["test"]) - 1) // ctx)
        windows = np.stack(
            [corpus["test"][i * ctx : i * ctx + ctx + 1] for i in range(n_test)]
        ).astype(np.int32)
        self.test_windows = jnp.asarray(windows)
        self.model = ByteLM(config.width, config.num_layers, config.num_heads, ctx)
        shapes = jax.eval_shape(self.init_params, jax.random.key(0))
        self.num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))
        local_batch = config.global_batch_size // self.mesh.size
        n_train = self.train_bytes.shape[0]

        def loss_fn(params, key):
            starts = jax.random.randint(key, (local_batch, 1), 0, n_train - ctx - 1)
            w = self.train_bytes[starts + jnp.arange(ctx + 1)]
            return _loss_and_accuracy(self.model.apply({"params": params}, w[:, :-1]), w[:, 1:])

        self.run = common.make_train_loop(
            self.spec, self.make_tx(0), self.mesh, loss_fn, shapes, self.num_params
        )
        self.evaluate = jax.jit(self._evaluate)

    def init_params(self, key: jax.Array) -> Any:
        tokens = jnp.zeros((1, self.config.context), jnp.int32)
        return self.model.init(key, tokens)["params"]

    def make_tx(self, seed: int) -> optax.GradientTransformation:
        c = self.config
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, c.learning_rate, min(c.warmup, c.steps - 1), c.steps
        )
        if c.optimizer == "onebit_adam":
            if self.spec.uncompressed:
                raise ValueError("optimizer='onebit_adam' needs a compressed codec")
            import jaxcomp as jc

            return jc.optax.onebit_adam(
                schedule,
                common.AXIS,
                self.spec.build(),
                warmup_steps=c.freeze_steps or max(1, 3 * c.steps // 10),
                weight_decay=c.weight_decay,
                algorithm=c.algorithm,
                send=c.send,
                seed=seed,
            )
        if c.optimizer != "adamw":
            raise ValueError(f"optimizer must be 'adamw' or 'onebit_adam', got {c.optimizer!r}")
        if c.sync_every:
            import jaxcomp as jc

            return jc.optax.diloco(
                optax.adamw(schedule, weight_decay=c.weight_decay),
                common.AXIS,
                sync_every=c.sync_every,
                outer=optax.sgd(c.outer_lr, momentum=0.9, nesterov=True),
                codec=None if self.spec.uncompressed else self.spec.build(),
                error_feedback=c.error_feedback and not self.spec.uncompressed,
                fragments=c.fragments,
                overlap_steps=c.overlap_steps,
                alpha=c.alpha,
                algorithm=c.algorithm,
                seed=seed,
            )
        return optax.chain(
            common.gradient_transformation(
                self.spec,
                error_feedback=c.error_feedback,
                algorithm=c.algorithm,
                min_compress_size=c.min_compress_size,
                seed=seed,
            ),
            optax.adamw(schedule, weight_decay=c.weight_decay),
        )

    def _evaluate(self, params):
        w = self.test_windows
        return _loss_and_accuracy(self.model.apply({"params": params}, w[:, :-1]), w[:, 1:])


class ShardedTrainer:
    """The sharded configuration (``Config.shard_params``): the parameters,
    Adam's state and the residuals sharded over the devices by
    ``jc.data_parallel(shard_params=jc.fsdp.ShardParams(...))``, which
    all-gathers each parameter for the forward pass and reduce-scatters its
    gradient (compressed with ``codec``; the all-gather with
    ``param_codec``). The batch is a global array drawn on the devices, so
    the same program runs with several processes (``jaxcomp launch``).

    A leaf whose dimension 0 does not divide over the sharding devices
    (attention's per-head biases and output kernel: ``num_heads`` rows) is
    sharded flattened: the step sees it as a vector, the model gets it back
    in its own shape after the gather."""

    def __init__(self, config: Config):
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        import jaxcomp as jc
        from jaxcomp import fsdp

        self.config = c = config
        self.spec = common.parse_codec(c.codec)
        self.param_spec = common.parse_codec(c.param_codec)
        if self.spec.powersgd:
            raise ValueError("shard_params: --codec powersgd is not a reduce-scatter codec")
        if c.optimizer != "adamw" or c.sync_every:
            raise ValueError("shard_params trains with adamw only (no onebit_adam, no DiLoCo)")
        flat = common.make_mesh(c.num_devices, c.global_batch_size)
        n = flat.size
        if c.replicas < 1 or n % c.replicas:
            raise ValueError(f"replicas={c.replicas} must divide the {n} devices")
        if c.replicas > 1:  # HSDP: sharded over AXIS, replicated over "replica"
            self.mesh = Mesh(flat.devices.reshape(c.replicas, n // c.replicas), REPLICA_AXES)
        else:
            self.mesh = flat
        self.shard_count = n // c.replicas
        corpus = load_corpus()
        replicated = NamedSharding(self.mesh, P())
        self.train_bytes = jax.device_put(corpus["train"].astype(np.int32), replicated)
        ctx = c.context
        n_test = min(c.eval_windows, (len(corpus["test"]) - 1) // ctx)
        windows = np.stack(
            [corpus["test"][i * ctx : i * ctx + ctx + 1] for i in range(n_test)]
        ).astype(np.int32)
        self.test_windows = jax.device_put(windows, replicated)
        self.model = ByteLM(c.width, c.num_layers, c.num_heads, ctx)
        tokens = jnp.zeros((1, ctx), jnp.int32)
        self.shapes = jax.eval_shape(
            lambda k: self.model.init(k, tokens)["params"], jax.random.key(0)
        )
        self.num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(self.shapes))
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, c.learning_rate, min(c.warmup, c.steps - 1), c.steps
        )
        self.tx = optax.adamw(schedule, weight_decay=c.weight_decay)
        self.shard = fsdp.ShardParams(
            axis=common.AXIS,
            gradients=self.spec.build(),
            parameters=self.param_spec.build(),
            error_feedback=c.error_feedback,
            replicate_over=REPLICA_AXES[0] if c.replicas > 1 else None,
            seed=c.seed,
        )
        model = self.model

        def loss_fn(params, windows):
            logits = model.apply({"params": self.unflatten(params)}, windows[:, :-1])
            return _loss_and_accuracy(logits, windows[:, 1:])

        self.step = jc.data_parallel(
            loss_fn, self.tx, self.mesh, shard_params=self.shard, has_aux=True
        )
        n_train, batch = self.train_bytes.shape[0], c.global_batch_size

        def draw(data, key, step):
            key = jax.random.fold_in(key, step)
            starts = jax.random.randint(key, (batch, 1), 0, n_train - ctx - 1)
            return data[starts + jnp.arange(ctx + 1)]

        self._draw = jax.jit(draw, out_shardings=self.step.batch_sharding)
        self._init = jax.jit(
            lambda k: self.flatten(model.init(k, tokens)["params"]), out_shardings=replicated
        )

        def evaluate(params, w):
            return _loss_and_accuracy(
                model.apply({"params": self.unflatten(params)}, w[:, :-1]), w[:, 1:]
            )

        self._evaluate = jax.jit(evaluate)
        self._telemetry = None

    def flatten(self, params):
        """``params`` as the step shards them (leaves that do not divide: 1-D)."""
        return jax.tree.map(lambda a: a if self._divides(a.shape) else a.reshape(-1), params)

    def unflatten(self, params):
        """The model's parameters from :meth:`flatten`'s."""
        return jax.tree.map(lambda a, s: a.reshape(s.shape), params, self.shapes)

    def _divides(self, shape) -> bool:
        return len(shape) > 0 and shape[0] % self.shard_count == 0

    def init_params(self, key: jax.Array) -> Any:
        """The model's parameters (unsharded), as the replicated path's."""
        return self.unflatten(self._init(key))

    def evaluate(self, params):
        """(held-out loss, next-byte accuracy) of the step's parameters."""
        return self._evaluate(params, self.test_windows)

    def run(self, params, state, data_key, start, num_steps: int):
        """``num_steps`` steps from step ``start``: ``(params, state,
        metrics)``, metrics as :func:`common.make_train_loop`'s."""
        start = int(start)
        sums = np.zeros(2)
        for i in range(num_steps):
            batch = self._draw(self.train_bytes, data_key, start + i)
            params, state, (loss, acc) = self.step(params, state, batch)
            if self._telemetry is None:
                self._telemetry = self.telemetry(params, state, batch)
            # One step in flight: XLA:CPU's rendezvous can abort with many queued.
            sums += (float(loss), float(acc))
        bits, wire = self._telemetry
        metrics = np.array([*(sums / num_steps), bits, wire], np.float64)
        return params, state, metrics

    def telemetry(self, params, state, batch) -> tuple[float, float]:
        """(bits per element, bytes one device sends per step), read from the
        compiled step (:func:`common.collective_traffic`). Bits per element
        are normalized as the replicated path's: a float32 ring all-reduce
        (a reduce-scatter and an all-gather, ``2 (P-1)/P`` of 4 bytes per
        element) is 32 bits, and so is float32 sharded training."""
        # Lowered as the step runs: compiling it again hits JAX's caches.
        text = self.step.lower(params, state, batch).compile().as_text()
        wire = sum(c["sent"] for c in common.collective_traffic(text, self.mesh))
        p = self.mesh.size
        return 8.0 * wire / (2.0 * (p - 1) / p * self.num_params), wire

    def start(self, config: Config, workdir, *, verbose: bool) -> dict:
        init_key, data_key = jax.random.split(jax.random.key(config.seed))
        params, state = self.step.init(self._init(init_key))
        result = common.fit(self, params, state, data_key, config, workdir, verbose=verbose)
        result["params"] = self.unflatten(result["params"])
        return result


@functools.lru_cache(maxsize=4)
def _trainer(config: Config) -> Trainer:
    return Trainer(config)


@functools.lru_cache(maxsize=2)
def _sharded_trainer(config: Config) -> ShardedTrainer:
    return ShardedTrainer(config)


def train_and_evaluate(
    config: Config, workdir: str | pathlib.Path | None = None, *, verbose: bool = True
) -> dict[str, Any]:
    """Trains with ``config``; returns the held-out metrics and the history.

    Args:
      config: the run's hyperparameters.
      workdir: if given, ``metrics.json`` (config, history, final) is written there.
      verbose: print a progress bar and a line per logging interval.
    Returns:
      A dict with ``test_loss`` (nats per byte), ``test_perplexity``,
      ``test_accuracy`` (next-byte), ``bits_per_element`` and ``wire_bytes``
      (means over the steps; bytes sent per device per step),
      ``train_seconds`` and ``history``.
    """
    common.check_config(config, min_steps=2)
    if config.shard_params:
        # The codecs' keys are seeded by the step itself: one per seed.
        result = _sharded_trainer(config).start(config, workdir, verbose=verbose)
    else:
        t = _trainer(dataclasses.replace(config, seed=0))
        result = common.start(t, config, workdir, verbose=verbose)
    result["test_perplexity"] = common.perplexity(result["test_loss"])
    return result
