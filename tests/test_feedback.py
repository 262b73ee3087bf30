"""Codec.encode_feedback: error feedback's compression in one call.

Its rule is the three calls it replaces: ``acc = float32(x) + residual``,
the payload ``encode(acc)`` and the new residual ``acc - decode(payload)``.
Every codec gives exactly their bytes on every backend; the codecs with a
fused CPU kernel (``feedback_kernel``) give them from one pass, at bucket
edges, across the kernel's threads, for each input dtype and for special
values, and the compiled step calls that kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONTRACT_CODECS, codec_id
from helpers import assert_same_bytes, assert_same_payload, gradient_like, registered_targets

import jaxcomp as jc

KEY = jax.random.key(7)
needs_ffi = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
FUSED = [c for c in CONTRACT_CODECS if c.feedback_kernel]
# The first configuration of each codec class (its users' default).
FIRST_OF_CLASS = {type(c): c for c in reversed(FUSED)}


@functools.partial(jax.jit, static_argnames=("codec", "backend"))
def by_calls(x, residual, key, codec, backend):
    """The rule, written out: add, encode, decode, subtract."""
    acc = x.astype(jnp.float32) + residual
    payload = codec.encode(acc, key, backend=backend)
    return payload, acc - codec.decode(payload, backend=backend)


@functools.partial(jax.jit, static_argnames=("codec", "backend"))
def fused(x, residual, key, codec, backend):
    return codec.encode_feedback(x, residual, key, backend=backend)


def residual_like(n: int, seed: int) -> jax.Array:
    return (gradient_like(n, seed=seed) * 0.25).astype(jnp.float32)


def check_same(codec, x, residual, key, backend, reference_backend, what):
    p, r = fused(x, residual, key, codec, backend)
    q, s = by_calls(x, residual, key, codec, reference_backend)
    assert_same_payload(p, q, f"{what} payload")
    assert_same_bytes(r, s, f"{what} new residual")


@pytest.mark.parametrize("codec", CONTRACT_CODECS, ids=codec_id)
def test_every_codec_gives_the_three_calls_bytes(codec):
    """The rule holds for every codec, fused or not: a bfloat16 gradient of
    a few buckets, the default backend against the calls on the same one."""
    n = 3 * (codec.split_granularity() or 64) + 5
    x = gradient_like(n, seed=1, dtype="bfloat16")
    check_same(codec, x, residual_like(n, 2), KEY, "auto", "auto", "auto")


@needs_ffi
@pytest.mark.parametrize("codec", FUSED, ids=codec_id)
def test_the_fused_kernel_gives_the_kernels_and_the_twins_bytes(codec):
    """The one-pass kernel against the separate kernels and against the
    twins: one element, a bucket edge, a partial last bucket, and enough
    buckets to spread over the kernel's threads, each input dtype. (With
    ``backend="xla"`` encode_feedback is the twins' three calls, which
    the second check runs.) The other configurations of a codec take two
    of the cases: a bucket edge, and the partial last bucket of a tensor
    spread over the threads."""
    g = codec.split_granularity() or 64
    cases = [(1, "float32"), (g + 1, "float16"), (4099, "float32"), (3 * 65536 + 13, "bfloat16")]
    if FIRST_OF_CLASS[type(codec)] is not codec:
        cases = cases[1::2]
    for n, dtype in cases:
        x = gradient_like(n, seed=n, dtype=dtype)
        res = residual_like(n, n + 1)
        key = jax.random.fold_in(KEY, n)
        check_same(codec, x, res, key, "ffi", "ffi", f"{dtype} n={n} vs kernels")
        check_same(codec, x, res, key, "ffi", "xla", f"{dtype} n={n} vs twins")


@needs_ffi
@pytest.mark.parametrize("codec", FUSED, ids=codec_id)
def test_special_values_and_shapes(codec):
    """NaN, infinities, zeros of both signs and subnormals in the gradient
    and in the residual; a 2-D gradient keeps its shape."""
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 3e-39, 1.0, -2.5], np.float32)
    x = np.array(gradient_like(1024, seed=3))
    res = np.array(residual_like(1024, 4))
    x[::97] = special[np.arange(x[::97].size) % special.size]
    res[5::89] = special[np.arange(res[5::89].size) % special.size]
    x, res = jnp.asarray(x).reshape(32, 32), jnp.asarray(res).reshape(32, 32)
    check_same(codec, x, res, KEY, "ffi", "ffi", "special values")
    p, r = fused(x, res, KEY, codec, "ffi")
    assert p.shape == (32, 32) and r.shape == (32, 32) and r.dtype == jnp.float32


@needs_ffi
@pytest.mark.parametrize("codec", FUSED[:1], ids=codec_id)
def test_the_cpu_step_calls_the_fused_kernel(codec):
    """On the CPU the default backend lowers to the one-pass target, not to
    the separate encode and decode: the fused path cannot fall back
    silently."""
    x = jnp.ones((4096,), jnp.float32)
    hlo = fused.lower(x, x, KEY, codec, "auto").as_text()
    assert f"jaxcomp_{codec.name}_encode_feedback" in hlo
    assert f"jaxcomp_{codec.name}_decode" not in hlo


@needs_ffi
@pytest.mark.parametrize(
    "spread", ["distinct", "ties"], ids=["sampled selection", "exact selection"]
)
def test_topk_large_tensors_in_one_pass(spread):
    """TopK's whole-tensor selection of a large acc: past 2^20 elements it
    samples a bound and collects (distinct magnitudes), or falls back to the
    radix select (a few magnitudes, many ties); both from the acc the
    one-pass kernel wrote into the new residual."""
    n = (1 << 20) + 37
    if spread == "distinct":
        x = gradient_like(n, seed=11)
    else:
        x = jnp.asarray(np.resize(np.array([0.5, -0.25, 0.5, 1.0], np.float32), n))
    res = residual_like(n, 12) if spread == "distinct" else jnp.zeros((n,), jnp.float32)
    check_same(jc.codecs.TopK(fraction=0.01), x, res, KEY, "ffi", "ffi", spread)


def test_a_residual_of_another_shape_or_dtype_is_refused():
    codec = jc.codecs.Int8()
    x = jnp.ones((100,), jnp.float32)
    with pytest.raises(ValueError, match=r"float32 of the gradient's shape \(100,\)"):
        codec.encode_feedback(x, jnp.ones((99,), jnp.float32))
    with pytest.raises(ValueError, match="got bfloat16"):
        codec.encode_feedback(x, jnp.ones((100,), jnp.bfloat16))


@needs_ffi
@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices")
@pytest.mark.parametrize(
    "codec, algorithm, calls",
    [
        (jc.codecs.QSGD(bits=4), "two_phase", 2),  # the first stage and the owner's
        (jc.codecs.OneBit(), "allgather", 1),
        (jc.codecs.Int8(), "ring", 3),  # the P - 1 hops; the owner's are separate
        (jc.codecs.TopK(fraction=0.01), "sparse", 1),  # the first stage; the dense one is raw
    ],
    ids=codec_id,
)
def test_compress_gradients_compresses_in_one_pass(codec, algorithm, calls):
    """On the CPU, ``compress_gradients``' compressions that keep what they
    miss run the one-pass kernel (a float32 leaf: every device's first
    compression, and the owner's with its server residual), and the step's
    own payload is never decoded for the residual. In the ring, each
    scatter-reduce hop's compression with its server residual is one pass;
    the owner's keeps the separate calls: its decoded chunk goes into the
    all-gather."""
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices("cpu")[:4])
    tx = jc.optax.compress_gradients(codec, "d", algorithm=algorithm, min_compress_size=16)
    params = {"w": jnp.zeros((64, 64), jnp.float32)}
    state = jc.optax.init(tx, params, mesh, "d")
    specs = jc.optax.state_specs(state, "d")
    step = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(g, s),
            mesh=mesh,
            in_specs=(jax.sharding.PartitionSpec(), specs),
            out_specs=(jax.sharding.PartitionSpec(), specs),
            check_vma=False,
        )
    )
    hlo = step.lower(params, state).compile().as_text()
    fused_target = f'"jaxcomp_{codec.name}_encode_feedback"'
    assert hlo.count(fused_target) == calls, hlo.count(fused_target)
    # the ring's owner encodes apart, once; nothing else does
    assert hlo.count(f'"jaxcomp_{codec.name}_encode"') == (algorithm == "ring")


@needs_ffi
@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices")
def test_hierarchical_compresses_its_slow_stage_in_one_pass():
    """Over (node, local) axes, ``acc`` crosses the fast axis in full
    precision and the slow stage's compression of the node-summed chunk
    is its own error feedback: one pass, no separate encode or decode, and
    nothing is lost (the updates and the residuals add up to the
    gradients)."""
    codec = jc.codecs.QSGD(bits=4)
    axes = ("node", "local")
    mesh = jax.make_mesh((2, 2), axes, devices=jax.devices("cpu")[:4])
    tx = jc.optax.compress_gradients(codec, axes, min_compress_size=16)
    params = {"w": jnp.zeros((64, 64), jnp.float32)}
    state = jc.optax.init(tx, params, mesh, axes)
    specs = jc.optax.state_specs(state, axes)
    P = jax.sharding.PartitionSpec
    step = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(jax.tree.map(lambda a: a[0], g), s),
            mesh=mesh,
            in_specs=(P(axes), specs),
            out_specs=(P(), specs),
            check_vma=False,
        )
    )
    grads = {"w": gradient_like(4 * 64 * 64, seed=5).reshape(4, 64, 64)}
    grads = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P(axes)))
    hlo = step.lower(grads, state).compile().as_text()
    assert hlo.count('"jaxcomp_qsgd_encode_feedback"') == 1
    assert '"jaxcomp_qsgd_encode"' not in hlo
    updates, state = step(grads, state)
    residuals = np.asarray(state.residuals["w"], np.float64)  # [devices, 64, 64]
    total = 4 * np.asarray(updates["w"], np.float64) + residuals.sum(0)
    expected = np.asarray(grads["w"], np.float64).sum(0)
    np.testing.assert_allclose(total, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_the_flags_name_the_kernels_the_sources_register():
    """``Codec.kernels`` says which codecs' one-pass targets the CPU and
    CUDA modules register (``backend="ffi"``
    calls them, and a flag without its kernel would fail to lower), read
    from the sources, so that a kernel or a flag added alone fails here."""
    classes = {type(c) for c in CONTRACT_CODECS}
    for platform, folder in (("cpu", "ffi"), ("cuda", "cuda")):
        flagged = {c.name for c in classes if "encode_feedback" in getattr(c.kernels, platform)}
        assert flagged == registered_targets(folder, "encode_feedback"), platform
    assert {c.name for c in classes if "encode_feedback" in c.kernels.cuda} == {
        "int8",
        "qsgd",
        "onebit",
        "signsgd",
        "natural",
        "fp8",
        "mx",
        "terngrad",
    }
