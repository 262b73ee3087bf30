"""The bad-input matrix of docs/codecs.md ("Bad inputs"): every codec against
every row, the error type and message, or the documented result. One test
per row of the table; the adversarial payloads (the last row) are in
tests/test_adversarial.py."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import codec_id
from helpers import assert_same_bytes, assert_same_payload

from jaxcomp import codecs as C

KEY = jax.random.key(5)
# One configuration per codec class (the recommended one): the rows below do
# not depend on the configuration, only on the codec.
CODECS = [cls.examples()[0] for cls in C.registered()]
every_codec = pytest.mark.parametrize("codec", CODECS, ids=codec_id)


@functools.partial(jax.jit, static_argnames=("codec", "backend"))
def _encode(x, key, codec, backend="auto"):
    return codec.encode(x, key, backend=backend)


@functools.partial(jax.jit, static_argnames=("backend",))
def _decode(payload, backend="auto"):
    return payload.codec.decode(payload, backend=backend)


def _round_trip(codec, x, backend="auto"):
    return _decode(_encode(x, KEY, codec, backend), backend)


# ---------------------------------------------------------------------------
# Input dtypes
# ---------------------------------------------------------------------------
BAD_DTYPES = ["int32", "float64", "complex64", "bool", "float8_e4m3fn"]


@every_codec
@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_unsupported_input_dtype(codec, dtype):
    """TypeError at trace time, for NumPy and JAX arrays alike (float64 is
    refused before any conversion, not encoded as float32)."""
    msg = re.escape(
        f"{type(codec).__name__}.encode: unsupported dtype {jnp.dtype(dtype).name}; "
        "expected float32, bfloat16 or float16"
    )
    x = np.ones((4, 3), dtype=jnp.dtype(dtype))
    with pytest.raises(TypeError, match=msg):
        codec.encode(x, KEY)
    if dtype != "float64":  # JAX has no float64 array without x64
        with pytest.raises(TypeError, match=msg):
            jax.jit(lambda v: codec.encode(v, KEY))(jnp.asarray(x))


@every_codec
def test_python_scalars_and_lists_take_float32(codec):
    """No dtype to check: JAX's default conversion (float32 without x64)."""
    for x in (1.5, [0.5, -2.0, 3.0]):
        p = codec.encode(x, KEY, backend="xla")
        assert p.dtype == jnp.float32 and p.shape == np.shape(x)


# ---------------------------------------------------------------------------
# Shapes and memory layout
# ---------------------------------------------------------------------------
SHAPES = {"scalar": (), "empty": (0, 3), "rank 6": (2, 1, 3, 1, 2, 2)}


@every_codec
@pytest.mark.parametrize("kind", list(SHAPES))
def test_shapes_round_trip(codec, kind):
    """Scalars, empty tensors and any rank: decode gives the shape and dtype
    back; the payload follows the layout of the element count."""
    shape = SHAPES[kind]
    x = jnp.linspace(-1.0, 1.0, int(np.prod(shape)), dtype=jnp.bfloat16).reshape(shape)
    p = _encode(x, KEY, codec)
    assert p.shape == shape and p.dtype == jnp.bfloat16
    assert p.nbytes == codec.wire_nbytes(shape, jnp.bfloat16)
    y = _decode(p)
    assert y.shape == shape and y.dtype == jnp.bfloat16
    if codec.name in ("identity", "cast") and x.size:
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))


@every_codec
def test_non_contiguous_input(codec):
    """A strided or transposed NumPy view encodes as its contiguous copy
    (row-major order of the logical array)."""
    base = np.asarray(np.random.default_rng(0).standard_normal((8, 16)), np.float32)
    for view in (base[:, ::2], base.T[::2]):
        assert not view.flags.c_contiguous
        assert_same_payload(
            _encode(view, KEY, codec), _encode(np.ascontiguousarray(view), KEY, codec), "view"
        )


@every_codec
def test_too_many_elements(codec):
    """More than 2^32 - 1 elements: ValueError at trace time."""
    x = jax.ShapeDtypeStruct((1 << 16, 1 << 16), jnp.float16)
    with pytest.raises(ValueError, match="limited to 2\\^32 - 1 elements"):
        jax.eval_shape(lambda v: codec.encode(v, KEY), x)


# ---------------------------------------------------------------------------
# Special values
# ---------------------------------------------------------------------------
def _input(n=64, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(1).uniform(-1, 1, n), dtype)


def _both(codec, x):
    """Decoded by kernel and twin, which must agree bit for bit."""
    got = _round_trip(codec, x, "auto")
    twin = _round_trip(codec, x, "xla")
    assert_same_bytes(got, twin, f"{codec!r} kernel vs twin")
    return np.asarray(got, np.float32)


@every_codec
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["NaN", "+inf", "-inf"])
def test_non_finite_inputs_propagate(codec, value):
    """A NaN or +-inf never decodes to a finite value at its position
    (docs/codecs.md, "Special values", says how far it spreads)."""
    x = _input().at[17].set(value)
    y = _both(codec, x)
    assert not np.isfinite(y[17]), y[17]


@every_codec
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_subnormal_inputs(codec, dtype):
    """Subnormals: finite results, kernel == twin; float32 (and bfloat16)
    subnormals count as zero in the codecs' arithmetic, so a tensor of only
    subnormals decodes to zeros, except Identity, TopK and Cast, which keep
    the values' bits (Cast rounds to the target). Float16 subnormals are
    normal float32 values and encode like any other; bfloat16 subnormals are
    float32 subnormals (the codecs compute in float32), the float32 case."""
    tiny = jnp.finfo(jnp.dtype(dtype)).smallest_subnormal
    x = jnp.asarray(np.linspace(-40, 40, 64) * np.float32(tiny), dtype)
    y = _both(codec, x)
    assert np.all(np.isfinite(y))
    if codec.name == "identity":
        assert_same_bytes(_round_trip(codec, x), x)
    elif codec.name not in ("cast", "topk") and dtype != "float16":
        assert np.all(y == 0), y


# ---------------------------------------------------------------------------
# Invalid configuration values
# ---------------------------------------------------------------------------
_B = "bucket_size must be a power of two in \\[8, 65536\\]"
INVALID_CONFIGS = {
    "QSGD": [
        ({"bits": 5}, "bits must be one of 2, 3, 4, 8"),
        ({"bits": 4.0}, "bits must be one of 2, 3, 4, 8"),
        ({"bits": True}, "bits must be one of 2, 3, 4, 8"),
        ({"bucket_size": 100}, _B),
        ({"bucket_size": 4}, _B),
        ({"bucket_size": 1 << 17}, _B),
        ({"norm": "l1"}, "norm must be one of \\('max', 'l2'\\)"),
    ],
    "OneBit": [({"bucket_size": 7}, _B), ({"bucket_size": 512.0}, _B)],
    "SignSGD": [({"bucket_size": 3}, _B)],
    "Int8": [({"bucket_size": 0}, _B)],
    "TernGrad": [({"bucket_size": -8}, _B)],
    "Natural": [
        ({"stochastic": 2}, "stochastic must be True or False"),
        ({"stochastic": "yes"}, "stochastic must be True or False"),
        ({"bucket_size": 12}, _B),
    ],
    "FP8": [
        ({"format": "e4m2"}, "format must be one of \\('e4m3', 'e5m2'\\)"),
        ({"format": "e2m1"}, "format must be one of \\('e4m3', 'e5m2'\\)"),
        ({"stochastic": 2}, "stochastic must be True or False"),
        ({"bucket_size": 100}, _B),
    ],
    "MX": [
        ({"element": "fp4"}, "element must be one of \\('e4m3', 'e5m2', 'e3m2', 'e2m3', 'e2m1'\\)"),
        ({"stochastic": "yes"}, "stochastic must be True or False"),
        ({"bucket_size": 64}, "bucket_size is the specification's block of 32 values"),
    ],
    "Cast": [
        ({"dtype": "float32"}, "dtype must be one of \\('bfloat16', 'float16'\\)"),
        ({"dtype": "int8"}, "dtype must be one of \\('bfloat16', 'float16'\\)"),
    ],
    "ThreeLC": [
        ({"sparsity": 0.5}, "sparsity must be a number in \\[1.0, 2.0\\)"),
        ({"sparsity": 2.0}, "sparsity must be a number in \\[1.0, 2.0\\)"),
        ({"sparsity": float("nan")}, "sparsity must be a number in \\[1.0, 2.0\\)"),
        ({"capacity": -1}, "capacity must be None or an int in \\[0, 2\\^31 - 1\\]"),
        ({"capacity": 1 << 31}, "capacity must be None or an int in \\[0, 2\\^31 - 1\\]"),
        ({"capacity": 1.5}, "capacity must be None or an int in \\[0, 2\\^31 - 1\\]"),
    ],
    "TopK": [
        ({"fraction": 0.0}, "fraction must be a number in \\(0, 1\\]"),
        ({"fraction": 1.5}, "fraction must be a number in \\(0, 1\\]"),
        ({"fraction": float("nan")}, "fraction must be a number in \\(0, 1\\]"),
        ({"fraction": 0.1, "k_per_bucket": (1, 8)}, "give one of fraction and k_per_bucket"),
        ({"fraction": None, "k_per_bucket": (9, 8)}, "k \\(of k_per_bucket\\) must be in"),
        ({"fraction": None, "k_per_bucket": (0, 8)}, "k \\(of k_per_bucket\\) must be in"),
        ({"fraction": None, "k_per_bucket": (2, 12)}, _B),
        ({"value_codec": C.ThreeLC()}, "value_codec must be a fixed-rate codec"),
        ({"value_codec": C.TopK()}, "value_codec must be a fixed-rate codec"),
        ({"value_codec": "qsgd"}, "value_codec must be a jaxcomp codec"),
    ],
}


def test_every_codec_has_invalid_config_rows():
    with_params = {cls.__name__ for cls in C.registered() if cls.__name__ != "Identity"}
    assert set(INVALID_CONFIGS) == with_params


@pytest.mark.parametrize(
    "name,kwargs,msg",
    [
        pytest.param(name, kw, msg, id=f"{name}-{kw}")
        for name, rows in INVALID_CONFIGS.items()
        for kw, msg in rows
    ],
)
def test_invalid_config_value(name, kwargs, msg):
    """ValueError at construction, naming the codec, the parameter and the
    allowed values; the same through jc.codecs.get."""
    cls = getattr(C, name)
    with pytest.raises(ValueError, match=f"^{name}: {msg}"):
        cls(**kwargs)
    with pytest.raises(ValueError, match=f"^{name}: {msg}"):
        C.get(cls.name, **kwargs)


@every_codec
def test_unknown_parameter(codec):
    """An unknown keyword: TypeError (the dataclass constructor's); through
    jc.codecs.get, as a keyword or in a spec string, a TypeError naming the
    codec, the key and every parameter the codec has."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        type(codec)(bogus=1)
    cls = type(codec)
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    says = f"^jc\\.codecs\\.get: {cls.__name__} \\('{cls.name}'\\) "
    says += "has no parameter 'bogus'" if fields else "takes no parameters; got 'bogus'"
    for args, kwargs in (((cls.name,), {"bogus": 1}), ((f"{cls.name}:bogus=1",), {})):
        with pytest.raises(TypeError, match=says) as e:
            C.get(*args, **kwargs)
        if fields:
            assert f"its parameters are {', '.join(fields)}" in str(e.value)
