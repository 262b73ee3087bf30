"""jc.data_parallel's replicated step with overlap=True (the default off
the CPU) reduces each bucket from inside the backward pass
(jaxcomp/optax/_overlap.py): what the compiled step's collectives wait
for, read from its unoptimized HLO; the same bits as the post-backward
step; error feedback's conservation over 1,000 steps; "auto" on a CPU mesh;
a model scanned over its layers, each layer sent from inside the reverse
scan (``compress_gradients(layers=)``)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import auto_mesh

import jaxcomp as jc

N_DEV = 8

# -- the compiled step's dependency structure -------------------------------

_COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(
    r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
    r"|(?:branch_computations|called_computations)=\{([^}]*)\}"
)


def _computations(hlo: str):
    """``({computation: {instruction: (opcode, operands, called)}}, roots,
    parameter numbers, callers)`` of an HLO module's text."""
    comps, roots, params, callers, cur = {}, {}, {}, {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head:
            cur = head.group(1)
            comps[cur] = {}
            continue
        m = _INSTR.match(line)
        if m is None or cur is None:
            continue
        name, op, rest = m.groups()
        depth, i = 1, 0
        while depth and i < len(rest):
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        args, attrs = rest[: i - 1], rest[i:]
        operands = [a.strip().lstrip("%") for a in args.split(",")]
        called = []
        for one, many in _CALLS.findall(attrs):
            called += [one] if one else [c.strip().lstrip("%") for c in many.split(",")]
        comps[cur][name] = (op, [a for a in operands if a in comps[cur]], called)
        if line.lstrip().startswith("ROOT"):
            roots[cur] = name
        if op == "parameter":
            params[(cur, name)] = int(args)
        for c in called:
            callers.setdefault(c, []).append((cur, name))
    return comps, roots, params, callers


def collective_dependencies(hlo: str) -> tuple[int, list[tuple[int, str, str]]]:
    """The module's number of matrix products (``dot``s) and, per
    collective, how many of them it depends on (through operands, the
    bodies of the calls that made them, and a computation's parameters
    back to its callers' operands): ``(dots, [(n, opcode, result type)])``."""
    comps, roots, params, callers = _computations(hlo)
    dots = sum(op == "dot" for c in comps.values() for op, _, _ in c.values())

    def reached(start) -> int:
        seen, stack, found = set(), [start], 0
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            comp, name = node
            op, operands, called = comps[comp][name]
            found += op == "dot"
            stack += [(comp, o) for o in operands]
            stack += [(c, roots[c]) for c in called if c in roots]
            if op == "parameter":
                for cc, cn in callers.get(comp, []):
                    cops = comps[cc][cn][1]
                    k = params[node]
                    if comps[cc][cn][0] == "conditional" or k >= len(cops):
                        stack += [(cc, o) for o in cops]
                    else:
                        stack.append((cc, cops[k]))
        return found

    return dots, [
        (reached((c, n)), op, n)
        for c in comps
        for n, (op, _, _) in comps[c].items()
        if op in _COLLECTIVES
    ]


def _mlp(layers=6, width=256, seed=0):
    keys = jax.random.split(jax.random.key(seed), layers)
    return [
        {"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros((width,))}
        for k in keys
    ]


def _mlp_loss(params, batch):
    x, y = batch
    for layer in params:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((x - y) ** 2)


def _batch(width=256, rows=2 * N_DEV, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (rows, width)), jax.random.normal(ky, (rows, width))


def _gradient_waits(step, params, batch) -> tuple[float, float]:
    """(fewest, most) of the step's matrix products a collective of the
    gradients waits for, as fractions; the loss's scalar mean is not one."""
    hlo = step.lower(*step.init(params), batch).compiler_ir("hlo").as_hlo_text()
    dots, deps = collective_dependencies(hlo)
    waits = [n / dots for n, _, _ in deps if n]
    # The loss's all-reduce waits for the forward pass only: leave it out.
    forward = min(waits)
    waits = [w for w in waits if w > forward]
    return min(waits), max(waits)


def test_the_first_bucket_is_sent_before_the_backward_pass_ends():
    """QSGD-4 with error feedback on a 6-layer MLP of 256 x 256 weights:
    the first gradient collective waits for at most 70% of the step's 17
    matrix products: for the forward pass and the last two layers' weight
    gradients (the bucket the default plan fills first, a quarter of a MiB),
    9 of them. After the backward pass, the first waits for 15, as the
    bucket of the first four layers waits for the first layer's gradient."""
    mesh = auto_mesh()
    tx = optax.chain(jc.optax.compress_gradients("qsgd:bits=4", "data"), optax.sgd(0.1))
    params, batch = _mlp(), _batch()
    first, _ = _gradient_waits(jc.data_parallel(_mlp_loss, tx, mesh, overlap=True), params, batch)
    assert first <= 0.70 and first == pytest.approx(9 / 17)
    after, _ = _gradient_waits(jc.data_parallel(_mlp_loss, tx, mesh, overlap=False), params, batch)
    assert after == pytest.approx(15 / 17)


def test_buckets_are_sent_in_the_order_the_backward_pass_completes_them():
    """Parameters listed against their order of use (the first layer's last
    in the tree): the buckets are issued by where the loss first uses them,
    so the first collective still waits only for the last layer's
    gradient, as a per-leaf ``lax.pmean`` would."""
    mesh = auto_mesh()
    names = [f"l{5 - i}" for i in range(6)]  # l5 is used first, l0 last

    def loss(params, batch):
        x, y = batch
        for n in names:
            x = jnp.tanh(x @ params[n])
        return jnp.mean((x - y) ** 2)

    params = {n: p["w"] for n, p in zip(names, _mlp(width=64), strict=True)}
    tx = optax.chain(jc.optax.compress_gradients("int8", "data", fusion_bytes=1), optax.sgd(0.1))
    step = jc.data_parallel(loss, tx, mesh, overlap=True)
    first, last = _gradient_waits(step, params, _batch(64))
    per_leaf = 7 / 17  # the forward pass and the last layer's weight gradient
    assert first == pytest.approx(per_leaf) and last == 1.0


# -- the same bits as after the backward pass -------------------------------


def _mixed(seed=0):
    """Leaves of three kinds: compressed float32, compressed bfloat16, and
    small ones sent exactly."""
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "a": jax.random.normal(k[0], (48, 64)) / 8,
        "b": jnp.zeros((64,)),
        "c": (jax.random.normal(k[1], (64, 32)) / 8).astype(jnp.bfloat16),
        "d": jax.random.normal(k[2], (32, 16)) / 8,
    }


def _mixed_loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["a"] + p["b"])
    h = jnp.tanh(h @ p["c"].astype(jnp.float32))
    return jnp.mean((h @ p["d"] - y) ** 2)


CASES = {
    "qsgd4-two-level": dict(codec="qsgd:bits=4"),
    "onebit-ring": dict(codec="onebit", algorithm="ring"),
    "int8-no-feedback": dict(codec="int8", error_feedback=False),
    "topk-warmup": dict(codec="topk:fraction=0.05", warmup_steps=2),
    "bf16-skip": dict(codec="bf16", on_nonfinite="skip"),
}


def _assert_same_bits(loss, params, codec, kw):
    """Five steps overlapped and five after the backward pass, of
    ``compress_gradients(codec, "data", **kw)`` then SGD with
    momentum: parameters and every state leaf equal bit for bit. Returns
    the overlapped run's ``(params, state)``."""
    mesh = auto_mesh()
    x = jax.random.normal(jax.random.key(3), (4 * N_DEV, 48))
    y = jax.random.normal(jax.random.key(4), (4 * N_DEV, 16))

    def run(overlap):
        tx = optax.chain(
            jc.optax.compress_gradients(codec, "data", **kw), optax.sgd(0.05, momentum=0.9)
        )
        step = jc.data_parallel(loss, tx, mesh, overlap=overlap)
        p, state = step.init(params)
        for i in range(5):
            p, state, _ = step(p, state, (x + i, y))
        return p, state

    got, want = run(True), run(False)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return got


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_and_post_backward_steps_give_the_same_bits(case):
    """Each codec configuration (fused buckets of two dtypes, exact small
    leaves, warm-up steps that branch)."""
    kw = dict(CASES[case])
    codec = kw.pop("codec")
    kw.update(fusion_bytes=8192, min_compress_size=256)
    _assert_same_bits(_mixed_loss, _mixed(), codec, kw)


def test_an_nnx_model_with_aux_and_a_key_gives_the_same_bits():
    """An NNX module (its dropout key per device), ``has_aux``: the
    overlapped step's parameters, state and metrics are the post-backward
    step's."""
    mesh = auto_mesh()

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(48, 64, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(jax.nn.relu(self.l1(x))))

    def loss(model, batch, key):
        x, y = batch
        out = model(x + 0.01 * jax.random.normal(key, x.shape))
        err = jnp.mean((out - y) ** 2)
        return err, {"err": err}

    batch = (jax.random.normal(jax.random.key(3), (4 * N_DEV, 48)), jnp.ones((4 * N_DEV, 16)))

    def run(overlap):
        tx = optax.chain(
            jc.optax.compress_gradients("qsgd:bits=4", "data", min_compress_size=256),
            optax.sgd(0.1),
        )
        step = jc.data_parallel(loss, tx, mesh, has_aux=True, overlap=overlap)
        params, state = step.init(MLP(nnx.Rngs(0)))
        outs = []
        for i in range(3):
            params, state, out = step(params, state, batch, jax.random.key(i))
            outs.append(out)
        return params, state, outs

    got, want = run(True), run(False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_error_feedback_conserves_the_gradient_sum_over_1000_steps():
    """A loss linear in the parameters, its gradient this device's batch
    row: after 1,000 overlapped steps of SGD(1), the applied means times the
    devices plus every device's residual equal the sum of the gradients
    (the all-gather algorithm keeps no server residual); "s" is a stack of
    3 layers, scanned, each sent from inside the reverse scan."""
    mesh = auto_mesh()
    shapes = {"a": (40, 50), "b": (30,), "c": (2000,), "s": (3, 400)}
    rng = np.random.default_rng(0)
    steps = 1000
    grads = {
        k: rng.normal(0.25, 1.0, (steps, N_DEV, *s)).astype(np.float32) for k, s in shapes.items()
    }

    def loss(params, batch):
        flat = sum(jnp.sum(params[k] * batch[k][0]) for k in "abc")

        def layer(total, xs):
            w, g = xs
            return total + jnp.sum(jc.fsdp.gather(w) * g), None

        return jax.lax.scan(layer, flat, (params["s"], batch["s"][0]))[0]

    tx = optax.chain(
        jc.optax.compress_gradients(
            "qsgd:bits=2",
            "data",
            algorithm="allgather",
            min_compress_size=100,
            layers=lambda path, _: jax.tree_util.keystr(path) == "['s']",
        ),
        optax.sgd(1.0),
    )
    step = jc.data_parallel(loss, tx, mesh, overlap=True)
    p0 = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    params, state = step.init(p0)
    assert [b.layers for b in state[0].comm.plan.buckets] == [0, 3]  # a, c fused; s by layer
    for t in range(steps):
        params, state, _ = step(params, state, {k: g[t] for k, g in grads.items()})
    residuals = state[0].residuals
    for k in shapes:
        total = N_DEV * (p0[k] - np.asarray(params[k], np.float64))
        total = total + np.asarray(residuals[k], np.float64).sum(0)
        want = grads[k].astype(np.float64).sum((0, 1))
        assert np.abs(total - want).max() <= 1e-5 * np.abs(want).max(), k


def test_auto_is_after_the_backward_pass_on_the_cpu():
    """On a CPU mesh "auto" sends the buckets after the backward pass (the
    step's HLO says so), and a bad value is refused."""
    mesh = auto_mesh()
    tx = optax.chain(jc.optax.compress_gradients("qsgd:bits=4", "data"), optax.sgd(0.1))
    first, _ = _gradient_waits(jc.data_parallel(_mlp_loss, tx, mesh), _mlp(), _batch())
    assert first == pytest.approx(15 / 17)
    with pytest.raises(ValueError, match="overlap must be True, False or"):
        jc.data_parallel(_mlp_loss, tx, mesh, overlap="yes")


@pytest.mark.parametrize(
    "case, why",
    [
        ("uncompressed_mean", "does not start with jc.optax.compress_gradients"),
        ("accumulate", "accumulate_steps > 1"),
        ("clip_first", "does not start with jc.optax.compress_gradients"),
    ],
)
def test_overlap_true_where_it_cannot_apply_raises(case, why):
    """overlap=True asked for a step that reduces after the backward pass
    (another all-reduce first, accumulation, a per-device clip before it)
    raises, saying why; "auto" runs the same step after the backward pass."""
    mesh = auto_mesh()
    compress = jc.optax.compress_gradients("int8", "data")
    first = {
        "uncompressed_mean": jc.optax.uncompressed_mean("data"),
        "accumulate": compress,
        "clip_first": optax.chain(optax.clip(1.0), compress),
    }[case]
    tx = optax.chain(first, optax.sgd(0.1))
    kw = {"accumulate_steps": 2} if case == "accumulate" else {}
    params, batch = _mlp(layers=2, width=64), _batch(64)
    step = jc.data_parallel(_mlp_loss, tx, mesh, overlap=True, **kw)
    with pytest.raises(ValueError, match=why):
        step(*step.init(params), batch)
    auto = jc.data_parallel(_mlp_loss, tx, mesh, **kw)
    auto(*auto.init(params), batch)


def test_the_sharded_steps_gathers_wait_for_no_layer():
    """The sharded step of an unrolled model (int8 gathers, QSGD-4
    reduce-scatters): every layer's all-gather depends on none of the
    step's matrix products, so layer i + 1's gather may run during layer
    i's compute; each reduce-scatter's all-to-all waits only for the
    layers after its own in the backward pass."""
    mesh = auto_mesh()

    def loss(p, batch):
        x, y = batch
        for i in range(4):
            x = jnp.tanh(x @ jc.fsdp.gather(p[f"l{i}"]))
        return jnp.mean((x - y) ** 2)

    keys = jax.random.split(jax.random.key(0), 4)
    params = {f"l{i}": jax.random.normal(k, (256, 256)) / 16 for i, k in enumerate(keys)}
    cfg = jc.fsdp.ShardParams("data", gradients="qsgd:bits=4", parameters="int8")
    step = jc.data_parallel(loss, optax.sgd(0.1), mesh, shard_params=cfg)
    hlo = step.lower(*step.init(params), _batch()).compiler_ir("hlo").as_hlo_text()
    dots, deps = collective_dependencies(hlo)
    assert dots == 4 + 4 + 3  # forward, weight gradients, input gradients
    assert sorted(n for n, op, _ in deps if op == "all-gather") == [0, 0, 0, 0]
    assert sorted(n for n, op, _ in deps if op == "all-to-all") == [5, 6, 7, 8]


# -- a model scanned over its layers ----------------------------------------


def _scanned(layers=4, width=64, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "inp": jax.random.normal(k[0], (48, width)) / 8,
        "layers": {
            "w": jax.random.normal(k[1], (layers, width, width)) / 8,
            "b": jnp.zeros((layers, width)),
        },
        "out": jax.random.normal(k[2], (width, 16)) / 8,
    }


def _scanned_loss(p, batch):
    x, y = batch
    h = x @ p["inp"]

    def layer(h, params):
        q = jc.fsdp.gather(params)  # one layer's parameters, in one call
        return jnp.tanh(h @ q["w"] + q["b"]), None

    h, _ = jax.lax.scan(layer, h, p["layers"])
    return jnp.mean((h @ p["out"] - y) ** 2)


def _stacked(path, leaf):
    return "layers" in jax.tree_util.keystr(path)


def _scan_bodies(hlo: str) -> list[tuple[int, int]]:
    """Per while loop of the module: ``(dots, collectives)`` in its body
    and every computation the body calls."""
    comps, _, _, _ = _computations(hlo)
    out = []
    for c in comps.values():
        for op, _, called in c.values():
            if op != "while":
                continue
            seen, stack = set(), list(called)
            while stack:
                name = stack.pop()
                if name in seen or name not in comps:
                    continue
                seen.add(name)
                stack += [x for _, _, cs in comps[name].values() for x in cs]
            ops = [o for name in seen for o, _, _ in comps[name].values()]
            out.append((ops.count("dot"), sum(o in _COLLECTIVES for o in ops)))
    return out


def test_a_scanned_model_sends_each_layer_from_inside_the_reverse_scan():
    """QSGD-4 with error feedback, the layers' weights stacked and scanned
    (``compress_gradients(layers=)``, ``jc.fsdp.gather`` in the layer):
    overlapped, the gradient collectives are in the body of the loop that
    computes the layers' gradients; after the backward pass, no loop with
    a matrix product has a collective (the layers are sent by a loop of
    their own, once the backward scan is done)."""
    mesh = auto_mesh()
    tx = optax.chain(
        jc.optax.compress_gradients("qsgd:bits=4", "data", layers=_stacked, min_compress_size=256),
        optax.sgd(0.1),
    )
    batch = _batch(48, seed=2)[0], _batch(16, seed=3)[1]

    def bodies(overlap):
        step = jc.data_parallel(_scanned_loss, tx, mesh, overlap=overlap)
        hlo = step.lower(*step.init(_scanned()), batch).compiler_ir("hlo").as_hlo_text()
        return _scan_bodies(hlo)

    overlapped, after = bodies(True), bodies(False)
    assert any(dots >= 2 and n >= 2 for dots, n in overlapped), overlapped
    assert not any(dots and n for dots, n in after), after
    assert any(n and not dots for dots, n in after), after  # the layer-by-layer reduction


SCANNED_CASES = {
    "qsgd4-two-level": dict(codec="qsgd:bits=4"),
    "onebit-ring": dict(codec="onebit", algorithm="ring"),
    "int8-no-feedback": dict(codec="int8", error_feedback=False),
    "topk-warmup": dict(codec="topk:fraction=0.05", warmup_steps=2),
}


@pytest.mark.parametrize("case", sorted(SCANNED_CASES))
def test_a_scanned_model_gives_the_post_backward_bits(case):
    """The scanned model, each layer sent from inside the reverse scan,
    against the post-backward step, which reduces the stacked buckets one
    layer after the other."""
    kw = dict(SCANNED_CASES[case])
    codec = kw.pop("codec")
    kw.update(layers=_stacked, min_compress_size=256)
    _, state = _assert_same_bits(_scanned_loss, _scanned(), codec, kw)
    plan = state[0].comm.plan
    assert [b.layers for b in plan.buckets if b.layers] == [4]  # the weights; the biases whole


def test_a_stack_gathered_whole_or_used_as_an_array_raises():
    """A stacked leaf reaches the overlapped step's loss as a handle: used
    whole (gathered outside the scan, or as an array) it raises, saying
    to gather one layer inside the scan."""
    mesh = auto_mesh()
    tx = optax.chain(
        jc.optax.compress_gradients("int8", "data", layers=_stacked, min_compress_size=256),
        optax.sgd(0.1),
    )
    batch = (jnp.ones((2 * N_DEV, 48)), jnp.ones((2 * N_DEV, 16)))

    def whole(p, batch):
        w = jc.fsdp.gather(p["layers"]["w"])
        return jnp.sum(w) + jnp.mean(batch[0] @ p["inp"])

    def as_array(p, batch):
        return jnp.sum(jnp.multiply(p["layers"]["w"], 2.0)) + jnp.mean(batch[0] @ p["inp"])

    for loss, match in ((whole, "gather one layer at a time"), (as_array, "LayerStack")):
        step = jc.data_parallel(loss, tx, mesh, overlap=True)
        with pytest.raises(ValueError, match=match):
            step(*step.init(_scanned()), batch)


def test_an_nnx_model_scanned_with_nnx_scan_gives_the_post_backward_bits():
    """The NNX stack of tests/test_fsdp.py (layers made by ``nnx.vmap``,
    applied by ``nnx.scan`` under ``nnx.remat``, each gathering its own
    parameter): the variable's value is the ``LayerStack``, and three
    overlapped steps equal the post-backward ones bit for bit."""
    from test_fsdp import _layers, _nnx_stack

    mesh = auto_mesh()
    loss, state0 = _nnx_stack()
    batch = (jax.random.normal(jax.random.key(1), (64, 64)), jnp.zeros((64, 8)))

    def run(overlap):
        compress = jc.optax.compress_gradients(
            "qsgd:bits=4", "data", layers=_layers, min_compress_size=256
        )
        step = jc.data_parallel(loss, optax.chain(compress, optax.sgd(0.1)), mesh, overlap=overlap)
        params, state = step.init(state0)
        for _ in range(3):
            params, state, _ = step(params, state, batch)
        return params, state

    got, want = run(True), run(False)
    assert [b.layers for b in got[1][0].comm.plan.buckets] == [6, 0]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_stack_counts_every_layer_in_the_telemetry():
    """The bytes a step sends, per the telemetry: a stack of 4 layers of
    64 x 64 sends what its 4 layers, as 4 leaves of their own buckets,
    send (QSGD-4 two-phase: its server residuals too)."""
    layers = {"w": jnp.zeros((4, 64, 64))}
    unrolled = {f"w{i}": jnp.zeros((64, 64)) for i in range(4)}
    kw = dict(algorithm="two_phase", fusion_bytes=64 * 64 * 4, min_compress_size=256)
    stacked = jc.optax.compress_gradients("qsgd:bits=4", "data", layers=lambda *_: True, **kw)
    apart = jc.optax.compress_gradients("qsgd:bits=4", "data", **kw)
    mesh = auto_mesh()
    got = jc.optax.init(stacked, layers, mesh, "data")
    want = jc.optax.init(apart, unrolled, mesh, "data")
    assert [b.layers for b in got.comm.plan.buckets] == [4]
    assert len(want.comm.plan.buckets) == 4
    assert jc.optax.telemetry(got) == jc.optax.telemetry(want)
    assert got.server_residuals[0].shape[-1] == sum(s.shape[-1] for s in want.server_residuals)
