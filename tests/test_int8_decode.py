"""Int8's decoded values are the kernel's bytes under XLA's FMA contraction.

XLA's CPU code contracts a product and the add it feeds into one FMA
(docs/codecs.md, "One answer"), and XLA:CPU removes
``lax.optimization_barrier`` before it fuses (jax 0.10.2), so a twin decode
fused into a sum over rows (``Codec.decode_sum``) or into a residual can
skip the product's rounding that the kernels (``-ffp-contract=off``) keep.
Int8's twin computes ``q * step`` as ``q * hi + q * lo``, two exact
products (``jaxcomp.codecs.int8.exact_parts``). These checks compile at
XLA's default optimization level, the one users' programs get, whatever
the process's ``XLA_FLAGS`` say (CI runs its test tiers at level 0, where
LLVM does not contract).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp.codecs.int8 import exact_parts

needs_ffi = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
DEFAULT_LEVEL = {"xla_backend_optimization_level": 3}
F32 = np.finfo(np.float32)


def special_steps() -> np.ndarray:
    """Steps of every kind: both signs of zero, subnormals, the smallest
    normals, both sides of 2^-100 (where exact_parts stops splitting),
    steps whose low 7 bits are zero, near float32's max, infinities and
    NaNs with payloads; then random bit patterns over every exponent."""
    base = [0.0, 1e-45, 3e-39, F32.tiny, 2.0**-110, 2.0**-100, 2.0**-99, 1.0, 0.5]
    base += [1.0 + 2.0**-23, 1.0 + 2.0**-16, 3.0 / 127, 7e35, F32.max / 127, F32.max, np.inf]
    words = np.array(base, np.float32).view(np.uint32)
    words = np.concatenate([words, words | np.uint32(0x80000000)])
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFC00123, 0x7FBFFFFF], np.uint32)
    rng = np.random.default_rng(0)
    return np.concatenate([words, nans, rng.integers(0, 2**32, 256, dtype=np.uint32)]).view(
        np.float32
    )


def test_exact_parts_split_every_step_into_exact_products():
    step = special_steps()
    hi, lo = (np.asarray(a) for a in jax.jit(exact_parts)(jnp.asarray(step)))
    q = np.arange(-128, 128, dtype=np.float64)[:, None]
    finite = np.isfinite(step)
    # hi + lo is step, exactly (float64 holds the sum of the two halves).
    np.testing.assert_array_equal(hi[finite].astype(np.float64) + lo[finite], step[finite])
    split = lo != 0
    assert split.sum() > 100  # most random steps are split
    for part in (hi[split], lo[split]):
        exact = q * part.astype(np.float64)
        # Every product of an int8 and a part within float32's range is a
        # float32 (past it, q * step overflows as well), and none is a
        # subnormal that the CPU's flush to zero would change.
        fits = np.abs(exact) <= F32.max
        with np.errstate(over="ignore"):
            assert (exact.astype(np.float32).astype(np.float64) == exact)[fits].all()
        assert not ((exact != 0) & (np.abs(exact) < F32.tiny)).any()
    # Unsplit (tiny, empty or non-finite): hi is step, bit for bit (NaN
    # payloads included), and lo a zero of step's sign.
    np.testing.assert_array_equal(hi[~split].view(np.uint32), step[~split].view(np.uint32))
    np.testing.assert_array_equal(np.signbit(lo[~split]), np.signbit(step[~split]))
    assert not split[np.abs(step) < 2.0**-100].any()


def _payloads(codec, rows: int, n: int, seed: int):
    """Stacked Int8 payloads: every code, steps from special_steps()."""
    rng = np.random.default_rng(seed)
    layout = codec.arrays(n, jnp.float32)
    q = rng.integers(-128, 128, (rows, layout["q"].shape[0]), dtype=np.int8)
    scales = np.resize(special_steps(), (rows, layout["scales"].shape[0]))
    scales = np.stack([rng.permutation(s) for s in scales])
    return jc.Payload(
        codec, (n,), jnp.float32, {"q": jnp.asarray(q), "scales": jnp.asarray(scales)}
    )


def _bytes(f, *args) -> bytes:
    return np.asarray(jax.jit(f).lower(*args).compile(DEFAULT_LEVEL)(*args)).tobytes()


@needs_ffi
@pytest.mark.parametrize("bucket_size", [8, 512])
def test_decode_and_decode_sum_twin_give_the_kernels_bytes(bucket_size):
    """Hostile scales and every code, at XLA's default level: decode and
    decode_sum (3 rows) give the kernel's bytes on both backends."""
    codec = jc.codecs.Int8(bucket_size=bucket_size)
    n = 300 * bucket_size + 5
    p = _payloads(codec, 3, n, bucket_size)

    def first(p):
        return jax.tree.map(lambda a: a[0], p)

    for name, f in {
        "decode_sum": lambda p, b: codec.decode_sum(p, backend=b),
        "decode": lambda p, b: codec.decode(first(p), backend=b),
    }.items():
        kernel = _bytes(lambda p, f=f: f(p, "ffi"), p)
        twin = _bytes(lambda p, f=f: f(p, "xla"), p)
        assert kernel == twin, name
