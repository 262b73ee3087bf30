"""Every optimizer state jaxcomp makes checkpoints with orbax and restores
bit-identically: every codec through every algorithm that carries it,
``onebit_adam``, ``powersgd`` and ``diloco``, on 2 to 8 devices, one step
each (the state's shapes are fixed by then). A state holds no zero-size
array (orbax refuses them): a bucket whose algorithm keeps no server
residual holds a one-element placeholder row, and DiLoCo without error
feedback holds no residual."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxcomp as jc

ocp = pytest.importorskip("orbax.checkpoint")

CODECS = [jc.codecs.get(name) for name in jc.codecs.names()]
SIZE = 96  # values per leaf: one small bucket per codec


def _mesh(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


def _loss(params, batch):
    return sum(jnp.mean((batch * p.reshape(-1)[: batch.shape[-1]]) ** 2) for p in params.values())


def _params(names):
    return {n: jnp.linspace(-1.0, 1.0, SIZE, dtype=jnp.float32) + i for i, n in enumerate(names)}


def _leaf_name(codec) -> str:
    return type(codec).__name__.lower()


def _compress(axis, algorithm, carried):
    """compress_gradients with one bucket per codec of ``carried``, the
    other leaves exact."""
    by_name = {_leaf_name(c): c for c in carried}

    def policy(path, leaf):
        del leaf
        return by_name.get(path[-1].key)

    return jc.optax.compress_gradients(policy, axis, algorithm=algorithm, min_compress_size=1)


def _carries(codec, algorithm) -> bool:
    rate = codec.rate
    if algorithm == "sparse":
        return rate is jc.codecs.Rate.SPARSE
    if algorithm == "allreduce":
        return rate is jc.codecs.Rate.LINEAR
    return True


def _roundtrip(path, params, opt_state):
    """Saves and restores ``{"p", "o"}`` with orbax; asserts every leaf
    comes back bit for bit, with its sharding; returns the restored tree."""
    tree = {"p": params, "o": opt_state}
    sizes = [x.size for x in jax.tree.leaves(tree)]
    assert min(sizes) > 0, "the state holds a zero-size array"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, tree)
        ckpt.wait_until_finished()
        restored = ckpt.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(tree), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return restored


def _check(tmp_path, tx, mesh, axis, params, steps_after=0, train=True):
    """One step (or, with ``train`` False, the state as initialized: its
    shapes are the trained state's), then the round trip."""
    step = jc.data_parallel(_loss, tx, mesh, axis)
    batch = jnp.ones((2 * step.num_devices, 8), jnp.float32)
    p, o = step.init(params)
    if train:
        p, o, _ = step(p, o, batch)
    restored = _roundtrip(tmp_path / "ckpt", p, o)
    for _ in range(steps_after):  # the restored state trains on exactly as the saved one
        p, o, _ = step(p, o, batch)
        rp, ro, _ = step(restored["p"], restored["o"], batch)
        for a, b in zip(jax.tree.leaves((p, o)), jax.tree.leaves((rp, ro)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        restored = {"p": rp, "o": ro}


@pytest.mark.parametrize(
    "codec, devices",
    [("onebit", 8), ("int8", 2), ("signsgd", 4), ("topk:fraction=0.1", 2)],
    ids=["onebit-8", "int8-2", "signsgd-4", "topk-2"],
)
def test_state_of_an_algorithm_without_server_residual_checkpoints(tmp_path, codec, devices):
    """``auto`` picks allgather (one compression, no server residual) for
    these: the state holds a placeholder row, orbax saves it, and the
    restored state trains on bit-identically."""
    mesh = _mesh((devices,), ("data",))
    tx = optax.chain(
        jc.optax.compress_gradients(codec, "data", min_compress_size=1), optax.sgd(0.1)
    )
    _check(tmp_path, tx, mesh, "data", {"w": jnp.ones((SIZE,), jnp.float32)}, steps_after=1)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_diloco_state_checkpoints(tmp_path, error_feedback):
    mesh = _mesh((4,), ("data",))
    tx = jc.optax.diloco(
        optax.sgd(0.1),
        "data",
        sync_every=1,
        codec="int8",
        error_feedback=error_feedback,
    )
    _check(tmp_path, tx, mesh, "data", {"w": jnp.ones((SIZE,), jnp.float32)}, steps_after=1)


# Device counts that differ in what decides the state's shapes: the
# smallest (2), one that does not divide the leaves' SIZE (5, odd: DiLoCo
# without error feedback), and the hierarchical pair with an odd (6: 2 x 3)
# and an even (8: 2 x 4) local axis. 3, 4 and 7 repeat one of these.
@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 5, 6, 8])
def test_every_codec_algorithm_and_optimizer_checkpoints(tmp_path, devices):
    """On ``devices`` devices: one chain with a compress_gradients per
    algorithm (each codec it carries in a bucket of its own), powersgd and
    onebit_adam; under the hierarchical pair where the count splits; and
    diloco, with and without error feedback by turns. On 8 devices (the
    flat chain, the hierarchical pair and DiLoCo) one step, then a
    bit-identical round trip; on the other counts the round trip of the
    initialized state, whose shapes (all that decides whether orbax saves
    it) are the trained state's: compiling the step is most of this test's
    time. (The fast tier trains and round-trips DiLoCo both ways and the
    algorithms without a server residual.)"""
    train = devices == 8
    names = [_leaf_name(c) for c in CODECS]
    params = {**_params(names), "mat": jnp.ones((16, 12), jnp.float32)}
    algorithms = ("auto", "allgather", "two_phase", "ring", "sparse", "allreduce")
    parts = [_compress("data", alg, [c for c in CODECS if _carries(c, alg)]) for alg in algorithms]
    parts += [
        jc.optax.powersgd("data", rank=2, rest="int8"),
        jc.optax.onebit_adam(1e-3, "data", warmup_steps=1),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # TernGrad through two_phase, ring
        mesh = _mesh((devices,), ("data",))
        _check(tmp_path / "flat", optax.chain(*parts), mesh, "data", params, train=train)
        if devices % 2 == 0 and devices > 2:
            pair = ("node", "local")
            mesh2 = _mesh((2, devices // 2), pair)
            tx = optax.chain(_compress(pair, "hierarchical", CODECS), optax.sgd(0.1))
            _check(tmp_path / "hier", tx, mesh2, pair, _params(names), train=train)
        # Its state's shapes depend on error_feedback, not on the codec.
        tx = jc.optax.diloco(
            optax.sgd(0.1),
            "data",
            sync_every=1,
            codec=CODECS[devices % len(CODECS)],
            error_feedback=devices % 2 == 0,
        )
        _check(tmp_path / "diloco", tx, mesh, "data", {"w": params["mat"]}, train=train)
