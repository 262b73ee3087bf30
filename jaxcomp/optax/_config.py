"""The communication options that ``compress_gradients``, ``onebit_adam``
and ``powersgd`` share, as one frozen configuration validated once when a
transformation is built, and the mesh axes they run over."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._axes import bound_size, names_of
from jaxcomp.collectives import ALGORITHMS

COMPRESS = "jc.optax.compress_gradients"
# Fusion saves collectives (their latency) at the cost of copying every fused
# leaf into one buffer. Past a few MiB a leaf's transfer dwarfs a
# collective's latency, and the copy is what costs (docs/benchmarks.md, "The
# optimizer step").
DEFAULT_FUSION_BYTES = 4 << 20
DEFAULT_MIN_COMPRESS_SIZE = 1024
# What update returns for a step whose mean gradient is not finite: "pass"
# returns that mean (optax.apply_if_finite and loss-scaling logic downstream
# see it), "skip" returns zeros. The state is left as it was either way.
NONFINITE_MODES = ("pass", "skip")


def bound_axis_sizes(axis_name, who: str = COMPRESS) -> tuple[int, ...]:
    """The sizes of the mapped axes ``axis_name``, or an error (from ``who``)
    that says how to bind them."""

    def unbound(a):
        return (
            f"{who}: update must run inside jax.shard_map or jax.pmap over the axis "
            f"{a!r}, which is not bound here. Put the optimizer update inside the mapped "
            "train step (see docs/training.md), or pass the axis_name of your mesh / pmap."
        )

    return tuple(bound_size(a, unbound) for a in names_of(axis_name))


def axis_sizes_or_none(axis_name) -> tuple[int, ...] | None:
    """The sizes of the axes where they are bound (inside the mapped
    function), else None."""
    try:
        return bound_axis_sizes(axis_name)
    except ValueError:
        return None


def check_static_int(who: str, name: str, value, lo: int) -> int:
    """``value`` as a Python int >= ``lo``, or the error that says so."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        hint = ""
        if isinstance(value, (jax.Array, np.ndarray)):
            hint = (
                " (under optax.inject_hyperparams, list it in static_args: it fixes "
                "the shapes of the state)"
            )
        raise ValueError(f"{who}: {name} must be a Python int >= {lo}, got {value!r}{hint}")
    return int(value)


def check_nonfinite(who: str, on_nonfinite) -> str:
    """``on_nonfinite``, checked against ``NONFINITE_MODES``."""
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(
            f"{who}: on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}"
        )
    return on_nonfinite


def is_static_int(value) -> bool:
    """A Python (or NumPy) int, not a bool: a value known when the step is
    traced, unlike a traced one under ``optax.inject_hyperparams``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """How a transformation's gradients travel, checked at construction.

    The options that ``compress_gradients``, ``onebit_adam`` and
    ``powersgd`` share, documented with ``compress_gradients``. None for
    ``fusion_bytes`` and ``min_compress_size`` takes the defaults (None
    keeps them out of ``optax.inject_hyperparams``' numeric hyperparameters,
    which would turn them into arrays: they fix shapes). Built once by each
    factory; ``onebit_adam`` replaces ``warmup_steps`` by its traced freeze
    step at every update.

    Attributes:
      axis_name: the data-parallel mesh / pmap axis, or ``(slow, fast)``.
      algorithm: ``jc.pmean``'s algorithm (``jc.collectives.ALGORITHMS``).
      fusion_bytes: the largest fused bucket, in gradient bytes.
      min_compress_size: leaves with fewer elements go uncompressed.
      warmup_steps: steps that send the exact mean; a Python int, or a
        traced one under ``optax.inject_hyperparams``.
      error_feedback: carry what compression dropped to the next step.
      server_error_feedback: also keep the second stage's error (two-level).
      residual_dtype: the residuals' dtype.
      residual_norm: report the residuals' global norm in the telemetry.
      on_nonfinite: one of ``NONFINITE_MODES``.
      seed: seeds the PRNG key of stochastic codecs.
      who: the public name that errors and warnings are reported under.
    """

    axis_name: Any
    algorithm: str = "auto"
    fusion_bytes: int | None = None
    min_compress_size: int | None = None
    warmup_steps: int | jax.Array = 0
    error_feedback: bool = True
    server_error_feedback: bool = True
    residual_dtype: Any = "float32"
    residual_norm: bool = False
    on_nonfinite: str = "pass"
    seed: int = 0
    who: str = dataclasses.field(default=COMPRESS, compare=False, repr=False)

    def __post_init__(self):
        who = self.who
        check_nonfinite(who, self.on_nonfinite)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"{who}: algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}"
            )
        fusion = DEFAULT_FUSION_BYTES if self.fusion_bytes is None else self.fusion_bytes
        small = (
            DEFAULT_MIN_COMPRESS_SIZE if self.min_compress_size is None else self.min_compress_size
        )
        self._set(fusion_bytes=check_static_int(who, "fusion_bytes", fusion, 1))
        self._set(min_compress_size=check_static_int(who, "min_compress_size", small, 0))
        if is_static_int(self.warmup_steps) and self.warmup_steps < 0:
            raise ValueError(f"{who}: warmup_steps must be >= 0, got {self.warmup_steps}")
        dtype = np.dtype(self.residual_dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{who}: residual_dtype must be a floating dtype, got {dtype.name}")
        self._set(residual_dtype=dtype, error_feedback=bool(self.error_feedback))
        self._set(residual_norm=bool(self.residual_norm))

    def _set(self, **values) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def two_level(self) -> bool:
        """Whether the state keeps server residuals (two-level error feedback)."""
        return self.error_feedback and bool(self.server_error_feedback)

    @property
    def never_warm(self) -> bool:
        """Whether no step is a warm-up step (then no ``lax.cond`` is traced)."""
        return isinstance(self.warmup_steps, (int, np.integer)) and self.warmup_steps == 0

    @property
    def feedback_dtype(self):
        """The residuals' dtype, or None without error feedback."""
        return self.residual_dtype if self.error_feedback else None

    def axes(self, sizes: tuple[int, ...]):
        """The axis argument of the collectives: one name, or the tuple of them."""
        return self.axis_name if len(sizes) == 1 else tuple(self.axis_name)
