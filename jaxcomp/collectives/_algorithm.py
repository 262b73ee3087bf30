"""The algorithm protocol: what every all-reduce algorithm declares, and how
a name finds it.

An algorithm is a frozen dataclass registered by name with
:func:`register`, one file per algorithm (``_allgather.py``,
``_two_phase.py``, ...; the package imports them all). Besides
:meth:`Algorithm.run` it *declares* what the public functions need, so
that none of them switches on names:

- its server residual: :meth:`Algorithm.state_size` and
  :meth:`Algorithm.state_positions`;
- its bytes on the wire: :meth:`Algorithm.operand_nbytes` (and
  :meth:`Algorithm.send_nbytes`, derived from it by default);
- its part in ``algorithm="auto"``: :attr:`Algorithm.auto_rank` and
  :meth:`Algorithm.chosen`;
- whether it compresses a reduced chunk again with the codec
  (:attr:`Algorithm.recompresses`, which :meth:`recompression_warning`
  reads);
- what the cost model of :mod:`jaxcomp.planning` needs: the codecs it is
  ranked for (:attr:`Algorithm.planned_rates`), its collectives in program
  order with their bytes (:meth:`Algorithm.collectives`, including the
  ``pmax`` of a capacity tier), the encodes and decodes it runs
  (:meth:`Algorithm.kernel_calls`), and what its first compression
  encodes (:meth:`Algorithm.compressed_values`).

What one call shares travels as a :class:`Context` (codec, axes, key,
divisor), built once by ``jc.psum`` / ``jc.pmean``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._axes import Axes
from jaxcomp.codecs.base import Codec, Rate
from jaxcomp.collectives._decode import decode_own
from jaxcomp.collectives._order import after
from jaxcomp.collectives.feedback import accumulate, compress_kept, kept

# (value: the sum / div, float32, flat; sent: float32, flat; the new server
# residual, or None): what every algorithm's run returns. run_feedback
# returns the same with what the input kept (float32, flat) in sent's place.
FlatReduced = tuple[jax.Array, jax.Array, jax.Array | None]

_REGISTRY: dict[str, Algorithm] = {}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of an algorithm, as a cost model sees it.

    Attributes:
      kind: as in :func:`~jaxcomp.collectives.operand_nbytes` ("all-gather",
        "all-to-all", "collective-permute", "all-reduce", or
        "reduce-scatter" for a float32 ``psum_scatter``).
      operand: this device's operand bytes.
      axis: the axis it runs over, an index into the call's axes: 0 for one
        axis; 0 (slow) or 1 (fast) for ``(slow, fast)`` axes.
    """

    kind: str
    operand: float
    axis: int = 0


class KernelCall(NamedTuple):
    """One encode or decode an all-reduce runs on one device."""

    what: str  # "encode" or "decode"
    values: int  # values encoded, or decoded
    codec: Codec


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """What every step of one all-reduce shares.

    Attributes:
      codec: the codec.
      axes: the axes reduced over, bound (names and sizes).
      key: this device's PRNG key (``_keys.device_key``); None for
        deterministic codecs.
      div: 1 for ``psum``, the number of devices for ``pmean``: the sum is
        divided by it before its last compression, so the mean costs no
        extra pass; ``sent`` stays in units of the sum.
      dep: results the call's first collective must wait for (a pytree, or
        None; :func:`~jaxcomp.collectives.after`): set by
        ``compress_gradients`` to the previous bucket's, so that every
        device enters the buckets' collectives in one order.
      all_to_all: how an all-to-all travels: "auto", "native" or
        "pairwise" (``jc.psum``'s ``all_to_all``).
      axis: the axis name for ``lax`` collectives (derived from ``axes``).
      size: the devices on the axes (derived from ``axes``).
    """

    codec: Codec
    axes: Axes
    key: jax.Array | None
    div: int
    dep: Any = None
    all_to_all: str = "auto"
    axis: Any = dataclasses.field(init=False)
    size: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "axis", self.axes.name)
        object.__setattr__(self, "size", self.axes.size)

    def over(self, axes: Axes) -> Context:
        """This context over other axes (one of ``(slow, fast)``)."""
        return dataclasses.replace(self, axes=axes)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """Base class of every all-reduce algorithm (see the module docstring).

    A subclass is a frozen dataclass decorated with :func:`register`; it
    sets :attr:`name` and defines :meth:`run` and :meth:`operand_nbytes`,
    and the rest where its defaults do not hold.
    """

    name: ClassVar[str]
    #: How many axes it reduces over: 1, or 2 for ``(slow, fast)`` axes.
    num_axes: ClassVar[int] = 1
    #: Its place in the ``auto`` rule: the algorithms of the call's number
    #: of axes are asked by ascending rank, and the first whose
    #: :meth:`chosen` says so runs. None: never chosen by ``auto``.
    auto_rank: ClassVar[int | None] = None
    #: Whether it compresses a reduced chunk again with the codec: a second
    #: compression under error feedback (``Codec.recompression``).
    recompresses: ClassVar[bool] = False
    #: The codec rates (:class:`~jaxcomp.codecs.base.Rate`) ``jaxcomp.planning``
    #: ranks this algorithm for; ``jc.psum`` may run it for others where it
    #: can.
    planned_rates: ClassVar[frozenset[Rate]] = frozenset()

    def run(self, ctx: Context, flat: jax.Array, state: jax.Array | None) -> FlatReduced:
        """The all-reduce of this device's ``flat`` tensor.

        Args:
          ctx: the call's context.
          flat: this device's tensor, flat, in its dtype.
          state: this device's server residual (float32,
            :meth:`state_size` elements), or None.
        Returns:
          ``(value, sent, state)``: the sum divided by ``ctx.div`` and what
          this device's input became (float32, flat), and the new server
          residual (None without one).
        """
        raise NotImplementedError

    def run_feedback(
        self, ctx: Context, flat: jax.Array, residual: jax.Array, state: jax.Array | None
    ) -> FlatReduced:
        """The all-reduce of ``flat + residual`` under error feedback.

        Args:
          ctx: the call's context.
          flat: this device's tensor, flat, in its dtype.
          residual: float32, ``flat``'s length: what this device's earlier
            compressions missed.
          state: as in :meth:`run`.
        Returns:
          ``(value, kept, state)``: as :meth:`run`'s, with ``kept = acc -
          sent`` (``acc`` the float32 ``flat + residual``), this device's
          new residual, in ``sent``'s place.

        By default the separate steps: ``acc`` is formed, :meth:`run` takes
        it in ``flat``'s dtype, and ``acc - sent`` is returned. Algorithms
        whose first compression is one encoding of the tensor override it
        with :func:`~jaxcomp.collectives.feedback.compress_kept`, which
        makes the payload and the new residual in one pass where the codec
        has the kernel, with the same bits, and tie their first collective's
        payload to ``ctx.dep`` (:func:`~jaxcomp.collectives.after`).
        """
        return _by_steps(self.run, ctx, flat, residual, state)

    def chosen(self, codec: Codec, n: int, axes: Axes) -> bool:
        """Whether ``auto`` picks this algorithm (asked in the order of
        :attr:`auto_rank`, so only where no earlier one was chosen)."""
        return False

    def state_size(self, codec: Codec, n: int, dtype: Any, axes: Axes) -> int:
        """Elements of one device's server residual (``n > 0``; with one
        axis, more than one device). 0: it keeps none."""
        return 0

    def state_positions(self, codec: Codec, n: int, dtype: Any, axes: Axes, m: int) -> np.ndarray:
        """Where each device's ``m > 0`` residual values lie in the flat
        tensor, int64 ``[devices, m]`` (values past ``n`` are made -1 by
        the caller). By default device ``d`` owns ``[d m, (d + 1) m)``."""
        return np.arange(axes.size, dtype=np.int64)[:, None] * m + np.arange(m)

    def operand_nbytes(self, codec: Codec, n: int, dtype: Any, axes: Axes) -> dict[str, int]:
        """Bytes this device hands to each kind of collective, as the
        compiled HLO shows them (more than one device)."""
        raise NotImplementedError

    def send_nbytes(self, codec: Codec, n: int, dtype: Any, axes: Axes) -> float:
        """Bytes one device sends over the network: by default, from
        :meth:`operand_nbytes` by the kind of each collective."""
        ops = self.operand_nbytes(codec, n, dtype, axes)
        return sum((_sent(kind, b, axes.size) for kind, b in ops.items()), 0.0)

    def collectives(
        self, codec: Codec, n: int, dtype: Any, axes: Axes, bits: float | None = None
    ) -> list[Collective]:
        """The collectives of one all-reduce of ``n`` values (more than one
        device), in program order, with this device's operand bytes.

        ``bits``: for variable-rate codecs, the payload bits per element
        the data needs, which pick the capacity tier a payload travels in
        (:func:`~jaxcomp.collectives._tiers.tier_nbytes`); None: the largest
        tier. By default the collectives of :meth:`operand_nbytes`, for
        codecs whose payloads have a fixed size.
        """
        if codec.rate is Rate.VARIABLE:
            raise ValueError(f"jc.collectives: {self.name!r} does not take {codec!r}")
        return [
            Collective(kind, b) for kind, b in self.operand_nbytes(codec, n, dtype, axes).items()
        ]

    def kernel_calls(self, codec: Codec, n: int, dtype: Any, axes: Axes) -> list[KernelCall]:
        """The encodes and decodes one device runs in an all-reduce of ``n``
        values (more than one device), as the compiled program has them
        (tests/test_planning.py counts its custom calls)."""
        raise NotImplementedError

    def compressed_values(self, n: int, axes: Axes) -> int:
        """Values this device's first compression encodes (what error
        feedback decodes as its own payload): by default the tensor's."""
        return n

    def label(self, codec: Codec, n: int, axes: Axes) -> str:
        """How a table of algorithms names this one for ``n`` values."""
        return self.name

    def compressor(self, codec: Codec, n: int, axes: Axes) -> Algorithm:
        """The algorithm whose compression of ``n`` values this is (what an
        accuracy measurement of the codec with it holds for): itself."""
        return self

    def recompression_warning(self, codec: Codec) -> str | None:
        """Why ``codec`` should not be trained with error feedback through
        this algorithm, or None."""
        if not self.recompresses or codec.recompression != "unsafe":
            return None
        return (
            f"{codec!r} with algorithm={self.name!r} and error feedback: its rounding is not a "
            "contraction, so the residual of the second compression (of a reduced chunk) grows "
            "without bound and training diverges (docs/accuracy.md). Use algorithm='auto' "
            "(allgather for this codec) or train it without error feedback."
        )


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: makes an algorithm reachable by its name."""
    if cls.name in _REGISTRY:
        raise RuntimeError(f"algorithm {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def names() -> tuple[str, ...]:
    """The names ``algorithm=`` takes: "auto", then every registered
    algorithm's, in registration order."""
    return ("auto", *_REGISTRY)


def registered() -> tuple[Algorithm, ...]:
    """Every registered algorithm, in registration order."""
    return tuple(_REGISTRY.values())


def get(name: str) -> Algorithm | None:
    """The registered algorithm called ``name``, or None."""
    return _REGISTRY.get(name)


def choose(codec: Codec, n: int, axes: Axes) -> Algorithm:
    """The algorithm ``auto`` runs for ``n`` values over ``axes``."""
    ranked = sorted(
        (
            a
            for a in _REGISTRY.values()
            if a.num_axes == len(axes.sizes) and a.auto_rank is not None
        ),
        key=lambda a: a.auto_rank,
    )
    for alg in ranked:
        if alg.chosen(codec, n, axes):
            return alg
    raise ValueError(f"jc.collectives: no algorithm takes {codec!r} over axes {axes.sizes}")


def resolve(codec: Codec, n: int, axes: Axes, algorithm: str, who: str) -> Algorithm:
    """``algorithm`` ("auto" or a name) for ``n`` values over ``axes``.
    ``(slow, fast)`` axes always take the algorithm of two axes."""
    if algorithm == "auto" or axes.hierarchical:
        return choose(codec, n, axes)
    alg = get(algorithm)
    if alg is None:
        raise ValueError(f"{who}: unknown algorithm {algorithm!r}")
    if alg.num_axes != 1:
        raise ValueError(
            f"{who}: the {algorithm} algorithm has {alg.num_axes} axes; got the size of one"
        )
    return alg


def all_reduce(
    ctx: Context, flat: jax.Array, algorithm: str, state: jax.Array | None
) -> FlatReduced:
    """The all-reduce of ``flat`` by ``algorithm`` ("auto" or a name); one
    device encodes and decodes locally."""
    if not ctx.axes.hierarchical and ctx.size == 1:
        return _one_device(ctx, flat, state)
    return resolve(ctx.codec, flat.size, ctx.axes, algorithm, "jc.psum").run(ctx, flat, state)


def all_reduce_feedback(
    ctx: Context, flat: jax.Array, residual: jax.Array, algorithm: str, state: jax.Array | None
) -> FlatReduced:
    """The all-reduce of ``flat + residual`` by ``algorithm`` under error
    feedback: ``(value, kept, state)`` (:meth:`Algorithm.run_feedback`)."""
    if not ctx.axes.hierarchical and ctx.size == 1:
        if ctx.div != 1:  # a context narrowed to one axis (Context.over) keeps its mean's div
            return _by_steps(_one_device, ctx, flat, residual, state)
        # What the algorithms' first compression does (run_feedback): the
        # payload and the new residual in one pass where the codec has the
        # kernel, the own payload decoded fused.
        p, kept = compress_kept(ctx.codec, after(flat, ctx.dep), residual, ctx.key, flat.dtype)
        return decode_own(p), kept, state
    alg = resolve(ctx.codec, flat.size, ctx.axes, algorithm, "jc.psum")
    return alg.run_feedback(ctx, flat, residual, state)


def _by_steps(run, ctx: Context, flat, residual, state) -> FlatReduced:
    """Error feedback around ``run(ctx, x, state) -> (value, sent,
    state)`` as separate steps: ``acc = flat + residual`` in float32, ``run``
    of ``acc`` in ``flat``'s dtype, and ``acc - sent`` kept. The order tie
    (``ctx.dep``) fuses into the sum."""
    acc = accumulate(after(flat, ctx.dep), residual)
    value, sent, state = run(ctx, acc.astype(flat.dtype), state)
    return value, kept(acc, sent), state


def _one_device(ctx: Context, flat: jax.Array, state: jax.Array | None) -> FlatReduced:
    """One device: its own payload decoded (:func:`decode_own`, fused into
    its consumers on GPUs), as every algorithm decodes what it sent."""
    codec, key, div = ctx.codec, ctx.key, ctx.div
    if div == 1:
        sent = decode_own(codec.encode(flat, key))
        return sent, sent, state
    hat = decode_own(codec.encode((flat.astype(jnp.float32) / div).astype(flat.dtype), key))
    return hat, hat * div, state


# ---------------------------------------------------------------------------
# The accounting of the public functions, over normalized axes
# ---------------------------------------------------------------------------
def state_size(codec: Codec, n: int, dtype: Any, axes: Axes, algorithm: str = "auto") -> int:
    """:func:`jaxcomp.collectives.state_size` over ``axes``."""
    if not axes.hierarchical and (axes.size == 1 or n == 0):
        return 0
    alg = resolve(codec, n, axes, algorithm, "jc.collectives.state_size")
    return alg.state_size(codec, n, dtype, axes)


def state_positions(
    codec: Codec, n: int, dtype: Any, axes: Axes, algorithm: str = "auto"
) -> np.ndarray:
    """:func:`jaxcomp.collectives.state_positions` over ``axes``."""
    m = state_size(codec, n, dtype, axes, algorithm)
    if m == 0:
        return np.zeros((axes.size, 0), np.int64)
    alg = resolve(codec, n, axes, algorithm, "jc.collectives.state_positions")
    pos = alg.state_positions(codec, n, dtype, axes, m)
    return np.where(pos < n, pos, -1)


def operand_nbytes(codec: Codec, n: int, dtype: Any, axes: Axes, algorithm: str) -> dict[str, int]:
    """:func:`jaxcomp.collectives.operand_nbytes` over ``axes``."""
    if axes.size == 1:
        return {}
    alg = resolve(codec, n, axes, algorithm, "jc.collectives.operand_nbytes")
    return alg.operand_nbytes(codec, n, dtype, axes)


def send_nbytes(codec: Codec, n: int, dtype: Any, axes: Axes, algorithm: str = "auto") -> float:
    """:func:`jaxcomp.collectives.send_nbytes` over ``axes``."""
    if axes.hierarchical:
        return choose(codec, n, axes).send_nbytes(codec, n, dtype, axes)
    if axes.size == 1:
        return 0.0
    alg = resolve(codec, n, axes, algorithm, "jc.collectives.send_nbytes")
    return alg.send_nbytes(codec, n, dtype, axes)


def collectives(
    codec: Codec, n: int, dtype: Any, axes: Axes, algorithm: str, bits: float | None = None
) -> list[Collective]:
    """:meth:`Algorithm.collectives` by ``algorithm`` over ``axes``; none
    on one device."""
    if not axes.hierarchical and axes.size == 1:
        return []
    alg = resolve(codec, n, axes, algorithm, "jc.collectives.collectives")
    return alg.collectives(codec, n, dtype, axes, bits)


def kernel_calls(codec: Codec, n: int, dtype: Any, axes: Axes, algorithm: str) -> list[KernelCall]:
    """:meth:`Algorithm.kernel_calls` by ``algorithm`` over ``axes``; one
    device encodes and decodes once."""
    if not axes.hierarchical and axes.size == 1:
        return [KernelCall("encode", n, codec), KernelCall("decode", n, codec)]
    alg = resolve(codec, n, axes, algorithm, "jc.collectives.kernel_calls")
    return alg.kernel_calls(codec, n, dtype, axes)


def uncompressed_send_nbytes(nbytes: int, axis_size: int) -> float:
    """Bytes one device sends in a ring all-reduce, what ``lax.psum`` costs
    on the network.

    Args:
      nbytes: bytes of the tensor.
      axis_size: devices on the axis.
    Returns:
      ``2 (P-1)/P * nbytes`` (0 for one device).
    """
    p = axis_size
    return 2.0 * (p - 1) / p * nbytes if p > 1 else 0.0


def _sent(kind: str, operand: int, p: int) -> float:
    """Bytes one device sends for a collective's operand of ``operand``
    bytes: ``(P-1)`` times an all-gather's, ``(P-1)/P`` of an
    all-to-all's, every byte of a collective-permute's, and a ring
    all-reduce's ``2 (P-1)/P`` of an all-reduce's."""
    if kind == "all-gather":
        return (p - 1) * operand
    if kind == "all-to-all":
        return (p - 1) / p * operand
    if kind == "all-reduce":
        return uncompressed_send_nbytes(operand, p)
    return operand  # collective-permute: every operand byte is sent
