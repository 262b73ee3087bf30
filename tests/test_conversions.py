"""16-bit float conversions of the kernels against XLA's, bit for bit, over
every half/bfloat16 bit pattern and a large sample of float32 ones."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp.codecs.cast import cast

pytestmark = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")

HALF_TYPES = ["float16", "bfloat16"]


def _f32_patterns() -> np.ndarray:
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    # Every exponent with mantissas at and around the f16/bf16 rounding points.
    exps = np.arange(256, dtype=np.uint32) << 23
    mants = np.array(
        [
            0,
            1,
            0xFFF,
            0x1000,
            0x1001,
            0x2000,
            0x3000,
            0x7FFF,
            0x8000,
            0x8001,
            0x10000,
            0x18000,
            0x7FE000,
            0x7FF000,
            0x7FFFFF,
        ],
        np.uint32,
    )
    edges = (exps[:, None] | mants[None, :]).reshape(-1)
    edges = np.concatenate([edges, edges | np.uint32(0x80000000)])
    return np.concatenate([random, edges])


@pytest.mark.parametrize("target", HALF_TYPES)
def test_float32_to_half_matches_xla(target):
    x = jnp.asarray(_f32_patterns().view(np.float32))
    ours = np.asarray(cast(x, target, backend="ffi")).view(np.uint16)
    xla = np.asarray(cast(x, target, backend="xla")).view(np.uint16)
    bad = np.nonzero(ours != xla)[0]
    assert bad.size == 0, [hex(v) for v in np.asarray(x).view(np.uint32)[bad[:5]]]


@pytest.mark.parametrize("source", HALF_TYPES)
@pytest.mark.parametrize("target", ["float32", "float16", "bfloat16"])
def test_every_half_pattern_converts_like_xla(source, target):
    if source == target:
        pytest.skip("identity")
    x = jnp.asarray(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.dtype(source)))
    ours = np.asarray(cast(x, target, backend="ffi"))
    xla = np.asarray(cast(x, target, backend="xla"))
    width = f"u{ours.dtype.itemsize}"
    np.testing.assert_array_equal(ours.view(width), xla.view(width))  # NaN bits included


@pytest.mark.parametrize("source", ["float32", *HALF_TYPES])
@pytest.mark.parametrize("target", ["float32", *HALF_TYPES])
def test_the_twins_nans_are_xla_cpus(source, target):
    """The Cast twin writes NaNs by XLA's CPU rule on every platform (its own
    bit operations, since XLA's GPU code writes other NaNs); on the CPU that
    is exactly ``astype``, for every bit pattern."""
    import jax

    from jaxcomp.codecs.cast import _astype

    if source == target:
        pytest.skip("identity")
    if source == "float32":
        x = _f32_patterns().view(np.float32)
    else:
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(jnp.dtype(source))
    x = jax.device_put(x, jax.devices("cpu")[0])
    ours = np.asarray(jax.jit(lambda v: _astype(v, jnp.dtype(target)))(x))
    xla = np.asarray(jax.jit(lambda v: v.astype(jnp.dtype(target)))(x))
    u = np.dtype(f"u{ours.dtype.itemsize}")
    bad = np.nonzero(ours.view(u) != xla.view(u))[0]
    assert bad.size == 0, bad[:5]
