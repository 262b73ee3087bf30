"""The fusion plan: which leaves are compressed with which codec, and how
they are packed into a few fused buckets.

The plan depends only on the tree structure, shapes and dtypes of the
gradients (and the policy), so it is static: computed at trace time, the same
in ``init`` and ``update``. Grouping small tensors into one buffer before a
collective is Horovod's tensor fusion and PyTorch DDP's gradient buckets;
leaving the small tensors (biases, norms) uncompressed follows the
low-precision study (Grubic et al. 2018, section 3) and 3LC (section 4).

The plan is how one step packs the leaves; the optimizer state does not
depend on it (its residuals are shaped like the parameters, one per leaf), so
a change of ``fusion_bytes`` or of the policy leaves a checkpoint loadable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import SUPPORTED_DTYPES, Codec, as_codec

Policy = Codec | str | Callable[[tuple, Any], Codec | None] | Any

_WHO = "jc.optax.compress_gradients"


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A fused buffer of leaves sharing one codec and one dtype.

    Attributes:
      codec: the codec of every leaf in the bucket; None for a group of
        leaves sent uncompressed (see :attr:`Plan.groups`).
      dtype: the leaves' dtype (the buffer is sent in it).
      leaves: indices (in tree-flatten order) of the leaves, in buffer order.
      sizes: the number of elements of each leaf (of one layer's slice, for
        a stacked bucket).
      layers: 0, or for a stacked bucket (``compress_gradients(layers=)``:
        one leaf whose leading axis is a stack of layers) the number of
        layers: the bucket is one layer's slice, reduced once per layer.
    """

    codec: Codec | None
    dtype: np.dtype
    leaves: tuple[int, ...]
    sizes: tuple[int, ...]
    layers: int = 0

    @property
    def size(self) -> int:
        """The number of elements of the fused buffer (one layer's)."""
        return int(sum(self.sizes))

    @property
    def count(self) -> int:
        """How many times a step reduces the buffer: once per layer."""
        return max(1, self.layers)

    @property
    def carries_residual(self) -> bool:
        """Whether the leaves have error-feedback residuals (floating-point
        leaves do; complex ones are always sent exactly and have none)."""
        return has_residual(self.dtype)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static description of one step's communication.

    Attributes:
      treedef: the gradients' tree structure.
      shapes, dtypes: of every leaf, in flatten order.
      buckets: the compressed buckets.
      exact: per dtype, the leaves averaged with one uncompressed ``lax.pmean``.
      passthrough: leaves returned as they are (float0 gradients of integer
        parameters carry nothing).
      paths: every leaf's path, as ``jax.tree_util.keystr`` writes it.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    buckets: tuple[Bucket, ...]
    exact: tuple[tuple[np.dtype, tuple[int, ...]], ...]
    passthrough: tuple[int, ...]
    paths: tuple[str, ...]

    @property
    def num_elements(self) -> int:
        """The number of gradient elements, all leaves together."""
        return int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))

    @property
    def groups(self) -> tuple[Bucket, ...]:
        """Every fused buffer of a step: the compressed buckets, then one
        ``Bucket`` with codec None per dtype of the uncompressed leaves."""
        exact = tuple(
            Bucket(None, d, ix, tuple(int(np.prod(self.shapes[i], dtype=np.int64)) for i in ix))
            for d, ix in self.exact
        )
        return self.buckets + exact

    @property
    def carries_residual(self) -> tuple[bool, ...]:
        """Per leaf, whether it has an error-feedback residual: every
        floating-point leaf does, whatever its codec (or none) this step."""
        return tuple(has_residual(d) for d in self.dtypes)


def has_residual(dtype) -> bool:
    """Whether a gradient of ``dtype`` has an error-feedback residual."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def gradient_shapes(params):
    """The gradients' shapes and dtypes for ``params``: integer and boolean
    parameters have float0 gradients (as ``jax.grad(..., allow_int=True)``
    gives), the others gradients like themselves."""

    def grad_like(p):
        dtype = np.dtype(p.dtype)
        if jnp.issubdtype(dtype, jnp.integer) or dtype == np.dtype(bool):
            return jax.ShapeDtypeStruct(np.shape(p), jax.dtypes.float0)
        return p

    return jax.tree.map(grad_like, params)


def _is_codec_leaf(x) -> bool:
    return x is None or isinstance(x, (Codec, str))


def is_codec_like(x) -> bool:
    """A codec, a codec class or a spec string (:func:`jaxcomp.codecs.get`)."""
    return isinstance(x, (Codec, str)) or (isinstance(x, type) and issubclass(x, Codec))


def resolve_policy(policy: Policy, who: str) -> Policy:
    """A spec string or a codec class read now (its errors included, from
    ``who``); any other policy as it is."""
    return as_codec(policy, who) if is_codec_like(policy) else policy


def leaf_codecs(policy: Policy, tree) -> list[Codec | None]:
    """The codec (or None) of every leaf of ``tree``, in flatten order."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if is_codec_like(policy):  # one codec, a codec class or a spec string for every leaf
        return [as_codec(policy, _WHO)] * len(leaves_with_path)
    if policy is None:
        return [None] * len(leaves_with_path)
    if callable(policy) and not isinstance(policy, (dict, list, tuple)):
        out = []
        for path, leaf in leaves_with_path:
            c = policy(path, leaf)
            if c is not None and not is_codec_like(c):
                raise TypeError(
                    "jc.optax.compress_gradients: the codec policy must return a jaxcomp codec, "
                    "a spec string such as 'qsgd:bits=4', or None; for "
                    f"{jax.tree_util.keystr(path)} it returned {type(c).__name__}"
                )
            out.append(None if c is None else as_codec(c, _WHO))
        return out
    codecs, cdef = jax.tree.flatten(policy, is_leaf=_is_codec_leaf)
    if jax.tree_util.treedef_is_leaf(cdef) and cdef != treedef:
        raise TypeError(
            f"{_WHO}: the codec must be a codec (jc.codecs.QSGD(bits=4)), a codec class, a "
            "spec string ('qsgd:bits=4'), a callable (path, leaf) -> codec | None, or a pytree "
            f"of codecs and None shaped like the gradients; got {type(policy).__name__}"
        )
    if cdef != treedef:
        raise ValueError(
            "jc.optax.compress_gradients: the codec pytree does not match the gradients. "
            "Give one codec (or None, for uncompressed) per gradient leaf, in a pytree of the "
            f"same structure as the parameters.\n  codecs:    {cdef}\n  gradients: {treedef}"
        )
    for c in codecs:
        if c is not None and not is_codec_like(c):
            raise TypeError(
                "jc.optax.compress_gradients: the codec pytree's leaves must be jaxcomp codecs, "
                f"spec strings such as 'qsgd:bits=4', or None, got {type(c).__name__}"
            )
    return [None if c is None else as_codec(c, _WHO) for c in codecs]


def _route(path: str, codec: Codec | None, size: int, dtype: np.dtype, min_compress_size: int):
    """Where a leaf goes this step: "passthrough" (a float0 gradient),
    "exact" (uncompressed) or "compressed"; a TypeError if none fits."""
    if dtype == np.dtype(jax.dtypes.float0):
        return "passthrough"
    if codec is None or size < min_compress_size:
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)):
            raise TypeError(
                f"jc.optax.compress_gradients: gradient {path} has dtype {dtype.name}; only "
                "floating-point gradients can be averaged"
            )
        return "exact"
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jc.optax.compress_gradients: {codec!r} cannot carry gradient {path} of dtype "
            f"{dtype.name} (codecs take float32, bfloat16 or float16); give that leaf the codec "
            "None in a policy (a callable (path, leaf) -> codec | None, or a pytree of codecs) "
            "to send it uncompressed"
        )
    return "compressed"


# The bucket the backward pass completes first holds at most this fraction of
# fusion_bytes, so that its collective starts after the last layers' gradients
# (PyTorch DDP's first bucket is small for the same reason).
FIRST_BUCKET_FRACTION = 8


def _fuse(leaves: list[int], sizes: list[int], itemsize: int, fusion_bytes: int):
    """Splits leaves sharing a codec and dtype, in order, into buckets of at
    most ``fusion_bytes`` (a larger leaf is a bucket of its own), filled
    from the last leaf: for a model whose parameters are listed in the order
    of use, the order in which the backward pass completes them. The
    bucket of the last leaves holds at most ``fusion_bytes //
    FIRST_BUCKET_FRACTION``."""
    buckets: list[list[int]] = [[]]
    nbytes, cap = 0, fusion_bytes // FIRST_BUCKET_FRACTION
    for i in reversed(leaves):
        if buckets[-1] and nbytes + sizes[i] * itemsize > cap:
            buckets.append([])
            nbytes, cap = 0, fusion_bytes
        buckets[-1].append(i)
        nbytes += sizes[i] * itemsize
    return [b[::-1] for b in reversed(buckets)]


def make_plan(
    policy: Policy, tree, *, min_compress_size: int, fusion_bytes: int, layers=None
) -> Plan:
    """Builds the plan for gradients shaped like ``tree``.

    Args:
      policy: a codec for every leaf, a callable ``(path, leaf) -> codec |
        None``, or a pytree of codecs and None with ``tree``'s structure
        (None: uncompressed); as ``compress_gradients``' ``codec``.
      tree: the gradients, or their ``jax.ShapeDtypeStruct``s.
      min_compress_size: leaves with fewer elements go uncompressed.
      fusion_bytes: the largest fused bucket, in gradient bytes.
      layers: ``layers(path, leaf) -> bool``, or None: the compressed
        leaves it names are stacks of layers (a model scanned over them),
        each a stacked bucket of its own (:attr:`Bucket.layers`), one
        layer's slice fused, sized and checked against
        ``min_compress_size``.
    Returns:
      The :class:`Plan`.
    Raises:
      ValueError: a policy pytree of another structure; ``layers`` naming a
        leaf of no dimension.
      TypeError: a policy returning something other than a codec or None;
        an integer gradient; a codec for a dtype it cannot carry.
    """
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    codecs = leaf_codecs(policy, tree)
    paths = tuple(jax.tree_util.keystr(path) for path, _ in leaves_with_path)
    shapes = tuple(tuple(int(d) for d in leaf.shape) for _, leaf in leaves_with_path)
    dtypes = tuple(np.dtype(leaf.dtype) for _, leaf in leaves_with_path)
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]

    compressed: dict[tuple[Codec, np.dtype], list[int]] = {}
    exact: dict[np.dtype, list[int]] = {}
    passthrough: list[int] = []
    stacked: list[Bucket] = []
    for i, codec in enumerate(codecs):
        path, leaf = leaves_with_path[i]
        if layers is not None and layers(path, leaf):
            if not shapes[i]:
                raise ValueError(
                    f"{_WHO}: layers= names {paths[i]}, a scalar; a stacked leaf has a "
                    "leading axis of layers (the axis a scan over layers slices)"
                )
            n = shapes[i][0]
            if n and _route(paths[i], codec, sizes[i] // n, dtypes[i], min_compress_size) == (
                "compressed"
            ):
                stacked.append(Bucket(codec, dtypes[i], (i,), (sizes[i] // n,), n))
                continue
        route = _route(paths[i], codec, sizes[i], dtypes[i], min_compress_size)
        if route == "passthrough":
            passthrough.append(i)
        elif route == "exact":
            exact.setdefault(dtypes[i], []).append(i)
        else:
            compressed.setdefault((codec, dtypes[i]), []).append(i)
    buckets = [
        Bucket(codec, dtype, tuple(members), tuple(sizes[j] for j in members))
        for (codec, dtype), leaves in compressed.items()
        for members in _fuse(leaves, sizes, dtype.itemsize, fusion_bytes)
    ] + stacked
    buckets.sort(key=lambda b: b.leaves[0])
    return Plan(
        treedef,
        shapes,
        dtypes,
        tuple(buckets),
        tuple((d, tuple(ix)) for d, ix in exact.items()),
        tuple(passthrough),
        paths,
    )
