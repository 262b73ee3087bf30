"""The digits CNN written in Flax NNX, trained under plain ``jax.jit``.

    python -m examples.image_classifier.nnx_main --codec qsgd:bits=4 --steps 600

The same model, data and hyperparameters as ``examples.image_classifier.main``
(configs/default.py), written as today's JAX code is: an ``nnx.Module``, a
mesh, and each step's global batch one array sharded over ``"data"`` by a
``NamedSharding``. ``jc.data_parallel`` turns the loss and the optax chain
into the jitted step; the gradient all-reduce inside it is the chain's first
element (``jc.optax.compress_gradients``, or a float32 ``lax.pmean`` for
``--codec float32``). The host draws each step's batch (indices from a
NumPy generator seeded by ``--seed``); every device shifts its images with
its own key (the step's key folded with the device index).
"""

from __future__ import annotations

from examples import common

common.simulate_devices(8)  # before jax is imported

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxcomp as jc  # noqa: E402
from examples.image_classifier import train  # noqa: E402
from examples.image_classifier.configs import default  # noqa: E402


class CNN(nnx.Module):
    """Two 3x3 conv + ReLU + 2x2 average-pool stages, then a hidden dense
    layer (the Linen ``train.CNN``, in NNX)."""

    def __init__(self, features=(16, 32), hidden=64, num_classes=10, *, rngs: nnx.Rngs):
        f1, f2 = features
        self.conv1 = nnx.Conv(1, f1, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(f1, f2, (3, 3), rngs=rngs)
        self.hidden = nnx.Linear(2 * 2 * f2, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for conv in (self.conv1, self.conv2):
            x = nnx.relu(conv(x))
            x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.out(nnx.relu(self.hidden(x)))


def loss_fn(model: CNN, batch, key):
    """Cross-entropy of this device's batch (shifted by up to ``shift``
    pixels with its key), and its accuracy."""
    x, y = batch
    x = train.random_shift(key, x, SHIFT)
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (jnp.argmax(logits, -1) == y).mean()


SHIFT = default.get_config().shift


def make_tx(config: train.Config, codec: str):
    """The optax chain of the Linen example, for ``codec`` (a --codec spec)."""
    spec = common.parse_codec(codec)
    return optax.chain(
        common.gradient_transformation(
            spec,
            error_feedback=config.error_feedback,
            algorithm=config.algorithm,
            min_compress_size=config.min_compress_size,
            seed=config.seed,
        ),
        optax.add_decayed_weights(config.weight_decay),
        optax.sgd(
            optax.cosine_decay_schedule(config.learning_rate, config.steps),
            momentum=config.momentum,
        ),
    )


def batches(config: train.Config, start: int = 0):
    """The global batch of every step from ``start`` on: (images, labels)
    drawn with replacement by a NumPy generator seeded by (seed, step), so a
    resumed run draws what the uninterrupted one would."""
    data = train.load_digits()
    n = data["x_train"].shape[0]
    step = start
    while True:
        idx = np.random.default_rng((config.seed, step)).integers(0, n, config.global_batch_size)
        yield step, (data["x_train"][idx], data["y_train"][idx])
        step += 1


def build(config: train.Config, codec: str, mesh=None, *, donate: bool = True, overlap="auto"):
    """(model, step, params, opt_state): the NNX model of ``config.seed``,
    the ``jc.data_parallel`` step (``overlap`` passed on), and its initial
    parameters and state."""
    mesh = (
        mesh if mesh is not None else common.make_mesh(config.num_devices, config.global_batch_size)
    )
    model = CNN(tuple(config.features), config.hidden, rngs=nnx.Rngs(config.seed))
    tx = make_tx(config, codec)
    step = jc.data_parallel(loss_fn, tx, mesh, has_aux=True, donate=donate, overlap=overlap)
    params, opt_state = step.init(model)
    return model, step, params, opt_state


def evaluate(step, params) -> tuple[float, float]:
    """Test loss and accuracy of the parameters (all 360 test images)."""
    data = train.load_digits()
    model = step.module(params)
    logits = model(jnp.asarray(data["x_test"]))
    y = jnp.asarray(data["y_test"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return float(loss), float((jnp.argmax(logits, -1) == y).mean())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m examples.image_classifier.nnx_main",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--codec", default="qsgd:bits=4", help="NAME[:KEY=VALUE,...] or float32")
    ap.add_argument("--steps", type=int, default=default.get_config().steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args(argv)
    config = dataclasses.replace(default.get_config(), steps=args.steps, seed=args.seed)
    _, step, params, opt_state = build(config, args.codec)
    key = jax.random.key(config.seed)
    t0 = time.perf_counter()
    for i, batch in batches(config):
        if i == config.steps:
            break
        batch = step.shard_batch(batch)  # one global array per input, sharded over "data"
        params, opt_state, (loss, acc) = step(params, opt_state, batch, jax.random.fold_in(key, i))
        if (i + 1) % args.log_every == 0 or i + 1 == config.steps:
            print(f"step {i + 1:5d}  loss {float(loss):.4f}  accuracy {float(acc):.4f}")
    test_loss, test_acc = evaluate(step, params)
    print(
        f"final ({args.codec}): test accuracy {test_acc:.4f}  test loss {test_loss:.4f}  "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return {"test_accuracy": test_acc, "test_loss": test_loss}


if __name__ == "__main__":
    main()
