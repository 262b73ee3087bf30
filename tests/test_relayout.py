"""``jc.optax.relayout``: a state saved on 8 devices resumes on 4 and back
on 8, and onto a (2, 4) two-level mesh, with what the residuals owe the
mean (every device's worker residual / P plus the server residuals at their
positions) kept to float32 rounding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp.optax._relayout import rows_map

CODEC = jc.codecs.QSGD(bits=4, bucket_size=128)
KW = dict(min_compress_size=64, fusion_bytes=4096)
PARAMS = {"a": jnp.zeros((40, 30)), "b": jnp.zeros((50,)), "c": jnp.zeros((700,))}
PAIR = ("node", "local")


def _mesh(shape, names):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _loss(params, batch):
    x, y = batch
    h = x @ params["a"] + params["b"][:30]
    return jnp.mean((h - y) ** 2) + jnp.mean((params["c"] - x[:, :1]) ** 2)


def _batch(t, n):
    k = jax.random.fold_in(jax.random.key(3), t)
    return jax.random.normal(k, (2 * n, 40)), jax.random.normal(
        jax.random.fold_in(k, 1), (2 * n, 30)
    )


@functools.cache  # one transformation per setting, so that its step compiles once
def _tx(axis, algorithm="auto"):
    return optax.chain(
        jc.optax.compress_gradients(CODEC, axis, algorithm=algorithm, **KW), optax.sgd(0.5)
    )


@functools.cache
def _step(tx, mesh, axis):
    return jc.data_parallel(_loss, tx, mesh, axis, donate=False)


def _train(tx, mesh, axis, params, opt_state, steps, t0=0):
    step = _step(tx, mesh, axis)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    for t in range(t0, t0 + steps):
        params, opt_state, _ = step(params, opt_state, _batch(t, step.num_devices))
    return params, opt_state


def owed(opt_state, sizes, algorithm, params=PARAMS, layers=None) -> dict:
    """Per leaf (float64): sum_d residual_d / P + the server residuals at
    their positions (units of the mean; a stacked bucket's row holds its
    layers' side by side)."""
    cs = opt_state[0]
    plan = jc.optax.make_plan(CODEC, params, **KW, layers=layers)
    keys = sorted(params)
    rows = np.asarray(cs.residuals[keys[0]]).shape[0]
    out = {k: np.asarray(cs.residuals[k], np.float64).sum(0) / rows for k in keys}
    for b, s in zip(plan.buckets, cs.server_residuals, strict=True):
        pos = jc.collectives.state_positions(b.codec, b.size, b.dtype, sizes, algorithm)
        if not pos.shape[1]:
            continue
        s = np.asarray(s, np.float64).reshape(rows, b.count, -1)
        fused = np.zeros((b.count, b.size))
        for layer in range(b.count):
            np.add.at(fused[layer], pos[pos >= 0], s[:, layer][pos >= 0])
        fused, at = fused.reshape(-1), 0
        for i, n in zip(b.leaves, b.sizes, strict=True):
            n *= b.count
            out[keys[i]] += fused[at : at + n].reshape(params[keys[i]].shape)
            at += n
    return out


def assert_kept(before: dict, after: dict):
    for k in before:
        scale = max(np.abs(before[k]).max(), 1e-30)
        np.testing.assert_allclose(after[k], before[k], rtol=0, atol=2e-7 * scale, err_msg=k)


@functools.cache
@functools.cache  # arrays: the tests read them, none changes them
def saved_on_8():
    """Three steps on 8 devices (two-phase: server residuals kept)."""
    mesh8 = _mesh((8,), ("data",))
    tx = _tx("data", "two_phase")
    opt_state = jc.optax.init(tx, PARAMS, mesh8, "data")
    params, opt_state = _train(tx, mesh8, "data", PARAMS, opt_state, 3)
    before = owed(opt_state, 8, "two_phase")
    assert any(np.abs(v).max() > 0 for v in before.values())
    assert any(np.asarray(s).any() for s in opt_state[0].server_residuals)
    return params, opt_state, before


def test_rows_map_keeps_what_the_devices_owe():
    for p in range(1, 9):
        for q in range(1, 9):
            w = rows_map(p, q, keep_sum=True)
            np.testing.assert_allclose(w.sum(0), q / p)  # every old row counted q / p times
            np.testing.assert_allclose(rows_map(p, q, keep_sum=False).sum(1), 1.0)
    np.testing.assert_array_equal(rows_map(8, 8, keep_sum=True), np.eye(8))
    np.testing.assert_array_equal(rows_map(4, 8, keep_sum=True), np.tile(np.eye(4), (2, 1)))


def test_eight_to_four_to_eight(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, opt_state, before = saved_on_8()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"p": params, "o": opt_state})
        ckpt.wait_until_finished()
        # On 4 devices: restore the saved shapes, replicated on the new mesh.
        mesh4 = _mesh((4,), ("data",))
        rep = NamedSharding(mesh4, P())
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
            {"p": params, "o": opt_state},
        )
        restored = ckpt.restore(tmp_path / "ckpt", target)
    tx = _tx("data", "two_phase")
    on4 = jc.optax.relayout(restored["o"], tx, PARAMS, mesh4, "data")
    assert on4[0].residuals["a"].shape == (4, 40, 30)
    assert on4[0].residuals["a"].sharding.spec == P("data")
    assert int(on4[0].step) == 3
    np.testing.assert_array_equal(on4[0].key, opt_state[0].key)
    assert not any(np.asarray(s).any() for s in on4[0].server_residuals)  # folded in
    assert_kept(before, owed(on4, 4, "two_phase"))
    # Training goes on on 4 devices, then back on 8.
    p4, o4 = _train(tx, mesh4, "data", restored["p"], on4, 2, t0=3)
    before4 = owed(o4, 4, "two_phase")
    mesh8 = _mesh((8,), ("data",))
    on8 = jc.optax.relayout(o4, tx, PARAMS, mesh8, "data")
    assert on8[0].residuals["a"].shape == (8, 40, 30)
    assert_kept(before4, owed(on8, 8, "two_phase"))
    p8, o8 = _train(tx, mesh8, "data", p4, on8, 1, t0=5)
    assert int(jc.optax.telemetry(o8)["step"]) == 6
    assert all(np.isfinite(np.asarray(v)).all() for v in p8.values())


def test_same_device_count_is_the_identity():
    _, opt_state, _ = saved_on_8()
    mesh8 = _mesh((8,), ("data",))
    again = jc.optax.relayout(opt_state, _tx("data", "two_phase"), PARAMS, mesh8, "data")
    for k in PARAMS:  # P == Q: each row as it was, plus the folded server residuals
        np.testing.assert_allclose(
            np.asarray(again[0].residuals[k]) - np.asarray(opt_state[0].residuals[k]),
            np.broadcast_to(
                owed(opt_state, 8, "two_phase")[k]
                - np.asarray(opt_state[0].residuals[k], np.float64).sum(0) / 8,
                again[0].residuals[k].shape,
            ),
            atol=1e-6,
        )


@pytest.mark.parametrize("shape", [(2, 4), pytest.param((4, 2), marks=pytest.mark.slow)])
def test_onto_a_two_level_mesh_and_back(shape):
    """8 devices onto (slow, fast) and back. On (2, 4) the slow all-reduce
    over 2 devices compresses once (no server residual, a placeholder); on
    (4, 2) it is two-phase, whose server residuals fold back in."""
    params, opt_state, before = saved_on_8()
    mesh2 = _mesh(shape, PAIR)
    tx2 = _tx(PAIR)
    on2 = jc.optax.relayout(opt_state, tx2, PARAMS, mesh2, PAIR)
    assert on2[0].residuals["a"].sharding.spec == P(PAIR)
    assert_kept(before, owed(on2, shape, "auto"))
    p2, o2 = _train(tx2, mesh2, PAIR, params, on2, 2, t0=3)
    before2 = owed(o2, shape, "auto")
    kept = any(np.asarray(s).any() for s in o2[0].server_residuals)
    assert kept == (shape[0] > 2)
    mesh8 = _mesh((8,), ("data",))
    tx = _tx("data", "two_phase")
    if shape == (2, 4):  # read as 8 flat rows, its placeholders do not fit
        with pytest.raises(ValueError, match="from_axis_sizes"):
            jc.optax.relayout(o2, tx, PARAMS, mesh8, "data")
    flat = jc.optax.relayout(o2, tx, PARAMS, mesh8, "data", from_axis_sizes=shape)
    assert_kept(before2, owed(flat, 8, "two_phase"))
    _train(tx, mesh8, "data", p2, flat, 1, t0=5)


def test_init_records_the_chain_after_tx_init_was_traced():
    """jc.optax.init (and relayout) learn the codecs of the chain while
    tracing tx.init; a trace jax cached earlier must not hide them."""
    tx = optax.chain(
        jc.optax.compress_gradients(jc.codecs.QSGD(bits=2, bucket_size=32), "data"),
        optax.adam(1e-3),
    )
    jax.eval_shape(tx.init, PARAMS)
    with pytest.warns(RuntimeWarning, match="second moment"):
        jc.optax.init(tx, PARAMS, _mesh((8,), ("data",)), "data")


def test_a_state_of_another_optimizer_is_refused():
    _, opt_state, _ = saved_on_8()
    other = jc.optax.onebit_adam(1e-3, "data", warmup_steps=2)
    with pytest.raises(ValueError, match="structure"):
        jc.optax.relayout(opt_state, other, PARAMS, _mesh((4,), ("data",)), "data")


@pytest.mark.slow
def test_onebit_adam_powersgd_and_diloco_states_relayout():
    """Their replicated parts carry over; their per-device parts are re-laid
    by the same rule (the sum of the residuals over the devices / P kept)."""
    mesh8, mesh4 = _mesh((8,), ("data",)), _mesh((4,), ("data",))
    for tx in (
        jc.optax.onebit_adam(1e-3, "data", warmup_steps=1),
        optax.chain(jc.optax.powersgd("data", rank=2, rest="int8"), optax.sgd(0.1)),
        jc.optax.diloco(
            optax.sgd(0.1, momentum=0.9), "data", sync_every=2, codec="int8", error_feedback=True
        ),
    ):
        step = jc.data_parallel(_loss, tx, mesh8, donate=False)
        params, opt_state = step.init(PARAMS)
        for t in range(3):
            params, opt_state, _ = step(params, opt_state, _batch(t, 8))
        on4 = jc.optax.relayout(opt_state, tx, PARAMS, mesh4, "data")
        old_leaves = jax.tree.leaves(opt_state)
        new_leaves = jax.tree.leaves(on4)
        for o, n in zip(old_leaves, new_leaves, strict=True):
            if o.shape == n.shape:
                continue
            assert o.shape[0] == 8 and n.shape[0] == 4
            if jnp.issubdtype(o.dtype, jnp.floating):
                np.testing.assert_allclose(
                    np.asarray(n, np.float64).mean(0),
                    np.asarray(o, np.float64).mean(0),
                    atol=1e-6 * max(1.0, float(np.abs(np.asarray(o)).max())),
                )


def test_the_steps_own_relayout_is_jc_optax_relayouts():
    """``step.relayout`` of the replicated step: the state jc.optax.relayout
    makes, so both modes of jc.data_parallel move a saved state alike."""
    _, opt_state, _ = saved_on_8()
    mesh4 = _mesh((4,), ("data",))
    tx = _tx("data", "two_phase")
    step = jc.data_parallel(_loss, tx, mesh4, donate=False)
    step.init(PARAMS)
    moved = step.relayout(jax.device_get(opt_state))
    want = jc.optax.relayout(jax.device_get(opt_state), tx, PARAMS, mesh4, "data")
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_stacked_leaf_moves_to_four_devices_layer_by_layer():
    """A stack of 3 layers (``compress_gradients(layers=)``: a stacked
    bucket, its server residual a row of every layer's), saved on 8
    devices after 3 steps, relayout onto 4: what it owes is kept."""
    params = {"s": jnp.zeros((3, 30, 30)), "a": jnp.zeros((40, 30))}

    def loss(p, batch):
        x, y = batch

        def layer(h, w):
            return jnp.tanh(h @ jc.fsdp.gather(w)), None

        h, _ = jax.lax.scan(layer, x @ p["a"], p["s"])
        return jnp.mean((h - y) ** 2)

    layers = lambda path, _: jax.tree_util.keystr(path) == "['s']"  # noqa: E731
    tx = optax.chain(
        jc.optax.compress_gradients(CODEC, "data", algorithm="two_phase", layers=layers, **KW),
        optax.sgd(0.5),
    )
    mesh8 = _mesh((8,), ("data",))
    step = jc.data_parallel(loss, tx, mesh8, donate=False)
    p, state = step.init({"s": params["s"] + 0.1, "a": params["a"] + 0.01})
    for t in range(3):
        p, state, _ = step(p, state, _batch(t, 8))
    assert [b.layers for b in state[0].comm.plan.buckets] == [0, 3]
    before = owed(state, 8, "two_phase", params, layers)
    assert np.abs(before["s"]).max() > 0 and np.asarray(state[0].server_residuals[1]).any()
    on4 = jc.optax.relayout(state, tx, params, _mesh((4,), ("data",)), "data")
    assert_kept(before, owed(on4, 4, "two_phase", params, layers))
