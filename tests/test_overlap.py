"""jc.data_parallel's replicated step with overlap=True (the default off
the CPU) reduces each bucket from inside the backward pass
(jaxcomp/optax/_overlap.py): what the compiled step's collectives wait
for, read from its unoptimized HLO; the same bits as the post-backward
step; error feedback's conservation over 1,000 steps; "auto" on a CPU mesh."""

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_and_post_backward_steps_give_the_same_bits(case):
    """Five steps of each codec configuration (fused buckets of two dtypes,
    exact small leaves, warm-up steps that branch): parameters and every
    state leaf equal bit for bit."""
    mesh = auto_mesh()
    kw = dict(CASES[case])
    codec = kw.pop("codec")
    x = jax.random.normal(jax.random.key(3), (4 * N_DEV, 48))
    y = jax.random.normal(jax.random.key(4), (4 * N_DEV, 16))

    def run(overlap):
        tx = optax.chain(
            jc.optax.compress_gradients(
                codec, "data", fusion_bytes=8192, min_compress_size=256, **kw
            ),
            optax.sgd(0.05, momentum=0.9),
        )
        step = jc.data_parallel(_mixed_loss, tx, mesh, overlap=overlap)
        params, state = step.init(_mixed())
        for i in range(5):
            params, state, _ = step(params, state, (x + i, y))
        return params, state

    got, want = run(True), run(False)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
    (the all-gather algorithm keeps no server residual)."""
    mesh = auto_mesh()
    shapes = {"a": (40, 50), "b": (30,), "c": (2000,)}
    rng = np.random.default_rng(0)
    steps = 1000
    grads = {
        k: rng.normal(0.25, 1.0, (steps, N_DEV, *s)).astype(np.float32) for k, s in shapes.items()
    }

    def loss(params, batch):
        return sum(jnp.sum(params[k] * batch[k][0]) for k in shapes)

    tx = optax.chain(
        jc.optax.compress_gradients(
            "qsgd:bits=2", "data", algorithm="allgather", min_compress_size=100
        ),
        optax.sgd(1.0),
    )
    step = jc.data_parallel(loss, tx, mesh, overlap=True)
    p0 = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    params, state = step.init(p0)
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
