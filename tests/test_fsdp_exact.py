"""The sharded step trains what the user wrote (jaxcomp/fsdp.py).

``tx`` runs on the global mean gradients, outside ``shard_map``: any optax
optimizer gives one device's step on the whole batch (global norms, trust
ratios, factored moments and matrix functions included), on one axis, on
``(slow, fast)`` and under HSDP; what cannot keep that contract raises.
A mesh with a model axis composes (tensor parallelism), and the state moves
to another device count with what the residuals owe kept."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp import fsdp

STEPS = 20


def _params(key=0):
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "w1": jax.random.normal(k1, (16, 32)) * 0.3,
        "b1": jnp.zeros((32,)),
        "w2": jax.random.normal(k2, (32, 8)) * 0.3,
        "scale": jnp.ones(()),
    }


def _mlp(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"]) * p["scale"]
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _batch(n=64):
    return (
        jax.random.normal(jax.random.key(1), (n, 16)),
        jax.random.normal(jax.random.key(2), (n, 8)),
    )


def _matrices(p):
    return jax.tree.map(lambda x: x.ndim > 1, p)


OPTIMIZERS = {
    "adamw-masked": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_matrices),
    "clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-1),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "inject-hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}
if hasattr(getattr(optax, "contrib", None), "muon"):
    OPTIMIZERS["muon"] = lambda: optax.contrib.muon(1e-2)

MESHES = {
    "fsdp": ((8,), ("fsdp",), fsdp.ShardParams("fsdp")),
    "slow-fast": ((2, 4), ("slow", "fast"), fsdp.ShardParams(("slow", "fast"))),
    "hsdp": ((2, 4), ("slow", "fast"), fsdp.ShardParams("fast", replicate_over="slow")),
}


@functools.cache
def _one_device(name: str):
    """``STEPS`` steps of ``OPTIMIZERS[name]`` on one device with the whole
    batch: the parameters after them."""
    tx = OPTIMIZERS[name]()
    params, batch = _params(), _batch()

    @jax.jit
    def step(p, o):
        updates, o = tx.update(jax.grad(_mlp)(p, batch), o, p)
        return optax.apply_updates(p, updates), o

    state = tx.init(params)
    for _ in range(STEPS):
        params, state = step(params, state)
    return params


def _run(tx, mesh, cfg, steps=STEPS, params=None, batch=None):
    step = jc.data_parallel(_mlp, tx, mesh, shard_params=cfg, donate=False)
    p, s = step.init(_params() if params is None else params)
    for _ in range(steps):
        p, s, _ = step(p, s, _batch() if batch is None else batch)
    return step, p, s


def _max_diff(a, b):
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "mesh_name",
    [
        "fsdp",
        pytest.param("slow-fast", marks=pytest.mark.slow),
        pytest.param("hsdp", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_any_optimizer_is_one_devices_step(name, mesh_name):
    """20 uncompressed sharded steps equal 20 steps on one device with the
    whole batch, to 1e-4 of how far the parameters moved (summation order):
    a transform that reduces over a parameter or over the tree (a global
    norm, a trust ratio, a factored moment, Muon's orthogonalization) sees
    the whole model, not a device's slices (per slice, clip_by_global_norm
    alone moved the parameters by twice the update)."""
    shape, names, cfg = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names)
    _, params, _ = _run(OPTIMIZERS[name](), mesh, cfg)
    want = _one_device(name)
    moved = _max_diff(want, _params())
    assert moved > 1e-3
    assert _max_diff(params, want) <= 1e-4 * moved


def _collectives(text: str) -> list[tuple[str, str]]:
    """``(kind, result type)`` of every collective in a compiled program."""
    out = []
    for line in text.splitlines():
        m = re.search(
            r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(", line
        )
        if m:
            out.append((m.group(2), re.sub(r"\{[\d,]*\}", "", m.group(1))))
    return out


def test_the_update_stays_sharded():
    """The compiled step of clip_by_global_norm + AdamW against plain SGD's:
    the only collectives the optimizer adds are all-reduces of scalars (the
    global norm); no parameter or moment is gathered outside the loss. The
    moments are sharded as their parameters."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    texts, states = {}, {}
    for name, tx in {
        "sgd": optax.sgd(0.1),
        "clip-adamw": optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
    }.items():
        step = jc.data_parallel(_mlp, tx, mesh, shard_params="fsdp")
        p, s = step.init(_params())
        texts[name] = step.lower(p, s, _batch()).compile().as_text()
        states[name] = s
    colls = {name: _collectives(text) for name, text in texts.items()}
    others = {
        name: sorted(c for c in found if c[0] != "all-reduce") for name, found in colls.items()
    }
    assert others["clip-adamw"] == others["sgd"]  # the loss's gathers and scatters only
    # XLA combines the scalar all-reduces into tuples: every one of scalars,
    # more of them than SGD's (the norm's).
    reduced = {
        name: [r for kind, r in found if kind == "all-reduce"] for name, found in colls.items()
    }
    for result in reduced["clip-adamw"]:
        assert re.fullmatch(r"\(?([su]32|f32)\[\](, ([su]32|f32)\[\])*\)?", result), result
    count = {name: sum(r.count("[]") for r in found) for name, found in reduced.items()}
    assert count["clip-adamw"] > count["sgd"]
    mu = states["clip-adamw"].opt_state[1][0].mu
    assert mu["w1"].addressable_shards[0].data.shape == (2, 32)
    assert mu["scale"].sharding.is_fully_replicated


# -- misuse -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, tx",
    [
        (
            "compress_gradients",
            lambda: optax.chain(jc.optax.compress_gradients("int8", "fsdp"), optax.sgd(0.1)),
        ),
        (
            "uncompressed_mean",
            lambda: optax.chain(jc.optax.uncompressed_mean("fsdp"), optax.sgd(0.1)),
        ),
        ("onebit_adam", lambda: jc.optax.onebit_adam(1e-3, "fsdp", warmup_steps=2)),
        ("powersgd", lambda: optax.chain(jc.optax.powersgd("fsdp"), optax.sgd(0.1))),
        ("diloco", lambda: jc.optax.diloco(optax.sgd(0.1), "fsdp", sync_every=2)),
    ],
)
def test_a_tx_that_averages_itself_is_refused(name, tx):
    """Inside a sharded step each device holds other slices: a transform
    that averages over the data axes would average different parameters."""
    step = jc.data_parallel(_mlp, tx(), jax.make_mesh((8,), ("fsdp",)), shard_params="fsdp")
    with pytest.raises(ValueError, match=rf"tx contains jc\.optax\.{name}.*optimizer alone"):
        step.init(_params())


def test_a_collective_in_the_update_is_refused():
    def averaged():
        def update(updates, state, params=None):
            return jax.tree.map(lambda g: lax.pmean(g, "fsdp"), updates), state

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    tx = optax.chain(averaged(), optax.sgd(0.1))
    step = jc.data_parallel(_mlp, tx, jax.make_mesh((8,), ("fsdp",)), shard_params="fsdp")
    params, state = step.init(_params())
    with pytest.raises(
        ValueError, match=r"runs a collective over a mesh axis.*without collectives"
    ):
        step(params, state, _batch())


def _stacked():
    return {"layers": jnp.ones((6, 16, 16)) * 0.1, "out": jnp.ones((16, 8)) * 0.1}


def _scanned(p, batch):
    x, y = batch

    def layer(h, w):
        return jnp.tanh(h @ fsdp.gather(w)), None

    h, _ = lax.scan(layer, x, p["layers"])
    return jnp.mean((h @ fsdp.gather(p["out"]) - y) ** 2)


def test_layers_misuse_names_the_leaf():
    mesh = jax.make_mesh((8,), ("fsdp",))
    batch = (jnp.ones((8, 16)), jnp.zeros((8, 8)))

    def step_of(layers, loss=_scanned, params=None):
        cfg = fsdp.ShardParams("fsdp", layers=layers)
        step = jc.data_parallel(loss, optax.sgd(0.1), mesh, shard_params=cfg)
        p, s = step.init(_stacked() if params is None else params)
        return step, p, s

    # A predicate that matches a leaf without a layer axis.
    with pytest.raises(ValueError, match=r"matched \['b'\] of shape \(16,\).*Leave \['b'\] out"):
        step_of(lambda path, x: True, params={"b": jnp.ones((16,))})
    # A matrix that is not a stack, gathered outside any scan.
    step, p, s = step_of(lambda path, x: True)
    with pytest.raises(ValueError, match=r"gather: \['out'\] is a ShardParams\(layers=...\) leaf"):
        step(p, s, batch)
    # A handle used without gather.
    step, p, s = step_of(
        lambda path, x: path[0].key == "layers",
        loss=lambda p, b: jnp.sum(p["layers"]) + _scanned(p, b),
    )
    with pytest.raises(ValueError, match=r"\['layers'\] is a ShardParams\(layers=...\) leaf"):
        step(p, s, batch)
    # Forgetting layers= for a stack that does not divide along dimension 0.
    with pytest.raises(ValueError, match=r"\['layers'\] of shape \(6, 16, 16\).*layers="):
        step_of(None)


# -- tensor parallelism ---------------------------------------------------------


def _tp_mesh():
    return jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)


def _tp_params(mesh):
    """``_params`` laid out Megatron-style over "model": w1 by columns, w2
    by rows."""
    layout = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "scale": P()}
    return jax.device_put(_params(), {k: NamedSharding(mesh, v) for k, v in layout.items()})


def test_fsdp_and_tensor_parallelism_compose():
    """On a 4 x 2 ("fsdp", "model") mesh: the step is the one-device step;
    the parameters keep their model layout and add "fsdp" on a free
    dimension; the compressed reduce-scatter runs over "fsdp" only, each
    device encoding its block of the model axis."""
    mesh = _tp_mesh()
    tx = optax.adam(1e-2)
    step, params, _ = _run(tx, mesh, fsdp.ShardParams("fsdp"), steps=5, params=_tp_params(mesh))
    assert params["w1"].sharding.spec == P("fsdp", "model")
    assert params["w2"].sharding.spec == P("model", "fsdp")  # dimension 0 is the model's
    assert params["b1"].sharding.spec == P("model")  # no free dimension: replicated over fsdp
    ref, state = _params(), tx.init(_params())
    for _ in range(5):
        updates, state = tx.update(jax.grad(_mlp)(ref, _batch()), state, ref)
        ref = optax.apply_updates(ref, updates)
    assert _max_diff(params, ref) < 1e-5

    cfg = fsdp.ShardParams("fsdp", gradients="qsgd:bits=4")
    step = jc.data_parallel(_mlp, tx, mesh, shard_params=cfg)
    p, s = step.init(_tp_params(mesh))
    text = step.lower(p, s, _batch()).compile().as_text()
    a2a = [line for line in text.splitlines() if " all-to-all(" in line]
    assert len(a2a) == 2 and all(_over_fsdp_only(line) for line in a2a)
    # Each encode reads the device's model block: w1's 16 x 16, w2's 16 x 8,
    # in 4 rows of one 512-value bucket each.
    encodes = re.findall(
        r"custom-call\(%[\w.\-]+\b.*?custom_call_target=\"jaxcomp_qsgd_encode", text
    )
    operands = re.findall(r"operand_layout_constraints=\{f32\[(\d+)\]", text)
    assert encodes and operands and all(int(n) <= 4 * 512 for n in operands)
    p, s, loss = step(p, s, _batch())
    assert np.isfinite(float(loss))


def _over_fsdp_only(line: str) -> bool:
    """Whether a collective of the 4 x 2 ("fsdp", "model") mesh runs over
    "fsdp" only: its replica groups as device lists, or (newer XLA) as the
    mesh with the axes named."""
    return "replica_groups={{0,2,4,6},{1,3,5,7}}" in line or bool(
        re.search(r"replica_groups=mesh\[[^\]]*\] \{'fsdp'\}", line)
    )


def test_replicated_step_takes_a_model_axis():
    """jc.data_parallel's replicated step on a 4 x 2 ("data", "model") mesh
    with the weights split over "model": the same parameters as on a mesh
    of the 4 data devices, and the layout over "model" kept."""
    out = {}
    for shape, names in [((4, 2), ("data", "model")), ((4,), ("data",))]:
        mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
        tx = optax.chain(jc.optax.compress_gradients("int8", "data"), optax.adam(1e-2))
        step = jc.data_parallel(_mlp, tx, mesh, donate=False)
        p, s = step.init(_tp_params(mesh) if len(shape) == 2 else _params())
        for _ in range(3):
            p, s, _ = step(p, s, _batch())
        out[len(shape)] = p
    assert out[2]["w1"].sharding.spec == P(None, "model")
    assert _max_diff(out[1], out[2]) < 1e-6


# -- NNX, steps in flight, another mesh -----------------------------------------------


def test_nnx_model_with_dropout_trains_with_a_stream_per_device():
    """A module holding nnx.Rngs (Dropout) through the sharded step: its
    streams are folded with the device index as in the replicated step, so
    the uncompressed sharded step equals the replicated one; the stream's
    counter moves on."""
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.l2 = nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jnp.tanh(self.l1(x))))

    def loss(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2)

    out = {}
    for name, (mesh, kwargs, tx) in {
        "sharded": (jax.make_mesh((8,), ("fsdp",)), {"shard_params": "fsdp"}, optax.adam(1e-2)),
        "replicated": (
            jax.make_mesh((8,), ("data",)),
            {},
            optax.chain(jc.optax.uncompressed_mean("data"), optax.adam(1e-2)),
        ),
    }.items():
        step = jc.data_parallel(loss, tx, mesh, donate=False, **kwargs)
        p, s = step.init(Net(nnx.Rngs(0)))
        for _ in range(3):
            p, s, _ = step(p, s, _batch())
        out[name] = (p, step.module(p))
    assert int(out["sharded"][1].drop.rngs.count.get_value()) == 3
    assert _max_diff(out["sharded"][0], out["replicated"][0]) < 1e-5


def test_an_unblocked_loop_keeps_one_step_in_flight():
    mesh = jax.make_mesh((8,), ("fsdp",))
    step = jc.data_parallel(_mlp, optax.adam(1e-2), mesh, shard_params="fsdp")
    assert step.max_in_flight == 1
    params, state = step.init(_params())
    batch = step.shard_batch(_batch())
    for _ in range(30):
        params, state, _ = step(params, state, batch)
        assert len(step._in_flight) <= 1
    assert np.isfinite(float(_mlp(jax.device_get(params), _batch())))


def _linear(p, batch):
    """A loss whose gradient is the batch itself, whatever the parameters."""
    return sum(jnp.sum(p[k] * batch[k].mean(0)) for k in p)


def _grads(n, seed):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((n, 64, 24)).astype(np.float32)}


@pytest.mark.parametrize(
    "shape, names, cfg",
    [
        ((4,), ("fsdp",), fsdp.ShardParams("fsdp", gradients="qsgd:bits=4")),
        (
            (2, 4),
            ("slow", "fast"),
            fsdp.ShardParams("fast", replicate_over="slow", gradients="qsgd:bits=4"),
        ),
        ((2, 4), ("slow", "fast"), fsdp.ShardParams(("slow", "fast"), gradients="qsgd:bits=4")),
    ],
    ids=["to-4", "to-hsdp-2x4", "to-slow-fast-2x4"],
)
def test_a_state_saved_on_8_devices_resumes_elsewhere(tmp_path, shape, names, cfg):
    """Three steps on 8 devices (one axis, QSGD-4 with error feedback, SGD
    at rate 1 on a loss whose gradient is the batch), an orbax checkpoint,
    ``relayout`` onto another mesh, three more steps: the parameters moved
    by what was applied plus what the residuals owe equal the mean
    gradients' sum, so nothing the codec dropped was lost in the move."""
    ocp = pytest.importorskip("orbax.checkpoint")
    old_cfg = fsdp.ShardParams("fsdp", gradients="qsgd:bits=4")
    p0 = {"a": jnp.zeros((64, 24))}
    first = _grads(8, 0)
    step = jc.data_parallel(
        _linear, optax.sgd(1.0), jax.make_mesh((8,), ("fsdp",)), shard_params=old_cfg
    )
    params, state = step.init(p0)
    for _ in range(3):
        params, state, _ = step(params, state, first)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": params, "state": state})

    n = int(np.prod(shape))
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:n])
    again = jc.data_parallel(_linear, optax.sgd(1.0), mesh, shard_params=cfg)
    p, s = again.init(p0)
    host = NamedSharding(mesh, P())  # the saved shapes, read onto the new mesh
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=host),
        {"params": params, "state": state},
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", abstract)
    s = again.relayout(restored["state"], from_shard_params=old_cfg)
    p = jax.device_put(restored["params"], jax.tree.map(lambda a: a.sharding, p))
    assert int(s.step) == 3
    second = _grads(n, 1)
    for _ in range(3):
        p, s, _ = again(p, s, second)

    total = 3 * first["a"].astype(np.float64).mean(0) + 3 * second["a"].astype(np.float64).mean(0)
    applied = -np.asarray(p["a"], np.float64)
    (r,) = (np.asarray(x, np.float64) for x in s.residuals)
    if cfg.replicate_over is not None:  # device (s, f) owes shard f
        owed = np.concatenate(list(r.reshape(2, 4, *r.shape[1:]).sum(0)), axis=0) / n
    elif len(names) == 2:  # the slow hop's partial sums, checked in total
        assert abs(applied.sum() + r.sum() / n - total.sum()) <= 1e-5 * np.abs(total).sum()
        return
    else:
        owed = r.sum(0) / n
    assert np.abs(applied + owed - total).max() <= 1e-5 * np.abs(total).max()
    assert np.abs(owed).max() > 0


def test_jc_optax_relayout_points_to_the_steps_own():
    mesh = jax.make_mesh((8,), ("fsdp",))
    step = jc.data_parallel(_linear, optax.sgd(1.0), mesh, shard_params="fsdp")
    params, state = step.init({"a": jnp.zeros((64, 24))})
    with pytest.raises(ValueError, match=r"sharded step.*step\.relayout\(saved"):
        jc.optax.relayout(state, optax.sgd(1.0), params, mesh, "fsdp")


def test_sharded_data_parallel_is_deprecated_for_data_parallel():
    mesh = jax.make_mesh((8,), ("fsdp",))
    with pytest.warns(DeprecationWarning, match=r"jc\.data_parallel\(.*shard_params"):
        step = fsdp.ShardedDataParallel(_mlp, optax.sgd(0.1), mesh, "fsdp")
    assert isinstance(step, jc.DataParallel) and step.shard_params.axis == "fsdp"
