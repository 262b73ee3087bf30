"""Data-parallel training of a student MLP on a teacher network's labels.

The task is generated: a fixed random "teacher" (a two-layer tanh MLP whose
weights come from ``task_seed``, the same for every run) labels standard
Gaussian inputs with one of ``num_classes`` classes, sampled from the softmax
of its logits at ``label_temperature`` (0: the argmax), so even the teacher
is not always right. The training data never repeats: at every step each of
``num_devices`` devices (8 simulated CPU devices by default) draws its own
fresh minibatch from a key folded from the run's seed, the step and the
device index. The held-out set is ``test_size`` samples drawn once from the
task seed, the same for every run, so its accuracy and mean cross-entropy
carry a sampling error of well under a tenth of a percentage point.

The gradients are all-reduced by the first stage of an optax chain: a
float32 ``lax.pmean`` for ``--codec float32``, else
``jc.optax.compress_gradients`` (compressed all-reduce with error feedback).
Everything runs inside ``jax.shard_map`` over the ``"data"`` axis,
``log_every`` steps per compiled call (a ``lax.fori_loop``).
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


@dataclasses.dataclass(frozen=True)
class Config:
    """Hyperparameters of one training run."""

    codec: str = "float32"  # a common.parse_codec spec
    error_feedback: bool = True  # only for compressed codecs
    algorithm: str = "auto"  # jc.pmean's algorithm
    # False selects the one-level error feedback of the algorithms that
    # compress twice (the second compression's error charged to the chunk's
    # owner, at the scale of the sum).
    server_error_feedback: bool = True
    min_compress_size: int = 1024  # the library's default: the biases go in float32
    steps: int = 2000
    global_batch_size: int = 256  # summed over the devices
    learning_rate: float = 0.5  # peak of a cosine decay to zero
    momentum: float = 0.5
    hidden: tuple[int, ...] = (256, 128)  # the student's hidden layers
    # The task (the same for every run of a task_seed)
    task_seed: int = 1234
    input_dim: int = 16
    num_classes: int = 10
    teacher_hidden: int = 32
    teacher_scale: float = 4.0  # the teacher's logit scale (matters only with a temperature)
    label_temperature: float = 0.0  # labels ~ softmax(logits / T); 0: argmax
    test_size: int = 65536  # held-out samples
    log_every: int = 500
    seed: int = 0
    num_devices: int | None = None  # None: every GPU, else the 8 simulated CPU devices


class MLP(nn.Module):
    """Dense + ReLU layers of the given widths, then a linear head."""

    hidden: tuple[int, ...] = (256, 128)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for h in self.hidden:
            x = nn.relu(nn.Dense(h)(x))
        return nn.Dense(self.num_classes)(x)


class Teacher:
    """A fixed random two-layer tanh MLP: the task's labelling function."""

    def __init__(self, config: Config):
        k1, k2, k3, k4 = jax.random.split(jax.random.key(config.task_seed), 4)
        d, h, c = config.input_dim, config.teacher_hidden, config.num_classes
        self.w1 = jax.random.normal(k1, (d, h)) / np.sqrt(d)
        self.b1 = 0.5 * jax.random.normal(k2, (h,))
        self.w2 = config.teacher_scale * jax.random.normal(k3, (h, c)) / np.sqrt(h)
        self.input_dim = d
        self.temperature = config.label_temperature
        # Centre the logits (minus their mean over inputs): no class dominates.
        self.b2 = jnp.zeros((c,))
        self.b2 = -self.logits(jax.random.normal(k4, (1 << 16, d))).mean(0)

    def logits(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ self.w1 + self.b1) @ self.w2 + self.b2

    def sample(self, key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
        """``n`` inputs ~ N(0, I) and their labels."""
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (n, self.input_dim))
        logits = self.logits(x)
        if self.temperature > 0:
            y = jax.random.categorical(ky, logits / self.temperature)
        else:
            y = jnp.argmax(logits, -1)
        return x, y.astype(jnp.int32)


def _loss_and_accuracy(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, (jnp.argmax(logits, -1) == labels).mean()


class Trainer:
    """The compiled pieces of a configuration, reusable across seeds (the
    seed only enters through the initial parameters, the data key and the
    codec's key in the optimizer state)."""

    def __init__(self, config: Config):
        self.config = config
        self.spec = common.parse_codec(config.codec)
        self.mesh = common.make_mesh(config.num_devices, config.global_batch_size)
        self.teacher = Teacher(config)
        test_key = jax.random.fold_in(jax.random.key(config.task_seed), 1)
        self.x_test, self.y_test = jax.jit(self.teacher.sample, static_argnums=1)(
            test_key, config.test_size
        )
        self.model = MLP(hidden=tuple(config.hidden), num_classes=config.num_classes)
        shapes = jax.eval_shape(self.init_params, jax.random.key(0))
        self.num_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))
        local_batch = config.global_batch_size // self.mesh.size

        def loss_fn(params, key):
            x, y = self.teacher.sample(key, local_batch)
            return _loss_and_accuracy(self.model.apply({"params": params}, x), y)

        self.run = common.make_train_loop(
            self.spec, self.make_tx(0), self.mesh, loss_fn, shapes, self.num_params
        )
        self.evaluate = jax.jit(self._evaluate)

    def init_params(self, key: jax.Array) -> Any:
        return self.model.init(key, jnp.zeros((1, self.config.input_dim), jnp.float32))["params"]

    def make_tx(self, seed: int) -> optax.GradientTransformation:
        c = self.config
        return optax.chain(
            common.gradient_transformation(
                self.spec,
                error_feedback=c.error_feedback,
                server_error_feedback=c.server_error_feedback,
                algorithm=c.algorithm,
                min_compress_size=c.min_compress_size,
                seed=seed,
            ),
            optax.sgd(optax.cosine_decay_schedule(c.learning_rate, c.steps), momentum=c.momentum),
        )

    def _evaluate(self, params):
        logits = self.model.apply({"params": params}, self.x_test)
        return _loss_and_accuracy(logits, self.y_test)


@functools.lru_cache(maxsize=4)
def _trainer(config: Config) -> Trainer:
    return Trainer(config)


def train_and_evaluate(
    config: Config, workdir: str | pathlib.Path | None = None, *, verbose: bool = True
) -> dict[str, Any]:
    """Trains with ``config``; returns the final held-out metrics and the history.

    Args:
      config: the run's hyperparameters.
      workdir: if given, ``metrics.json`` (config, history, final) is written there.
      verbose: print a progress bar and a line per logging interval.
    Returns:
      A dict with ``test_accuracy`` and ``test_loss`` (mean cross-entropy, nats)
      on the held-out set, ``bits_per_element`` and ``wire_bytes`` (means over
      the steps; bytes sent per device per step), ``train_seconds`` and
      ``history`` (one row per logging interval).
    """
    common.check_config(config)
    # One compiled trainer serves every seed (the seed enters through start).
    return common.start(
        _trainer(dataclasses.replace(config, seed=0)), config, workdir, verbose=verbose
    )
