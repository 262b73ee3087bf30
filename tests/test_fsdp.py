"""Sharded training (jaxcomp/fsdp.py): ``jc.data_parallel(shard_params=...)``.

The exact configuration is checked against full-batch SGD computed on one
device; the compressed ones for error feedback's conservation, for a
bit-identical resume, for the bytes in the compiled step, and for the
per-layer gather of a stacked model (the compiled program's buffers)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp import fsdp

LR = 0.1


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


def _full_batch_sgd(loss, params, batch, steps):
    for _ in range(steps):
        g = jax.grad(loss)(params, batch)
        params = jax.tree.map(lambda a, b: a - LR * b, params, g)
    return params


def _max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    "shape, cfg",
    [
        ((8,), fsdp.ShardParams(axis="fsdp")),
        ((8,), fsdp.ShardParams(axis="fsdp", gradients="identity", parameters="identity")),
        ((2, 4), fsdp.ShardParams(axis=("slow", "fast"))),
        ((2, 4), fsdp.ShardParams(axis="fast", replicate_over="slow")),
    ],
    ids=["fsdp", "fsdp-identity-codecs", "fsdp-2d", "hsdp"],
)
def test_exact_sharded_step_is_full_batch_sgd(shape, cfg):
    names = ("fsdp",) if len(shape) == 1 else ("slow", "fast")
    mesh = jax.make_mesh(shape, names)
    step = jc.data_parallel(_mlp, optax.sgd(LR), mesh, shard_params=cfg, donate=False)
    params, state = step.init(_params())
    for _ in range(3):
        params, state, loss = step(params, state, _batch())
    assert _max_diff(params, _full_batch_sgd(_mlp, _params(), _batch(), 3)) < 1e-6
    assert np.isfinite(float(loss))


def test_layout_shards_parameters_state_and_residuals():
    mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(axis="fsdp", gradients=jc.codecs.QSGD(bits=4))
    step = jc.data_parallel(_mlp, optax.adam(1e-3), mesh, shard_params=cfg)
    params, state = step.init(_params())
    assert params["w1"].sharding.spec == P("fsdp")
    assert params["scale"].sharding.is_fully_replicated
    for a in jax.tree.leaves(params):
        if a.ndim:
            assert a.addressable_shards[0].data.shape[0] == a.shape[0] // 8
    # Adam's moments: global arrays, sharded as their parameters.
    mu = state.opt_state[0].mu
    assert mu["w1"].shape == (16, 32)
    assert mu["w1"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)
    assert mu["scale"].sharding.is_fully_replicated
    # One residual per sharded leaf: what a device compresses, the whole leaf.
    assert [r.shape for r in state.residuals] == [(8, 32), (8, 16, 32), (8, 32, 8)]
    assert all(r.addressable_shards[0].data.shape[0] == 1 for r in state.residuals)


def _stacked(layers=6, width=64):
    k1, k2 = jax.random.split(jax.random.key(3))
    return {
        "layers": {"w": jax.random.normal(k1, (layers, width, width)) * 0.1},
        "out": jax.random.normal(k2, (width, 8)) * 0.1,
    }


def _scanned_loss(remat):
    def loss(p, batch):
        x, y = batch

        def body(h, layer):
            return jnp.tanh(h @ fsdp.gather(layer["w"])), None

        h, _ = lax.scan(jax.checkpoint(body) if remat else body, x, p["layers"])
        return jnp.mean((h @ fsdp.gather(p["out"]) - y) ** 2)

    return loss


def _unrolled(p, batch):
    x, y = batch
    for w in p["layers"]["w"]:
        x = jnp.tanh(x @ w)
    return jnp.mean((x @ p["out"] - y) ** 2)


def _layers(path, _):
    return "layers" in jax.tree_util.keystr(path)


def test_scanned_model_gathers_one_layer_at_a_time():
    mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(axis="fsdp", layers=_layers)
    batch = (jax.random.normal(jax.random.key(1), (64, 64)), jnp.zeros((64, 8)))
    layer_bytes, stack_bytes = 64 * 64 * 4, 6 * 64 * 64 * 4
    temp = {}
    for remat in (True, False):
        step = jc.data_parallel(_scanned_loss(remat), optax.sgd(LR), mesh, shard_params=cfg)
        params, state = step.init(_stacked())
        compiled = step.lower(params, state, batch).compile()
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
        gathered = re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", compiled.as_text())
        assert gathered and all(
            int(np.prod([int(d) for d in g.split(",")])) <= 64 * 64 for g in gathered
        )
    # Rematerialized, the step's buffers hold about two layers' gathered
    # parameters, never the stack; kept for the backward pass, every layer's.
    assert temp[True] < 3 * layer_bytes < stack_bytes < temp[False]
    step = jc.data_parallel(
        _scanned_loss(True), optax.sgd(LR), mesh, shard_params=cfg, donate=False
    )
    params, state = step.init(_stacked())
    for _ in range(2):
        params, state, _ = step(params, state, batch)
    assert params["layers"]["w"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp")), 3)
    assert _max_diff(params, _full_batch_sgd(_unrolled, _stacked(), batch, 2)) < 1e-6


def _nnx_stack():
    """A Flax NNX model of ``_stacked``'s shape: its layers made by
    ``nnx.vmap`` (the stacked leaf) and applied by ``nnx.scan``; each layer
    gathers its own parameter (``get_value``: the variable's value is a
    ``Shard`` handle when the step hands one over)."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (64, 64)) * 0.1)

        def __call__(self, h):
            return jnp.tanh(h @ fsdp.gather(self.w.get_value()))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=6)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return Layer(rngs)

            self.layers = create(rngs)
            self.out = nnx.Param(jax.random.normal(rngs.params(), (64, 8)) * 0.1)

        def __call__(self, x):
            body = nnx.remat(Layer.__call__)  # the backward pass gathers again
            forward = nnx.scan(
                lambda h, layer: body(layer, h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry
            )
            h = forward(x, self.layers)
            return h @ fsdp.gather(self.out.get_value())

    graphdef, state = nnx.split(Stack(nnx.Rngs(3)))

    def loss(params, batch):
        x, y = batch
        return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    return loss, state


@pytest.mark.parametrize("front_end", ["nnx", "linen"])
def test_flax_scan_model_gathers_one_layer_at_a_time(front_end):
    """nnx.scan and Linen's nn.scan slice the layers' ``Shard`` handles as
    lax.scan does: the compiled step's all-gathers are one layer's size,
    with remat its buffers hold under three layers' parameters, and the
    exact step is full-batch SGD of the unsharded model."""
    pytest.importorskip("flax")
    mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(axis="fsdp", layers=_layers)
    batch = (jax.random.normal(jax.random.key(1), (64, 64)), jnp.zeros((64, 8)))
    loss, state0 = _nnx_stack() if front_end == "nnx" else _linen_stack()
    step = jc.data_parallel(loss, optax.sgd(LR), mesh, shard_params=cfg, donate=False)
    params, state = step.init(state0)
    compiled = step.lower(params, state, batch).compile()
    gathered = re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", compiled.as_text())
    assert gathered and all(
        int(np.prod([int(d) for d in g.split(",")])) <= 64 * 64 for g in gathered
    )
    assert compiled.memory_analysis().temp_size_in_bytes < 3 * 64 * 64 * 4
    for _ in range(2):
        params, state, _ = step(params, state, batch)
    layers = params["layers"]["w"]
    layers = layers.get_value() if front_end == "nnx" else layers
    assert layers.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp")), 3)
    assert _max_diff(params, _full_batch_sgd(loss, state0, batch, 2)) < 1e-6


def _linen_stack():
    """The same model in Flax Linen: ``nn.scan`` over a layer whose
    parameters ``nn.map_variables`` passes through ``fsdp.gather``, inside
    ``nn.remat`` so that the backward pass gathers again."""
    import flax.linen as nn

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            w = self.param("w", nn.initializers.normal(0.1), (64, 64))
            return jnp.tanh(h @ w), None

    def gather_all(tree):
        return jax.tree.map(fsdp.gather, tree, is_leaf=lambda x: isinstance(x, fsdp.Shard))

    gathered = nn.remat(nn.map_variables(Layer, "params", trans_in_fn=gather_all, init=True))

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                gathered, variable_axes={"params": 0}, split_rngs={"params": True}, length=6
            )
            h, _ = scan(name="layers")(x, None)
            return h @ fsdp.gather(self.param("out", nn.initializers.normal(0.1), (64, 8)))

    model = Stack()

    def loss(params, batch):
        x, y = batch
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    return loss, model.init(jax.random.key(3), jnp.zeros((1, 64)))["params"]


def _linear(p, batch):
    """A loss whose gradient is the batch itself, whatever the parameters."""
    return sum(jnp.sum(p[k] * batch[k].mean(0)) for k in p)


@pytest.mark.parametrize(
    "shape, cfg",
    [
        ((8,), fsdp.ShardParams(axis="fsdp", gradients=jc.codecs.QSGD(bits=4))),
        ((8,), fsdp.ShardParams(axis="fsdp", gradients=jc.codecs.OneBit(bucket_size=64))),
        ((2, 4), fsdp.ShardParams(axis=("slow", "fast"), gradients=jc.codecs.Int8())),
        ((2, 4), fsdp.ShardParams(axis="fast", replicate_over="slow", gradients="qsgd:bits=4")),
    ],
    ids=["qsgd4", "onebit", "int8-2d", "hsdp-qsgd4"],
)
def test_error_feedback_conserves_over_1000_steps(shape, cfg):
    """SGD at rate 1 applies the owners' mean gradients, so over the steps
    ``P * (params_0 - params_T) + sum of every device's residual`` must equal
    the sum of the gradients: nothing a codec dropped was lost. The
    residuals live where the module docstring says, in the leaf's layout
    (HSDP: the shard each device compresses)."""
    names = ("fsdp",) if len(shape) == 1 else ("slow", "fast")
    mesh = jax.make_mesh(shape, names)
    n = int(np.prod(shape))
    p0 = {"a": jnp.zeros((64, 24)), "b": jnp.zeros((512,))}
    rng = np.random.default_rng(0)
    grads = {k: rng.standard_normal((n, *v.shape)).astype(np.float32) for k, v in p0.items()}
    batch = {k: jnp.asarray(v) for k, v in grads.items()}  # one example per device
    step = jc.data_parallel(_linear, optax.sgd(1.0), mesh, shard_params=cfg)
    params, state = step.init(p0)
    steps = 1000
    params, state, _ = step(params, state, batch)  # the first step builds the step
    # The other steps as one program: a loop of the jitted step, one dispatch.
    many = jax.jit(
        lambda p, s, b: lax.fori_loop(1, steps, lambda _, c: step._step(*c, b, ())[:2], (p, s))
    )
    params, state = many(params, state, batch)
    for i, k in enumerate(sorted(p0)):
        total = steps * grads[k].astype(np.float64).sum(0)
        applied = n * -np.asarray(params[k], np.float64)
        res = np.asarray(state.residuals[i], np.float64)
        if cfg.replicate_over is not None:
            # Device (s, f) holds the residual of fast shard f: summed over
            # slow, joined over fast.
            res = np.concatenate(list(res.reshape(2, 4, *res.shape[1:]).sum(0)), axis=0)
        elif len(shape) == 2:
            # Each device's slow-hop input is a partial sum over its fast
            # group, in the reduce-scatter's own order: checked in total.
            assert abs(applied.sum() + res.sum() - total.sum()) <= 1e-5 * np.abs(total).sum()
            continue
        else:
            res = res.sum(0)
        err = np.abs(applied + res - total).max()
        assert err <= 1e-5 * np.abs(total).max(), (k, err)
    # The codec dropped something: the residuals are not all zero.
    assert any(float(jnp.abs(r).max()) > 0 for r in state.residuals)


def test_orbax_resume_is_bit_identical(tmp_path):
    """Two steps, an orbax checkpoint of the parameters and the state (every
    device's shards and residuals), a fresh step restoring it into the
    layout its init makes, two more steps: the run without the checkpoint's
    bits, and the stochastic codec's keys follow the restored counter."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(
        axis="fsdp", gradients=jc.codecs.QSGD(bits=4), parameters=jc.codecs.Int8()
    )
    step = jc.data_parallel(_mlp, optax.adam(1e-2), mesh, shard_params=cfg, donate=False)
    params, state = step.init(_params())
    for _ in range(2):
        params, state, _ = step(params, state, _batch())
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": params, "state": state})
    for _ in range(2):
        params, state, _ = step(params, state, _batch())
    again = jc.data_parallel(_mlp, optax.adam(1e-2), mesh, shard_params=cfg, donate=False)
    p, s = again.init(_params())
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        {"params": p, "state": s},
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", abstract)
    p, s = restored["params"], restored["state"]
    for _ in range(2):
        p, s, _ = again(p, s, _batch())
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p, s)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


_ITEM = {"f32": 4, "bf16": 2, "u32": 4, "s32": 4, "u16": 2, "u8": 1, "s8": 1}


def _collective_bytes(compiled_text, kind):
    """Bytes of the results of every ``kind`` collective in the compiled
    program (tuple results summed)."""
    total = 0
    for result in re.findall(rf"= (.*?) {kind}\(", compiled_text):
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            total += _ITEM[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def test_compressed_step_sends_a_sixth_of_float32():
    """The step's compiled program: QSGD-4's all-to-alls carry at most 1/6
    of the float32 reduce-scatters' bytes, Int8's all-gathers about 1/4 of
    float32's."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    params = {"w": jnp.zeros((256, 512)), "v": jnp.zeros((512, 256))}

    def loss(p, x):
        return jnp.sum((x @ p["v"]) @ p["w"])

    batch = jnp.ones((8, 512))
    texts = {}
    for name, cfg in {
        "f32": fsdp.ShardParams(axis="fsdp"),
        "c": fsdp.ShardParams(
            axis="fsdp", gradients=jc.codecs.QSGD(bits=4), parameters=jc.codecs.Int8()
        ),
    }.items():
        step = jc.data_parallel(loss, optax.sgd(LR), mesh, shard_params=cfg)
        p, s = step.init(params)
        texts[name] = step.lower(p, s, batch).compile().as_text()
    # Reduce-scatter output is the owned shard; its operand is P times it.
    f32_scatter = 8 * _collective_bytes(texts["f32"], "reduce-scatter")
    assert f32_scatter == 2 * 256 * 512 * 4
    assert 0 < _collective_bytes(texts["c"], "all-to-all") <= f32_scatter / 6
    f32_gather = _collective_bytes(texts["f32"], "all-gather")
    assert 0 < _collective_bytes(texts["c"], "all-gather") <= f32_gather / 3.8


@pytest.mark.parametrize(
    "shape, cfg, match",
    [
        ((8,), fsdp.ShardParams(axis="data"), r"'data'\] is not an axis of the mesh"),
        (
            (2, 4),
            fsdp.ShardParams(axis=("slow", "fast"), replicate_over="slow"),
            "names an axis twice",
        ),
    ],
)
def test_bad_meshes_say_what_to_do(shape, cfg, match):
    names = ("fsdp",) if len(shape) == 1 else ("slow", "fast")
    with pytest.raises(ValueError, match=match):
        jc.data_parallel(_mlp, optax.sgd(LR), jax.make_mesh(shape, names), shard_params=cfg)


def test_leaves_that_do_not_divide_say_what_to_do():
    step = jc.data_parallel(
        _mlp, optax.sgd(LR), jax.make_mesh((8,), ("fsdp",)), shard_params="fsdp"
    )
    bad = dict(_params(), w1=jnp.zeros((12, 32)))
    with pytest.raises(ValueError, match=r"\['w1'\] of shape \(12, 32\).*Pad that dimension"):
        step.init(bad)
    with pytest.raises(ValueError, match="leave axis_name out"):
        jc.data_parallel(
            _mlp, optax.sgd(LR), jax.make_mesh((8,), ("fsdp",)), "fsdp", shard_params="fsdp"
        )
    with pytest.raises(ValueError, match="accumulate_steps"):
        jc.data_parallel(
            _mlp,
            optax.sgd(LR),
            jax.make_mesh((8,), ("fsdp",)),
            shard_params="fsdp",
            accumulate_steps=2,
        )


def test_sharded_params_reach_the_replicated_step_with_a_pointer():
    mesh = jax.make_mesh((8,), ("data",))
    w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
    step = jc.data_parallel(lambda p, b: jnp.sum(p["w"]), optax.sgd(LR), mesh)
    with pytest.raises(ValueError, match="shard_params="):
        step.init({"w": w})


def test_a_step_that_is_not_finite_changes_nothing():
    mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(axis="fsdp", gradients=jc.codecs.QSGD(bits=4))
    step = jc.data_parallel(_mlp, optax.adam(1e-2), mesh, shard_params=cfg, donate=False)
    params, state = step.init(_params())
    params, state, _ = step(params, state, _batch())
    x, y = _batch()
    bad = (x.at[60, 3].set(jnp.nan), y)  # one example of the last device
    p, s, loss = step(params, state, bad)
    assert not np.isfinite(float(loss))
    before = jax.tree.leaves((params, state.opt_state, state.residuals))
    after = jax.tree.leaves((p, s.opt_state, s.residuals))
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    p, s, loss = step(p, s, _batch())
    assert np.isfinite(float(loss)) and _max_diff(p, params) > 0


def _group_size(line: str) -> int | None:
    """The devices in each replica group of a collective's HLO line: a list
    of device ids, or (newer XLA) the mesh with the axes it runs over."""
    g = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if g:
        return len(g.group(1).split(","))
    g = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if g:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", g.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", g.group(2))]))
    return None


def _sent_per_device(compiled_text, group_size):
    """Bytes one device sends in the collectives among ``group_size``
    devices, as docs/collectives.md counts them: (P-1)/P of an all-gather's
    result, of an all-to-all's or a reduce-scatter's operand, and 2 (P-1)/P
    of an all-reduce's."""
    sent = 0.0
    for line in compiled_text.splitlines():
        m = re.search(r"= (.*?) (all-gather|all-to-all|reduce-scatter|all-reduce)\(", line)
        if not m or _group_size(line) != group_size:
            continue
        nbytes = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            nbytes += _ITEM[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
        p = group_size
        sent += {
            "all-gather": (p - 1) / p,
            "all-to-all": (p - 1) / p,
            "reduce-scatter": p - 1,  # of the result: the operand is p times it
            "all-reduce": 2 * (p - 1) / p,
        }[m.group(2)] * nbytes
    return sent


def test_hsdp_compresses_the_slow_axis_to_a_sixth():
    mesh = jax.make_mesh((2, 4), ("slow", "fast"))
    params = {"w": jnp.zeros((256, 512)), "v": jnp.zeros((512, 256))}

    def loss(p, x):
        return jnp.sum((x @ p["v"]) @ p["w"])

    sent = {}
    for name, codec in {"f32": None, "qsgd4": jc.codecs.QSGD(bits=4)}.items():
        cfg = fsdp.ShardParams(axis="fast", replicate_over="slow", gradients=codec)
        step = jc.data_parallel(loss, optax.sgd(LR), mesh, shard_params=cfg)
        p, s = step.init(params)
        text = step.lower(p, s, jnp.ones((8, 512))).compile().as_text()
        sent[name] = (_sent_per_device(text, 2), _sent_per_device(text, 4))
    # float32: the owned quarter of both matrices, all-reduced over the pair.
    assert sent["f32"][0] == 2 * 256 * 512 * 4 / 4
    assert 0 < sent["qsgd4"][0] <= sent["f32"][0] / 6
    assert sent["qsgd4"][1] == sent["f32"][1]  # the fast axis stays exact


def test_an_unused_parameter_keeps_its_residual():
    """A parameter the loss does not use has no backward pass of its gather:
    its residual stays what it was (overwritten with a zero "gradient" it
    would lose what the device owes)."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(axis="fsdp", gradients=jc.codecs.QSGD(bits=2))
    step = jc.data_parallel(
        lambda p, x: jnp.sum(p["a"] * x.mean(0)),
        optax.sgd(LR),
        mesh,
        shard_params=cfg,
        donate=False,
    )
    params, state = step.init({"a": jnp.ones((64, 8)), "unused": jnp.ones((64, 8))})
    state = state._replace(residuals=tuple(r + 0.5 for r in state.residuals))
    _, new, _ = step(params, state, jax.random.normal(jax.random.key(0), (8, 64, 8)))
    np.testing.assert_array_equal(np.asarray(new.residuals[1]), np.asarray(state.residuals[1]))
    assert not np.array_equal(np.asarray(new.residuals[0]), np.asarray(state.residuals[0]))


def test_aux_is_averaged_and_the_key_differs_per_device():
    mesh = jax.make_mesh((8,), ("fsdp",))

    def loss(p, batch, key):
        noise = jax.random.uniform(key, ())  # a draw of this device's key
        return _mlp(p, batch), {"noise": noise, "n": jnp.ones(())}

    step = jc.data_parallel(
        loss, optax.sgd(LR), mesh, shard_params="fsdp", has_aux=True, donate=False
    )
    params, state = step.init(_params())
    key = jax.random.key(7)
    _, _, (value, aux) = step(params, state, _batch(), key)
    assert float(aux["n"]) == 1.0
    draws = [jax.random.uniform(jax.random.fold_in(key, d), ()) for d in range(8)]
    np.testing.assert_allclose(float(aux["noise"]), float(np.mean(draws)), rtol=1e-6)
    assert float(value) == pytest.approx(float(_mlp(_params(), _batch())), rel=1e-6)


def test_small_leaves_take_exact_collectives():
    """``min_compress_size``: a leaf of fewer values goes through lax's
    collectives, without a residual; the others through the codecs."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    cfg = fsdp.ShardParams(
        axis="fsdp",
        gradients=jc.codecs.QSGD(bits=4),
        parameters=jc.codecs.Int8(),
        min_compress_size=500,
    )
    step = jc.data_parallel(_mlp, optax.sgd(LR), mesh, shard_params=cfg, donate=False)
    params, state = step.init(_params())
    # w1 (512 values) and w2 (256): only w1 has a residual; b1 (32) none.
    assert [r.shape for r in state.residuals] == [(8, 16, 32)]
    text = step.lower(params, state, _batch()).compile().as_text()
    exact = re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(", text)
    assert sorted(exact) == ["32", "32,8"]  # b1 and w2, gathered whole in float32
    params, state, loss = step(params, state, _batch())
    assert np.isfinite(float(loss))


def test_shard_dim_picks_the_dimension_to_shard():
    """A per-head leaf (4 heads, 8 devices) sharded along its dimension 1,
    a scalar-like leaf replicated: the step is full-batch SGD still."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    heads = {"q": jax.random.normal(jax.random.key(4), (4, 16)) * 0.3, "s": jnp.ones((3,))}

    def loss(p, batch):
        x, y = batch
        h = jnp.tanh(x @ p["q"].reshape(16, 4).T.reshape(4, 16).T) * p["s"].sum()
        return jnp.mean((h[:, :4] - y[:, :4]) ** 2)

    def dims(path, leaf):
        return {"q": 1, "s": None}[path[0].key]

    cfg = fsdp.ShardParams(axis="fsdp", shard_dim=dims)
    step = jc.data_parallel(loss, optax.sgd(LR), mesh, shard_params=cfg, donate=False)
    params, state = step.init(heads)
    assert params["q"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "fsdp")), 2)
    assert params["s"].sharding.is_fully_replicated
    for _ in range(2):
        params, state, _ = step(params, state, _batch())
    assert _max_diff(params, _full_batch_sgd(loss, heads, _batch(), 2)) < 1e-6
    with pytest.raises(ValueError, match="shard_dim gave 2"):
        jc.data_parallel(
            loss, optax.sgd(LR), mesh, shard_params=fsdp.ShardParams(shard_dim=lambda p, x: 2)
        ).init(heads)
