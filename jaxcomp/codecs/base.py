"""The codec protocol: what every codec declares and implements.

A codec is a frozen, hashable config (usable as a static argument) with pure
``encode``/``decode``. Besides the two functions it *declares* what it is,
and every layer above reads the declaration instead of guessing from
attributes:

- :attr:`Codec.rate`, a :class:`Rate`: how the size of its payload behaves,
  which decides how the collectives move it (fixed-size payloads; one
  fixed-capacity buffer of variable length, moved in capacity tiers; sparse
  index/value pairs, moved by SparCML's algorithms; or linear payloads that
  can be summed on the wire).
- :meth:`Codec.arrays`, its payload layout: the name, element count and dtype
  of every array for a tensor of ``n`` elements. It is the one place a
  payload size is written in Python: the kernel calls take their output
  shapes from it, ``decode`` and the wire format check payloads against it,
  and the byte accounting of the collectives, the optax telemetry and the
  HLO tests derive from it (:meth:`Codec.wire_nbytes`).
- :meth:`Codec.split_granularity`, whether a payload can be cut into the
  payloads of consecutive chunks (and stacked payloads decoded as one).
- The protocol of its rate kind: :class:`VariableRateCodec` and
  :class:`SparseCodec` add the methods their collectives need.

Each codec lives in one file, ``jaxcomp/codecs/<name>.py``: the config, its
layout, the calls of its FFI kernels and their pure-JAX twins (the oracle the
kernels are tested against, byte for byte). Importing :mod:`jaxcomp.codecs`
imports every module of the package and registers every codec class it
defines, by name and by wire id.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp._ffi import Backend, resolve_backend
from jaxcomp.ops import dispatch, ffi_call, ieee
from jaxcomp.ops.rng import seed_words
from jaxcomp.payload import Payload

SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
MAX_ELEMENTS = (1 << 32) - 1

_REGISTRY: dict[str, type[Codec]] = {}
_BY_ID: dict[int, type[Codec]] = {}


class Rate(enum.Enum):
    """What a codec's payload is, as the collectives see it.

    - ``FIXED``: every array's size is a function of the tensor's shape;
      the payload is moved as it is (allgather, two-phase, ring).
    - ``VARIABLE``: the payload holds one fixed-capacity buffer of a stream
      whose length depends on the data (3LC's zero-run encoding); the
      collectives agree on the longest stream and move the payload in the
      smallest capacity tier that holds it (:class:`VariableRateCodec`).
    - ``SPARSE``: the payload is index/value pairs; the collectives use
      SparCML's sparse all-reduce algorithms (:class:`SparseCodec`).
    - ``LINEAR``: payloads are all-reducible: the element-wise sum of the
      payload arrays of several tensors is the payload of their sum (a
      linear map, with any randomness shared by every device), so the
      collectives sum the payloads with one ``psum`` and decode once.
    """

    FIXED = "fixed"
    VARIABLE = "variable"
    SPARSE = "sparse"
    LINEAR = "linear"


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: makes a codec reachable by name and by wire id."""
    for table, k in ((_REGISTRY, cls.name), (_BY_ID, cls.codec_id)):
        if k in table:
            raise RuntimeError(f"codec {k!r} registered twice")
        table[k] = cls
    return cls


def registered() -> tuple[type[Codec], ...]:
    """Every registered codec class, by wire id."""
    return tuple(_BY_ID[k] for k in sorted(_BY_ID))


def names() -> list[str]:
    """Names of every registered codec."""
    return sorted(_REGISTRY)


def by_id(codec_id: int) -> type[Codec] | None:
    """The codec class of a wire id, or None."""
    return _BY_ID.get(codec_id)


_ALIASES = {
    "bf16": ("cast", {"dtype": "bfloat16"}),
    "fp16": ("cast", {"dtype": "float16"}),
    "1bit": ("onebit", {}),
    "3lc": ("threelc", {}),
    "sign": ("signsgd", {}),
    "mxfp8": ("mx", {"element": "e4m3"}),
    "mxfp6": ("mx", {"element": "e2m3"}),
    "mxfp4": ("mx", {"element": "e2m1"}),
}
_ALIASES["bfloat16"] = _ALIASES["bf16"]
_ALIASES["float16"] = _ALIASES["f16"] = _ALIASES["fp16"]
_ALIASES["1-bit"] = _ALIASES["1bit"]

_SPEC_HELP = (
    "a codec (jc.codecs.QSGD(bits=4)), a codec class (jc.codecs.QSGD: its defaults) or a "
    "spec string ('qsgd:bits=4,bucket_size=512', 'bf16', 'topk:fraction=0.01')"
)


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside parentheses."""
    out, depth, cur = [], 0, []
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            raise ValueError(f"jc.codecs.get: unbalanced parentheses in {text!r}")
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"jc.codecs.get: unbalanced parentheses in {text!r}")
    return [*out, "".join(cur)]


def _parse_value(text: str) -> Any:
    t = text.strip()
    if t.startswith("(") and t.endswith(")"):  # a nested codec: value_codec=(qsgd:bits=8)
        return get(t[1:-1])
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    if re.fullmatch(r"\d+x\d+", low):
        return tuple(int(v) for v in low.split("x"))
    return t


def _format_value(v: Any) -> str:
    """A parameter value as :func:`_parse_value` reads it back."""
    if v is None:
        return "none"
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    if isinstance(v, tuple) and all(isinstance(e, (int, np.integer)) for e in v):
        return "x".join(str(int(e)) for e in v)
    if isinstance(v, Codec):
        return f"({v.spec})"
    return str(v)


def get(name: Any, **params: Any) -> Codec:
    """A codec by name and parameters, or by a spec string.

    Args:
      name: a codec name (``"qsgd"``, ``"onebit"``, ...: see :func:`names`),
        an alias (``"bf16"``, ``"fp16"``, ``"1bit"``, ``"3lc"``, ``"sign"``,
        ``"mxfp8"``, ``"mxfp6"`` (E2M3), ``"mxfp4"``),
        or a spec string ``"name:key=value,key=value"`` (e.g.
        ``"qsgd:bits=4,bucket_size=512"``, ``"topk:k_per_bucket=8x512"``,
        ``"topk:fraction=0.01,value_codec=(qsgd:bits=8)"``), as
        :attr:`Codec.spec` and ``str(codec)`` write it; or a codec class
        (``jc.codecs.QSGD``, constructed with ``params``) or a codec
        (returned as it is, or with ``params`` replaced).
      **params: the codec's parameters (they override those of the string).
    Returns:
      The codec, equal to the one its class would construct.
    Raises:
      ValueError: an unknown name, with the known ones and the aliases
        listed and the closest one suggested; or a bad parameter value, as
        the codec's constructor reports it.
      TypeError: a parameter the codec does not have (in the string or the
        keywords), with its parameters listed and the closest one
        suggested; or anything else than the forms above.
    """
    if isinstance(name, Codec):
        _check_keys(type(name), params, None)
        return dataclasses.replace(name, **params) if params else name
    if isinstance(name, type) and issubclass(name, Codec):
        _check_keys(name, params, None)
        return name(**params)
    if not isinstance(name, str):
        raise TypeError(f"jc.codecs.get: expected {_SPEC_HELP}; got {type(name).__name__}")
    head, _, rest = name.partition(":")
    spec: dict[str, Any] = {}
    if rest.strip():
        for item in _split_top(rest, ","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(
                    f"jc.codecs.get: cannot read {item!r} in {name!r}; write "
                    "name:key=value,... (e.g. 'qsgd:bits=4,bucket_size=512')"
                )
            spec[key.strip()] = _parse_value(value)
    head = head.strip().lower()
    if head in _ALIASES:
        head, alias_params = _ALIASES[head]
        spec = {**alias_params, **spec}
    try:
        cls = _REGISTRY[head]
    except KeyError:
        raise ValueError(
            f"jc.codecs.get: unknown codec {head!r}{_did_you_mean(head, [*_REGISTRY, *_ALIASES])}; "
            f"known: {', '.join(names())} (aliases: "
            f"{', '.join(f'{a} = {_alias_target(a)}' for a in sorted(_ALIASES))}); "
            "parameters go after a colon: 'qsgd:bits=4'"
        ) from None
    _check_keys(cls, spec, name)
    _check_keys(cls, params, None)
    return cls(**{**spec, **params})


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    """A hint naming the closest of ``choices`` to ``word``, or ""."""
    close = difflib.get_close_matches(word.lower(), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_keys(cls: type[Codec], keys: Any, spec: str | None) -> None:
    """TypeError for a key that is not a parameter of ``cls``, naming the
    codec, the key, the parameters and the closest one. ``spec``: the spec
    string the keys come from (None: keyword arguments)."""
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in keys:
        if key in fields:
            continue
        where = f" in {spec!r}" if spec is not None else ""
        if not fields:
            raise TypeError(
                f"jc.codecs.get: {cls.__name__} ({cls.name!r}) takes no parameters; "
                f"got {key!r}{where}"
            )
        raise TypeError(
            f"jc.codecs.get: {cls.__name__} ({cls.name!r}) has no parameter {key!r}{where}"
            f"{_did_you_mean(key, fields)}; its parameters are {', '.join(fields)}"
            f"{_example(cls)}"
        )


def _example(cls: type[Codec]) -> str:
    """The spec string of ``cls``'s defaults, as an example, or ""."""
    try:
        return f", as in {cls().spec!r}"
    except (TypeError, ValueError):
        return ""


def _alias_target(alias: str) -> str:
    head, params = _ALIASES[alias]
    return head + (
        ":" + ",".join(f"{k}={_format_value(v)}" for k, v in params.items()) if params else ""
    )


def as_codec(value: Any, who: str) -> Codec:
    """``value`` as a codec, for the functions that take one: a codec, a
    codec class (its defaults) or a spec string (:func:`get`)."""
    if isinstance(value, (Codec, str)) or (isinstance(value, type) and issubclass(value, Codec)):
        return get(value)
    raise TypeError(f"{who}: the codec must be {_SPEC_HELP}; got {type(value).__name__}")


def check_int(owner: str, name: str, value: Any, allowed: str, ok: bool) -> None:
    """Raises the project's standard ValueError for a bad structural parameter."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not ok:
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")


def check_bucket_size(owner: str, bucket_size: Any) -> None:
    """Bucket sizes are powers of two in [8, 65536] (whole bytes of 1-bit codes)."""
    ok = isinstance(bucket_size, (int, np.integer)) and 8 <= bucket_size <= 65536
    ok = ok and (int(bucket_size) & (int(bucket_size) - 1)) == 0
    check_int(owner, "bucket_size", bucket_size, "a power of two in [8, 65536]", ok)


def num_buckets(n: int, bucket: int) -> int:
    """Buckets of ``bucket`` values covering ``n`` (the last one zero padded)."""
    return -(-n // bucket)


def index_dtype(limit: int) -> np.dtype:
    """The smallest unsigned integer dtype holding every index in ``[0, limit)``."""
    for dt in (np.uint8, np.uint16):
        if limit <= 1 << (8 * np.dtype(dt).itemsize):
            return np.dtype(dt)
    return np.dtype(np.uint32)


def array(count: int, dtype: Any) -> jax.ShapeDtypeStruct:
    """One payload array of the layout: ``count`` elements of ``dtype``."""
    return jax.ShapeDtypeStruct((int(count),), np.dtype(dtype))


_OPS = frozenset({"encode", "decode", "decode_sum", "encode_feedback"})


class Kernels(NamedTuple):
    """Which FFI kernels a codec class has, on which platform, and which of
    the CUDA ones ``backend="auto"`` runs: the one declaration that
    :meth:`Codec.route` resolves every call by.

    Operations: "encode", "decode", "decode_sum" (decode-and-accumulate of
    stacked float32 payloads, :meth:`Codec.decode_sum`) and
    "encode_feedback" (error feedback's compression in one pass,
    :meth:`Codec.encode_feedback`). ``cpu`` and ``cuda`` name the kernels
    the CPU and CUDA modules register (``jaxcomp_<name>_<op>``;
    tests/test_feedback.py and tests/test_pipeline.py read them from the
    sources); ``cuda_auto``, the CUDA kernels that "auto" runs on GPUs,
    each faster there than the twin XLA compiles and fuses into its
    neighbours (docs/gpu.md, "Kernel or twin on the GPU: the rule"). A new
    codec's default: its CUDA encode and decode, until a GPU has timed them.
    """

    cpu: frozenset[str] = frozenset({"encode", "decode"})
    cuda: frozenset[str] = frozenset({"encode", "decode"})
    cuda_auto: frozenset[str] = frozenset({"encode", "decode"})

    @classmethod
    def of(cls, cpu=("encode", "decode"), cuda=("encode", "decode"), cuda_auto=None) -> Kernels:
        """A declaration from any iterables (``cuda_auto`` default: ``cuda``'s
        encode and decode); checks that the names are operations and that
        "auto" runs only kernels that exist."""
        cpu, cuda = frozenset(cpu), frozenset(cuda)
        auto = cuda & {"encode", "decode"} if cuda_auto is None else frozenset(cuda_auto)
        for name, ops in (("cpu", cpu), ("cuda", cuda), ("cuda_auto", auto)):
            if not ops <= _OPS:
                raise ValueError(f"Kernels.{name}: unknown operations {sorted(ops - _OPS)}")
        if not auto <= cuda:
            raise ValueError(f"Kernels.cuda_auto lists kernels CUDA lacks: {sorted(auto - cuda)}")
        return cls(cpu, cuda, auto)


@dataclasses.dataclass(frozen=True)
class Codec:
    """Base class of every codec (see the module docstring for the protocol).

    A subclass is a frozen (``kw_only``) dataclass decorated with
    :func:`register`, and defines:

    - ``name``, ``codec_id`` (its permanent wire id), ``rate`` and
      ``stochastic`` (class variables; ``stochastic`` may be a property when
      it depends on the config);
    - :meth:`arrays`, its payload layout;
    - its kernels' pure-JAX twins, :meth:`twin_encode` and
      :meth:`twin_decode`: the FFI targets ``jaxcomp_<name>_encode`` and
      ``jaxcomp_<name>_decode`` take the flat tensor (and the seed words, if
      ``seeded``) and the payload arrays, with the attributes
      :meth:`kernel_attrs`, and must give the same bytes as the twins.
      Codecs whose kernels do not fit that pattern override ``_encode``
      (returning the payload arrays in layout order) and ``_decode``
      (returning the flat tensor), both through :meth:`kernel`;
    - :meth:`wire_params` / :meth:`from_wire_params` when its config is not
      just integer fields, and :meth:`split_granularity` where it applies;
    - :meth:`examples`, configurations for the tests and benchmarks.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    rate: ClassVar[Rate] = Rate.FIXED
    stochastic: ClassVar[bool] = False
    seeded: ClassVar[bool] = False  # the encode kernel takes two uint32 seed words
    #: How training with error feedback takes a second compression of a
    #: reduced (summed) chunk, as the two-phase all-reduce and the ring make:
    #: "fine" (as well as one compression), "coarse" (it trains, but loses
    #: accuracy that one compression per device does not: 1-bit codecs,
    #: 3LC with sparsity above 1) or "unsafe" (the server residual grows
    #: without bound and training diverges: TernGrad, whose ternary rounding
    #: is not a contraction). Measured in docs/accuracy.md; it decides
    #: ``algorithm="auto"`` (``jc.collectives.choose_algorithm``).
    recompression: ClassVar[str] = "fine"
    #: Whether :meth:`twin_decode` is element-wise (each value from its own
    #: bucket's codes and statistics: no scan, no scatter). Then XLA fuses
    #: the twin into whatever consumes the decoded tensor, and on GPUs the
    #: collectives decode through it (the received payloads into their
    #: sum, a device's own payload into its residual update): one pass
    #: instead of a full-size tensor written by the kernel and read again.
    #: On the CPU they use the kernels, which are faster there than
    #: XLA:CPU's fused loops (the "fused" backend of ``jaxcomp.ops``;
    #: docs/benchmarks.md, "The optimizer step").
    #: False for codecs whose decode is a scan or a scatter (3LC's
    #: zero-run decoding, top-k's sparse pairs), which keep their kernel.
    elementwise_decode: ClassVar[bool] = True
    #: The FFI kernels of the class, by platform, and the CUDA ones
    #: "auto" runs (:class:`Kernels`); :meth:`route` resolves every kernel
    #: call by it.
    kernels: ClassVar[Kernels] = Kernels()

    @property
    def cuda_auto(self) -> frozenset[str]:
        """The CUDA kernels ``backend="auto"`` runs on GPUs
        (``kernels.cuda_auto``; a codec whose measurements depend on its
        configuration refines it here)."""
        return self.kernels.cuda_auto

    @property
    def decode_sum_kernel(self) -> bool:
        """Whether the CPU kernels have ``jaxcomp_<name>_decode_sum``."""
        return "decode_sum" in self.kernels.cpu

    @property
    def cuda_decode_sum_kernel(self) -> bool:
        """Whether the CUDA kernels have it too (else GPUs run the twin)."""
        return "decode_sum" in self.kernels.cuda

    @property
    def feedback_kernel(self) -> bool:
        """Whether this codec's :meth:`encode_feedback` has the one-pass CPU
        kernel ``jaxcomp_<name>_encode_feedback``."""
        return "encode_feedback" in self.kernels.cpu

    @property
    def cuda_feedback_kernel(self) -> bool:
        """Whether it has the one-pass CUDA kernel too (``backend="ffi"``
        runs it on GPUs; "auto" where :attr:`cuda_auto` lists it)."""
        return self.feedback_kernel and "encode_feedback" in self.kernels.cuda

    def route(self, op: str, backend: str) -> tuple[Backend, bool]:
        """How a call of ``op`` runs under ``backend``: the backend
        :func:`jaxcomp.ops._dispatch.dispatch` takes and whether it runs the
        CUDA kernel on GPUs. The one place the declaration is resolved:

        - "xla": the twins everywhere;
        - "ffi" (or "auto" under ``JAXCOMP_BACKEND=ffi``): the kernel on
          every platform that has one (required on the CPU); on GPUs the
          twin where CUDA has none;
        - "auto": the CPU kernel where built; on GPUs the CUDA kernel where
          :attr:`cuda_auto` lists ``op``, else the twin;
        - "fused": the CPU kernel where built, the twin on GPUs (which XLA
          fuses into what consumes it: the collectives' decodes).
        """
        on_cuda = op in self.kernels.cuda and (op != "encode_feedback" or self.feedback_kernel)
        resolved = resolve_backend(backend)
        if resolved is Backend.FFI:
            return (Backend.FFI if on_cuda else Backend.FUSED_FFI), on_cuda
        if resolved is Backend.AUTO:
            auto = on_cuda and op in self.cuda_auto
            return (Backend.AUTO if auto else Backend.FUSED), auto
        return resolved, False

    # -- to be provided by each codec ------------------------------------
    def arrays(self, n: int, dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
        """The payload layout: the one place a payload size is written.

        Args:
          n: elements of the (flattened) tensor.
          dtype: the tensor's dtype.
        Returns:
          ``{name: ShapeDtypeStruct((count,), dtype)}`` for every payload
          array, in wire order.
        """
        raise NotImplementedError

    def twin_encode(self, flat: jax.Array, *seed: jax.Array) -> Sequence[jax.Array]:
        """The pure-JAX twin of the encode kernel.

        It is the oracle the kernels are tested against, byte for byte, and
        what runs on platforms without kernels.

        Args:
          flat: the flat tensor (float32, bfloat16 or float16).
          *seed: for ``seeded`` codecs, the two uint32 seed words.
        Returns:
          The payload arrays, in layout order.
        """
        raise NotImplementedError

    def twin_decode(self, *arrays: jax.Array, n: int, dtype: Any) -> jax.Array:
        """The pure-JAX twin of the decode kernel.

        Args:
          *arrays: the payload arrays, in layout order.
          n: elements of the tensor.
          dtype: its dtype.
        Returns:
          The flat decoded tensor.
        """
        raise NotImplementedError

    def kernel_attrs(self, decode: bool) -> dict[str, int]:
        """The integer attributes of a kernel call.

        Args:
          decode: the decode kernel's (True) or the encode kernel's (False).
        Returns:
          ``{attribute name: int}``.
        """
        return {}

    def _encode(self, flat: jax.Array, key: jax.Array | None, backend: str) -> Sequence[jax.Array]:
        backend, cuda = self.route("encode", backend)
        return self.kernel(
            backend,
            f"jaxcomp_{self.name}_encode",
            self.twin_encode,
            (flat, self.seed(key)) if self.seeded else (flat,),
            self.arrays(flat.size, flat.dtype).values(),
            cuda=cuda,
            **self.kernel_attrs(decode=False),
        )

    def _decode(self, payload: Payload, backend: str) -> jax.Array:
        def twin(*arrays):
            # The decoders' NaN rule (common.h), whatever NaN the platform's
            # arithmetic made.
            out = self.twin_decode(*arrays, n=payload.size, dtype=payload.dtype)
            return (ieee.canonical_nan(out),)

        backend, cuda = self.route("decode", backend)
        return self.kernel(
            backend,
            f"jaxcomp_{self.name}_decode",
            twin,
            tuple(payload.arrays.values()),
            (self.output(payload),),
            cuda=cuda,
            **self.kernel_attrs(decode=True),
        )[0]

    @classmethod
    def examples(cls, *, coverage: bool = False) -> tuple[Codec, ...]:
        """Configurations of this codec, for the tests, benchmarks and demo.

        Args:
          coverage: also the configurations that, between them, take every
            code path (small and odd buckets, modes, nested codecs).
        Returns:
          The configurations users pick (the first is the recommended one),
          then with ``coverage`` the others. The contract suite runs the
          coverage set; the benchmarks and the demo the first set.
        """
        return (cls(),)

    def split_granularity(self) -> int | None:
        """``g`` such that the payload of ``k * g`` values is, array by array,
        the concatenation of the payloads of its ``k`` consecutive chunks of
        ``g`` values (so a payload can be cut into per-chunk payloads by
        reshaping, and stacked payloads decoded as one). None where no such
        ``g`` exists (a whole-tensor packing or scale)."""
        return None

    def wire_params(self) -> tuple[int, ...]:
        """The configuration as int64s, for the wire header: by default the
        dataclass fields in order, which must then all be ints or bools."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, np.integer, bool, np.bool_)):
                raise TypeError(f"{type(self).__name__} must define wire_params for {f.name}")
            out.append(int(v))
        return tuple(out)

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Codec:
        """The inverse of :meth:`wire_params`.

        Args:
          params: the int64 parameters of a wire header.
        Returns:
          The codec.
        Raises:
          ValueError: parameters that no configuration of the codec has.
        """
        fields = dataclasses.fields(cls)
        if len(params) != len(fields):
            raise ValueError(
                f"{cls.__name__}: expected {len(fields)} wire params, got {len(params)}"
            )
        kwargs = {}
        for f, p in zip(fields, params, strict=True):
            kwargs[f.name] = bool(p) if f.type in ("bool", bool) else int(p)
            if f.type in ("bool", bool) and p not in (0, 1):
                raise ValueError(f"{cls.__name__}: {f.name} must be 0 or 1, got {p}")
        return cls(**kwargs)

    # -- derived from the layout -------------------------------------------
    def layout(self, shape: tuple[int, ...], dtype: Any = jnp.float32):
        """The payload layout (:meth:`arrays`) for a tensor of this shape.

        Args:
          shape: the tensor's shape.
          dtype: its dtype.
        Returns:
          ``{name: ShapeDtypeStruct}`` in wire order.
        """
        return self.arrays(int(np.prod(shape, dtype=np.int64)), np.dtype(dtype))

    def wire_nbytes(self, shape: tuple[int, ...], dtype: Any = jnp.float32) -> int:
        """Bytes on the wire for a tensor of this shape and dtype.

        Args:
          shape: the tensor's shape.
          dtype: its dtype.
        Returns:
          The payload's bytes (static; for variable-rate codecs, the whole
          capacity, an upper bound of what is used).
        """
        return sum(
            int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize
            for s in self.layout(tuple(shape), dtype).values()
        )

    def bits_per_element(
        self, shape: tuple[int, ...] = (1 << 20,), dtype: Any = jnp.float32
    ) -> float:
        """Wire bits per input element.

        Args:
          shape: the tensor's shape (default 2^20 elements).
          dtype: its dtype.
        Returns:
          ``8 * wire_nbytes / elements``.
        """
        n = int(np.prod(shape, dtype=np.int64))
        return 8.0 * self.wire_nbytes(shape, dtype) / max(n, 1)

    def used_nbytes(self, payload: Payload) -> jax.Array:
        """Bytes of a payload that carry data.

        Args:
          payload: a payload of this codec.
        Returns:
          A traced int32 (per tensor): all the bytes but for variable-rate
          codecs.
        """
        return jnp.asarray(payload.nbytes, jnp.int32)

    def payload(self, arrays: Any, shape: tuple[int, ...], dtype: Any) -> Payload:
        """A :class:`~jaxcomp.Payload` of this codec from its arrays.

        Args:
          arrays: a sequence in layout order, or a mapping by name; each may
            carry extra leading (batch) axes.
          shape: the tensor's shape.
          dtype: its dtype.
        Returns:
          The payload.
        Raises:
          ValueError: names, sizes or dtypes that do not match the layout.
        """
        layout = self.layout(tuple(shape), dtype)
        if not isinstance(arrays, dict):
            arrays = dict(zip(layout, arrays, strict=True))
        if list(arrays) != list(layout):
            raise ValueError(
                f"{type(self).__name__}: payload arrays {list(arrays)}, expected {list(layout)}"
            )
        self._check_arrays(arrays, layout, batched=True)
        return Payload(self, shape, dtype, arrays)

    def _check_arrays(self, arrays, layout, *, batched: bool, where: str = "") -> None:
        """Each array against its layout entry: same dtype, and the same
        shape (with ``batched``, the same last axis under any leading ones)."""
        for k, spec in layout.items():
            a = arrays[k]
            shape = tuple(a.shape[a.ndim - 1 :]) if batched else tuple(a.shape)
            if shape != tuple(spec.shape) or np.dtype(a.dtype) != np.dtype(spec.dtype):
                raise ValueError(
                    f"{type(self).__name__}{where}: payload array {k!r} is "
                    f"{np.dtype(a.dtype).name}{list(a.shape)}, expected "
                    f"{np.dtype(spec.dtype).name}{list(spec.shape)}"
                    + ("" if batched else " (batched payloads: use jax.vmap)")
                )

    # -- encode / decode ---------------------------------------------------
    def check_input(self, x: Any) -> jax.Array:
        """Validates a tensor to encode.

        Args:
          x: anything ``jnp.asarray`` takes.
        Returns:
          ``x`` as an array.
        Raises:
          TypeError: a dtype other than float32, bfloat16 or float16
            (checked before any conversion: a NumPy float64 array is not
            silently encoded as float32 and decoded as another dtype than
            it had; Python scalars and lists take JAX's default, float32).
          ValueError: more than 2^32 - 1 elements.
        """
        given = getattr(x, "dtype", None)
        if given is not None and np.dtype(given) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{type(self).__name__}.encode: unsupported dtype {np.dtype(given).name}; "
                "expected float32, bfloat16 or float16"
            )
        x = jnp.asarray(x)
        if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{type(self).__name__}.encode: unsupported dtype {np.dtype(x.dtype).name}; "
                "expected float32, bfloat16 or float16"
            )
        if x.size > MAX_ELEMENTS:
            raise ValueError(
                f"{type(self).__name__}.encode: inputs are limited to 2^32 - 1 elements"
            )
        return x

    @property
    def spec(self) -> str:
        """This codec as a spec string that :func:`get` reads back:
        ``"qsgd:bits=4,bucket_size=512,norm=max"`` (every parameter
        written out). ``str(codec)`` is the same string."""
        fields = [f for f in dataclasses.fields(self) if f.init]
        parts = [f"{f.name}={_format_value(getattr(self, f.name))}" for f in fields]
        return self.name + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.spec

    def encode(self, x: Any, key: jax.Array | None = None, *, backend: str = "auto") -> Payload:
        """Encodes ``x`` (float32/bfloat16/float16, any shape) into a payload.

        Args:
          x: the tensor.
          key: a JAX PRNG key; required by stochastic codecs, ignored otherwise.
          backend: "auto" (kernel where built, else the twin), "ffi", "xla"
            or "fused" (:mod:`jaxcomp.ops._dispatch`).
        Returns:
          A :class:`~jaxcomp.Payload` with static shapes (:meth:`arrays`).
        """
        x = self.check_input(x)
        backend = resolve_backend(backend)  # once: the kernel calls take it as it is
        if self.stochastic and key is None:
            raise ValueError(f"{type(self).__name__} is stochastic: encode needs a PRNG key")
        arrays = self._encode(x.reshape(-1), key if self.stochastic else None, backend)
        return self.payload(tuple(arrays), x.shape, x.dtype)

    def decode(self, payload: Payload, *, backend: str = "auto") -> jax.Array:
        """Decodes a payload of this codec.

        Args:
          payload: a :class:`~jaxcomp.Payload` of this codec, of one tensor
            (use ``jax.vmap`` for stacked payloads).
          backend: "auto" (kernel where built, else the twin), "ffi", "xla"
            or "fused" (the kernel on the CPU, the twin that XLA fuses into
            the consumer elsewhere: :mod:`jaxcomp.ops._dispatch`).
        Returns:
          The tensor, in the original shape and dtype.
        Raises:
          TypeError: not a payload.
          ValueError: a payload of another codec, or arrays that do not
            match the layout.
        """
        if not isinstance(payload, Payload):
            raise TypeError(
                f"{type(self).__name__}.decode expects a Payload, got {type(payload).__name__}"
            )
        if payload.codec != self:
            raise ValueError(f"{self!r}.decode got a payload of {payload.codec!r}")
        self._check_arrays(
            payload.arrays,
            self.layout(payload.shape, payload.dtype),
            batched=False,
            where=".decode",
        )
        backend = resolve_backend(backend)  # once: the kernel calls take it as it is
        return self._decode(payload, backend).reshape(payload.shape)

    def decode_sum(self, payloads: Payload, *, backend: str = "auto") -> jax.Array:
        """The sum of stacked float32 payloads, decoded, in row order.

        What a device does with the chunks it receives in a reduce-scatter:
        ``((row 0 + row 1) + row 2) + ...``, every row decoded as
        :meth:`decode` decodes it. Codecs with a decode-and-accumulate
        kernel (:attr:`decode_sum_kernel`: the CPU's, every fixed-rate
        codec; QSGD's on CUDA too,
        :attr:`cuda_decode_sum_kernel`) never write a decoded row out;
        the twin (and every other codec) decodes the rows, then adds them.

        Args:
          payloads: a payload of this codec whose arrays have one leading
            axis (the rows), each row a float32 tensor's.
          backend: "auto" (kernel where built, else the twin), "ffi" (the
            kernel required on the CPU, and on CUDA where the codec has
            one) or "xla".
        Returns:
          float32 ``[payloads.size]``.
        """
        if payloads.codec != self:
            raise ValueError(f"{self!r}.decode_sum got a payload of {payloads.codec!r}")
        if payloads.dtype != jnp.float32:
            raise ValueError(f"{self!r}.decode_sum takes float32 payloads, got {payloads.dtype}")
        n = payloads.size
        arrays = tuple(payloads.arrays.values())
        if arrays[0].shape[0] == 0:
            return jnp.zeros((n,), jnp.float32)

        def add_rows(rows):
            # XLA's CPU code contracts a decoded product and the add it
            # feeds into an FMA, which the kernels never do. The barrier
            # keeps the rows out of the sum's fusion only where XLA keeps it
            # until it fuses (jax 0.12; jax 0.10.2's XLA:CPU removes it
            # first), so a twin decode must also give values that no
            # contraction changes (Int8: int8.exact_parts).
            rows = lax.optimization_barrier(rows.reshape(-1, n).astype(jnp.float32))
            total = rows[0]
            for i in range(1, rows.shape[0]):
                total = total + rows[i]
            return ieee.canonical_nan(total)  # inf + -inf: the decoders' NaN rule

        def twin(*arrays):
            return (
                add_rows(
                    jax.vmap(lambda *a: self.twin_decode(*a, n=n, dtype=jnp.float32))(*arrays)
                ),
            )

        if not self.decode_sum_kernel:
            return add_rows(jax.vmap(lambda p: self.decode(p, backend=backend))(payloads))
        backend, cuda = self.route("decode_sum", backend)
        return self.kernel(
            backend,
            f"jaxcomp_{self.name}_decode_sum",
            twin,
            arrays,
            (jax.ShapeDtypeStruct((n,), jnp.float32),),
            cuda=cuda,
            **self.kernel_attrs(decode=True),
        )[0]

    def encode_feedback(
        self,
        x: Any,
        residual: jax.Array,
        key: jax.Array | None = None,
        *,
        backend: str = "auto",
    ) -> tuple[Payload, jax.Array]:
        """Error feedback's compression: the payload of ``x + residual`` and
        what it leaves out, the new residual.

        The rule, the same on every backend: ``acc = float32(x) + residual``
        (one float32 add per element), the payload is :meth:`encode` of the
        float32 ``acc``, and the new residual is ``acc - decode(payload)``
        in float32, bit for bit what those three calls give. Codecs with a
        fused CPU kernel (:attr:`feedback_kernel`) compute it in one pass
        over the gradient and the residual, each bucket in cache, with no
        ``acc`` and no decoded tensor written out; elsewhere (other codecs,
        GPUs, ``backend="xla"``) it is the three calls, which XLA fuses
        where it can. Int8, QSGD, OneBit, SignSGD, Natural, FP8, MX and
        TernGrad have the one-pass kernel on CUDA as well
        (:attr:`cuda_feedback_kernel`), which ``backend="ffi"`` runs, and
        "auto" where :attr:`cuda_auto` lists "encode_feedback".

        Args:
          x: the gradient (float32, bfloat16 or float16, any shape).
          residual: float32, ``x``'s shape: what earlier steps left out.
          key: a JAX PRNG key; required by stochastic codecs.
          backend: "auto" (the fused kernel on the CPU where built, on
            GPUs where :attr:`cuda_auto` says, else the three calls' twins),
            "ffi" (the fused kernel required on the CPU, and on CUDA where
            the codec has one), "xla" (the twins) or "fused" (the fused
            kernel on the CPU, the twins on GPUs).
        Returns:
          ``(payload, new_residual)``: a float32 payload of ``x``'s shape,
          and the float32 new residual.
        """
        x = self.check_input(x)
        residual = jnp.asarray(residual)
        if residual.shape != x.shape or residual.dtype != jnp.float32:
            raise ValueError(
                f"{type(self).__name__}.encode_feedback: the residual must be float32 of the "
                f"gradient's shape {x.shape}, got {residual.dtype}{list(residual.shape)}"
            )
        resolve_backend(backend)  # the values every codec method takes, checked
        if self.stochastic and key is None:
            raise ValueError(f"{type(self).__name__} is stochastic: encode needs a PRNG key")
        key = key if self.stochastic else None
        flat, res = x.reshape(-1), residual.reshape(-1)
        if not self.feedback_kernel:
            return self._feedback_by_calls(flat, res, key, backend, x.shape)
        resolved, cuda = self.route("encode_feedback", backend)
        if resolved is Backend.XLA:
            return self._feedback_by_calls(flat, res, key, resolved, x.shape)
        return self._feedback_fused(flat, res, key, resolved, x.shape, cuda)

    def _feedback_fused(self, flat, res, key, backend, shape, cuda):
        """:meth:`encode_feedback` by the fused kernel where ``backend``
        runs it (the twins' three calls elsewhere)."""
        n = flat.size
        layout = self.arrays(n, jnp.float32)

        def twin(flat, res, *seed):
            acc = flat.astype(jnp.float32) + res
            arrays = self.twin_encode(acc, *seed)
            hat = ieee.canonical_nan(self.twin_decode(*arrays, n=n, dtype=jnp.float32))
            return (*arrays, acc - hat)

        outs = self.kernel(
            backend,
            f"jaxcomp_{self.name}_encode_feedback",
            twin,
            (flat, res, self.seed(key)) if self.seeded else (flat, res),
            (*layout.values(), jax.ShapeDtypeStruct((n,), jnp.float32)),
            cuda=cuda,
            **self.kernel_attrs(decode=False),
        )
        payload = self.payload(tuple(outs[:-1]), shape, jnp.float32)
        return payload, outs[-1].reshape(shape)

    def _feedback_by_calls(self, flat, res, key, backend, shape):
        """:meth:`encode_feedback` as three calls: add, encode, decode."""
        acc = flat.astype(jnp.float32) + res
        payload = self.encode(acc.reshape(shape), key, backend=backend)
        hat = self.decode(payload, backend=backend).reshape(-1)
        return payload, (acc - hat).reshape(shape)

    # -- for the codecs' own use ---------------------------------------------
    @staticmethod
    def seed(key: jax.Array | None) -> jax.Array:
        """The seed words the kernels and twins draw random bits from.

        Args:
          key: a JAX PRNG key, or None (a deterministic call).
        Returns:
          uint32[2] (zeros for None).
        """
        return jnp.zeros((2,), jnp.uint32) if key is None else seed_words(key)

    @staticmethod
    def kernel(
        backend: str,
        target: str,
        twin: Callable[..., Sequence[jax.Array]],
        args: Sequence[jax.Array],
        results: Sequence[jax.ShapeDtypeStruct],
        scratch: Sequence[jax.ShapeDtypeStruct] = (),
        cuda: bool | None = None,
        **attrs: int,
    ) -> tuple[jax.Array, ...]:
        """Runs an FFI kernel or its pure-JAX twin, as ``backend`` says
        (:func:`jaxcomp.ops._dispatch.dispatch`).

        Args:
          backend: "auto", "ffi" or "xla".
          target: the FFI target's name (``jaxcomp_<op>``).
          twin: the twin, called with ``args``; returns the results.
          args: the operands.
          results: the results' shapes and dtypes (from the layout).
          scratch: work buffers the kernel takes as extra results after
            ``results``; dropped from what it returns (the twin has none).
          cuda: whether "auto" and "fused" run the CUDA kernel on GPUs
            (:attr:`cuda_auto`); None: "auto" does, "fused" does not.
          **attrs: the kernel's integer attributes.
        Returns:
          The results.
        """
        results = tuple(results)

        def run_kernel(*a):
            return ffi_call(target, results + tuple(scratch), *a, **attrs)[: len(results)]

        return dispatch(backend, run_kernel, lambda *a: tuple(twin(*a)), *args, cuda=cuda)

    @staticmethod
    def output(payload: Payload) -> jax.ShapeDtypeStruct:
        """The decode kernel's result for a payload.

        Args:
          payload: a payload.
        Returns:
          The flat tensor's shape and dtype.
        """
        return jax.ShapeDtypeStruct((payload.size,), payload.dtype)


class BucketedCodec(Codec):
    """A codec with a scale (or a few statistics) per bucket of
    ``bucket_size`` values, a field of the subclass validated here; by
    default its payloads split at bucket boundaries and its kernels take
    the bucket size as their attribute."""

    bucket_size: int

    def __post_init__(self):
        check_bucket_size(type(self).__name__, self.bucket_size)

    @classmethod
    def examples(cls, *, coverage: bool = False) -> tuple[Codec, ...]:
        """The default configuration; for coverage also the smallest bucket
        (8 values: one byte of 1-bit codes)."""
        return (cls(), cls(bucket_size=8)) if coverage else (cls(),)

    def num_buckets(self, n: int) -> int:
        """Buckets covering ``n`` values (the last one zero padded).

        Args:
          n: elements of the tensor.
        Returns:
          ``ceil(n / bucket_size)``.
        """
        return num_buckets(n, self.bucket_size)

    def split_granularity(self) -> int | None:
        return self.bucket_size

    def kernel_attrs(self, decode: bool) -> dict[str, int]:
        return {"bucket_size": self.bucket_size}


class VariableRateCodec(Codec):
    """Protocol of ``Rate.VARIABLE`` codecs: the payload has one
    fixed-capacity byte buffer (:meth:`stream_capacity`) holding a stream whose
    length depends on the data. The collectives agree on the longest stream
    (:meth:`stream_length`), move every payload in the smallest of
    :meth:`capacity_tiers` that holds it (:meth:`with_capacity`), and decode
    at that capacity; nothing is ever truncated, since the last tier is the
    codec's own capacity, which every stream fits."""

    rate: ClassVar[Rate] = Rate.VARIABLE

    def stream_capacity(self, n: int) -> int:
        """The codec's own buffer size.

        Args:
          n: elements of the tensor.
        Returns:
          Bytes of the stream buffer.
        """
        raise NotImplementedError

    def stream_length(self, payload: Payload) -> jax.Array:
        """The bytes a payload's stream needs.

        Args:
          payload: a payload of this codec (any leading axes).
        Returns:
          int32, per tensor: the complete stream's length, the smallest
          capacity that holds it.
        """
        raise NotImplementedError

    def with_capacity(self, payload: Payload, nbytes: int) -> Payload:
        """The payload in a buffer of another capacity.

        Args:
          payload: a payload of this codec (any leading axes; traced arrays
            are fine).
          nbytes: the new capacity (static).
        Returns:
          A payload of the codec configured with that capacity: the buffer
          cut or zero-padded, marked overflowed (never silently truncated)
          when the stream does not fit.
        """
        raise NotImplementedError

    def capacity_tiers(self, n: int) -> tuple[int, ...]:
        """The static capacities the collectives may move a payload in.

        Args:
          n: elements of the tensor.
        Returns:
          Capacities in bytes, ascending; the last is
          :meth:`stream_capacity`, the codec's own, which every stream fits.
        """
        return (self.stream_capacity(n),)


class SparseCodec(Codec):
    """Protocol of ``Rate.SPARSE`` codecs: the payload is ``entries(n)``
    index/value pairs (values possibly through a nested fixed-rate
    ``value_codec``, which the sparse all-reduce also uses for its dense
    stage)."""

    rate: ClassVar[Rate] = Rate.SPARSE
    elementwise_decode: ClassVar[bool] = False  # a scatter of the pairs
    value_codec: Codec | None

    def entries(self, n: int) -> int:
        """The number of pairs in a payload.

        Args:
          n: elements of the tensor.
        Returns:
          Index/value pairs (padding entries included).
        """
        raise NotImplementedError

    def pairs(self, payload: Payload, *, backend: str = "auto") -> tuple[jax.Array, jax.Array]:
        """A payload's pairs, for the sparse all-reduce.

        Args:
          payload: a payload of this codec (any leading axes).
          backend: for decoding the values ("auto", "ffi" or "xla").
        Returns:
          ``(indices, values)``: global flat int32 indices, ascending per
          tensor, and float32 values, ``[..., entries]``; entries that carry
          nothing read index ``n`` and value 0.
        """
        raise NotImplementedError


def import_all() -> None:
    """Imports every module of :mod:`jaxcomp.codecs` (which registers the
    codec classes they define)."""
    import importlib
    import pkgutil

    import jaxcomp.codecs as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.name.startswith("_") and mod.name != "base":
            importlib.import_module(f"jaxcomp.codecs.{mod.name}")
