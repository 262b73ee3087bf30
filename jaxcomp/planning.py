"""Which codec and algorithm to use: a cost model of the compressed all-reduce.

``python -m jaxcomp plan`` and docs/choosing.md are built on this module. For
a gradient of ``n`` float32 values, a cluster (processes, devices per
process, the links between and within them) and the codecs' measured speed,
it predicts the time of every codec x algorithm and ranks them against
``lax.psum``. A prediction is the sum of

- **the wire**: the alpha-beta model (Hockney 1994; for the collectives,
  Thakur, Rabenseifner and Gropp 2005): every collective costs its rounds
  times the link's latency plus its bytes over the bandwidth. The bytes are
  library's own accounting: every registered algorithm declares its
  collectives and their bytes (``jc.collectives.Algorithm.collectives``,
  from the codecs' ``wire_nbytes`` and ``capacity_tiers``), not derived
  again here. Where several
  devices of one process (node) reach other nodes over one link, that
  link carries the node's share of every collective (below, ``_egress``);
- **the codec's kernels**: the encodes and decodes the algorithm runs
  (as it declares them, ``jc.collectives.Algorithm.kernel_calls``,
  matching the compiled program: tests/test_planning.py counts the custom
  calls), at the
  per-element cost measured by ``jaxcomp._bench`` (``python -m jaxcomp
  bench``) on this machine or read from a stored run;
- **memory passes** (CPU): XLA's own count of the bytes the program's other
  operations touch (``cost_analysis()["bytes accessed"]`` of the compiled
  all-reduce, which leaves the kernels out) at the machine's copy rate, and
  the page faults of large buffers that the CPU runtime allocates afresh
  every call (glibc serves allocations above its largest mmap threshold,
  32 MiB, from fresh zeroed pages), from ``memory_analysis()``; plus, with
  error feedback, the residual's passes.

Sharded training (``python -m jaxcomp plan --shard-params``,
:func:`plan_sharded`) is priced with the same terms: a step's parameter
all-gathers and gradient reduce-scatter per layer, as
``jc.collectives.ReduceScatter`` and ``AllGather`` declare their
collectives and kernel calls, ranked against float32 sharded training.

Everything runs in sequence: XLA:CPU runs a collective's neighbours before
or after it, not beside it (docs/collectives.md, "Overlap"), so the parts
add up. On GPUs that is pessimistic where XLA overlaps compute with
communication.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from jaxcomp._axes import Axes
from jaxcomp.codecs.base import Codec, Rate
from jaxcomp.collectives import (
    Algorithm,
    Collective,
    KernelCall,
    choose_algorithm,
    registered,
    tier_nbytes,
)

F32 = np.dtype(np.float32)
BASELINE = "lax.psum"
# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX,
# 4 * 1024 * 1024 * sizeof(long)): buffers above it are mmapped and unmapped
# on every call, so each call pays the kernel's zeroing of their pages.
MMAP_THRESHOLD_MAX = 32 << 20
# Bytes per gradient element that error feedback adds (docs/training.md,
# "What one step does"): acc = grad + residual reads 8 and writes 4;
# residual = acc - sent reads 4 and writes 4 (the own payload's decode is a
# kernel call of its own).
ERROR_FEEDBACK_BYTES = 20
# Devices the CPU programs are compiled for to read XLA's memory traffic;
# beyond it the traffic is extrapolated linearly in the number of devices.
TRAFFIC_MAX_DEVICES = 8


# ---------------------------------------------------------------------------
# Links and clusters
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Link:
    """One link of the alpha-beta model.

    Attributes:
      bandwidth: nominal bits per second, each direction. For the link
        between processes (nodes): what one process's network interfaces
        carry together; within a node: per device.
      latency: seconds per message round (alpha).
      goodput: the fraction of ``bandwidth`` a transfer gets (TCP and
        framing overheads).
      all_to_all_slowdown: an all-to-all that sends more than
        ``queue_bytes`` over the link takes this many times its nominal
        bandwidth time (in place of ``goodput``): the measured cost of the
        packets lost when ``P - 1`` flows, posted at once, overflow a shaped
        queue (docs/choosing.md).
      queue_bytes: the bytes a link's queue holds before it drops.
    """

    bandwidth: float
    latency: float = 0.0
    goodput: float = 1.0
    all_to_all_slowdown: float = 1.0
    queue_bytes: float = math.inf

    def seconds(self, nbytes: float, kind: str) -> float:
        """Bandwidth time of ``nbytes`` sent over this link by one
        collective of ``kind``."""
        if kind == "all-to-all" and nbytes > self.queue_bytes:
            return 8 * nbytes / self.bandwidth * self.all_to_all_slowdown
        return 8 * nbytes / (self.bandwidth * self.goodput)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where the all-reduce runs.

    Attributes:
      processes: JAX processes (nodes), joined by ``inter``.
      devices_per_process: devices of each process, joined by ``intra``.
      inter: the link between processes; its bandwidth is what one
        process's interfaces carry together.
      intra: the link between the devices of one process (None: free).
    """

    processes: int
    devices_per_process: int
    inter: Link
    intra: Link | None = None

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process


# ---------------------------------------------------------------------------
# Codec compute: per-element costs measured by jaxcomp._bench
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelRates:
    """One codec's measured throughput, in GB/s of float32 input, at some
    sizes (ascending); ``bits`` is the payload bits per element the data
    needed (below the static size only for variable-rate codecs)."""

    sizes: tuple[int, ...]
    encode_gbps: tuple[float, ...]
    decode_gbps: tuple[float, ...]
    bits: float

    def seconds(self, what: str, m: int) -> float:
        """Seconds to encode or decode ``m`` values: per-element time
        interpolated in log size between the measured sizes, held past
        them."""
        if m <= 0:
            return 0.0
        gbps = self.encode_gbps if what == "encode" else self.decode_gbps
        per = [4.0 / (g * 1e9) for g in gbps]
        if m <= self.sizes[0] or len(self.sizes) == 1:
            return m * per[0]
        if m >= self.sizes[-1]:
            return m * per[-1]
        i = int(np.searchsorted(self.sizes, m)) - 1
        lo, hi = math.log(self.sizes[i]), math.log(self.sizes[i + 1])
        t = (math.log(m) - lo) / (hi - lo)
        return m * (per[i] * (1 - t) + per[i + 1] * t)


@dataclasses.dataclass(frozen=True)
class Compute:
    """What the codecs' kernels and the memory passes cost on one device.

    Attributes:
      platform: "cpu" or "gpu". On GPUs the collectives decode with the
        twins fused into their consumers (docs/collectives.md) and the
        allocator reuses memory, so the XLA:CPU memory terms do not apply.
      kernels: ``repr(codec)`` -> its :class:`KernelRates`.
      memcpy_gbps: GB/s of a buffer copy on that device (each byte read
        and written).
      share: how many times slower than measured the compute runs, e.g.
        4 for four processes sharing the two cores the figures were
        measured with, whose kernels each used both.
      source: where the figures come from, for the report.
    """

    platform: str
    kernels: Mapping[str, KernelRates]
    memcpy_gbps: float
    share: float = 1.0
    source: str = ""

    def rates(self, codec: Codec) -> KernelRates:
        try:
            return self.kernels[repr(codec)]
        except KeyError:
            raise ValueError(
                f"jaxcomp.planning: no compute figures for {codec!r} in {self.source or 'the profile'}; "
                "measure it (python -m jaxcomp plan --codecs ...) or pass --no-compute"
            ) from None

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds for ``nbytes`` of memory traffic (a copy moves two bytes
        of traffic per byte copied)."""
        return self.share * nbytes / (2 * self.memcpy_gbps * 1e9)

    def fresh_seconds(self, nbytes: float) -> float:
        """Seconds to fault in ``nbytes`` of fresh pages: about a pass
        writing them (docs/benchmarks.md: "a temporary costs about what a
        pass writing it costs")."""
        return self.share * nbytes / (self.memcpy_gbps * 1e9)


def _pick(rows: Sequence[Mapping], backend: str) -> Mapping | None:
    return next((r for r in rows if r["backend"] == backend), None)


def load_compute(path: str, *, share: float = 1.0) -> Compute:
    """A :class:`Compute` from a ``jaxcomp._bench`` JSON (``python -m
    jaxcomp bench --json FILE``).

    Encodes use the kernel's figure (the collectives encode with it);
    decodes the kernel's on the CPU, and on GPUs the twin's for codecs
    whose decode is element-wise (what the collectives run there).
    """
    with open(path) as f:
        data = json.load(f)
    env = data.get("environment", {})
    gpu = env.get("device_kind", "cpu") != "cpu"
    by_codec: dict[str, dict[int, list[Mapping]]] = {}
    for r in data["rows"]:
        by_codec.setdefault(r["codec"], {}).setdefault(int(r["n"]), []).append(r)
    elementwise = _elementwise_by_repr()
    kernels = {}
    for name, sizes in by_codec.items():
        enc, dec, bits = [], [], 0.0
        for n in sorted(sizes):
            ffi, twin = _pick(sizes[n], "ffi"), _pick(sizes[n], "xla")
            e = ffi or twin
            d = twin if gpu and elementwise.get(name, False) and twin else (ffi or twin)
            enc.append(e["encode_gbps"])
            dec.append(d["decode_gbps"])
            bits = e["bits_per_element"]
        kernels[name] = KernelRates(tuple(sorted(sizes)), tuple(enc), tuple(dec), bits)
    # The copy rate of the largest size: the memory passes are over tensors
    # past the caches.
    largest = max(int(r["n"]) for r in data["rows"])
    memcpy = float(np.median([r["memcpy_gbps"] for r in data["rows"] if int(r["n"]) == largest]))
    label = f"{path} ({env.get('device_kind', '?')})"
    return Compute("gpu" if gpu else "cpu", kernels, memcpy, share, label)


def _elementwise_by_repr() -> dict[str, bool]:
    from jaxcomp import codecs

    return {
        repr(c): c.elementwise_decode
        for cls in codecs.registered()
        for c in cls.examples(coverage=True)
    }


def measure_compute(
    codecs: Iterable[Codec], n: int = 1 << 22, *, reps: int = 3, share: float = 1.0
) -> Compute:
    """A :class:`Compute` measured now on JAX's default device, quickly: one
    jitted encode and decode per codec at ``n`` values, the median of
    ``reps`` calls (``jaxcomp._bench``'s input and timer), used for every
    size; and the copy rate of a 64 MiB buffer, past the caches. For the
    full benchmark (steady-state loops, several sizes) run ``python -m
    jaxcomp bench --json FILE`` and pass it with ``--compute FILE``."""
    import jax

    from jaxcomp import _bench, _ffi

    # Another process's load slows these timings and so every prediction
    # made with them: the label says so (the one-minute load average, per
    # core, before and after the measurement).
    load_before = _load_per_core()
    x = _bench.make_input(n)
    gpu = x.devices().pop().platform != "cpu"
    kernels = _ffi.cuda_available() if gpu else _ffi.cpu_available()
    big = np.ones(1 << 24, np.float32)
    mc = _bench.device_copy_gbps(jax.device_put(big)) if gpu else _bench.memcpy_gbps(big)
    out = {}
    for c in codecs:
        out[repr(c)] = _measure_codec(c, x, kernels, gpu, reps)
    where = jax.devices()[0].device_kind
    label = f"measured now at n=2^{n.bit_length() - 1} ({where})"
    load = max(load_before, _load_per_core())
    if load > BUSY_LOAD:
        label += (
            f"; the host was busy (load {load:.1f} per core): the codecs' figures are "
            "slower than on a quiet host, and so is every prediction made with them"
        )
    return Compute("gpu" if gpu else "cpu", out, mc, share, label)


#: A one-minute load average per core above which :func:`measure_compute`
#: says that its figures were taken on a busy host.
BUSY_LOAD = 0.5


def _load_per_core() -> float:
    """The one-minute load average over the cores (0 where the platform has
    none)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


def _measure_codec(codec: Codec, x, kernels: bool, gpu: bool, reps: int) -> KernelRates:
    """Encode and decode throughput of one codec as the collectives run it:
    the kernels, and on GPUs the twin's decode for element-wise codecs."""
    import jax

    from jaxcomp import _bench

    n, key = x.size, jax.random.key(0)
    # As the collectives run them: "auto" is the kernel on the CPU and the
    # codec's rule on GPUs (Codec.kernels).
    enc_backend = "auto" if kernels and codec.name != "identity" else "xla"
    dec_backend = "xla" if gpu and codec.elementwise_decode else enc_backend
    enc = jax.jit(lambda x, k: codec.encode(x, k, backend=enc_backend))
    dec = jax.jit(lambda p: codec.decode(p, backend=dec_backend))
    payload = jax.block_until_ready(enc(x, key))
    te = _bench._median_seconds(functools.partial(enc, x, key), reps, 0.02)
    td = _bench._median_seconds(functools.partial(dec, payload), reps, 0.02)
    bits = 8 * int(payload.used_nbytes) / n
    return KernelRates((n,), (4 * n / te / 1e9,), (4 * n / td / 1e9,), bits)


# ---------------------------------------------------------------------------
# The library's bytes, per collective
# ---------------------------------------------------------------------------
def _named(algorithm: str) -> Algorithm:
    """The registered algorithm called ``algorithm``."""
    for alg in registered():
        if alg.name == algorithm:
            return alg
    known = ", ".join(a.name for a in registered())
    raise ValueError(f"jaxcomp.planning: unknown algorithm {algorithm!r} (one of {known})")


def collectives(
    codec: Codec | None, algorithm: str, n: int, devices, bits: float | None = None
) -> list[Collective]:
    """The collectives of one all-reduce of ``n`` float32 values, in
    program order, as the algorithm declares them
    (``jc.collectives.Algorithm.collectives``).

    Args:
      codec: the codec; None: ``lax.psum`` of the float32 tensor.
      algorithm: a registered algorithm's name.
      n: values per device.
      devices: the devices of one axis, or ``(slow, fast)`` sizes for an
        algorithm of two axes (each collective says which it runs over).
      bits: for variable-rate codecs, the payload bits per element the
        data needs, which pick each payload's capacity tier (None: the
        largest tier, as ``jc.collectives.operand_nbytes`` counts it).
    """
    axes = Axes.of_sizes(devices)
    if not axes.hierarchical and axes.size == 1:
        return []
    if codec is None:
        return [Collective("all-reduce", 4 * n)]
    return _named(algorithm).collectives(codec, n, F32, axes, bits)


def hierarchical_collectives(
    codec: Codec, n: int, nodes: int, local: int, bits: float | None = None
) -> tuple[list[Collective], str, list[Collective]]:
    """Deprecated: :func:`collectives` over ``(nodes, local)`` devices,
    each collective with the axis it runs over."""
    warnings.warn(
        "jaxcomp.planning.hierarchical_collectives is deprecated; use "
        "collectives(codec, algorithm, n, (nodes, local)), whose collectives say their axis",
        DeprecationWarning,
        stacklevel=2,
    )
    m = -(-n // local)
    slow_alg = choose_algorithm(codec, m, nodes)
    colls = collectives(codec, choose_algorithm(codec, n, (nodes, local)), n, (nodes, local), bits)
    return [c for c in colls if c.axis == 1], slow_alg, [c for c in colls if c.axis == 0]


def device_send_bytes(c: Collective, devices: int) -> float:
    """Bytes one device sends in collective ``c`` (the rules of
    ``jc.collectives.send_nbytes``)."""
    p = devices
    if c.kind == "all-gather":
        return (p - 1) * c.operand
    if c.kind in ("all-to-all", "reduce-scatter"):
        return (p - 1) / p * c.operand
    if c.kind == "all-reduce":
        return 2.0 * (p - 1) / p * c.operand
    return c.operand


def rounds(c: Collective, devices: int) -> int:
    """Message rounds of collective ``c`` (Thakur, Rabenseifner and Gropp
    2005: ring all-gather, ring reduce-scatter and pairwise-exchange
    all-to-all P - 1, ring all-reduce 2 (P - 1); one ppermute hop is one)."""
    p = devices
    if c.kind == "all-reduce":
        return 2 * (p - 1)
    if c.kind in ("all-gather", "all-to-all", "reduce-scatter"):
        return p - 1
    return 1


# ---------------------------------------------------------------------------
# Time of a collective on a cluster
# ---------------------------------------------------------------------------
def _egress(c: Collective, nodes: int, local: int) -> float:
    """Bytes one process (node) sends to the others in collective ``c`` over
    a flat axis of ``nodes * local`` devices in node-major order.

    Ring all-reduce and all-gather: the ring crosses each node boundary once
    per channel, and NCCL or gloo split the data over the channels, so a
    node sends what one device of the ring sends (Patarasuk and Yuan 2009:
    the bandwidth-optimal ring). All-to-all: each of the node's devices
    sends its pieces for every device of the other nodes. A ring hop
    (``ppermute`` to the next device): one device per node sends across.
    """
    p = nodes * local
    if nodes == 1:
        return 0.0
    if c.kind in ("all-reduce", "all-gather", "reduce-scatter"):
        return device_send_bytes(c, p)
    if c.kind == "all-to-all":
        return local * (p - local) / p * c.operand
    return c.operand


def _collective_time(
    c: Collective, cluster: Cluster, nodes: int, local: int, groups: int = 1
) -> tuple[float, float]:
    """(wire seconds, latency seconds) of ``c`` over ``nodes * local``
    devices; ``groups`` such collectives run at once, one per device of a
    node (the slow axis of ``(slow, fast)`` axes), sharing its link."""
    p = nodes * local
    wire, alpha = 0.0, 0.0
    if nodes > 1:
        wire = cluster.inter.seconds(groups * _egress(c, nodes, local), c.kind)
        alpha = cluster.inter.latency
    if local > 1 and cluster.intra is not None:
        wire = max(wire, cluster.intra.seconds(device_send_bytes(c, p), c.kind))
        alpha = max(alpha, cluster.intra.latency)
    return wire, rounds(c, p) * alpha


def kernel_calls(codec: Codec, algorithm: str, n: int, devices) -> list[KernelCall]:
    """The encode and decode kernel calls of one device, ``(what, values,
    codec)``, as ``jc.psum`` runs them for its value: what the algorithm
    declares (``jc.collectives.Algorithm.kernel_calls``; the compiled
    program's custom calls, tested); one device encodes and decodes once.
    Identity has no kernel. ``devices``: as in :func:`collectives`."""
    if codec.name == "identity":
        return []
    axes = Axes.of_sizes(devices)
    if not axes.hierarchical and axes.size == 1:
        return [KernelCall("encode", n, codec), KernelCall("decode", n, codec)]
    return _named(algorithm).kernel_calls(codec, n, F32, axes)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """XLA:CPU's accounting of a compiled all-reduce, per element of the
    tensor: bytes its non-kernel operations touch, and the bytes of its
    temporaries and of its output."""

    accessed: float
    temp: float
    output: float
    kernel_calls: int = 0  # jaxcomp custom calls in the program (every branch)


@functools.cache
def program_traffic(codec: Codec | None, algorithm: str, shape: tuple[int, ...], n: int) -> Traffic:
    """Compiles ``jc.psum`` (``lax.psum`` for ``codec`` None) of ``n`` float32
    per device on a CPU mesh of ``shape`` (one axis, or ``(slow, fast)``
    for an algorithm of two axes) and reads XLA's cost and memory
    analyses. Needs ``prod(shape)`` CPU devices (``jax_num_cpu_devices``)."""
    import jax

    from jaxcomp.collectives import psum

    def f(x, axis, k):
        if codec is None:
            return jax.lax.psum(x, axis)
        return psum(x, axis, codec, key=k, algorithm=algorithm).value

    return _compiled_traffic(f, shape, n, "float32")


@functools.cache
def sharded_traffic(
    collective: str, codec: Codec | None, shape: tuple[int, ...], n: int, dtype: str = "float32"
) -> Traffic:
    """:func:`program_traffic` of a collective of sharded training:
    ``collective`` is ``jc.collectives.ReduceScatter``'s name (``jc.psum_scatter``
    of ``n`` values, tiled), ``AllGather``'s (``jc.all_gather`` of ``n``),
    or :data:`BASELINE` (``lax.psum``); ``codec`` None: lax's collective,
    in ``dtype``."""
    from jax import lax

    from jaxcomp.collectives import AllGather, ReduceScatter, all_gather, psum_scatter

    def f(x, axis, k):
        if collective == ReduceScatter.name:
            if codec is None:
                return lax.psum_scatter(x, axis, tiled=True)
            # The value and what was sent (error feedback's residual is made of it).
            return tuple(psum_scatter(x, axis, codec, key=k, tiled=True))[:2]
        if collective == AllGather.name:
            if codec is None:
                return lax.all_gather(x, axis, tiled=True)
            return all_gather(x, axis, codec, key=k, tiled=True)
        if collective == BASELINE and codec is None:
            return lax.psum(x, axis)
        raise ValueError(f"jaxcomp.planning: no sharded program {collective!r} of {codec!r}")

    return _compiled_traffic(f, shape, n, dtype)


def _compiled_traffic(body, shape: tuple[int, ...], n: int, dtype: str) -> Traffic:
    """Compiles ``body(x, axis, key)`` (an array, or a tuple of them) of
    this device's ``n`` values of ``dtype`` on a CPU mesh of ``shape`` and
    reads XLA's cost and memory analyses, per value."""
    import jax
    from jax.sharding import PartitionSpec as P

    count = math.prod(shape)
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        raise RuntimeError(
            f"jaxcomp.planning: {count} CPU devices needed to compile the collective, "
            f"{len(cpus)} present (set jax_num_cpu_devices before JAX starts)"
        )
    names = ("slow", "fast") if len(shape) == 2 else ("data",)
    axis = names if len(shape) == 2 else names[0]
    mesh = jax.sharding.Mesh(np.array(cpus[:count]).reshape(shape), names)

    def f(x, k):
        return jax.tree.map(lambda y: y[None], body(x[0], axis, k))

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(axis)))
    x = jax.ShapeDtypeStruct((count, n), np.dtype(dtype))
    compiled = g.lower(x, jax.random.key(0)).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    calls = len(re.findall(r'custom_call_target="jaxcomp_', compiled.as_text()))
    return Traffic(
        cost.get("bytes accessed", 0.0) / n,
        mem.temp_size_in_bytes / n,
        mem.output_size_in_bytes / n,
        calls,
    )


def traffic(
    codec: Codec | None, algorithm: str, shape: tuple[int, ...], n: int = 1 << 16
) -> Traffic:
    """:func:`program_traffic` for any number of devices: compiled at up
    to :data:`TRAFFIC_MAX_DEVICES` devices (fewer if fewer CPU devices are
    present; a ``(slow, fast)`` mesh at up to half of them x 2), and past that
    extrapolated linearly in the devices from two sizes where it grows
    (the allgather's decoded rows and the ring's copies grow with P), held
    where it does not."""
    return _extrapolated(lambda s: program_traffic(codec, algorithm, s, n), shape)


def _sharded_at(collective, codec, shape, dtype) -> Traffic:
    """:func:`sharded_traffic` for any number of devices (as :func:`traffic`)."""
    return _extrapolated(lambda s: sharded_traffic(collective, codec, s, 1 << 16, dtype), shape)


def _extrapolated(compiled_at, shape: tuple[int, ...]) -> Traffic:
    """:func:`traffic`'s rule over ``compiled_at(shape) -> Traffic``."""
    import jax

    most = min(len(jax.devices("cpu")), TRAFFIC_MAX_DEVICES)
    if most < 2:
        raise RuntimeError(
            "jaxcomp.planning: compiling the collectives needs 2 or more CPU devices "
            "(jax.config.update('jax_num_cpu_devices', 8) before JAX starts), or --no-compute"
        )
    if len(shape) == 2:
        return compiled_at((min(shape[0], most // 2), min(shape[1], 2)))
    (p,) = shape
    if p <= most:
        return compiled_at((p,))
    a = compiled_at((most // 2,))
    b = compiled_at((most,))
    t = (p - most) / (most - most // 2)
    grow = lambda u, v: v + max(v - u, 0.0) * t  # noqa: E731
    return Traffic(grow(a.accessed, b.accessed), grow(a.temp, b.temp), b.output, b.kernel_calls)


def _memory_seconds(compute: Compute, t: Traffic, n: int) -> float:
    """The XLA:CPU memory terms of one all-reduce of ``n`` values: the bytes
    its operations touch, and the fresh pages of its buffers above glibc's
    mmap threshold (the temporaries are one allocation on XLA:CPU)."""
    fresh = sum(b for b in (t.temp * n, t.output * n) if b > MMAP_THRESHOLD_MAX)
    return compute.memory_seconds(t.accessed * n) + compute.fresh_seconds(fresh)


# ---------------------------------------------------------------------------
# One prediction
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Estimate:
    """The predicted time of one all-reduce, in parts (seconds).

    Attributes:
      codec: the codec (None: ``lax.psum`` of float32).
      algorithm: the algorithm (as it labels itself: the hierarchical one
        with its slow stage in brackets).
      wire: bandwidth time of every collective.
      latency: rounds times the links' latency.
      kernels: the codec's encodes and decodes.
      memory: the other operations' memory traffic and fresh pages (CPU),
        and error feedback's passes.
      inter_bytes: bytes one process sends to the others.
      device_bytes: bytes one device sends (``jc.collectives.send_nbytes``).
      bits: payload bits per element.
      method: a training method other than ``compress_gradients`` with the
        codec (:func:`method_estimates`), "" for the codec rows.
      compressed_by: the algorithm whose compression this is (a
        hierarchical row's slow stage), which its accuracy measurement
        (:func:`measured_loss`) is looked up by.
    """

    codec: Codec | None
    algorithm: str
    wire: float
    latency: float
    kernels: float
    memory: float
    inter_bytes: float
    device_bytes: float
    bits: float
    method: str = ""
    compressed_by: str = ""

    @property
    def seconds(self) -> float:
        return self.wire + self.latency + self.kernels + self.memory

    @property
    def name(self) -> str:
        if self.method:
            return self.method
        return "float32" if self.codec is None else self.codec.spec

    @property
    def baseline(self) -> bool:
        """Whether this is an uncompressed all-reduce of float32."""
        return self.codec is None and not self.method


def _bits(codec: Codec, compute: Compute | None) -> float | None:
    """Payload bits per element the data needs, for variable-rate codecs
    (measured with the compute figures; None: the largest tier)."""
    if codec.rate is not Rate.VARIABLE or compute is None:
        return None
    rates = compute.kernels.get(repr(codec))
    return None if rates is None else rates.bits


def _compute_seconds(
    codec: Codec | None,
    algorithm: str,
    calls: list[tuple[str, int, Codec]],
    n: int,
    shape: tuple[int, ...],
    compute: Compute | None,
) -> tuple[float, float]:
    """(kernel seconds, memory seconds) of one device running ``calls``
    and the rest of the compiled all-reduce of ``n`` values over a mesh of
    ``shape``."""
    if compute is None:
        return 0.0, 0.0
    kern = compute.share * sum(compute.rates(c).seconds(what, m) for what, m, c in calls)
    mem = 0.0
    if compute.platform == "cpu" and math.prod(shape) > 1:
        mem = _memory_seconds(compute, traffic(codec, algorithm, shape), n)
    return kern, mem


def predict(
    codec: Codec | None,
    algorithm: str,
    n: int,
    cluster: Cluster,
    compute: Compute | None = None,
    *,
    error_feedback: bool = False,
) -> Estimate:
    """The predicted time of one all-reduce of ``n`` float32 values.

    Args:
      codec: the codec, or None for ``lax.psum`` (``algorithm`` ignored).
      algorithm: a registered algorithm: one of one axis over all the
        cluster's devices, or one of two axes over (processes, devices per
        process).
      n: values per device.
      cluster: the devices and links.
      compute: the codecs' measured speed (None: the wire alone).
      error_feedback: add what ``compress_gradients``'s error feedback
        costs (the own payload's decode and the residual's passes).
    Returns:
      An :class:`Estimate`.
    """
    if codec is None:
        return _predict_baseline(n, cluster, compute)
    alg = _named(algorithm)
    axes, spans = _axes(cluster, alg.num_axes)
    colls = collectives(codec, alg.name, n, axes.axis_sizes, _bits(codec, compute))
    wire, latency, inter, dev = _on_axes(colls, cluster, spans)
    calls = kernel_calls(codec, alg.name, n, axes.axis_sizes)
    kern, mem = _compute_seconds(codec, alg.name, calls, n, axes.sizes, compute)
    own = alg.compressed_values(n, axes) if axes.size > 1 else n
    if error_feedback:
        # On one device the decoded payload is the value itself.
        k2, m2 = _error_feedback(compute, codec, n, own if axes.size > 1 else 0)
        kern, mem = kern + k2, mem + m2
    bits = 8 * _payload_bytes(codec, own, compute) / own
    label = alg.label(codec, n, axes)
    by = alg.compressor(codec, n, axes).name
    return Estimate(codec, label, wire, latency, kern, mem, inter, dev, bits, compressed_by=by)


def _axes(cluster: Cluster, num_axes: int) -> tuple[Axes, list[tuple[int, int, int]]]:
    """The axes an algorithm of ``num_axes`` axes runs over on ``cluster``,
    and for each axis ``(nodes, local, groups)``: the processes it spans,
    the devices of each process it spans, and how many such collectives
    share a process's link at once. One axis: every device (node-major);
    ``(slow, fast)``: the processes, then the devices of each."""
    nodes, local = cluster.processes, cluster.devices_per_process
    if num_axes == 1:
        return Axes((cluster.devices,)), [(nodes, local, 1)]
    return Axes((nodes, local)), [(nodes, 1, local), (1, local, 1)]


def _on_axes(colls: Sequence[Collective], cluster: Cluster, spans) -> tuple[float, ...]:
    """(wire s, latency s, bytes one process sends to the others, bytes one
    device sends) of ``colls`` over the axes of ``spans``."""
    wire = latency = 0.0
    inter = dev = 0
    for i, (nodes, local, groups) in enumerate(spans):
        on = [c for c in colls if c.axis == i]
        w, a = _wire(on, cluster, nodes, local, groups)
        wire, latency = wire + w, latency + a
        if nodes > 1:  # an axis within a process sends nothing to the others
            inter += groups * sum(_egress(c, nodes, local) for c in on)
        dev += sum(device_send_bytes(c, nodes * local) for c in on)
    return wire, latency, inter, dev


def _predict_baseline(n: int, cluster: Cluster, compute: Compute | None) -> Estimate:
    """``lax.psum`` of ``n`` float32 values over every device."""
    p, local = cluster.devices, cluster.devices_per_process
    colls = collectives(None, BASELINE, n, p)
    wire, latency, inter, dev = _on_axes(colls, cluster, [(cluster.processes, local, 1)])
    _, mem = _compute_seconds(None, BASELINE, [], n, (p,), compute)
    return Estimate(None, BASELINE, wire, latency, 0.0, mem, inter, dev, 32.0)


def _wire(colls, cluster, nodes, local, groups=1) -> tuple[float, float]:
    parts = [_collective_time(c, cluster, nodes, local, groups) for c in colls]
    return sum(w for w, _ in parts), sum(a for _, a in parts)


def _error_feedback(compute, codec, n, own):
    """(kernel, memory) seconds of error feedback: the own payload's decode
    of ``own`` values and the residual's passes over ``n``."""
    if compute is None:
        return 0.0, 0.0
    kern = (
        compute.share * compute.rates(codec).seconds("decode", own)
        if codec.name != "identity"
        else 0.0
    )
    return kern, compute.memory_seconds(ERROR_FEEDBACK_BYTES * n)


def _payload_bytes(codec: Codec, n: int, compute: Compute | None) -> float:
    bits = _bits(codec, compute)
    return codec.wire_nbytes((n,), F32) if bits is None else tier_nbytes(codec, n, F32, bits)


# ---------------------------------------------------------------------------
# Ranking
# ---------------------------------------------------------------------------
def default_codecs() -> list[Codec]:
    """The recommended configuration of every registered codec (the first of
    its ``examples()``), Identity aside."""
    from jaxcomp import codecs

    return [cls.examples()[0] for cls in codecs.registered() if cls is not codecs.Identity]


def candidate_algorithms(
    codec: Codec, cluster: Cluster, only: Sequence[str] | None = None
) -> list[str]:
    """The algorithms ``codec`` can run on ``cluster``: every registered
    algorithm that is ranked for the codec's rate
    (``Algorithm.planned_rates``), unless a second compression is unsafe
    for it (``jc.collectives.recompression_warning``: TernGrad); those of
    two axes where several processes each have several devices. ``only``:
    just these."""
    levels = 2 if cluster.processes > 1 and cluster.devices_per_process > 1 else 1
    out = []
    for alg in registered():
        if (
            (only is None or alg.name in only)
            and codec.rate in alg.planned_rates
            and alg.num_axes <= levels
            and alg.recompression_warning(codec) is None
        ):
            out.append(alg.name)
    return out


def plan(
    n: int,
    cluster: Cluster,
    compute: Compute | None = None,
    *,
    codecs: Sequence[Codec] | None = None,
    algorithms: Sequence[str] | None = None,
    error_feedback: bool = True,
    bucket: int | None = None,
    min_bits: float = 0.0,
    methods: Methods | None = None,
) -> list[Estimate]:
    """Every codec x algorithm, and the other training methods, predicted
    and ranked, fastest first, with the float32 baselines among them:
    ``lax.psum``'s row and, where the cluster has a fast level, the
    hierarchical all-reduce of float32.

    Args:
      n: gradient values per device (the model's parameters).
      cluster: the devices and links.
      compute: the codecs' speed (None: the wire alone).
      codecs: the codecs to rank (default: :func:`default_codecs`).
      algorithms: only these algorithms (default: every one that applies).
      error_feedback: count error feedback's own cost (``compress_gradients``
        keeps it on by default; the ``lax.psum`` row has none).
      bucket: values per all-reduce; a larger gradient is sent as
        ``ceil(n / bucket)`` equal buckets, one after the other
        (``compress_gradients`` makes every leaf above ``fusion_bytes`` a
        bucket of its own). None: one all-reduce of all ``n``.
      min_bits: leave out codecs of fewer payload bits per element (their
        static size; 8 keeps the codecs that train with Adam as float32
        does, docs/training.md).
      methods: the other methods' options (:class:`Methods`); None: their
        defaults. Left out where ``algorithms`` is given.
    Returns:
      Estimates sorted by predicted seconds (ties by name, so the order
      is deterministic).
    """
    k = 1 if not bucket or n <= bucket else -(-n // bucket)
    m = -(-n // k)
    rows = [predict(None, BASELINE, m, cluster, compute)]
    if _two_levels(cluster):
        rows.append(_uncompressed_hierarchical(m, cluster, compute))
    for codec in default_codecs() if codecs is None else codecs:
        if codec.bits_per_element() < min_bits:
            continue
        for alg in candidate_algorithms(codec, cluster, algorithms):
            rows.append(predict(codec, alg, m, cluster, compute, error_feedback=error_feedback))
    rows = [times(e, k) for e in rows]
    if algorithms is None:
        rows += method_estimates(n, k, cluster, compute, methods or Methods(n))
    return sorted(rows, key=lambda e: (e.seconds, e.name, e.algorithm))


def _two_levels(cluster: Cluster) -> bool:
    return cluster.processes > 1 and cluster.devices_per_process > 1


def _uncompressed_hierarchical(n: int, cluster: Cluster, compute: Compute | None) -> Estimate:
    """The best uncompressed all-reduce where processes have several
    devices: float32 over the fast level, float32 ``psum`` of a chunk over
    the slow one (the algorithm of two axes with the Identity codec)."""
    from jaxcomp.codecs import Identity

    sizes = (cluster.processes, cluster.devices_per_process)
    e = predict(Identity(), choose_algorithm(Identity(), n, sizes), n, cluster, compute)
    return dataclasses.replace(e, codec=None, compressed_by="")


# ---------------------------------------------------------------------------
# The other methods: PowerSGD, 1-bit Adam, DiLoCo
# ---------------------------------------------------------------------------
def default_width(n: int) -> int:
    """The hidden size of a transformer of ``n`` parameters whose width is
    100 times its depth (``12 L d^2`` parameters: GPT-2, GPT-3 and Llama
    are within 2x of that ratio), rounded to a multiple of 64: 1B gives
    2048, 7B 3968, 100M 960."""
    return max(64, 64 * round((100 * n / 12) ** (1 / 3) / 64))


@dataclasses.dataclass(frozen=True)
class Methods:
    """What the rows of the methods other than ``compress_gradients``
    assume.

    Attributes:
      n: the model's parameters.
      width: its hidden size: PowerSGD's factors of a transformer layer's
        ``12 d^2`` values (four ``d x d`` and two ``d x 4d`` matrices) are
        ``18 d r`` values. Default :func:`default_width`.
      powersgd_rank: PowerSGD's rank r.
      sync_every: DiLoCo's inner steps per synchronization (the paper's
        500): its rows are one synchronization divided by them, the
        communication per step.
      onebit_adam_codec: ``jc.optax.onebit_adam``'s default codec.
      diloco_codec: the codec of the compressed DiLoCo row (the DiLoCo
        papers quantize the outer gradients to 8 or 4 bits).
    """

    n: int
    width: int | None = None
    powersgd_rank: int = 4
    sync_every: int = 500
    onebit_adam_codec: Codec | None = None
    diloco_codec: Codec | None = None

    def __post_init__(self):
        from jaxcomp import codecs

        defaults = {
            "width": self.width or default_width(self.n),
            "onebit_adam_codec": self.onebit_adam_codec or codecs.OneBit(bucket_size=256),
            "diloco_codec": self.diloco_codec or codecs.Int8(),
        }
        for name, value in defaults.items():
            object.__setattr__(self, name, value)
        for name in ("width", "powersgd_rank", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"jaxcomp.planning: {name} must be >= 1, got {getattr(self, name)}"
                )

    @property
    def codecs(self) -> tuple[Codec, ...]:
        """The codecs these rows run, whose compute figures they need."""
        return (self.onebit_adam_codec, self.diloco_codec)


def method_estimates(
    n: int, k: int, cluster: Cluster, compute: Compute | None, methods: Methods
) -> list[Estimate]:
    """The rows of PowerSGD, 1-bit Adam and DiLoCo for ``n`` gradient values
    sent as ``k`` buckets (their communication per training step).

    - ``jc.optax.powersgd``: the factors in two float32 all-reduces of all
      the matrices (``powersgd_rank``, :attr:`Methods.width`), plus its
      passes over the gradient (the two products read it, the residual's
      error feedback); the small leaves it leaves exact are not counted.
      Where processes have several devices it averages over the fast level
      exactly first, and every device then all-reduces the factors over the
      slow one.
    - ``jc.optax.onebit_adam``: after its warm-up, its momentum goes as
      ``compress_gradients`` sends a gradient with its codec (by ``auto``).
    - ``jc.optax.diloco``: one float32 all-reduce (or one of the codec's,
      without error feedback) every ``sync_every`` steps, per step.
    Rows whose codec has no compute figures in ``compute`` are left out.
    """
    m = -(-n // k)
    sizes = (cluster.processes, cluster.devices_per_process) if _two_levels(cluster) else None
    out = [_powersgd(n, cluster, compute, methods)]
    codec = methods.onebit_adam_codec
    if _has_figures(codec, compute):
        alg = choose_algorithm(codec, m, sizes or cluster.devices)
        e = times(predict(codec, alg, m, cluster, compute, error_feedback=True), k)
        out.append(dataclasses.replace(e, method=f"onebit_adam({codec.spec})"))
    h = methods.sync_every
    sync = times(predict(None, BASELINE, m, cluster, compute), k)
    out.append(dataclasses.replace(times(sync, 1 / h), method=f"diloco:sync_every={h}"))
    codec = methods.diloco_codec
    if _has_figures(codec, compute):
        alg = choose_algorithm(codec, m, sizes or cluster.devices)
        e = times(predict(codec, alg, m, cluster, compute), k / h)
        out.append(dataclasses.replace(e, method=f"diloco:sync_every={h},codec={codec.spec}"))
    return out


def _has_figures(codec: Codec, compute: Compute | None) -> bool:
    return compute is None or repr(codec) in compute.kernels


# The algorithm label of PowerSGD's rows, as the accuracy study names it.
LOW_RANK = "low-rank pmean"


def _powersgd(n: int, cluster: Cluster, compute: Compute | None, methods: Methods) -> Estimate:
    r, d = methods.powersgd_rank, methods.width
    factors = n * 1.5 * r / d  # 18 d r factor values per 12 d^2 gradient values
    half = Collective("all-reduce", 2 * factors)  # the P's, then the Q's, float32
    if _two_levels(cluster):
        exact = Collective("all-reduce", 4 * n, axis=1)
        colls, num_axes, label = [exact, half, half], 2, f"{LOW_RANK}, exact within a process"
    else:
        colls, num_axes, label = [half, half], 1, LOW_RANK
    _, spans = _axes(cluster, num_axes)
    wire, latency, inter, dev = _on_axes(colls, cluster, spans)
    mem = 0.0 if compute is None else compute.memory_seconds((8 + ERROR_FEEDBACK_BYTES) * n)
    name = f"powersgd:rank={r}"
    bits = 32 * factors / n
    return Estimate(None, label, wire, latency, 0.0, mem, inter, dev, bits, name, LOW_RANK)


# ---------------------------------------------------------------------------
# What the accuracy study measured (docs/accuracy.md)
# ---------------------------------------------------------------------------
def _normalized(method: str) -> str:
    """A method key of ``jaxcomp._accuracy`` with its codec spec as
    ``Codec.spec`` writes it."""
    from jaxcomp import codecs

    if method.startswith("onebit_adam("):
        return f"onebit_adam({codecs.get(method[len('onebit_adam(') : -1]).spec})"
    if method.startswith("powersgd:"):
        return method
    return codecs.get(method).spec


@functools.cache
def _measured() -> tuple[dict, dict]:
    from jaxcomp import _accuracy

    return tuple(
        {(_normalized(m), alg): v for (m, alg), v in table.items()}
        for table in (_accuracy.SGD, _accuracy.ADAM)
    )


NOT_MEASURED = "not measured"


def measured_loss(e: Estimate) -> tuple[float | str | None, float | str | None]:
    """What the accuracy study (docs/accuracy.md) measured for ``e``'s
    method with its algorithm (a hierarchical row: its slow stage's), with
    SGD and with Adam: the held-out loss's change against float32 in
    percent, None where the run diverged, or :data:`NOT_MEASURED`. The
    float32 rows are the reference, 0."""
    if e.baseline:
        return 0.0, 0.0
    key = (e.name, e.compressed_by)
    sgd, adam = _measured()
    return sgd.get(key, NOT_MEASURED), adam.get(key, NOT_MEASURED)


def accuracy_class(loss: float | str | None) -> str:
    """A measured change of the held-out loss as a class: "parity" up to
    +1%, "close" up to +5%, "loses" beyond, "diverged", or "not
    measured"."""
    if loss == NOT_MEASURED:
        return NOT_MEASURED
    if loss is None:
        return "diverged"
    word = "parity" if loss <= 1 else "close" if loss <= 5 else "loses"
    return f"{word} ({loss:+.1f}%)"


def times(e: Estimate, k: float) -> Estimate:
    """``k`` all-reduces like ``e``, one after the other (a fraction: one
    every ``1 / k`` steps, per step); also ``k`` layers of a
    :class:`ShardedEstimate`."""
    if k == 1:
        return e
    return dataclasses.replace(
        e,
        wire=k * e.wire,
        latency=k * e.latency,
        kernels=k * e.kernels,
        memory=k * e.memory,
        inter_bytes=k * e.inter_bytes,
        device_bytes=k * e.device_bytes,
    )


# ---------------------------------------------------------------------------
# A whole step's all-reduces
# ---------------------------------------------------------------------------
def step_buckets(codec: Codec | None, shapes: Sequence[tuple[int, ...]], **plan_options):
    """The all-reduces of one ``compress_gradients`` step for float32
    leaves of ``shapes``: ``[(codec or None, values)]``, from the
    library's own fusion plan (``jaxcomp.optax._plan.make_plan``; options
    as ``compress_gradients``' ``fusion_bytes`` and ``min_compress_size``,
    their defaults if left out). ``codec`` None: one uncompressed bucket
    of every leaf (what ``lax.pmean`` of the gradients moves)."""
    import jax

    from jaxcomp.optax import DEFAULT_FUSION_BYTES, DEFAULT_MIN_COMPRESS_SIZE, make_plan

    if codec is None:
        return [(None, sum(math.prod(s) for s in shapes))]
    tree = [jax.ShapeDtypeStruct(tuple(s), np.float32) for s in shapes]
    options = {
        "fusion_bytes": DEFAULT_FUSION_BYTES,
        "min_compress_size": DEFAULT_MIN_COMPRESS_SIZE,
        **plan_options,
    }
    p = make_plan(codec, tree, **options)
    return [(b.codec, b.size) for b in p.groups for _ in range(b.count)]  # a stack: per layer


def predict_step(
    codec: Codec | None,
    shapes: Sequence[tuple[int, ...]],
    cluster: Cluster,
    compute: Compute | None = None,
    *,
    error_feedback: bool = True,
    **plan_options,
) -> list[Estimate]:
    """The estimates of every all-reduce of one training step (the
    compressed buckets by ``algorithm="auto"``, then the uncompressed
    leaves' ``lax.pmean``); sum their ``seconds`` for the step's
    communication and codec time."""
    levels = cluster.processes > 1 and cluster.devices_per_process > 1
    sizes = (cluster.processes, cluster.devices_per_process) if levels else cluster.devices
    out = []
    for c, m in step_buckets(codec, shapes, **plan_options):
        alg = BASELINE if c is None else choose_algorithm(c, m, sizes)
        out.append(predict(c, alg, m, cluster, compute, error_feedback=error_feedback))
    return out


# ---------------------------------------------------------------------------
# Sharded training: a step's parameter all-gathers and gradient reduce-scatter
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sharding:
    """One way of training with sharded parameters, as
    ``jc.fsdp.ShardParams`` configures it.

    Attributes:
      gradients: the gradient's codec: of its reduce-scatter (FSDP) or of
        its shard's all-reduce across the processes (HSDP, by ``jc.psum``'s
        ``auto``); None: exact, lax's collectives in ``dtype``.
      parameters: the codec of the parameter all-gather; None: exact.
      hsdp: sharded over the devices of a process and replicated across
        the processes (``ShardParams(axis=fast, replicate_over=slow)``);
        False: sharded over every device (FSDP; where processes have
        several devices, over ``(slow, fast)`` axes: the reduce-scatter
        exact within a process and compressed across, the all-gather
        compressed across).
      dtype: the dtype of the exact collectives: float32, or bfloat16 for
        a model trained in bf16 (its gradients and parameters exact).
    """

    gradients: Codec | None = None
    parameters: Codec | None = None
    hsdp: bool = False
    dtype: np.dtype = F32

    @property
    def layout(self) -> str:
        return "hsdp" if self.hsdp else "fsdp"

    @property
    def baseline(self) -> bool:
        """Whether this is uncompressed sharded training in float32."""
        return self.gradients is None and self.parameters is None and self.dtype == F32

    @property
    def name(self) -> str:
        """The gradients' codec spec, or the exact collectives' dtype."""
        return self.gradients.spec if self.gradients else np.dtype(self.dtype).name

    @property
    def parameters_name(self) -> str:
        return self.parameters.spec if self.parameters else np.dtype(self.dtype).name


@dataclasses.dataclass(frozen=True)
class Part:
    """One collective call of a sharded step for one layer, as the library
    declares it.

    Attributes:
      what: what it moves ("parameter all-gather", "gradient
        reduce-scatter", "gradient all-reduce across processes").
      collectives: its collectives, each on an axis of ``spans``.
      spans: per axis ``(nodes, local, groups)``, as :func:`_axes` gives
        them.
      calls: its encodes and decodes, with error feedback's decode of its
        own payload where it runs one.
      residual: float32 values of the error-feedback residual it keeps (0:
        none).
      count: how many times a step runs it.
      traffic: XLA:CPU's accounting of its compiled program, per value
        (:func:`sharded_traffic`, :func:`traffic`), computed when called;
        None: no program (one device).
      values: this device's values in its program's input.
    """

    what: str
    collectives: tuple[Collective, ...]
    spans: tuple[tuple[int, int, int], ...]
    calls: tuple[KernelCall, ...] = ()
    residual: int = 0
    count: int = 1
    traffic: Callable[[], Traffic] | None = dataclasses.field(default=None, compare=False)
    values: int = 0


def _flat(devices: int, nodes: int, local: int) -> tuple[Axes, tuple]:
    """One axis of ``nodes * local`` devices, node-major, and its span."""
    return Axes((devices,)), ((nodes, local, 1),)


def _shard_axes(cluster: Cluster, hsdp: bool) -> tuple[Axes, tuple]:
    """The axes the parameters are sharded over on ``cluster``, and their
    spans: a process's devices (HSDP); every device, over ``(slow,
    fast)`` axes where processes have several devices (FSDP)."""
    nodes, local = cluster.processes, cluster.devices_per_process
    if hsdp:
        return _flat(local, 1, local)
    if _two_levels(cluster):
        axes, spans = _axes(cluster, 2)
        return axes, tuple(spans)
    return _flat(cluster.devices, nodes, local)


def _exact_axes(cluster: Cluster, hsdp: bool) -> tuple[Axes, tuple]:
    """Where an exact (lax) collective of the shard axes runs: one
    collective over all of them at once."""
    nodes, local = cluster.processes, cluster.devices_per_process
    return _flat(local, 1, local) if hsdp else _flat(cluster.devices, nodes, local)


def shard_values(n: int, cluster: Cluster, hsdp: bool = False) -> int:
    """``n`` values padded to a multiple of the devices they are sharded
    over (a parameter's sharded dimension must divide evenly,
    ``jc.data_parallel``)."""
    p = cluster.devices_per_process if hsdp else cluster.devices
    return -(-n // p) * p


def sharded_parts(
    s: Sharding,
    n: int,
    cluster: Cluster,
    *,
    regather: bool = True,
    error_feedback: bool = True,
    compute: Compute | None = None,
) -> list[Part]:
    """The collective calls of one step of sharded training for one layer
    of ``n`` values (a multiple of the devices it is sharded over,
    :func:`shard_values`), from the declarations of
    ``jc.collectives.ReduceScatter`` and ``AllGather`` (and, for HSDP's
    all-reduce across the processes, the algorithm ``jc.psum`` runs):

    - the parameter all-gather of this device's shard, in the forward
      pass and, with ``regather``, again in the backward pass (a layer
      rematerialized with ``jax.checkpoint``, as ZeRO-3 does);
    - the gradient's reduce-scatter over the shard axes (HSDP: exact);
    - HSDP: the gradient shard's all-reduce across the processes.

    Raises ValueError where a collective does not take a codec (the
    reduce-scatter and all-gather take fixed-size codecs).
    """
    gather = _gather_part(s, n, cluster)
    parts = [dataclasses.replace(gather, count=2 if regather else 1)]
    fb = error_feedback and s.gradients is not None
    parts.append(_scatter_part(s, n, cluster, fb))
    if s.hsdp and cluster.processes > 1:
        parts.append(_across_part(s, n // cluster.devices_per_process, cluster, fb, compute))
    return parts


def _program(collective: str, codec: Codec | None, axes: Axes, dtype) -> Callable | None:
    """The :class:`Part` traffic of ``collective`` (:func:`sharded_traffic`)
    over ``axes``; None on one device."""
    if axes.size == 1 and not axes.hierarchical:
        return None
    return functools.partial(_sharded_at, collective, codec, axes.sizes, np.dtype(dtype).name)


def _gather_part(s: Sharding, n: int, cluster: Cluster) -> Part:
    """The all-gather of this device's shard of a layer of ``n`` values."""
    from jaxcomp.codecs import Identity
    from jaxcomp.collectives import AllGather

    ag, c = AllGather(), s.parameters
    axes, spans = _shard_axes(cluster, s.hsdp)
    shard = n // axes.size
    if c is None:
        axes, spans = _exact_axes(cluster, s.hsdp)
        colls = ag.collectives(Identity(), shard, s.dtype, axes)
        return Part(
            "parameter all-gather",
            tuple(colls),
            spans,
            traffic=_program(ag.name, None, axes, s.dtype),
            values=shard,
        )
    return Part(
        "parameter all-gather",
        tuple(ag.collectives(c, shard, F32, axes)),
        spans,
        tuple(ag.kernel_calls(c, shard, F32, axes)),
        traffic=_program(ag.name, c, axes, F32),
        values=shard,
    )


def _scatter_part(s: Sharding, n: int, cluster: Cluster, feedback: bool) -> Part:
    """The reduce-scatter of this device's gradient of a layer of ``n``
    values: exact in the training dtype, or HSDP's in float32 (the
    gradient is cast to float32 first), else compressed, with a residual
    of what it compresses under error feedback."""
    from jaxcomp.codecs import Identity
    from jaxcomp.collectives import ReduceScatter

    rs, c = ReduceScatter(), s.gradients
    if c is None or s.hsdp:
        axes, spans = _exact_axes(cluster, s.hsdp)
        dtype = s.dtype if c is None else F32
        return Part(
            "gradient reduce-scatter",
            tuple(rs.collectives(Identity(), n, dtype, axes)),
            spans,
            traffic=_program(rs.name, None, axes, dtype),
            values=n,
        )
    axes, spans = _shard_axes(cluster, s.hsdp)
    return Part(
        "gradient reduce-scatter",
        tuple(rs.collectives(c, n, F32, axes)),
        spans,
        tuple(rs.kernel_calls(c, n, F32, axes)),
        rs.compressed_values(n, axes) if feedback else 0,
        traffic=_program(rs.name, c, axes, F32),
        values=n,
    )


def _across_part(
    s: Sharding, shard: int, cluster: Cluster, feedback: bool, compute: Compute | None
) -> Part:
    """HSDP: every device's all-reduce of its gradient shard of ``shard``
    values across the processes (``lax.psum``, or ``jc.psum`` by
    ``auto``), the devices of a process at once over its link."""
    procs, c = cluster.processes, s.gradients
    across = ((procs, 1, cluster.devices_per_process),)
    if c is None:
        return Part(
            "gradient all-reduce across processes",
            (Collective("all-reduce", np.dtype(s.dtype).itemsize * shard),),
            across,
            traffic=_program(BASELINE, None, Axes((procs,)), s.dtype),
            values=shard,
        )
    alg = choose_algorithm(c, shard, procs)
    calls = list(kernel_calls(c, alg, shard, procs))
    if feedback and c.name != "identity":  # as predict's error feedback: its own payload
        calls.append(KernelCall("decode", _named(alg).compressed_values(shard, Axes((procs,))), c))
    return Part(
        f"gradient all-reduce across processes ({alg})",
        tuple(collectives(c, alg, shard, procs, _bits(c, compute))),
        across,
        tuple(calls),
        shard if feedback else 0,
        traffic=functools.partial(traffic, c, alg, (procs,)),
        values=shard,
    )


@dataclasses.dataclass(frozen=True)
class ShardedEstimate:
    """The predicted communication of one step of sharded training, in
    parts (seconds), as :class:`Estimate` has them.

    Attributes:
      sharding: what is compressed, and the layout.
      label: how the collectives run ("fsdp", "fsdp(slow, fast)", "hsdp").
      wire, latency, kernels, memory, inter_bytes, device_bytes: as
        :class:`Estimate`'s, for the whole step (memory: the compiled
        collectives' memory traffic on CPUs, and error feedback's
        residual passes).
      gradient_bits, parameter_bits: wire bits per element of the gradient
        and of the parameters.
      regather: whether the backward pass's re-gather is counted.
    """

    sharding: Sharding
    label: str
    wire: float
    latency: float
    kernels: float
    memory: float
    inter_bytes: float
    device_bytes: float
    gradient_bits: float
    parameter_bits: float
    regather: bool

    @property
    def seconds(self) -> float:
        return self.wire + self.latency + self.kernels + self.memory

    @property
    def baseline(self) -> bool:
        return self.sharding.baseline


def _wire_bits(codec: Codec | None, n: int, dtype) -> float:
    if codec is None:
        return 8.0 * np.dtype(dtype).itemsize
    return 8 * codec.wire_nbytes((n,), F32) / n


def predict_sharded(
    s: Sharding,
    n: int,
    cluster: Cluster,
    compute: Compute | None = None,
    *,
    regather: bool = True,
    error_feedback: bool = True,
    bucket: int | None = None,
) -> ShardedEstimate:
    """The predicted communication time of one step of sharded training of
    ``n`` parameters (:func:`sharded_parts` of each layer), with the link
    model and kernel rates of the all-reduce rows (:func:`predict`).

    Args:
      s: what is compressed, and the layout.
      n: the model's parameters.
      cluster: the devices and links.
      compute: the codecs' speed (None: the wire alone).
      regather: count the backward pass's re-gather of the parameters.
      error_feedback: count error feedback's residual passes.
      bucket: values per layer: the model is ``ceil(n / bucket)`` equal
        layers, each gathered and scattered on its own. None: one.
    """
    k = 1 if not bucket or n <= bucket else -(-n // bucket)
    m = shard_values(-(-n // k), cluster, s.hsdp)
    parts = sharded_parts(
        s, m, cluster, regather=regather, error_feedback=error_feedback, compute=compute
    )
    costs = [_part_cost(part, cluster, compute) for part in parts]
    wire, latency, kern, mem, inter, dev = (sum(c) for c in zip(*costs, strict=True))
    shard_axes, _ = _shard_axes(cluster, s.hsdp)
    label = s.layout if s.hsdp or len(shard_axes.sizes) == 1 else "fsdp(slow, fast)"
    e = ShardedEstimate(
        s,
        label,
        wire,
        latency,
        kern,
        mem,
        inter,
        dev,
        _wire_bits(s.gradients, m, s.dtype),
        _wire_bits(s.parameters, m // shard_axes.size, s.dtype),
        regather,
    )
    return times(e, k)


def _part_cost(part: Part, cluster: Cluster, compute: Compute | None) -> tuple[float, ...]:
    """(wire, latency, kernel and memory seconds, bytes out of a process
    and of a device) of a step's runs of ``part``: the all-reduce rows'
    terms (:func:`predict`)."""
    wire, latency, inter, dev = _on_axes(part.collectives, cluster, part.spans)
    kern = mem = 0.0
    if compute is not None:
        kern = compute.share * sum(compute.rates(c).seconds(w, v) for w, v, c in part.calls)
        mem = compute.memory_seconds(ERROR_FEEDBACK_BYTES * part.residual)
        if compute.platform == "cpu" and part.traffic is not None:
            mem += _memory_seconds(compute, part.traffic(), part.values)
    return tuple(part.count * x for x in (wire, latency, kern, mem, inter, dev))


def shardings(
    codecs: Sequence[Codec], parameters: Sequence[Codec | None], cluster: Cluster
) -> list[Sharding]:
    """The configurations :func:`plan_sharded` ranks: float32 and bf16
    sharded training, and every gradient codec with every parameter codec;
    each as FSDP and, where processes have several devices, as HSDP."""
    layouts = (False, True) if _two_levels(cluster) else (False,)
    out = []
    for hsdp in layouts:
        out.append(Sharding(hsdp=hsdp))
        out.append(Sharding(hsdp=hsdp, dtype=np.dtype("bfloat16")))
        for g in codecs:
            for p in parameters:
                out.append(Sharding(g, p, hsdp))
    return out


def _refused(s: Sharding) -> str | None:
    """Why the compressed collectives of ``s`` do not take its codecs
    (``planned_rates`` of ``ReduceScatter`` and ``AllGather``), or None.
    HSDP's gradient codec goes to ``jc.psum``, which takes every codec."""
    from jaxcomp.collectives import AllGather, ReduceScatter

    uses = [(AllGather(), s.parameters, "all-gather")]
    if not s.hsdp:
        uses.append((ReduceScatter(), s.gradients, "reduce-scatter"))
    for alg, codec, what in uses:
        if codec is not None and codec.rate not in alg.planned_rates:
            rates = ", ".join(sorted(r.value for r in alg.planned_rates))
            return f"the {what} takes {rates}-rate codecs, and {codec!r} is {codec.rate.value}-rate"
    return None


def plan_sharded(
    n: int,
    cluster: Cluster,
    compute: Compute | None = None,
    *,
    codecs: Sequence[Codec] | None = None,
    parameters: Sequence[Codec | None] = (None,),
    regather: bool = True,
    error_feedback: bool = True,
    bucket: int | None = None,
) -> tuple[list[ShardedEstimate], list[tuple[Sharding, str]]]:
    """Sharded training's configurations (:func:`shardings`) predicted and
    ranked, fastest first, with float32 sharded training (lax's
    reduce-scatter and all-gather) among them as the baseline.

    Args:
      n: the model's parameters.
      cluster, compute, bucket: as :func:`plan`'s (``bucket``: values per
        layer).
      codecs: the gradient codecs (default: :func:`default_codecs`).
      parameters: the parameter all-gather's codecs, None for exact.
      regather, error_feedback: as :func:`predict_sharded`'s.
    Returns:
      ``(rows, left_out)``: the estimates sorted by predicted seconds, and
      the configurations a collective does not take, each with why.
    """
    codecs = default_codecs() if codecs is None else codecs
    rows, left_out = [], []
    for s in shardings(codecs, parameters, cluster):
        if why := _refused(s):
            left_out.append((s, why))
            continue
        rows.append(
            predict_sharded(
                s,
                n,
                cluster,
                compute,
                regather=regather,
                error_feedback=error_feedback,
                bucket=bucket,
            )
        )
    key = lambda e: (e.seconds, e.label, e.sharding.name, e.sharding.parameters_name)  # noqa: E731
    return sorted(rows, key=key), left_out


def sharded_table(rows: Sequence[ShardedEstimate], top: int | None = None) -> str:
    """A markdown table of ranked sharded-training estimates, with the
    speedup over the fastest float32 sharded training; ``top``: the best
    rows only, and the float32 ones."""
    base = min(e.seconds for e in rows if e.baseline)
    lines = [
        "| rank | gradients | parameters | layout | bits/elt (grad, param) | GB out per process "
        "| wire | latency | codec kernels | memory | total | vs best float32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(rows, 1):
        if top is not None and i > top and not e.baseline:
            continue
        s = e.sharding
        lines.append(
            f"| {i} | `{s.name}` | `{s.parameters_name}` | {e.label} "
            f"| {e.gradient_bits:.2f}, {e.parameter_bits:.2f} | {_time_cells(e, base)} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Units and tables, for the command line
# ---------------------------------------------------------------------------
_RATE_UNITS = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "b/s": 8.0,
    "kb/s": 8e3,
    "mb/s": 8e6,
    "gb/s": 8e9,
    "tb/s": 8e12,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _parse(text: str, units: Mapping[str, float], what: str, default: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zµ/]*)\s*", text.lower())
    if not m or (m.group(2) or default) not in units:
        raise ValueError(
            f"jaxcomp.planning: cannot read {text!r} as a {what} "
            f"(a number with one of the units {', '.join(u for u in units if u)})"
        )
    return float(m.group(1)) * units[m.group(2) or default]


def parse_rate(text: str) -> float:
    """Bits per second from ``"10gbit"``, ``"400Gbit"``, ``"900GB/s"``
    (bytes) or a plain number of bits per second."""
    return _parse(text, _RATE_UNITS, "bandwidth", "bit")


def parse_seconds(text: str) -> float:
    """Seconds from ``"5us"``, ``"1.5ms"``, ``"0.002"``."""
    return _parse(text, _TIME_UNITS, "time", "s")


def parse_count(text: str) -> int:
    """A count from ``"100M"``, ``"1B"``, ``"4.25e6"``."""
    return round(_parse(text, _COUNT_UNITS, "count", ""))


def _fmt_s(t: float) -> str:
    if t == 0:
        return "0"
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


def _time_cells(e, base: float) -> str:
    """The cells both tables share: GB out per process, the time's parts,
    the total and the speedup over ``base`` seconds."""
    return (
        f"{e.inter_bytes / 1e9:.3f} | {_fmt_s(e.wire)} | {_fmt_s(e.latency)} "
        f"| {_fmt_s(e.kernels)} | {_fmt_s(e.memory)} | {_fmt_s(e.seconds)} "
        f"| {base / e.seconds:.2f}x"
    )


def table(rows: Sequence[Estimate], top: int | None = None) -> str:
    """A markdown table of ranked estimates, with the speedup over the
    fastest float32 row and what the accuracy study measured
    (:func:`measured_loss`); ``top``: the best rows only, and the float32
    ones."""
    base = min(e.seconds for e in rows if e.baseline)
    lines = [
        "| rank | codec | algorithm | bits/elt | GB out per process | wire | latency "
        "| codec kernels | memory | total | vs best float32 | held-out loss, SGD "
        "| held-out loss, Adam |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, e in enumerate(rows, 1):
        if top is not None and i > top and not e.baseline:
            continue
        sgd, adam = (accuracy_class(v) for v in measured_loss(e))
        lines.append(
            f"| {i} | `{e.name}` | {e.algorithm} | {e.bits:.2f} | {_time_cells(e, base)} "
            f"| {sgd} | {adam} |"
        )
    return "\n".join(lines)


def __getattr__(name: str):
    # Names of earlier releases, derived now from the algorithms' declarations.
    if name in ("FLAT_ALGORITHMS", "DEFAULT_DENSE"):
        warnings.warn(
            f"jaxcomp.planning.{name} is deprecated; every registered algorithm "
            "(jc.collectives.registered()) declares what the planner needs "
            "(num_axes, planned_rates)",
            DeprecationWarning,
            stacklevel=2,
        )
        flat = [a for a in registered() if a.num_axes == 1]
        if name == "DEFAULT_DENSE":
            flat = [a for a in flat if Rate.FIXED in a.planned_rates]
        return tuple(a.name for a in flat)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
