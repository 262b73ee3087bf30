"""Platform dispatch between FFI kernels and their pure-JAX twins.

This is the only place that runs one or the other, as ``backend`` (a codec
resolves it, with whether GPUs run the CUDA kernel, in ``Codec.route``)
says: "xla" always runs the twin; "ffi" always calls the kernel (lowering
fails on a platform without one); "auto" runs the kernel on the CPU and,
where the codec's rule (``Codec.cuda_auto``) says so, on CUDA GPUs, and the twin
elsewhere (TPU, a GPU build without CUDA); "fused" runs the kernel on the
CPU and the twin elsewhere, where XLA fuses the twin into what consumes its
result (the collectives decode with it).

Under a trace the choice is one primitive, ``jaxcomp_platform_call``, with
a lowering rule per platform: each lowers its own branch (the kernel's
custom call, or the twin traced then), so a program lowered for the CPU
never traces the twin and holds no conditional, and a program exported
for several platforms gets one branch per platform, as
``lax.platform_dependent`` would give it. ``lax.platform_dependent``
itself traces every branch at once and lowers a conditional around each
call: trace and compile time that every step would pay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxcomp._ffi import Backend, cpu_available, cuda_available, kernels_line, resolve_backend


def ffi_call(
    target: str,
    results: Sequence[jax.ShapeDtypeStruct],
    *args: jax.Array,
    **attrs: int,
) -> tuple[jax.Array, ...]:
    """Calls an FFI target; integer attributes are passed as exact int64."""
    call = jax.ffi.ffi_call(target, tuple(results), vmap_method="broadcast_all")
    outs = tuple(call(*args, **{k: np.int64(v) for k, v in attrs.items()}))
    # Inside shard_map, an ffi_call's outputs are typed device-invariant even
    # though they depend on per-device inputs; mark them varying over the
    # inputs' axes, as the twin's outputs are (and as they really are).
    axes = _varying_axes(args)
    if axes:
        outs = tuple(lax.pcast(o, axes, to="varying") for o in outs)
    return outs


def _varying_axes(args) -> tuple[str, ...]:
    """Mesh axes over which any of ``args`` varies (empty outside shard_map)."""
    axes: set[str] = set()
    for a in args:
        aval = jax.typeof(a)
        mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.11
        varying = mat.varying if mat is not None else getattr(aval, "vma", None)
        axes |= set(varying or ())
    return tuple(sorted(axes))


def dispatch(
    backend: str,
    kernel: Callable[..., tuple[jax.Array, ...]],
    twin: Callable[..., tuple[jax.Array, ...]],
    *args: jax.Array,
    cuda: bool | None = None,
) -> tuple[jax.Array, ...]:
    """Runs ``kernel(*args)`` or ``twin(*args)`` according to ``backend``.

    "fused" on the CPU is the kernel: XLA:CPU's fused loops of the twins
    run slower than the kernels by more than the pass they save
    (docs/benchmarks.md, "The optimizer step" and "Compressed all-reduce
    over emulated links"). ``cuda`` says whether "auto" and "fused" run
    the kernel on CUDA GPUs (the codec's rule, ``Codec.cuda_auto``);
    None: "auto" does and "fused" does not. "ffi" always runs it."""
    backend = resolve_backend(backend)  # as it is where the caller resolved it
    if backend is Backend.XLA:
        return tuple(twin(*args))
    cpu = cpu_available()
    required = backend in (Backend.FFI, Backend.FUSED_FFI)
    if required and not (cpu or cuda_available()):
        raise RuntimeError(
            f"backend='ffi' but no jaxcomp kernels are loaded: {kernels_line()}. "
            "backend='xla' or 'auto' runs the pure-JAX twins instead"
        )
    if backend is Backend.FFI:
        return tuple(kernel(*args))
    if not required and any(a.size == 0 for a in args if hasattr(a, "size")):
        # Nothing to compute; the twin handles empty shapes without a custom call.
        return tuple(twin(*args))
    fused = backend in (Backend.FUSED, Backend.FUSED_FFI)
    on_cpu = kernel if cpu or required else twin
    use_cuda = (not fused) if cuda is None else cuda
    on_cuda = kernel if cuda_available() and use_cuda else twin
    if on_cpu is twin and on_cuda is twin:
        return tuple(twin(*args))
    # The kernel's result types are the cheap trace (a custom call and its
    # varying-axes casts).
    return tuple(platform_dependent(*args, cpu=on_cpu, cuda=on_cuda, default=twin, typed_by=kernel))


def platform_dependent(
    *args,
    cpu: Callable,
    default: Callable,
    cuda: Callable | None = None,
    typed_by: Callable | None = None,
):
    """``lax.platform_dependent(*args, cpu=..., cuda=..., default=...)``, each
    branch traced only where a platform that runs it is lowered.

    Under a trace it is one ``jaxcomp_platform_call`` with a lowering rule
    per platform; eagerly, ``lax.platform_dependent`` (only the default
    device's branch runs). ``args`` are pytrees of arrays; the branches
    take them and nothing from an enclosing trace (they are traced later,
    at lowering), and return the same pytree of the same types. ``typed_by``
    (default ``cpu``) is the function traced now for those types: the
    cheapest."""
    cuda = default if cuda is None else cuda
    leaves, in_tree = jax.tree.flatten(args)
    if not any(isinstance(a, jax.core.Tracer) for a in leaves):
        return lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=default)

    def flat(fn):
        return lambda *a: tuple(jax.tree.leaves(fn(*jax.tree.unflatten(in_tree, a))))

    typed = typed_by or cpu
    jaxpr, shapes = jax.make_jaxpr(
        lambda *a: typed(*jax.tree.unflatten(in_tree, a)), return_shape=True
    )(*leaves)
    branches = {id(f): flat(f) for f in (cpu, cuda, default)}  # identical branches stay so
    out_avals = tuple(jaxpr.out_avals)
    outs = _call_p.bind(
        *leaves,
        cpu=branches[id(cpu)],
        cuda=branches[id(cuda)],
        default=branches[id(default)],
        out_avals=out_avals,
    )
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


# A kernel call or its twin, per platform (dispatch): the operands, the
# branches for "cpu", "cuda" and the rest, and the results' types.
_call_p = Primitive("jaxcomp_platform_call")
_call_p.multiple_results = True
_call_p.def_abstract_eval(lambda *avals, out_avals, **branches: out_avals)


def _call_impl(*args, cpu, cuda, default, out_avals):
    return tuple(lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=default))


_call_p.def_impl(_call_impl)


def _lowering(platform: str | None):
    def rule(ctx, *args, cpu, cuda, default, out_avals):
        fn = {"cpu": cpu, "cuda": cuda}.get(platform, default)
        return mlir.lower_fun(lambda *a: tuple(fn(*a)), multiple_results=True)(ctx, *args)

    return rule


mlir.register_lowering(_call_p, _lowering(None))
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(_call_p, _lowering(_platform), platform=_platform)


def _batched(args, dims, *, cpu, cuda, default, out_avals):
    # Batched, each branch vmapped; still traced only where it is lowered.
    unbatched = getattr(batching, "not_mapped", None)  # None in newer JAX
    axes = tuple(None if d is unbatched else d for d in dims)
    size = next(a.shape[d] for a, d in zip(args, axes, strict=True) if d is not None)

    def vmapped(fn):
        return lambda *xs: tuple(jax.vmap(lambda *ys: tuple(fn(*ys)), in_axes=axes)(*xs))

    fns = {id(fn): vmapped(fn) for fn in (cpu, cuda, default)}  # identical branches stay so
    avals = tuple(a.update(shape=(size, *a.shape)) for a in out_avals)  # the batch axis first
    outs = _call_p.bind(
        *args, cpu=fns[id(cpu)], cuda=fns[id(cuda)], default=fns[id(default)], out_avals=avals
    )
    return outs, [0] * len(avals)


batching.primitive_batchers[_call_p] = _batched
