"""Data-parallel training of a small byte-level transformer language model.

The corpus is the English help text that ships with every Python
(``pydoc_data.topics``, ~490 KB: the language reference's topics as shown by
``help()``), read as UTF-8 bytes (vocabulary 256). The last 10% is held out.
Each of ``num_devices`` devices (8 simulated CPU devices by default) draws its
own random windows, and the gradients are all-reduced by the first stage of
an optax chain: a float32 ``lax.pmean`` for ``--codec float32``, else
``jc.optax.compress_gradients``. The loss is the mean next-byte cross entropy
(nats per byte); perplexity is its exponential.
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


@functools.lru_cache(maxsize=4)
def _trainer(config: Config) -> Trainer:
    return Trainer(config)


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
    t = _trainer(dataclasses.replace(config, seed=0))
    result = common.start(t, config, workdir, verbose=verbose)
    result["test_perplexity"] = common.perplexity(result["test_loss"])
    return result
