"""Reading and checking optimizer states.

Where the per-device parts of a state live (``find_states``,
``partition_specs``, ``check_laid_out``; the public ``state_specs`` and
``telemetry``), and the per-device parts an update reads, checks against
the gradients and writes back: the residuals shaped like the parameters
(``[1, *leaf.shape]`` per device), the server residuals of the compressed
buckets (``[1, m]`` per device) and PowerSGD's factors. The state classes
stay with their transformations and declare their layout here
(:func:`all_reduce_state`), so this module imports none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxcomp.collectives import state_size
from jaxcomp.optax._config import COMPRESS
from jaxcomp.optax._plan import Plan


# ---------------------------------------------------------------------------
# The states of the transformations that all-reduce the gradients
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """What of a state is per device.

    Attributes:
      per_device: fields with one row per device (sharded along the data
        axis under ``jax.shard_map``); the other fields are replicated.
      nested: fields holding another optimizer state, laid out in turn.
    """

    per_device: tuple[str, ...] = ()
    nested: tuple[str, ...] = ()


# The state classes of the transformations that all-reduce the gradients
# (the uncompressed baseline included): telemetry reads them, and they decide
# which leaves are laid out per device.
LAYOUTS: dict[type, Layout] = {}


def all_reduce_state(*, per_device: tuple[str, ...] = (), nested: tuple[str, ...] = ()):
    """Class decorator: registers the state of a transformation that
    all-reduces the gradients, and what of it is per device."""

    def register(cls):
        LAYOUTS[cls] = Layout(tuple(per_device), tuple(nested))
        return cls

    return register


def is_all_reduce_state(x) -> bool:
    return isinstance(x, tuple(LAYOUTS))


def find_states(opt_state) -> list:
    """The all-reduce states inside ``opt_state``, in tree order."""
    return [
        s for s in jax.tree.leaves(opt_state, is_leaf=is_all_reduce_state) if is_all_reduce_state(s)
    ]


def check_type(state, cls: type, who: str) -> None:
    """Raises the TypeError of an update given another transformation's state."""
    if not isinstance(state, cls):
        raise TypeError(f"{who}: update got a {type(state).__name__}, not a {cls.__name__}")


def telemetry(opt_state) -> dict[str, jax.Array]:
    """The last step's telemetry of a ``compress_gradients`` state.

    Args:
      opt_state: an optimizer state holding a :class:`CompressState`
        (or a ``powersgd`` or ``pmean`` state) anywhere (a chain,
        ``inject_hyperparams``, ``MultiSteps``, ...; the first one counts
        if there are several). The uncompressed ``jc.optax.uncompressed_mean``
        reports the gradients' own bits per element and the bytes its
        all-reduce sends (see :class:`PmeanState`).
    Returns:
      ``{"step", "bits_per_element", "wire_bytes", "compression_ratio",
      "residual_norm", "skipped_steps"}``: scalars for a shard_map state,
      arrays with the leading device axis for a pmap state (the same value
      on every device). ``residual_norm`` is 0 unless the transformation was
      built with ``residual_norm=True``; ``skipped_steps`` counts the steps
      whose mean gradient was not finite (see :class:`Telemetry`).
    Raises:
      ValueError: ``opt_state`` holds no ``compress_gradients`` state.
    """
    found = find_states(opt_state)
    if not found:
        raise ValueError(
            "jc.optax.telemetry: no jc.optax.compress_gradients (or powersgd, pmean) state "
            "inside this optimizer state; pass the whole opt_state of a chain that contains "
            "one"
        )
    s = found[0]
    return {"step": s.step, **s.telemetry._asdict()}


def state_specs(opt_state, axis_name, *, strict: bool = True) -> Any:
    """PartitionSpecs for an optimizer state under ``jax.shard_map``.

    Per-device leaves get ``P(axis_name)`` (sharded along the data axis, one
    row per device), everything else ``P()`` (replicated). Per-device are:
    the residuals of every :class:`CompressState` (one
    ``[devices, *leaf.shape]`` array per floating-point parameter leaf) and
    its server residuals (one ``[devices, m]`` array per fused bucket), and
    the accumulated gradients of an ``optax.MultiSteps`` whose inner state
    holds a ``compress_gradients`` (or ``pmean``) state (they are summed
    before the all-reduce, so they differ per device; they are stored
    concatenated along their first axis). A ``jc.optax.uncompressed_mean`` state is
    replicated.

    Args:
      opt_state: the optimizer state, or its ``jax.eval_shape``.
      axis_name: the data-parallel mesh axis (or the pair of hierarchical axes).
      strict: raise for a state without an all-reduce state (below); False
        lays such a state out replicated.
    Returns:
      A pytree of ``PartitionSpec`` with ``opt_state``'s structure, for the
      ``in_specs`` / ``out_specs`` of ``jax.shard_map``.
    Raises:
      ValueError: with ``strict``, ``opt_state`` holds no ``compress_gradients``,
        ``powersgd`` or ``pmean`` state (a chain whose all-reduce jaxcomp
        does not know, or a container hiding it, such as an
        NNX ``nnx.State``): every leaf would silently be replicated; or it
        was made by a plain ``tx.init`` outside the mesh (one residual row
        on one device).
    """
    if strict and not find_states(opt_state):
        raise ValueError(
            "jc.optax.state_specs: no jc.optax.compress_gradients (or onebit_adam, powersgd, "
            "pmean) state inside "
            f"this optimizer state (a {type(opt_state).__name__}), so no leaf would be laid out "
            "per device. Pass the optax state itself, as tx.init or jc.optax.init returned it "
            "(a container that wraps its leaves, such as a Flax NNX optimizer's nnx.State, "
            "hides the compress state). A chain without compression is replicated: "
            "jax.tree.map(lambda _: P(), opt_state)."
        )
    check_laid_out(opt_state)
    return partition_specs(opt_state, axis_name)


def check_laid_out(opt_state) -> None:
    """Raises for a state made by a plain ``tx.init`` outside the mesh: its
    per-device residuals are one row on one device, where ``jc.optax.init``
    gives one row per device, sharded over the mesh (shard_map would fail
    with a bare "does not evenly divide" error)."""
    if jax.device_count() < 2:
        return
    for s in find_states(opt_state):
        for r in jax.tree.leaves(getattr(s, "residuals", ())):
            sharding = getattr(r, "sharding", None)
            if (
                isinstance(r, jax.Array)
                and isinstance(sharding, jax.sharding.SingleDeviceSharding)
                and r.ndim
                and r.shape[0] == 1
            ):
                raise ValueError(
                    "jc.optax.state_specs: this state holds one residual row on one device: it "
                    "was made by tx.init outside the mesh, where each device needs its own row. "
                    "Create it with jc.optax.init(tx, params, mesh, axis_name) (under jax.pmap: "
                    "jax.pmap(tx.init, axis_name=...))."
                )


def partition_specs(opt_state, axis_name) -> Any:
    """The PartitionSpecs of :func:`state_specs`, unchecked (a state without
    an all-reduce state is all replicated)."""
    spec = P(tuple(axis_name)) if isinstance(axis_name, (tuple, list)) else P(axis_name)

    def is_node(x):
        return is_all_reduce_state(x) or isinstance(x, optax.MultiStepsState)

    def walk(x):
        if isinstance(x, optax.MultiStepsState):
            return _multi_steps_specs(x, spec, walk, is_node)
        for cls, layout in LAYOUTS.items():
            if isinstance(x, cls):
                return _layout_specs(x, layout, spec, walk, is_node)
        return P()

    return jax.tree.map(walk, opt_state, is_leaf=is_node)


def _layout_specs(x, layout: Layout, spec, walk, is_node):
    """An all-reduce state's specs: its per-device fields ``spec``, its
    nested states walked, the rest replicated."""
    replicated = jax.tree.map(lambda _: P(), x._replace(**dict.fromkeys(layout.nested, ())))
    return replicated._replace(
        **{f: jax.tree.map(lambda _: spec, getattr(x, f)) for f in layout.per_device},
        **{f: jax.tree.map(walk, getattr(x, f), is_leaf=is_node) for f in layout.nested},
    )


def _multi_steps_specs(x, spec, walk, is_node):
    """An ``optax.MultiStepsState``'s specs: its accumulated gradients are
    per device when its inner state all-reduces them."""
    inner = jax.tree.map(walk, x.inner_opt_state, is_leaf=is_node)
    rest = jax.tree.map(lambda _: P(), x._replace(inner_opt_state=None))
    if find_states(x.inner_opt_state):

        def acc_spec(a):
            if not jnp.ndim(a):
                raise ValueError(
                    "jc.optax.state_specs: optax.MultiSteps accumulates a scalar "
                    "gradient per device, which cannot be stored sharded; give that "
                    "parameter a leading axis of size 1"
                )
            return spec

        rest = rest._replace(acc_grads=jax.tree.map(acc_spec, x.acc_grads))
    return rest._replace(inner_opt_state=inner)


# ---------------------------------------------------------------------------
# The residuals: one per leaf, [1, *leaf.shape] per device
# ---------------------------------------------------------------------------
def is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def replicated_error(path: str, rows: int, who: str = COMPRESS) -> ValueError:
    """The error of a per-device state passed as replicated (``rows`` rows)."""
    return ValueError(
        f"{who}: inside the mapped step each device must see its own residual "
        f"(leading axis 1), but for {path} it sees {rows} rows: the per-device "
        "state was passed as replicated. Under jax.shard_map give the optimizer "
        "state in_specs/out_specs=jc.optax.state_specs(opt_state, axis_name) "
        "(and create it with jc.optax.init); under jax.pmap, create it with "
        "jax.pmap(tx.init)."
    )


def zero_residuals(plan: Plan, dtype) -> Any:
    """Zero residuals for every floating-point leaf of the plan."""
    leaves = [
        jnp.zeros((1, *shape), dtype) if carries else optax.MaskedNode()
        for shape, carries in zip(plan.shapes, plan.carries_residual, strict=True)
    ]
    return plan.treedef.unflatten(leaves)


def read_residuals(plan: Plan, residuals, dtype, who: str = COMPRESS) -> list:
    """This device's residual of every leaf, shaped like the leaf (None for
    a leaf without one), after checking the state against the gradients."""
    found = jax.tree.structure(residuals, is_leaf=is_masked)
    if found != plan.treedef:
        raise ValueError(
            f"{who}: the state's residuals do not have the gradients' structure (one "
            "residual per gradient leaf, shaped like the parameters; a state whose residuals "
            "are one array per fused bucket predates that layout): was the state initialized "
            f"with parameters of another structure?\n  residuals: {found}\n  gradients: "
            f"{plan.treedef}"
        )
    leaves = plan.treedef.flatten_up_to(residuals)
    return [_read_residual(plan, i, r, dtype, who) for i, r in enumerate(leaves)]


def _read_residual(plan: Plan, i: int, r, dtype, who: str):
    """Leaf ``i``'s residual on this device (``r[0]``), or None, checked."""
    path, shape = plan.paths[i], plan.shapes[i]
    if not plan.carries_residual[i]:
        if is_masked(r):
            return None
        raise ValueError(
            f"{who}: gradient {path} of dtype {plan.dtypes[i].name} has no residual, but "
            f"the state holds a {type(r).__name__} for it (expected optax.MaskedNode()): was "
            "the state initialized with parameters of other dtypes?"
        )
    if is_masked(r) or tuple(r.shape[1:]) != shape:
        got = "optax.MaskedNode()" if is_masked(r) else f"shape {tuple(r.shape)}"
        raise ValueError(
            f"{who}: the state's residual for {path} has {got}, but the gradient has shape "
            f"{shape} (expected (1, *shape) inside the mapped step): was the state initialized "
            "with other parameters?"
        )
    if r.shape[0] != 1:
        raise replicated_error(path, r.shape[0], who)
    if r.dtype != dtype:
        raise ValueError(
            f"{who}: the state's residual for {path} has dtype {r.dtype.name}, but "
            f"residual_dtype is {dtype.name}: build the transformation with the "
            "residual_dtype the state was created with"
        )
    return r[0]


def keep_finite(ok, new, old):
    """``new`` where ``ok`` (the step's mean was finite) and the element is
    finite, else ``old``: one elementwise select, which XLA fuses into the
    pass that writes the state, with no reduction over the residuals.

    With finite means a float32 residual is finite (a non-finite ``acc``
    on any device reaches the mean, tests/test_nonfinite.py) except past
    half of float32's range, and a narrower ``residual_dtype`` overflows
    where its range ends: such an element keeps its old value, so the
    state never holds a non-finite residual."""
    return jnp.where(ok & jnp.isfinite(new), new, old)


def write_residuals(plan: Plan, state_residuals, new: list, ok) -> Any:
    """The state's residuals after a step: the new ones if ``ok``, else the
    old ones (a step with a non-finite mean changes nothing), element by
    element as :func:`keep_finite` says.

    The select is taken on the state's own ``(1, *shape)`` arrays, not on
    the leaf-shaped ones and then expanded: XLA then needs one temporary
    less (docs/benchmarks.md, "The optimizer step")."""
    raw = plan.treedef.flatten_up_to(state_residuals)
    leaves = [
        optax.MaskedNode() if n is None else keep_finite(ok, n[None], o)
        for o, n in zip(raw, new, strict=True)
    ]
    return plan.treedef.unflatten(leaves)


# ---------------------------------------------------------------------------
# The server residuals: one [1, m] row per compressed bucket per device
# ---------------------------------------------------------------------------
def server_sizes(plan: Plan, sizes: tuple[int, ...], algorithm: str) -> tuple[int, ...]:
    """The length ``m`` of every compressed bucket's server residual (a
    stacked bucket's: its layers' rows, one after the other)."""
    axis_sizes = sizes[0] if len(sizes) == 1 else sizes
    return tuple(
        b.count * state_size(b.codec, b.size, b.dtype, axis_sizes, algorithm) for b in plan.buckets
    )


# A bucket whose algorithm keeps no server residual on the bound axes (one
# compression: allgather, allreduce, static sparse; every algorithm on two
# devices for some codecs) holds a row of this width instead of an empty one:
# orbax refuses to save zero-size arrays, and the state's structure must not
# depend on the number of devices (``jax.eval_shape(tx.init)`` outside the
# mesh gives the structure that ``jc.optax.init`` lays out). Always zero;
# a step never reads or writes it.
PLACEHOLDER_WIDTH = 1


def stored_width(m: int) -> int:
    """The width of the state's row for a server residual of ``m`` values."""
    return m or PLACEHOLDER_WIDTH


def zero_servers(plan: Plan, sizes, algorithm: str) -> tuple:
    """Zero server residuals (a placeholder row where a bucket keeps none,
    :data:`PLACEHOLDER_WIDTH`); where the axes are not bound (``tx.init``
    outside the mapped function, or ``jax.eval_shape`` of it), empty rows
    that ``update`` rejects with a message saying how to create the state."""
    if sizes is None:
        return tuple(jnp.zeros((1, 0), jnp.float32) for _ in plan.buckets)
    return tuple(
        jnp.zeros((1, stored_width(m)), jnp.float32) for m in server_sizes(plan, sizes, algorithm)
    )


def read_servers(plan: Plan, servers, sizes, algorithm: str, who: str = COMPRESS) -> tuple:
    """This device's server residual of every bucket, checked."""
    want = server_sizes(plan, sizes, algorithm)
    got = (
        tuple(tuple(getattr(s, "shape", ())) for s in servers)
        if isinstance(servers, tuple)
        else None
    )
    if got is None or len(got) != len(want):
        raise ValueError(
            f"{who}: the state holds {len(servers) if got is not None else 'no'} server "
            f"residuals, but this step has {len(want)} compressed buckets: was the state "
            "initialized with other parameters, codecs, fusion_bytes or min_compress_size, "
            "or with server_error_feedback=False?"
        )
    for b, m, shape, s in zip(plan.buckets, want, got, servers, strict=True):
        _check_server(b, m, shape, s, sizes, algorithm, who)
    # A placeholder row reads as the empty residual the algorithm takes.
    return tuple(s[0, :m] for m, s in zip(want, servers, strict=True))


def _check_server(bucket, m: int, shape: tuple, s, sizes, algorithm: str, who: str) -> None:
    if not m and shape in ((1, 0), (1, PLACEHOLDER_WIDTH)) and s.dtype == jnp.float32:
        return  # none kept: the placeholder (or an empty row, from tx.init outside the mesh)
    if shape == (1, 0) and m:
        raise ValueError(
            f"{who}: the state's server residuals are empty: it was initialized outside "
            "the mapped function, where the number of devices is unknown. Create it with "
            "jc.optax.init(tx, params, mesh, axis_name) under jax.shard_map, or "
            "jax.pmap(tx.init, axis_name=...) under jax.pmap."
        )
    if len(shape) == 2 and shape[0] != 1 and shape[1] == stored_width(m):
        raise replicated_error(
            f"the server residual of the bucket of {bucket.codec!r}", shape[0], who
        )
    if shape != (1, m) or s.dtype != jnp.float32:
        raise ValueError(
            f"{who}: the state's server residual for the bucket of {bucket.codec!r} "
            f"({bucket.size} values) has shape {shape}, expected (1, {stored_width(m)}) for "
            f"algorithm={algorithm!r} on axes of sizes {sizes}: the server residuals "
            "depend on the fused buckets, the algorithm and the number of devices, so "
            "restore a state under the same fusion_bytes, codec policy, algorithm and "
            "mesh (the per-leaf residuals do not)"
        )


def write_servers(old: tuple, new, ok) -> tuple:
    """The state's server residuals after a step, as :func:`keep_finite`
    says; a placeholder row (a bucket that keeps none) as it was."""
    return tuple(
        o if n is None or not n.size else keep_finite(ok, n[None], o)
        for o, n in zip(old, new, strict=True)
    )


# ---------------------------------------------------------------------------
# PowerSGD's factors and residuals
# ---------------------------------------------------------------------------
def read_factors(plan, qs, residuals, who: str) -> tuple[list, list | None]:
    """PowerSGD's Q of every leaf and its residual (the state's own
    ``(1, *shape)`` array; ``residuals`` None without error feedback), in
    flatten order, checked against the plan (a ``LowRankPlan``)."""
    qs = plan.treedef.flatten_up_to(qs)
    res = None if residuals is None else plan.treedef.flatten_up_to(residuals)
    for i, (_, m, r) in plan.matrices.items():
        if getattr(qs[i], "shape", None) != (m, r):
            raise ValueError(
                f"{who}: the state's Q for leaf {i} has shape "
                f"{getattr(qs[i], 'shape', None)}, expected {(m, r)}: was it initialized "
                "with other parameters or another rank?"
            )
        if res is not None:
            if getattr(res[i], "shape", (None,))[1:] != plan.shapes[i]:
                raise ValueError(
                    f"{who}: the state's residual for leaf {i} does not fit the gradient "
                    f"of shape {plan.shapes[i]}: was it initialized with other parameters?"
                )
            if res[i].shape[0] != 1:
                raise replicated_error(f"leaf {i}", res[i].shape[0])
    return qs, res


# ---------------------------------------------------------------------------
# What a compress_gradients state was made for
# ---------------------------------------------------------------------------
# Codecs below this many wire bits per element train Adam-family optimizers
# placed after compress_gradients worse than float32: Adam divides by a
# second moment that sees the compression noise (docs/accuracy.md, "Adam on
# the LM").
ADAM_COARSE_BITS = 8.0


def coarse_for_adam(plan: Plan) -> tuple:
    """The plan's codecs that send fewer than ADAM_COARSE_BITS bits per element."""
    return tuple(
        dict.fromkeys(
            b.codec for b in plan.buckets if b.codec.bits_per_element() < ADAM_COARSE_BITS
        )
    )


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Comm:
    """What a ``compress_gradients`` state was made for, carried in the
    state as static pytree data (no leaves; part of its structure): the
    plan that lays its residuals and server residuals out, the algorithm and
    the axes. ``jc.optax.init`` reads its coarse codecs, ``relayout`` its
    server residuals' layout. ``reducer``: the transformation's
    ``InBackward`` (its reduction from the backward pass), which ``jc.data_parallel`` runs from
    inside the backward pass; not compared, so that the states of two equal
    transformations have one structure."""

    plan: Plan
    algorithm: str
    axis_name: Any
    reducer: Any = dataclasses.field(default=None, compare=False, repr=False)
