"""jc.data_parallel: the jitted data-parallel step for plain jax.jit on a mesh.

It is the hand-written shard_map step, moved into the library: the same
program, so the same bits (an NNX CNN over 100 steps, a hierarchical mesh);
checkpointing through orbax resumes bit-identically; gradient accumulation,
the per-device key and aux follow their documented rules; misuse raises.
The two-process run is in test_train_builder_multiprocess.py.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import auto_mesh, mlp_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

# The examples are not part of the installed package: import them from the checkout.
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


def _mlp():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (32, 256)) / 32**0.5,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(k2, (256, 1)) / 16,
    }
    x = jax.random.normal(k3, (256, 32))
    return params, (x, jnp.sin(x[:, :1]))


def _hand_written(loss_fn, tx, mesh, axis, *, has_aux=False, key=False):
    """The shard_map step of docs/training-loop.md, written out."""
    data = P(axis)

    def local(params, opt_state, batch, *k):
        args = (jax.random.fold_in(k[0], jax.lax.axis_index(axis)),) if k else ()
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch, *args)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(out, axis)

    def step(params, opt_state, batch, *k):
        specs = jc.optax.state_specs(opt_state, axis)
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), specs, (data, data), *((P(),) * len(k))),
            out_specs=(P(), specs, P()),
            check_vma=False,
        )(params, opt_state, batch, *k)

    return jax.jit(step)


def _assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- the NNX CNN: 100 steps, bit for bit, and a checkpoint mid-run -----------


@pytest.fixture(scope="module")
def nnx_run():
    from examples.image_classifier import nnx_main
    from examples.image_classifier.configs import default

    config = default.get_config()
    config = type(config)(**{**config.__dict__, "steps": 100})
    return nnx_main, config


def _nnx_steps(nnx_main, config, step, params, opt_state, start, stop):
    key = jax.random.key(config.seed)
    loss = None
    for i, batch in nnx_main.batches(config, start):
        if i == stop:
            break
        params, opt_state, (loss, _) = step(
            params, opt_state, step.shard_batch(batch), jax.random.fold_in(key, i)
        )
    return params, opt_state, loss


def test_nnx_cnn_equals_the_hand_written_step_bit_for_bit(nnx_run):
    nnx_main, config = nnx_run
    _, step, params, opt_state = nnx_main.build(config, "qsgd:bits=4")
    assert isinstance(params, dict)  # the nnx.Param variables, as a plain dict
    assert params["conv1"]["kernel"].sharding.spec == P()
    batch = step.shard_batch(next(nnx_main.batches(config))[1])
    assert batch[0].sharding == NamedSharding(step.mesh, P("data"))
    residuals = jax.tree.leaves(opt_state[0].residuals)
    assert all(r.sharding.spec == P("data") and r.shape[0] == 8 for r in residuals)

    p1, s1, loss1 = _nnx_steps(nnx_main, config, step, params, opt_state, 0, 100)

    # The same NNX model and chain, through a shard_map step written by hand.
    from flax import nnx

    model = nnx_main.CNN(tuple(config.features), config.hidden, rngs=nnx.Rngs(config.seed))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)

    def loss_of_dict(params, batch, key):
        st = jax.tree.map(lambda a: a, state)
        nnx.replace_by_pure_dict(st, params)
        return nnx_main.loss_fn(nnx.merge(graphdef, st, rest), batch, key)

    tx = nnx_main.make_tx(config, "qsgd:bits=4")
    hand = _hand_written(loss_of_dict, tx, step.mesh, "data", has_aux=True, key=True)
    params = jax.tree.map(lambda a: a, step.init(model)[0])
    opt_state = jc.optax.init(tx, params, step.mesh, "data")
    key = jax.random.key(config.seed)
    for i, (x, y) in nnx_main.batches(config):
        if i == 100:
            break
        params, opt_state, (loss2, _) = hand(params, opt_state, (x, y), jax.random.fold_in(key, i))

    assert float(loss1) < 1.5  # it trains (from 2.3)
    np.testing.assert_array_equal(np.asarray(loss1), np.asarray(loss2))
    _assert_trees_equal(p1, params)
    _assert_trees_equal(s1, opt_state)


def test_nnx_checkpoint_mid_run_resumes_bit_identically(nnx_run, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    nnx_main, config = nnx_run
    _, step, params, opt_state = nnx_main.build(config, "qsgd:bits=4", donate=False)
    p_full, s_full, loss_full = _nnx_steps(nnx_main, config, step, params, opt_state, 0, 40)

    p, s, _ = _nnx_steps(nnx_main, config, step, params, opt_state, 0, 20)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": p, "opt_state": s})
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        {"params": p, "opt_state": s},
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", abstract)
    # The restored per-device residuals are every device's own, not device 0's.
    _assert_trees_equal(restored, {"params": p, "opt_state": s})
    p, s, loss = _nnx_steps(
        nnx_main, config, step, restored["params"], restored["opt_state"], 20, 40
    )
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss_full))
    _assert_trees_equal(p, p_full)
    _assert_trees_equal(s, s_full)

    # step.module gives the trained NNX model back.
    model = step.module(p)
    np.testing.assert_array_equal(np.asarray(model.conv1.kernel[...]), p["conv1"]["kernel"])


# -- pytrees, a hierarchical mesh, accumulation, the key ---------------------


def test_hierarchical_mesh_equals_the_hand_written_step():
    mesh = auto_mesh((2, 4), ("slow", "fast"))
    axes = ("slow", "fast")
    codec = jc.codecs.QSGD(bits=4)
    tx = optax.chain(
        jc.optax.compress_gradients(codec, axes, algorithm="hierarchical", min_compress_size=0),
        optax.sgd(0.1, momentum=0.9),
    )
    params0, batch = _mlp()
    step = jc.data_parallel(mlp_loss, tx, mesh, axes, donate=False)
    params, opt_state = step.init(params0)
    batch = step.shard_batch(batch)
    assert batch[0].sharding.spec == P(axes)
    hand = _hand_written(mlp_loss, tx, mesh, axes)
    p2, s2 = params, opt_state
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state, batch)
        p2, s2, loss2 = hand(p2, s2, batch)
    assert float(loss) == float(loss2)
    _assert_trees_equal(params, p2)
    _assert_trees_equal(opt_state, s2)


@pytest.mark.parametrize("axes", ["data", ("slow", "fast")], ids=["flat", "hierarchical"])
def test_explicit_mesh_and_host_batch_train_as_on_an_auto_mesh(axes):
    """jax.make_mesh's default axes are Explicit, where shard_map refuses an
    input not already laid out as its in_specs say: the step reshards the
    batch (a host NumPy array here) itself, and trains bit for bit as on a
    mesh of Auto axes."""
    names = (axes,) if isinstance(axes, str) else axes
    shape = (8,) if len(names) == 1 else (2, 4)
    tx = optax.chain(jc.optax.compress_gradients("qsgd:bits=4", axes), optax.sgd(0.1))
    params0, batch = _mlp()
    host_batch = jax.tree.map(np.asarray, batch)
    runs = []
    for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
        mesh = jax.make_mesh(shape, names, axis_types=(kind,) * len(names))
        step = jc.data_parallel(mlp_loss, tx, mesh, axes)
        params, opt_state = step.init(params0)
        for _ in range(3):
            params, opt_state, loss = step(params, opt_state, host_batch)
        runs.append((params, float(loss)))
    (p_explicit, l_explicit), (p_auto, l_auto) = runs
    assert l_explicit == l_auto
    _assert_trees_equal(p_explicit, p_auto)


def test_accumulation_averages_the_microbatch_gradients():
    """k microbatches of b examples are one batch of k*b: with an exact
    all-reduce (Identity), the update equals the single-batch update up to
    float32 summation order."""
    mesh = auto_mesh()
    tx = optax.chain(
        jc.optax.compress_gradients(jc.codecs.Identity(), "data", min_compress_size=0),
        optax.sgd(0.5),
    )
    params0, batch = _mlp()
    one = jc.data_parallel(mlp_loss, tx, mesh, donate=False)
    four = jc.data_parallel(mlp_loss, tx, mesh, accumulate_steps=4, donate=False)
    p, s = one.init(params0)
    p1, _, l1 = one(p, s, batch)
    p4, _, l4 = four(p, s, batch)
    np.testing.assert_allclose(float(l4), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p4), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert not np.array_equal(np.asarray(p4["w1"]), np.asarray(p["w1"]))  # it stepped


def test_key_is_folded_with_the_device_index_and_aux_is_reduced():
    mesh = auto_mesh()
    tx = optax.chain(jc.optax.compress_gradients("int8", "data"), optax.sgd(0.1))

    def loss_fn(params, batch, key):
        u = jax.random.uniform(key)
        return mlp_loss(params, batch), {"u": u, "count": jnp.int32(batch[0].shape[0])}

    params0, batch = _mlp()
    step = jc.data_parallel(loss_fn, tx, mesh, has_aux=True, accumulate_steps=2)
    params, opt_state = step.init(params0)
    key = jax.random.key(3)
    _, _, (_, aux) = step(params, opt_state, batch, key)
    # device d, microbatch i: fold_in(fold_in(key, d), i); aux floats averaged
    # over both, integers summed.
    want = np.mean(
        [
            float(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, d), i)))
            for d in range(8)
            for i in range(2)
        ]
    )
    np.testing.assert_allclose(float(aux["u"]), want, rtol=1e-6)
    assert int(aux["count"]) == 256  # 8 devices x 2 microbatches x 16 examples


def test_float32_baseline_chain_without_compression():
    """A chain whose all-reduce is a plain lax.pmean works through the step
    too (nothing is per-device)."""
    mesh = auto_mesh()

    def pmean_grads():
        return optax.GradientTransformation(
            lambda p: optax.EmptyState(),
            lambda u, s, p=None: (jax.tree.map(lambda g: jax.lax.pmean(g, "data"), u), s),
        )

    params0, batch = _mlp()
    step = jc.data_parallel(mlp_loss, optax.chain(pmean_grads(), optax.sgd(0.1)), mesh)
    params, opt_state = step.init(params0)
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, batch)
    assert float(loss) < float(mlp_loss(params0, batch))


# -- misuse ------------------------------------------------------------------


def test_misuse_raises_clear_errors():
    mesh = auto_mesh()
    tx = optax.chain(jc.optax.compress_gradients("qsgd:bits=4", "data"), optax.sgd(0.1))
    params0, batch = _mlp()
    with pytest.raises(ValueError, match=r"not an axis of the mesh, whose axes are \('data',\)"):
        jc.data_parallel(mlp_loss, tx, mesh, "batch")
    with pytest.raises(ValueError, match=r"besides the data axes.*no parameter is laid out"):
        jc.data_parallel(mlp_loss, tx, auto_mesh((4, 2), ("data", "model")), "data").init(params0)
    with pytest.raises(TypeError, match=r"optax\.GradientTransformation"):
        jc.data_parallel(mlp_loss, optax.sgd, mesh)
    with pytest.raises(TypeError, match=r"jax\.sharding\.Mesh"):
        jc.data_parallel(mlp_loss, tx, jax.devices())
    with pytest.raises(ValueError, match="accumulate_steps"):
        jc.data_parallel(mlp_loss, tx, mesh, accumulate_steps=0)
    step = jc.data_parallel(mlp_loss, tx, mesh, accumulate_steps=2)
    params, opt_state = step.init(params0)
    with pytest.raises(ValueError, match=r"multiple of 16 \(8 data devices x accumulate_steps=2"):
        step(params, opt_state, (batch[0][:40], batch[1][:40]))
    # A state made by a plain tx.init, outside the mesh.
    with pytest.raises(ValueError, match=r"jc.optax.init\(tx, params, mesh, axis_name\)"):
        step(params, tx.init(params0), batch)
    with pytest.raises(ValueError, match="init\\(\\) was given a pytree"):
        step.module(params)


def test_nnx_optimizer_route_is_refused():
    """The usual NNX setup, nnx.Optimizer over a compress_gradients chain and
    nnx.shard_map with replicated specs, would keep every device's residual
    in one array typed as replicated: update refuses the state tx.init made
    outside the mesh, and state_specs refuses the nnx.State that hides the
    compress state. (jc.data_parallel takes the NNX model instead.)"""
    from flax import nnx

    mesh = auto_mesh()
    model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    tx = optax.chain(
        jc.optax.compress_gradients("qsgd:bits=4", "data", min_compress_size=0), optax.sgd(0.1)
    )
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"hides the compress state"):
        jc.optax.state_specs(nnx.state(opt), "data")

    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    f = nnx.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P(), check_vma=False
    )
    with pytest.raises(ValueError, match=r"initialized outside the mapped function.*jc.optax.init"):
        nnx.jit(f)(model, opt, jnp.ones((64, 64)))


# -- NNX variables that the loss sets: BatchNorm -------------------------------


def _bn_net():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(16, 32, rngs=rngs)
            self.bn = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
            self.out = nnx.Linear(32, 1, rngs=rngs)
            self.fixed = nnx.Variable(jnp.full(3, 1 / 3))  # never set: kept bit for bit

        def __call__(self, x):
            return self.out(nnx.relu(self.bn(self.lin(x))))

    return Net(nnx.Rngs(0))


def _bn_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _bn_stats_after(model, shards):
    """BatchNorm's running statistics after the forward passes of ``shards``
    (each a list of microbatches, run in order) on copies of ``model``,
    averaged over the shards: what the step should keep."""
    from flax import nnx

    means, variances = [], []
    for microbatches in shards:
        m = nnx.clone(model)
        for x in microbatches:
            m(x)
        means.append(np.asarray(m.bn.mean[...]))
        variances.append(np.asarray(m.bn.var[...]))
    return np.mean(means, axis=0), np.mean(variances, axis=0)


@pytest.mark.parametrize("k", [1, 2], ids=["one_batch", "accumulate_2"])
def test_nnx_batchnorm_statistics_are_averaged_and_carried(k):
    """Each device's BatchNorm updates its running statistics on its rows
    (on each microbatch in turn); the step keeps their average over the
    devices, replicated, and the next step starts from it."""
    mesh = auto_mesh()
    tx = optax.chain(jc.optax.uncompressed_mean("data"), optax.sgd(0.1))
    step = jc.data_parallel(_bn_loss, tx, mesh, accumulate_steps=k, donate=False)
    model = _bn_net()
    params, opt_state = step.init(model)
    rng = np.random.default_rng(0)
    # Every device's rows drawn around their own mean, so the statistics differ.
    x = (rng.standard_normal((128, 16)) + np.repeat(np.arange(8), 16)[:, None]).astype(np.float32)
    batch = step.shard_batch((x, np.sin(x[:, :1])))
    shards = [np.split(x[16 * d : 16 * (d + 1)], k) for d in range(8)]
    start = step.module(params)
    for _ in range(2):
        want_mean, want_var = _bn_stats_after(start, shards)
        params, opt_state, loss = step(params, opt_state, batch)
        trained = step.module(params)
        np.testing.assert_allclose(
            np.asarray(trained.bn.mean[...]), want_mean, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(np.asarray(trained.bn.var[...]), want_var, rtol=1e-5, atol=1e-6)
        assert trained.bn.mean[...].sharding.spec == P()
        start = trained
    assert not np.allclose(np.asarray(start.bn.mean[...]), 0)  # the statistics moved
    np.testing.assert_array_equal(np.asarray(start.fixed[...]), np.full(3, np.float32(1 / 3)))
    assert np.isfinite(float(loss))


# -- steps in flight ----------------------------------------------------------


def test_cpu_mesh_keeps_one_step_in_flight():
    """On the CPU the step waits for the previous step before dispatching
    the next (tests/test_loop_under_load.py runs the documented loop under
    load); max_in_flight sets or lifts the bound."""
    mesh = auto_mesh()
    tx = optax.chain(jc.optax.uncompressed_mean("data"), optax.sgd(0.1))
    params0, batch = _mlp()
    step = jc.data_parallel(mlp_loss, tx, mesh)
    assert step.max_in_flight == 1
    params, opt_state = step.init(params0)
    params, opt_state, first = step(params, opt_state, batch)
    params, opt_state, _ = step(params, opt_state, batch)
    assert first.is_ready()  # the second call waited for it
    assert jc.data_parallel(mlp_loss, tx, mesh, max_in_flight=None).max_in_flight is None
    assert jc.data_parallel(mlp_loss, tx, mesh, max_in_flight=3).max_in_flight == 3
    one_device = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    assert jc.data_parallel(mlp_loss, tx, one_device).max_in_flight is None  # no collective
    for bad in (0, True, "always", 1.5):
        with pytest.raises(ValueError, match="max_in_flight must be"):
            jc.data_parallel(mlp_loss, tx, mesh, max_in_flight=bad)


def test_nnx_loss_that_adds_variables_is_refused():
    """The step carries the variables init() saw; one that the loss creates
    (here lazily, on the first call) has nowhere to go, and the error says
    what to do instead."""
    from flax import nnx

    class Lazy(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(32, 1, rngs=rngs)

        def __call__(self, x):
            y = self.lin(x)
            self.last_mean = nnx.BatchStat(jnp.mean(y))
            return y

    tx = optax.chain(jc.optax.uncompressed_mean("data"), optax.sgd(0.1))
    step = jc.data_parallel(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), tx, auto_mesh())
    params, opt_state = step.init(Lazy(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"added or removed variables.*has_aux=True"):
        step(params, opt_state, _mlp()[1])
