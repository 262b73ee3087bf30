"""Versioned byte format of a payload (docs/wire-format.md).

A message is one :class:`~jaxcomp.Payload` in a self-describing,
little-endian layout::

    fixed header (20 bytes)   magic "JXCP", version, codec id, tensor dtype,
                              ndim, #params, #arrays, total message length
    codec params              int64 each
    tensor dims               uint64 each
    array descriptors         (uint8 dtype code, uint64 element count) each
    array data                raw little-endian bytes, in the codec's layout order
    trailer                   uint32 CRC-32 (zlib) of every byte before it

:func:`from_bytes` treats its input as untrusted: every field is checked
against the buffer length before it is used, and every way the bytes can be
wrong is reported as :class:`~jaxcomp.WireFormatError`.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs import base as codec_base
from jaxcomp.errors import WireFormatError
from jaxcomp.payload import Payload

__all__ = [
    "MAGIC",
    "VERSION",
    "from_bytes",
    "header_nbytes",
    "parse",
    "serialized_nbytes",
    "to_bytes",
]

MAGIC = b"JXCP"
VERSION = 1

# magic, version, codec id, tensor dtype code, ndim, #params, #arrays, total length
_FIXED = struct.Struct("<4sHHBBBBQ")
_PARAM = struct.Struct("<q")
_DIM = struct.Struct("<Q")
_DESCRIPTOR = struct.Struct("<BQ")
_CRC = struct.Struct("<I")

FIXED_NBYTES = _FIXED.size  # 20
DESCRIPTOR_NBYTES = _DESCRIPTOR.size  # 9
CRC_NBYTES = _CRC.size  # 4

MAX_NDIM = 64  # numpy's limit on array rank
MAX_ELEMENTS = (1 << 32) - 1  # the codecs' limit on input size (codecs/base.py)

# One code table for the tensor's dtype and the arrays' dtypes; 0 is never valid.
# Codes are permanent: new dtypes get new codes, retired ones are never reused.
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(jnp.float32): 1,
    np.dtype(jnp.bfloat16): 2,
    np.dtype(jnp.float16): 3,
    np.dtype(np.uint8): 4,
    np.dtype(np.int8): 5,
    np.dtype(np.uint16): 6,
    np.dtype(np.int16): 7,
    np.dtype(np.uint32): 8,
    np.dtype(np.int32): 9,
}
_DTYPES_BY_CODE = {code: dt for dt, code in DTYPE_CODES.items()}
_TENSOR_DTYPE_CODES = frozenset(DTYPE_CODES[np.dtype(d)] for d in codec_base.SUPPORTED_DTYPES)
# Raw bytes are moved as little-endian unsigned integers of the same width, so the
# format does not depend on the host's byte order (bfloat16 has no '<' spelling).
_UINT_OF_SIZE = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


def _dtype_code(dtype: Any, what: str) -> int:
    try:
        return DTYPE_CODES[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"to_bytes: {what} has dtype {dtype!r}, which has no wire code") from None


def header_nbytes(codec: codec_base.Codec, shape: tuple[int, ...], dtype: Any = jnp.float32) -> int:
    """Bytes of a message before the array data (fixed header, params, dims, descriptors).

    Args:
      codec: the codec of the payload.
      shape: shape of the original tensor.
      dtype: dtype of the original tensor.
    Returns:
      The header size in bytes; the whole message is this plus
      ``codec.wire_nbytes(shape, dtype)`` plus the 4-byte CRC trailer.
    """
    narrays = len(codec.layout(tuple(shape), dtype))
    return (
        FIXED_NBYTES
        + _PARAM.size * len(codec.wire_params())
        + _DIM.size * len(shape)
        + DESCRIPTOR_NBYTES * narrays
    )


def serialized_nbytes(
    codec: codec_base.Codec, shape: tuple[int, ...], dtype: Any = jnp.float32
) -> int:
    """Length of ``to_bytes(payload)`` for a payload of this codec, shape and dtype.

    Args:
      codec: the codec of the payload.
      shape: shape of the original tensor.
      dtype: dtype of the original tensor.
    Returns:
      The message size in bytes, header and CRC trailer included.
    """
    return header_nbytes(codec, shape, dtype) + codec.wire_nbytes(tuple(shape), dtype) + CRC_NBYTES


def to_bytes(payload: Payload) -> bytes:
    """Serializes one payload to the versioned wire format.

    Args:
      payload: a :class:`~jaxcomp.Payload` with concrete arrays (not traced)
        that match ``payload.codec.layout(payload.shape, payload.dtype)``
        exactly: one tensor, no batch axes.
    Returns:
      The message as ``bytes``.
    Raises:
      TypeError: ``payload`` is not a Payload, or its arrays are traced.
      ValueError: the arrays do not match the codec's layout, or a field does
        not fit the format.
    """
    if not isinstance(payload, Payload):
        raise TypeError(f"to_bytes expects a jaxcomp.Payload, got {type(payload).__name__}")
    codec_id, params = _codec_fields(payload.codec)
    tensor_code = _tensor_code(payload)
    descriptors, chunks = _array_fields(payload)
    shape = payload.shape
    header_len = (
        FIXED_NBYTES
        + _PARAM.size * len(params)
        + _DIM.size * len(shape)
        + DESCRIPTOR_NBYTES * len(chunks)
    )
    total = header_len + sum(len(c) for c in chunks) + CRC_NBYTES
    parts = [
        _FIXED.pack(
            MAGIC, VERSION, codec_id, tensor_code, len(shape), len(params), len(chunks), total
        ),
        *(_PARAM.pack(p) for p in params),
        *(_DIM.pack(d) for d in shape),
        *descriptors,
        *chunks,
    ]
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def _codec_fields(codec: codec_base.Codec) -> tuple[int, tuple[int, ...]]:
    """The codec's id and wire params, checked to fit their header fields."""
    name = type(codec).__name__
    codec_id = int(codec.codec_id)
    if not 0 <= codec_id <= 0xFFFF:
        raise ValueError(f"to_bytes: codec id {codec_id} of {name} does not fit in uint16")
    params = tuple(int(p) for p in codec.wire_params())
    if len(params) > 0xFF:
        raise ValueError(f"to_bytes: {name} has {len(params)} wire params; at most 255 fit")
    for p in params:
        if not -(1 << 63) <= p < (1 << 63):
            raise ValueError(f"to_bytes: {name} wire param {p} does not fit in int64")
    return codec_id, params


def _tensor_code(payload: Payload) -> int:
    """The tensor's dtype code, after checking its shape fits the format."""
    shape = payload.shape
    if len(shape) > MAX_NDIM:
        raise ValueError(f"to_bytes: tensor rank {len(shape)} exceeds {MAX_NDIM}")
    if any(d < 0 or d > MAX_ELEMENTS for d in shape) or payload.size > MAX_ELEMENTS:
        raise ValueError(
            f"to_bytes: shape {shape} is outside the format's limit of 2^32 - 1 elements"
        )
    if payload.dtype not in codec_base.SUPPORTED_DTYPES:
        raise ValueError(
            f"to_bytes: tensor dtype {payload.dtype.name} is not one of float32, bfloat16, float16"
        )
    return DTYPE_CODES[payload.dtype]


def _array_fields(payload: Payload) -> tuple[list[bytes], list[bytes]]:
    """(descriptors, data) of the payload's arrays, each checked against the
    codec's layout, the data as little-endian bytes."""
    name = type(payload.codec).__name__
    layout = payload.codec.layout(payload.shape, payload.dtype)
    arrays = payload.arrays
    if list(arrays) != list(layout):
        raise ValueError(
            f"to_bytes: {name} payload arrays are {list(arrays)}, expected {list(layout)} in that order"
        )
    descriptors, chunks = [], []
    for k, spec in layout.items():
        a = arrays[k]
        if isinstance(a, jax.core.Tracer):
            raise TypeError(
                f"to_bytes: payload array {k!r} is traced; serialize concrete arrays, outside jit"
            )
        a = np.asarray(a)
        if a.shape != tuple(spec.shape) or a.dtype != np.dtype(spec.dtype):
            raise ValueError(
                f"to_bytes: {name} payload array {k!r} is {a.dtype.name}{list(a.shape)}, expected "
                f"{np.dtype(spec.dtype).name}{list(spec.shape)} (batched payloads: serialize "
                "each tensor's payload separately)"
            )
        descriptors.append(_DESCRIPTOR.pack(_dtype_code(a.dtype, f"array {k!r}"), a.size))
        wire_uint = _UINT_OF_SIZE[a.dtype.itemsize]
        chunks.append(
            np.ascontiguousarray(a)
            .reshape(-1)
            .view(wire_uint.newbyteorder("="))
            .astype(wire_uint)
            .tobytes()
        )
    return descriptors, chunks


# Readers see the same few configurations and shapes over and over: both
# are pure functions of hashable values (a failure is not cached, and raises
# again on the next call).
@functools.lru_cache(maxsize=256)
def _codec_of(cls, params: tuple[int, ...]):
    codec = cls.from_wire_params(params)
    return codec, tuple(int(p) for p in codec.wire_params())


@functools.lru_cache(maxsize=1024)
def _layout_of(codec, shape: tuple[int, ...], dtype: np.dtype):
    return tuple(
        (k, np.dtype(spec.dtype), math.prod(spec.shape), tuple(spec.shape))
        for k, spec in codec.layout(shape, dtype).items()
    )


def _fail(msg: str) -> WireFormatError:
    return WireFormatError(f"from_bytes: {msg}")


def from_bytes(b: bytes | bytearray | memoryview, *, max_elements: int | None = None) -> Payload:
    """Parses and validates one message produced by :func:`to_bytes`.

    Checks, in order: the magic, the version, that every header field lies
    inside the buffer, that the declared length equals the buffer's length,
    that the array sizes add up to it, the CRC, the codec id and parameters,
    the tensor's dtype and shape, and that the arrays match
    ``codec.layout(shape, dtype)`` in number, dtype and size.

    Args:
      b: the message; any bytes-like object of exactly one message.
      max_elements: if given, the most elements the tensor may have. The
        format's own limit (2^32 - 1) bounds what the reader allocates by
        the message's length, but not what decoding allocates: a sparse or
        variable-rate payload (TopK, ThreeLC with a small capacity) of a few
        bytes can declare 2^32 - 1 elements. A reader of untrusted messages
        sets this to what it is prepared to decode.
    Returns:
      A :class:`~jaxcomp.Payload` whose arrays are fresh ``jax.Array`` s, ready
      for ``payload.codec.decode``.
    Raises:
      WireFormatError: on any malformed, truncated, inconsistent or unknown
        input (and never another exception for bad bytes).
    """
    codec, shape, dtype, arrays = parse(b, max_elements=max_elements)
    return Payload(codec, shape, dtype, {k: jnp.asarray(a) for k, a in arrays.items()})


def parse(b: bytes | bytearray | memoryview, *, max_elements: int | None = None):
    """:func:`from_bytes` without the conversion to ``jax.Array``: the same
    checks, in the same order, with the same errors.

    Args:
      b: the message; any bytes-like object of exactly one message.
      max_elements: as for :func:`from_bytes`.
    Returns:
      ``(codec, shape, dtype, arrays)``, the arrays as NumPy arrays in
      layout order (copies, in host byte order).
    Raises:
      WireFormatError: as :func:`from_bytes`.
    """
    try:
        buf = memoryview(b).cast("B")
    except TypeError as e:
        raise WireFormatError(
            f"from_bytes expects a contiguous bytes-like object, got {type(b).__name__}"
        ) from e
    # First that the bytes are intact, then that they mean something.
    h = _read_frame(buf)
    codec = _read_codec(h.codec_id, h.params)
    dtype = _read_tensor(h.tensor_code, h.shape, max_elements)
    try:
        layout = _layout_of(codec, h.shape, dtype)
    except Exception as e:
        raise _fail(f"{codec!r} has no layout for shape {list(h.shape)} {dtype.name}: {e}") from e
    if len(layout) != len(h.descriptors):
        raise _fail(
            f"{codec!r} on {dtype.name}{list(h.shape)} has {len(layout)} arrays "
            f"({', '.join(k for k, *_ in layout)}), the message has {len(h.descriptors)}"
        )
    arrays = _read_arrays(buf, h.header_len, codec, h.shape, dtype, layout, h.descriptors)
    return codec, h.shape, dtype, arrays


class _Frame(NamedTuple):
    """A message's header fields, read and checked against its length."""

    codec_id: int
    tensor_code: int
    params: tuple[int, ...]
    shape: tuple[int, ...]
    descriptors: list[tuple[np.dtype, int]]
    header_len: int


def _read_frame(buf: memoryview) -> _Frame:
    """The header of the message in ``buf``: magic, version, every field
    inside the buffer, the declared and actual lengths, the CRC."""
    n = len(buf)
    if n < len(MAGIC):
        raise _fail(f"truncated: {n} bytes, shorter than the {len(MAGIC)}-byte magic")
    if bytes(buf[:4]) != MAGIC:
        raise _fail(f"bad magic {bytes(buf[:4])!r}, expected {MAGIC!r}")
    if n < FIXED_NBYTES + CRC_NBYTES:
        raise _fail(
            f"truncated: {n} bytes, shorter than the smallest message ({FIXED_NBYTES + CRC_NBYTES})"
        )
    _, version, codec_id, tensor_code, ndim, nparams, narrays, total = _FIXED.unpack_from(buf, 0)
    if version != VERSION:
        raise _fail(f"unsupported format version {version}; this reader knows version {VERSION}")
    if total != n:
        if total > n:
            raise _fail(f"truncated: header declares {total} bytes, got {n}")
        raise _fail(f"{n - total} trailing bytes after the {total}-byte message")
    if ndim > MAX_NDIM:
        raise _fail(f"tensor rank {ndim} exceeds {MAX_NDIM}")
    header_len = (
        FIXED_NBYTES + _PARAM.size * nparams + _DIM.size * ndim + DESCRIPTOR_NBYTES * narrays
    )
    if header_len + CRC_NBYTES > n:
        raise _fail(
            f"truncated: {nparams} params, {ndim} dims and {narrays} arrays need a "
            f"{header_len}-byte header, but the message is {n} bytes"
        )
    off = FIXED_NBYTES
    params = tuple(_PARAM.unpack_from(buf, off + _PARAM.size * i)[0] for i in range(nparams))
    off += _PARAM.size * nparams
    shape = tuple(_DIM.unpack_from(buf, off + _DIM.size * i)[0] for i in range(ndim))
    off += _DIM.size * ndim
    descriptors = _read_descriptors(buf, off, narrays)
    data_len = sum(count * dt.itemsize for dt, count in descriptors)  # Python ints: no overflow
    if header_len + data_len + CRC_NBYTES != n:
        raise _fail(
            f"inconsistent sizes: the array descriptors declare {data_len} data bytes after a "
            f"{header_len}-byte header, but the message is {n} bytes"
        )
    (crc,) = _CRC.unpack_from(buf, n - CRC_NBYTES)
    actual = zlib.crc32(buf[: n - CRC_NBYTES])
    if crc != actual:
        raise _fail(f"CRC mismatch: trailer says {crc:#010x}, the data gives {actual:#010x}")
    return _Frame(codec_id, tensor_code, params, shape, descriptors, header_len)


def _read_descriptors(buf: memoryview, off: int, narrays: int) -> list[tuple[np.dtype, int]]:
    """The ``(dtype, count)`` of each array, from ``narrays`` descriptors at ``off``."""
    descriptors = []
    for i in range(narrays):
        code, count = _DESCRIPTOR.unpack_from(buf, off + DESCRIPTOR_NBYTES * i)
        dt = _DTYPES_BY_CODE.get(code)
        if dt is None:
            raise _fail(f"array {i} has unknown dtype code {code}")
        descriptors.append((dt, count))
    return descriptors


def _read_codec(codec_id: int, params: tuple[int, ...]) -> codec_base.Codec:
    """The registered codec of ``codec_id``, built from canonical ``params``."""
    cls = codec_base.by_id(codec_id)
    if cls is None:
        known = [(c.codec_id, c.name) for c in codec_base.registered()]
        raise _fail(f"unknown codec id {codec_id}; known: {known}")
    # The codec's own code runs on untrusted values here; whatever it raises is
    # a rejection of those values.
    try:
        codec, canonical = _codec_of(cls, params)
    except Exception as e:
        raise _fail(f"{cls.__name__} rejects wire params {list(params)}: {e}") from e
    if canonical != params:
        raise _fail(
            f"{cls.__name__} wire params {list(params)} are not canonical (they read as "
            f"{codec!r}, whose params are {list(canonical)})"
        )
    return codec


def _read_tensor(tensor_code: int, shape: tuple[int, ...], max_elements: int | None) -> np.dtype:
    """The tensor's dtype, after checking its shape against the format's and
    the caller's limits."""
    if tensor_code not in _TENSOR_DTYPE_CODES:
        raise _fail(
            f"tensor dtype code {tensor_code} is not float32 (1), bfloat16 (2) or float16 (3)"
        )
    size = 1
    for d in shape:
        if d > MAX_ELEMENTS:
            raise _fail(f"dimension {d} of shape {list(shape)} exceeds 2^32 - 1")
        size *= d
    if size > MAX_ELEMENTS:
        raise _fail(f"shape {list(shape)} has {size} elements, over the limit of 2^32 - 1")
    if max_elements is not None and size > max_elements:
        raise _fail(
            f"shape {list(shape)} has {size} elements, over the caller's max_elements={max_elements}"
        )
    return _DTYPES_BY_CODE[tensor_code]


def _read_arrays(
    buf, header_len, codec, shape, dtype, layout, descriptors
) -> dict[str, np.ndarray]:
    """Checks each descriptor against the layout and copies the arrays out
    of ``buf`` into host-order NumPy arrays."""
    arrays = {}
    off = header_len
    for (k, want_dt, want_count, want_shape), (dt, count) in zip(layout, descriptors, strict=True):
        if dt != want_dt:
            raise _fail(f"array {k!r} of {codec!r} is {dt.name}, expected {want_dt.name}")
        if count != want_count:
            raise _fail(
                f"array {k!r} of {codec!r} on {dtype.name}{list(shape)} has {count} elements, "
                f"expected {want_count}"
            )
        raw = np.frombuffer(buf, dtype=_UINT_OF_SIZE[dt.itemsize], count=count, offset=off)
        off += count * dt.itemsize
        # astype copies (out of the caller's buffer) and converts to host order.
        host = raw.astype(raw.dtype.newbyteorder("="), copy=True).view(dt)
        arrays[k] = host.reshape(want_shape)
    return arrays
