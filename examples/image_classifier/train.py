"""Data-parallel training of a small CNN on scikit-learn's digits.

Each of ``num_devices`` devices (8 simulated CPU devices by default) draws its
own minibatch, computes its gradient, and the gradients are all-reduced by the
first stage of an optax chain: a float32 ``lax.pmean`` for ``--codec float32``,
else ``jc.optax.compress_gradients`` (compressed all-reduce with error
feedback). Everything runs inside ``jax.shard_map`` over the ``"data"`` axis,
``log_every`` steps per compiled call (a ``lax.fori_loop``).

The data: the 1797 8x8 grey images of ``sklearn.datasets.load_digits``, split
once (stratified, fixed seed) into 1437 training and 360 test images.
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
from jax import lax

from examples import common

TEST_SIZE = 360
SPLIT_SEED = 0


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of one training run."""

    codec: str = "float32"  # a common.parse_codec spec
    error_feedback: bool = True  # only for compressed codecs
    algorithm: str = "auto"  # jc.pmean's algorithm
    # Leaves smaller than this are averaged in float32 (here: the biases);
    # the library's default, 1024, would also leave two of the four kernels
    # of this small model uncompressed.
    min_compress_size: int = 128
    steps: int = 600
    global_batch_size: int = 128  # summed over the devices
    learning_rate: float = 0.5  # peak of a cosine decay to zero
    momentum: float = 0.5
    weight_decay: float = 1e-4
    shift: int = 1  # random translation by up to this many pixels (augmentation)
    features: tuple[int, ...] = (16, 32)
    hidden: int = 64
    log_every: int = 100
    seed: int = 0
    num_devices: int | None = None  # None: every GPU, else the 8 simulated CPU devices


class CNN(nn.Module):
    """Two 3x3 conv + ReLU + 2x2 average-pool stages, then a hidden dense layer."""

    features: tuple[int, ...] = (16, 32)
    hidden: int = 64
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for f in self.features:
            x = nn.relu(nn.Conv(f, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


@functools.cache
def load_digits() -> dict[str, np.ndarray]:
    """Digits scaled to [0, 1], NHWC float32; a fixed stratified split."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    d = sk_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    y = d.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_SIZE, random_state=SPLIT_SEED, stratify=y
    )
    return {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}


def _loss_and_accuracy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, (jnp.argmax(logits, -1) == labels).mean()


def random_shift(key: jax.Array, x: jax.Array, shift: int) -> jax.Array:
    """Translates each image by up to ``shift`` pixels in each direction
    (zero fill): the classic augmentation for digit images."""
    if shift == 0:
        return x
    n, h, w, _ = x.shape
    padded = jnp.pad(x, ((0, 0), (shift, shift), (shift, shift), (0, 0)))
    offsets = jax.random.randint(key, (n, 2), 0, 2 * shift + 1)

    def crop(img, off):
        return lax.dynamic_slice(img, (off[0], off[1], 0), (h, w, img.shape[-1]))

    return jax.vmap(crop)(padded, offsets)


class Trainer:
    """The compiled pieces of a configuration, reusable across seeds (the
    seed only enters through the initial parameters, the data key and the
    codec's key in the optimizer state)."""

    def __init__(self, config: Config):
        self.config = config
        self.spec = common.parse_codec(config.codec)
        self.mesh = common.make_mesh(config.num_devices, config.global_batch_size)
        data = load_digits()
        self.x_train, self.y_train = jnp.asarray(data["x_train"]), jnp.asarray(data["y_train"])
        self.x_test, self.y_test = jnp.asarray(data["x_test"]), jnp.asarray(data["y_test"])
        self.model = CNN(features=tuple(config.features), hidden=config.hidden)
        shapes = jax.eval_shape(self.init_params, jax.random.key(0))
        self.num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))
        local_batch = config.global_batch_size // self.mesh.size
        n_train = self.x_train.shape[0]

        def loss_fn(params, key):
            k_idx, k_shift = jax.random.split(key)
            idx = jax.random.randint(k_idx, (local_batch,), 0, n_train)
            x = random_shift(k_shift, self.x_train[idx], config.shift)
            return _loss_and_accuracy(self.model.apply({"params": params}, x), self.y_train[idx])

        self.run = common.make_train_loop(
            self.spec, self.make_tx(0), self.mesh, loss_fn, shapes, self.num_params
        )
        self.evaluate = jax.jit(self._evaluate)

    def init_params(self, key: jax.Array) -> Any:
        return self.model.init(key, jnp.zeros((1, 8, 8, 1), jnp.float32))["params"]

    def make_tx(self, seed: int) -> optax.GradientTransformation:
        c = self.config
        return optax.chain(
            common.gradient_transformation(
                self.spec,
                error_feedback=c.error_feedback,
                algorithm=c.algorithm,
                min_compress_size=c.min_compress_size,
                seed=seed,
            ),
            optax.add_decayed_weights(c.weight_decay),
            optax.sgd(optax.cosine_decay_schedule(c.learning_rate, c.steps), momentum=c.momentum),
        )

    def _evaluate(self, params):
        return _loss_and_accuracy(self.model.apply({"params": params}, self.x_test), self.y_test)


@functools.lru_cache(maxsize=4)
def _trainer(config: Config) -> Trainer:
    return Trainer(config)


def train_and_evaluate(
    config: Config, workdir: str | pathlib.Path | None = None, *, verbose: bool = True
) -> dict[str, Any]:
    """Trains with ``config``; returns the final test metrics and the history.

    Args:
      config: the run's hyperparameters.
      workdir: if given, ``metrics.json`` (config, history, final) is written there.
      verbose: print a progress bar and a line per logging interval.
    Returns:
      A dict with ``test_accuracy``, ``test_loss``, ``bits_per_element`` and
      ``wire_bytes`` (means over the steps; bytes sent per device per step),
      ``train_seconds`` and ``history`` (one row per logging interval).
    """
    common.check_config(config)
    # One compiled trainer serves every seed (the seed enters through start).
    return common.start(
        _trainer(dataclasses.replace(config, seed=0)), config, workdir, verbose=verbose
    )
