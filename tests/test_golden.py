"""Golden vectors: the wire bytes of fixed inputs are pinned, on every backend.

tests/golden/vectors.json holds, per case, an input tensor, a PRNG seed, the
bytes of ``wire.to_bytes(codec.encode(x, key))`` and the bytes of
``codec.decode(wire.from_bytes(wire))``; tests/golden/make_golden.py wrote it.
A failure here means the bytes of a codec or of the wire format changed: that
is a format change (docs/wire-format.md, "Versioning"), never a test to update
casually.
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp import wire

_DOC = json.loads((pathlib.Path(__file__).parent / "golden" / "vectors.json").read_text())
CASES = _DOC["cases"]
_DTYPES = {
    "float32": np.dtype(jnp.float32),
    "bfloat16": np.dtype(jnp.bfloat16),
    "float16": np.dtype(jnp.float16),
}


def _from_le_hex(h: str, dtype: np.dtype, shape) -> np.ndarray:
    u = np.dtype(f"u{dtype.itemsize}")
    raw = np.frombuffer(bytes.fromhex(h), dtype=u.newbyteorder("<"))
    return raw.astype(u).view(dtype).reshape(shape)


def _le_hex(a: np.ndarray) -> str:
    u = np.dtype(f"u{a.dtype.itemsize}")
    return np.ascontiguousarray(a).reshape(-1).view(u).astype(u.newbyteorder("<")).tobytes().hex()


def _codec(case):
    return jc.codecs.get(case["codec"], **case["params"])


def _key(case):
    if case["seed"] is None:
        return None
    key = jax.random.key(case["seed"], impl="threefry2x32")
    assert [int(w) for w in jax.random.key_data(key)] == case["key_words"]
    return key


def _input(case):
    return jnp.asarray(_from_le_hex(case["input"], _DTYPES[case["dtype"]], tuple(case["shape"])))


def _first_of_each_codec():
    seen, ids = set(), set()
    for c in CASES:
        if c["codec"] not in seen:
            seen.add(c["codec"])
            ids.add(c["id"])
    return ids


_OP_BY_OP = _first_of_each_codec()


def _backends(case):
    """The kernel and the twin under jit; for the first case of each codec
    also the twin op by op (eager), the path of un-jitted user code, where
    XLA compiles each operation alone (no fusion, no FMA contraction across
    operations). The kernel runs the same custom call eagerly and jitted."""
    ffi_skip = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
    out = [
        pytest.param(case, "ffi", "jit", marks=ffi_skip, id=f"{case['id']}-ffi"),
        pytest.param(case, "xla", "jit", id=f"{case['id']}-xla"),
    ]
    if case["id"] in _OP_BY_OP:
        out.append(pytest.param(case, "xla", "eager", id=f"{case['id']}-xla-eager"))
    return out


def _run(fn, backend, mode):
    fn = functools.partial(fn, backend=backend)
    return jax.jit(fn) if mode == "jit" else fn


def test_file_matches_reader_version():
    assert _DOC["format_version"] == wire.VERSION
    assert len({c["id"] for c in CASES}) == len(CASES)


def test_every_codec_has_golden_vectors():
    assert {c["codec"] for c in CASES} == set(jc.codecs.names())


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_wire_bytes_parse_and_reserialize(case):
    b = bytes.fromhex(case["wire"])
    p = wire.from_bytes(b)
    assert p.codec == _codec(case)
    assert p.shape == tuple(case["shape"])
    assert p.dtype == _DTYPES[case["dtype"]]
    assert wire.to_bytes(p) == b
    assert len(b) == wire.serialized_nbytes(p.codec, p.shape, p.dtype)


@pytest.mark.parametrize(("case", "backend", "mode"), [p for c in CASES for p in _backends(c)])
def test_golden_bytes(case, backend, mode):
    codec = _codec(case)
    payload = _run(codec.encode, backend, mode)(_input(case), _key(case))
    assert wire.to_bytes(payload).hex() == case["wire"]
    golden = wire.from_bytes(bytes.fromhex(case["wire"]))
    out = _run(golden.codec.decode, backend, mode)(golden)
    assert out.shape == tuple(case["shape"])
    assert np.dtype(out.dtype) == _DTYPES[case["dtype"]]
    assert _le_hex(np.asarray(out)) == case["decoded"]
