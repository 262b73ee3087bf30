"""FP8 and MX against a plain NumPy implementation of the specifications'
rules, written here from the OCP texts (OFP8 rev. 1.0 for E4M3/E5M2; MX
v1.0, sections 5-6, for FP6, FP4 and the E8M0 scale), independent of the
codecs' code: every element format's values from its (exponent, mantissa,
bias) definition, round to nearest even by search over those values,
saturation at the largest finite value, the shared exponent
floor(log2(max|v|)) - emax through frexp. Both backends must equal it on
random data of the three input dtypes, odd sizes, zeros, subnormals, NaN
and Inf. The stochastic rounding is unbiased and its variance bounded.

XLA's CPU runtime computes with denormals flushed (the kernels too,
docs/codecs.md): the reference flushes float32 subnormal inputs and results
to zero where the CPU would.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp.codecs.mx import _unpack

# name: (exponent bits, mantissa bits, bias, has inf/NaN codes at the top)
SPEC = {
    "e4m3": (4, 3, 7, "nan-only"),  # S.1111.111 is NaN; no inf
    "e5m2": (5, 2, 15, "ieee"),  # exponent 11111: inf and NaN
    "e3m2": (3, 2, 3, None),
    "e2m3": (2, 3, 1, None),
    "e2m1": (2, 1, 1, None),
}


def finite_values(name):
    """The non-negative finite values of a format, indexed by their code."""
    ebits, mbits, bias, special = SPEC[name]
    values = []
    for code in range(1 << (ebits + mbits)):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if special == "ieee" and e == (1 << ebits) - 1:
            break
        if special == "nan-only" and e == (1 << ebits) - 1 and m == (1 << mbits) - 1:
            break
        if e == 0:
            values.append(m * 2.0 ** (1 - bias - mbits))
        else:
            values.append((1 + m / 2**mbits) * 2.0 ** (e - bias))
    return np.array(values)


def test_formats_largest_values_are_the_specifications():
    want = {"e4m3": 448.0, "e5m2": 57344.0, "e3m2": 28.0, "e2m3": 7.5, "e2m1": 6.0}
    assert {k: finite_values(k)[-1] for k in SPEC} == want
    assert finite_values("e2m1").tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def round_nearest_even(t, name):
    """Codes (sign bit included) of float64 t: the nearest finite value, ties
    to the even code, saturating at the largest finite value."""
    ebits, mbits, _, _ = SPEC[name]
    table = finite_values(name)
    a = np.abs(t)
    hi = np.clip(np.searchsorted(table, a), 1, len(table) - 1)
    lo = hi - 1
    d_lo, d_hi = a - table[lo], table[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a >= table[-1], len(table) - 1, code)
    return code | (np.signbit(t).astype(np.int64) << (ebits + mbits))


def code_values(codes, name):
    ebits, mbits, _, _ = SPEC[name]
    table = finite_values(name)
    mag = codes & ((1 << (ebits + mbits)) - 1)
    v = table[np.minimum(mag, len(table) - 1)]
    return np.where(codes >> (ebits + mbits), -v, v)


def ftz32(x):
    """float64 -> float32 as XLA:CPU leaves it: subnormal results flushed."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), x), x)


def mx_reference(x32, name):
    """(codes, E8M0 scales, decoded float32) of the MX v1.0 rules, per block of 32."""
    x = ftz32(x32).astype(np.float64)  # DAZ: subnormal inputs read as zero
    emax = int(np.floor(np.log2(finite_values(name)[-1])))
    nb = -(-x.size // 32)
    xb = np.pad(x, (0, nb * 32 - x.size)).reshape(nb, 32)
    m = np.max(np.abs(xb), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        _, exp = np.frexp(np.where(np.isfinite(m) & (m > 0), m, 1.0))
    shared = np.where(m > 0, exp - 1 - emax, -127)  # floor(log2 m) - emax
    shared = np.clip(shared, -127, 127)
    nonfinite = ~np.isfinite(m)
    scales = np.where(nonfinite, 255, shared + 127)
    t = np.where(nonfinite[:, None], 0.0, xb / 2.0 ** shared[:, None])
    codes = round_nearest_even(t, name)
    decoded = code_values(codes, name) * 2.0 ** shared[:, None]
    decoded = np.where(nonfinite[:, None], np.nan, decoded)
    return codes, scales, ftz32(decoded.reshape(-1)[: x.size])


def fp8_reference(x32, name, bucket):
    """(codes, decoded float32) of FP8 with a float32 max|v| per bucket: the
    products in float32 as the codec defines them, the rounding as above."""
    x = ftz32(x32)
    fmax = np.float32(finite_values(name)[-1])
    nb = -(-x.size // bucket)
    xb = np.pad(x, (0, nb * bucket - x.size)).reshape(nb, bucket)
    m = np.max(np.abs(xb), axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(m > 0, fmax / m, np.float32(0)).astype(np.float32)
        t = (xb * inv[:, None]).astype(np.float32)
        codes = round_nearest_even(np.where(np.isnan(t), 0.0, t.astype(np.float64)), name)
        step = (m * (np.float32(1) / fmax)).astype(np.float32)
        decoded = (code_values(codes, name).astype(np.float32) * step[:, None]).astype(np.float32)
    return codes, ftz32(decoded.reshape(-1)[: x.size])


@functools.partial(jax.jit, static_argnames=("codec", "backend"))
def _round_trip(x, codec, backend):
    """(payload, decoded) of one compiled encode and decode."""
    p = codec.encode(x, backend=backend)
    return p, codec.decode(p, backend=backend)


def _inputs(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp(rng.uniform(-12, 12, n))
    x = x.astype(np.float32)
    x[::13] = 0.0
    x[3::29] = -0.0
    x[5::31] = 3e-39  # subnormal
    x[6::37] = rng.standard_normal(x[6::37].size) * 1e-30
    return x


@pytest.mark.parametrize("backend", ["ffi", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("element", list(SPEC))
def test_mx_equals_the_specification(element, dtype, backend):
    if backend == "ffi" and not jc.cpu_available():
        pytest.skip("no CPU kernels")
    codec = jc.codecs.MX(element=element)
    for n, seed in ((1, 0), (77, 1), (1029, 2)):
        x = jnp.asarray(_inputs(n, seed)).astype(dtype)
        if dtype == "float16":  # keep the float16 inputs finite
            x = jnp.clip(x.astype(jnp.float32), -6e4, 6e4).astype(jnp.float16)
        x32 = np.asarray(x.astype(jnp.float32))
        codes, scales, decoded = mx_reference(x32, element)
        p, got = _round_trip(x, codec, backend)
        np.testing.assert_array_equal(np.asarray(p.arrays["scales"]), scales)
        got_codes = _unpack(p.arrays["codes"], codec.format.bits)
        np.testing.assert_array_equal(np.asarray(got_codes), codes.reshape(-1))
        want = jnp.asarray(decoded).astype(dtype)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8), err_msg=f"n={n}"
        )


@pytest.mark.parametrize("backend", ["ffi", "xla"])
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_fp8_equals_the_specification(name, backend):
    if backend == "ffi" and not jc.cpu_available():
        pytest.skip("no CPU kernels")
    for bucket, n, seed in ((8, 37, 3), (256, 1029, 4)):
        codec = jc.codecs.FP8(format=name, bucket_size=bucket)
        x = _inputs(n, seed)
        codes, decoded = fp8_reference(x, name, bucket)
        p, got = _round_trip(jnp.asarray(x), codec, backend)
        np.testing.assert_array_equal(np.asarray(p.arrays["codes"]), codes.reshape(-1))
        got = np.asarray(got)
        np.testing.assert_array_equal(got.view(np.uint32), decoded.view(np.uint32))


@pytest.mark.parametrize("codec", [jc.codecs.MX(), jc.codecs.FP8(), jc.codecs.MX(element="e2m1")])
def test_special_values(codec):
    """A block with NaN or inf decodes to NaN (MX: the NaN scale 0xFF); an
    all-zero block to zeros with their signs; the other blocks are intact."""
    x = np.full(64 * 8, 0.25, np.float32)
    x[3], x[300] = np.nan, np.inf
    x[256:264] = 0.0
    x[257] = -0.0
    b = codec.bucket_size
    y = np.asarray(codec.decode(codec.encode(jnp.asarray(x))))
    bad = {3 // b, 300 // b}
    for k in range(x.size // b):
        block = y[k * b : (k + 1) * b]
        if k in bad:
            assert np.isnan(block).all() or codec.name == "fp8", k
            assert np.isnan(block[(3 if k == 3 // b else 300) % b])
        elif k * b <= 256 < (k + 1) * b:
            assert np.signbit(y[257]) and y[256] == 0
        else:
            np.testing.assert_array_equal(block, x[k * b : (k + 1) * b])


@pytest.mark.slow
@pytest.mark.parametrize(
    "codec",
    [jc.codecs.FP8(stochastic=True), jc.codecs.MX(element="e2m1", stochastic=True)],
    ids=str,
)
def test_stochastic_rounding_is_unbiased(codec):
    """Mean of 2,000 independent roundings: within 5 standard errors of x,
    element by element (x inside the saturation range); the variance per
    element at most (quantum)^2 / 4."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, 256).astype(np.float32)
    x[0] = 1.0  # the block max: exact, so nothing saturates
    x[32::32] = 1.0
    enc = jax.jit(jax.vmap(lambda k: codec.decode(codec.encode(jnp.asarray(x), k))))
    draws = np.asarray(enc(jax.random.split(jax.random.key(1), 2000)), np.float64)
    mean, var = draws.mean(0), draws.var(0)
    se = np.sqrt(np.maximum(var, 1e-30) / draws.shape[0])
    assert np.all(np.abs(mean - x) <= 5 * se + 1e-7), np.max(np.abs(mean - x) / (se + 1e-12))
    # E2M1 with 1.0 -> 4: steps of 1 in [2, 4), 0.25 in real units; E4M3 with
    # 1.0 -> 448: steps of 32 in [256, 448], 32/448 in real units.
    quantum = 0.25 if codec.name == "mx" else 32 / 448
    assert np.all(var <= quantum**2 / 4 + 1e-9)


@pytest.mark.parametrize("backend", ["ffi", "xla"])
@pytest.mark.parametrize("element", list(SPEC))
def test_mx_non_finite_blocks_equal_the_specification(element, backend):
    """NaN and ±inf: the block's scale is E8M0's NaN (0xFF) and it decodes to
    NaN; the other blocks are the specification's as above."""
    if backend == "ffi" and not jc.cpu_available():
        pytest.skip("no CPU kernels")
    x = _inputs(200, 5)
    x[7], x[70], x[150] = np.nan, np.inf, -np.inf
    codes, scales, decoded = mx_reference(x, element)
    codec = jc.codecs.MX(element=element)
    p, got = _round_trip(jnp.asarray(x), codec, backend)
    np.testing.assert_array_equal(np.asarray(p.arrays["scales"]), scales)
    assert (scales == 255).sum() == 3
    finite = np.repeat(scales != 255, 32)[: x.size]
    got_codes = np.asarray(_unpack(p.arrays["codes"], codec.format.bits))[: x.size]
    np.testing.assert_array_equal(got_codes[finite], codes.reshape(-1)[: x.size][finite])
    np.testing.assert_array_equal(np.asarray(got), decoded)  # NaN where the reference has NaN
