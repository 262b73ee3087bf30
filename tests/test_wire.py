"""The wire format: round trips, and rejection of every malformed byte stream.

The structural tests build messages with an encoder written here from
docs/wire-format.md (``_build``), independent of jaxcomp/wire.py, and edit one
field at a time with a valid CRC, so that the checks behind the CRC are what
they exercise.
"""

from __future__ import annotations

import functools
import pathlib
import re
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxcomp as jc
from jaxcomp import WireFormatError, wire

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
DTYPES = [F32, BF16, F16]
# The dtype code table of docs/wire-format.md.
CODES = {
    F32: 1,
    BF16: 2,
    F16: 3,
    np.dtype(np.uint8): 4,
    np.dtype(np.int8): 5,
    np.dtype(np.uint16): 6,
    np.dtype(np.int16): 7,
    np.dtype(np.uint32): 8,
    np.dtype(np.int32): 9,
}
KEY = jax.random.key(0)

# The spec-level round trip below runs every codec's user configurations,
# each on one of these (shape, dtype) pairs in turn; the contract suite runs
# the round trip of every coverage configuration.
_SHAPES = [((37,), F32), ((3, 5, 7), BF16), ((), F16), ((2, 0, 3), F32), ((37,), F16)]
ROUNDTRIP_CASES = [
    pytest.param(
        codec, *_SHAPES[i % len(_SHAPES)], id=f"{codec!r}-{_SHAPES[i % len(_SHAPES)][1].name}"
    )
    for i, codec in enumerate(c for cls in jc.codecs.registered() for c in cls.examples())
]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def _encoder(codec):
    # jit: the twins are slow op by op, and this is how codecs run in training.
    return jax.jit(lambda x, key: codec.encode(x, key))


@functools.cache
def _decoder(codec):
    return jax.jit(codec.decode)


def _input(shape, dtype, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    return jnp.asarray(x.astype(dtype))


@functools.cache
def _payload(codec, shape=(37,), dtype=F32):
    return _encoder(codec)(_input(shape, dtype), KEY)


@functools.cache
def _message(codec, shape=(37,), dtype=F32) -> bytes:
    return wire.to_bytes(_payload(codec, shape, dtype))


def _raw(a) -> bytes:
    """The array's bytes (the host is little-endian, as the wire is)."""
    return np.asarray(a).tobytes()


# -- an independent encoder, straight from the spec ---------------------------


def _build(
    *,
    codec_id,
    params,
    tensor_code,
    dims,
    arrays,
    version=1,
    magic=b"JXCP",
    total=None,
    extra=b"",
):
    """A message from its fields; ``arrays`` is a list of (dtype code, count, data)."""
    head = struct.pack(
        "<4sHHBBBB", magic, version, codec_id, tensor_code, len(dims), len(params), len(arrays)
    )
    rest = b"".join(
        [
            *(struct.pack("<q", p) for p in params),
            *(struct.pack("<Q", d) for d in dims),
            *(struct.pack("<BQ", code, count) for code, count, _ in arrays),
            *(data for _, _, data in arrays),
            extra,
        ]
    )
    if total is None:
        total = len(head) + 8 + len(rest) + 4
    body = head + struct.pack("<Q", total) + rest
    return body + struct.pack("<I", zlib.crc32(body))


def _fields(payload):
    return {
        "codec_id": payload.codec.codec_id,
        "params": list(payload.codec.wire_params()),
        "tensor_code": CODES[payload.dtype],
        "dims": list(payload.shape),
        "arrays": [
            (CODES[np.dtype(a.dtype)], int(np.asarray(a).size), _raw(a))
            for a in payload.arrays.values()
        ],
    }


def _edited(codec, shape=(37,), dtype=F32, **changes):
    return _build(**{**_fields(_payload(codec, shape, dtype)), **changes})


def _recrc(b: bytes) -> bytes:
    return b[:-4] + struct.pack("<I", zlib.crc32(b[:-4]))


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize(("codec", "shape", "dtype"), ROUNDTRIP_CASES)
def test_roundtrip(codec, shape, dtype):
    p = _encoder(codec)(_input(shape, dtype), KEY)
    b = wire.to_bytes(p)
    assert isinstance(b, bytes)
    assert len(b) == wire.serialized_nbytes(codec, shape, dtype)
    assert len(b) == wire.header_nbytes(codec, shape, dtype) + p.nbytes + 4
    q = wire.from_bytes(b)
    assert q.codec == codec and q.shape == shape and q.dtype == dtype
    assert list(q.arrays) == list(p.arrays)
    for k, a in p.arrays.items():
        assert isinstance(q[k], jax.Array)
        assert q[k].shape == a.shape and q[k].dtype == a.dtype
        assert _raw(q[k]) == _raw(a), k
    assert _raw(_decoder(codec)(q)) == _raw(_decoder(codec)(p))
    assert wire.to_bytes(q) == b
    assert b == _build(**_fields(p)), "to_bytes disagrees with the spec's field layout"


def test_dtype_codes_are_the_documented_ones():
    assert dict(wire.DTYPE_CODES) == CODES
    assert (wire.MAGIC, wire.VERSION) == (b"JXCP", 1)


def _documented_codec_ids() -> dict[str, int]:
    """The codec id table of docs/wire-format.md ("| id | `name` | ...")."""
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "wire-format.md").read_text()
    section = doc.split("## Codecs", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", section, flags=re.M)
    return {name: int(i) for i, name in rows}


def test_codec_ids_are_the_documented_ones():
    """Every registered codec has the id the spec gives it, and the spec
    lists no codec that is not registered (ids are permanent)."""
    ids = {cls.name: cls.codec_id for cls in jc.codecs.registered()}
    assert ids == _documented_codec_ids()


def test_header_of_a_known_message():
    codec = jc.codecs.OneBit(bucket_size=8)
    p = _encoder(codec)(jnp.arange(-4.0, 5.0, dtype=jnp.float32).reshape(3, 3), None)
    b = wire.to_bytes(p)
    # magic, version 1, codec 2, float32, ndim 2, 1 param, 2 arrays, 84 bytes in all
    assert b[:20] == bytes.fromhex("4a58435001000200010201025400000000000000")
    assert b[20:28] == struct.pack("<q", 8)  # bucket_size
    assert b[28:44] == struct.pack("<QQ", 3, 3)  # dims
    assert b[44:62] == struct.pack("<BQBQ", 4, 2, 1, 4)  # bits: uint8[2], means: float32[4]
    assert b[62:80] == _raw(p["bits"]) + _raw(p["means"])
    assert b[80:] == struct.pack("<I", zlib.crc32(b[:80]))
    assert len(b) == 84


def _doc_dump(title: str) -> bytes:
    doc = (pathlib.Path(__file__).parents[1] / "docs" / "wire-format.md").read_text()
    block = doc.split(title, 1)[1].split("```", 2)[1]
    return bytes.fromhex("".join(line[6:] for line in block.strip().splitlines()))


def test_examples_in_the_spec_match_the_code():
    onebit = jc.codecs.OneBit(bucket_size=8)
    p = _encoder(onebit)(jnp.arange(-4.0, 5.0, dtype=jnp.float32).reshape(3, 3), None)
    assert _doc_dump("## Example 1") == wire.to_bytes(p)
    qsgd = jc.codecs.QSGD(bits=4, bucket_size=8)
    x = jnp.asarray([0.5, -1.0, 0.25, 0.0, 2.0], jnp.float16)
    assert _doc_dump("## Example 2") == wire.to_bytes(_encoder(qsgd)(x, jax.random.key(7)))


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy", "memoryview-u32"])
def test_accepts_bytes_like(kind):
    b = _message(jc.codecs.Int8(bucket_size=16))
    arg = {
        "bytes": lambda: b,
        "bytearray": lambda: bytearray(b),
        "memoryview": lambda: memoryview(b"xx" + b)[2:],
        "numpy": lambda: np.frombuffer(b, np.uint8),
        "memoryview-u32": lambda: memoryview(bytearray(b + b"\0" * (-len(b) % 4))).cast("I"),
    }[kind]()
    if kind == "memoryview-u32" and len(b) % 4:
        with pytest.raises(WireFormatError, match="trailing"):
            wire.from_bytes(arg)
    else:
        assert wire.to_bytes(wire.from_bytes(arg)) == b


def test_result_does_not_alias_the_buffer():
    codec = jc.codecs.Identity()
    buf = bytearray(_message(codec))
    p = wire.from_bytes(buf)
    before = _raw(p["values"])
    buf[-8:-4] = b"\xff\xff\xff\xff"
    assert _raw(p["values"]) == before


def test_rejects_non_contiguous_and_non_bytes():
    b = _message(jc.codecs.Identity())
    with pytest.raises(WireFormatError, match="contiguous"):
        wire.from_bytes(memoryview(b + b)[::2])
    with pytest.raises(WireFormatError):
        wire.from_bytes("JXCP")
    with pytest.raises(WireFormatError):
        wire.from_bytes(None)


def test_to_bytes_rejects_batched_and_malformed_payloads():
    codec = jc.codecs.Int8(bucket_size=16)
    x = jnp.ones((2, 37), jnp.float32)
    batched = jax.vmap(codec.encode)(x)  # leading axis from vmap; metadata is per tensor
    with pytest.raises(ValueError, match="batched"):
        wire.to_bytes(batched)
    p = codec.encode(x[0])
    with pytest.raises(ValueError, match="arrays are"):
        wire.to_bytes(jc.Payload(codec, p.shape, p.dtype, {"q": p["q"]}))
    with pytest.raises(ValueError, match="expected"):
        wire.to_bytes(
            jc.Payload(
                codec, p.shape, p.dtype, {**p.arrays, "scales": p["scales"].astype(jnp.float16)}
            )
        )
    with pytest.raises(TypeError, match="Payload"):
        wire.to_bytes(p.arrays)


def test_to_bytes_rejects_traced_payloads():
    codec = jc.codecs.Identity()
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda x: wire.to_bytes(codec.encode(x)))(jnp.ones(3))


# -- structural corruption, with a valid CRC ----------------------------------

QSGD = jc.codecs.QSGD(bits=4, bucket_size=16)
IDENT = jc.codecs.Identity()
CAST = jc.codecs.Cast("bfloat16")


def _edit_fixed(b: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(b)
    struct.pack_into(fmt, b, offset, value)
    return _recrc(bytes(b))


BAD = {
    "bad-magic": (lambda: b"JXCQ" + _message(IDENT)[4:], "bad magic"),
    "bad-magic-short": (lambda: b"XY", "truncated"),
    "empty": (lambda: b"", "truncated"),
    "magic-only": (lambda: b"JXCP" + b"\0" * 10, "truncated"),
    "version-0": (lambda: _edited(IDENT, version=0), "unsupported format version 0"),
    "version-2": (lambda: _edited(IDENT, version=2), "unsupported format version 2"),
    "unknown-codec": (lambda: _edited(IDENT, codec_id=999), "unknown codec id 999"),
    "qsgd-bits-5": (lambda: _edited(QSGD, params=[5, 16, 0]), "QSGD rejects wire params"),
    "qsgd-bucket-12": (lambda: _edited(QSGD, params=[4, 12, 0]), "bucket_size"),
    "qsgd-norm-2": (lambda: _edited(QSGD, params=[4, 16, 2]), "QSGD rejects wire params"),
    "qsgd-norm-minus-1": (lambda: _edited(QSGD, params=[4, 16, -1]), "norm code"),
    "qsgd-huge-param": (lambda: _edited(QSGD, params=[-(1 << 63), 16, 0]), "rejects"),
    "qsgd-too-few-params": (lambda: _edited(QSGD, params=[4, 16]), "rejects"),
    "qsgd-too-many-params": (lambda: _edited(QSGD, params=[4, 16, 0, 0]), "rejects"),
    "identity-extra-param": (lambda: _edited(IDENT, params=[0]), "expected 0 wire params"),
    "cast-target-2": (lambda: _edited(CAST, params=[2]), "Cast rejects"),
    "cast-target-minus-2": (lambda: _edited(CAST, params=[-2]), "dtype code"),
    "tensor-dtype-uint8": (lambda: _edited(IDENT, tensor_code=4), "tensor dtype code 4"),
    "tensor-dtype-0": (lambda: _edited(IDENT, tensor_code=0), "tensor dtype code 0"),
    "tensor-dtype-vs-array": (lambda: _edited(IDENT, tensor_code=3), "is float32, expected float16"),
    "dims-vs-size": (lambda: _edited(IDENT, dims=[38]), "has 37 elements, expected 38"),
    "dims-more-buckets": (lambda: _edited(QSGD, dims=[49]), "has 24 elements, expected 32"),
    "dims-rank": (lambda: _edited(IDENT, dims=[37, 2]), "expected 74"),
    "dims-over-u32": (lambda: _edited(IDENT, dims=[1 << 32, 0]), "exceeds 2\\^32 - 1"),
    "dims-product": (lambda: _edited(IDENT, dims=[1 << 16, 1 << 16]), "over the limit"),
    "dims-u64-max": (lambda: _edited(IDENT, dims=[(1 << 64) - 1]), "exceeds"),
    "dims-rank-65": (lambda: _edited(IDENT, dims=[1] * 65), "rank 65 exceeds 64"),
    "array-dtype-int8-for-uint8": (
        lambda: _edited(QSGD, arrays=[(5, *_fields(_payload(QSGD))["arrays"][0][1:]), _fields(_payload(QSGD))["arrays"][1]]),
        "'codes' .* is int8, expected uint8",
    ),
    "array-dtype-unknown": (lambda: _edited(IDENT, arrays=[(200, 37, b"\0" * 37)]), "unknown dtype code 200"),
    "array-dtype-0": (lambda: _edited(IDENT, arrays=[(0, 37, b"")]), "unknown dtype code 0"),
    "array-missing": (lambda: _edited(QSGD, arrays=_fields(_payload(QSGD))["arrays"][:1]), "has 2 arrays"),
    "array-extra": (lambda: _edited(IDENT, arrays=[*_fields(_payload(IDENT))["arrays"], (4, 1, b"\0")]), "has 1 arrays"),
    "array-count-swapped": (
        lambda: _edited(IDENT, dims=[148], arrays=[(4, 148, _fields(_payload(IDENT))["arrays"][0][2])]),
        "'values' .* is uint8, expected float32",
    ),
    "array-count-huge": (lambda: _edited(IDENT, arrays=[(1, 1 << 60, b"")]), "inconsistent sizes"),
    "array-count-u64-max": (lambda: _edited(IDENT, arrays=[(9, (1 << 64) - 1, b"")]), "inconsistent sizes"),
    "trailing-byte": (lambda: _message(IDENT) + b"\0", "1 trailing bytes"),
    "trailing-bytes-in-length": (lambda: _edited(IDENT, extra=b"\0\0\0"), "inconsistent sizes"),
    "truncated-one": (lambda: _message(IDENT)[:-1], "truncated"),
    "total-too-small": (lambda: _edited(IDENT, total=30), "trailing bytes"),
    "total-too-big": (lambda: _edited(IDENT, total=1 << 62), "truncated: header declares"),
    "ndim-255": (lambda: _edit_fixed(_message(IDENT), 9, "<B", 255), "rank 255 exceeds 64"),
    "nparams-255": (lambda: _edit_fixed(_message(IDENT), 10, "<B", 255), "truncated"),
    "narrays-0": (lambda: _edit_fixed(_message(IDENT), 11, "<B", 0), "inconsistent sizes"),
    "bad-crc": (lambda: _message(IDENT)[:-4] + b"\0\0\0\0", "CRC mismatch"),
    "data-flip": (lambda: bytes([*_message(IDENT)[:-5], _message(IDENT)[-5] ^ 1, *_message(IDENT)[-4:]]), "CRC mismatch"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_rejects(name):
    make, match = BAD[name]
    with pytest.raises(WireFormatError, match=match) as info:
        wire.from_bytes(make())
    assert str(info.value).startswith("from_bytes")
    assert isinstance(info.value, ValueError)


def test_edited_header_builder_is_faithful():
    # The structural tests are only meaningful if an unedited _build is accepted.
    for codec in (QSGD, IDENT, CAST):
        assert _edited(codec) == _message(codec)


def test_valid_crc_but_cast_dtype_change_is_a_valid_message():
    # Cast's layout does not depend on the tensor's dtype: relabeling float32 as
    # float16 is a different, valid message, not corruption the format can see.
    p = wire.from_bytes(_edited(CAST, tensor_code=3))
    assert p.dtype == F16


# -- fuzzing -------------------------------------------------------------------

FUZZ_CODECS = [
    jc.codecs.QSGD(bits=2, bucket_size=8, norm="l2"),
    jc.codecs.OneBit(bucket_size=8),
    jc.codecs.Int8(bucket_size=8),
    jc.codecs.Cast("float16"),
    jc.codecs.Identity(),
]
FUZZ_CASES = [(c, (3, 7), BF16) for c in FUZZ_CODECS] + [
    (jc.codecs.Identity(), (), F16),
    (jc.codecs.QSGD(bits=8, bucket_size=8), (0,), F32),
]


def _fuzz_message(i):
    return _message(*FUZZ_CASES[i])


def _only_wire_format_error(b):
    """from_bytes either rejects ``b`` with WireFormatError or parses it canonically."""
    try:
        p = wire.from_bytes(b)
    except WireFormatError:
        return False
    assert wire.to_bytes(p) == bytes(b)
    return True


@pytest.mark.parametrize("i", range(len(FUZZ_CASES)))
def test_every_truncation_is_rejected(i):
    b = _fuzz_message(i)
    for n in range(len(b)):
        with pytest.raises(WireFormatError):
            wire.from_bytes(b[:n])


@FUZZ
@given(
    i=st.integers(0, len(FUZZ_CASES) - 1),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_byte_flips_are_rejected(i, flips):
    b = bytearray(_fuzz_message(i))
    positions = {}
    for pos, mask in flips:
        positions[pos % len(b)] = positions.get(pos % len(b), 0) ^ mask
    if not any(positions.values()):
        return
    for pos, mask in positions.items():
        b[pos] ^= mask
    # CRC-32 detects every error burst of up to 32 bits; a few scattered byte flips
    # slip past it with probability 2^-32.
    with pytest.raises(WireFormatError):
        wire.from_bytes(bytes(b))


@FUZZ
@given(data=st.binary(max_size=300))
def test_garbage_is_rejected(data):
    with pytest.raises(WireFormatError):
        wire.from_bytes(data)


@FUZZ
@given(data=st.binary(max_size=300), version=st.integers(0, 3))
def test_garbage_after_magic_is_rejected(data, version):
    with pytest.raises(WireFormatError):
        wire.from_bytes(b"JXCP" + struct.pack("<H", version) + data)


@FUZZ
@given(
    i=st.integers(0, len(FUZZ_CASES) - 1),
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=3),
    header_only=st.booleans(),
)
def test_edits_with_valid_crc_are_rejected_or_canonical(i, edits, header_only):
    b = bytearray(_fuzz_message(i))
    span = min(len(b) - 4, 80) if header_only else len(b) - 4
    for pos, value in edits:
        b[pos % span] = value
    _only_wire_format_error(_recrc(bytes(b)))


def _maybe(strategy):
    return st.none() | strategy


@FUZZ
@given(
    i=st.integers(0, len(FUZZ_CASES) - 1),
    codec_id=_maybe(st.integers(0, 6)),
    params=_maybe(
        st.lists(st.integers(-3, 600) | st.integers(-(1 << 63), (1 << 63) - 1), max_size=4)
    ),
    tensor_code=_maybe(st.integers(0, 10)),
    dims=_maybe(st.lists(st.integers(0, 70) | st.integers(0, (1 << 64) - 1), max_size=4)),
    codes=_maybe(st.lists(st.integers(0, 10), max_size=3)),
    counts=_maybe(st.lists(st.integers(0, 600), max_size=3)),
)
def test_well_framed_edited_fields_are_rejected_or_canonical(
    i, codec_id, params, tensor_code, dims, codes, counts
):
    # Some fields of a valid message replaced, with array data sized to match the
    # descriptors and a valid CRC, so that the checks past the framing and the
    # CRC (codec, params, dtype, dims, layout) are the ones exercised.
    fields = _fields(_payload(*FUZZ_CASES[i]))
    for name, value in [
        ("codec_id", codec_id),
        ("params", params),
        ("tensor_code", tensor_code),
        ("dims", dims),
    ]:
        if value is not None:
            fields[name] = value
    arrays = fields["arrays"]
    if codes is not None or counts is not None:
        codes = codes if codes is not None else [a[0] for a in arrays]
        counts = counts if counts is not None else [a[1] for a in arrays]
        by_code = {v: k for k, v in CODES.items()}
        fields["arrays"] = [
            (c, n, b"\x5a" * (n * by_code[c].itemsize if c in by_code else 0))
            for c, n in zip(codes, counts, strict=False)
        ]
    _only_wire_format_error(_build(**fields))


# -- huge declared sizes: rejected before anything of that size is allocated ---


def _peak_alloc(fn) -> int:
    """Peak bytes traced by tracemalloc while ``fn`` runs (NumPy's data
    buffers included)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


_HUGE = {
    # A 2^40-element tensor, arrays sized as its layout says.
    "dims 2^40": dict(dims=[1 << 20, 1 << 20]),
    "dims 2^40, one dim": dict(dims=[1 << 40]),
    # The descriptors declare 2^40 elements (of a real 37-element tensor).
    "array 2^40 elements": dict(arrays=[(1, 1 << 40, b"\0" * 148)]),
    "dims and array 2^40": dict(dims=[1 << 40], arrays=[(1, 1 << 40, b"\0" * 148)]),
}


@pytest.mark.parametrize("case", list(_HUGE))
def test_huge_element_count_is_rejected_without_allocating_it(case):
    b = _edited(IDENT, **_HUGE[case])

    def read():
        with pytest.raises(
            WireFormatError,
            match=r"exceeds 2\^32 - 1|over the limit of 2\^32 - 1|inconsistent sizes",
        ):
            wire.from_bytes(b)

    assert _peak_alloc(read) < 1 << 20


def test_max_elements_bounds_what_a_small_message_decodes_to():
    """A ThreeLC payload of fixed capacity has the same arrays for any n: a
    header edited to 2^32 - 1 elements still frames and checks, and would
    decode into 16 GiB. ``max_elements`` rejects it before that."""
    codec = jc.codecs.ThreeLC(capacity=8)
    b = _edited(codec, shape=(100,), dims=[(1 << 32) - 1])
    p = wire.from_bytes(b)  # accepted: the format's limit is 2^32 - 1
    assert p.size == (1 << 32) - 1 and p.nbytes == 8 + 9
    for read in (wire.from_bytes, wire.parse):
        with pytest.raises(WireFormatError, match="over the caller's max_elements=1048576"):
            read(b, max_elements=1 << 20)
    assert wire.from_bytes(_message(codec, (100,)), max_elements=100).size == 100
