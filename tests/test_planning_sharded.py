"""``jaxcomp plan --shard-params``: the bytes of a sharded step are those
that jc.collectives.ReduceScatter and AllGather declare and the compiled
jc.psum_scatter / jc.all_gather send, HSDP's slow link carries the shard's
all-reduce alone, compression wins on a slow link, and the command runs."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_scatter import _hlo_collectives

import jaxcomp as jc
from jaxcomp import planning
from jaxcomp.__main__ import main

F32 = np.float32
QSGD4 = jc.codecs.QSGD(bits=4, bucket_size=512)
INT8 = jc.codecs.Int8(bucket_size=512)
SLOW = planning.Link(1e8, 5e-5)


def _cluster(two_levels: bool) -> planning.Cluster:
    if two_levels:
        return planning.Cluster(2, 4, planning.Link(1e10, 5e-5), planning.Link(1e12, 2e-6))
    return planning.Cluster(8, 1, planning.Link(1e10, 5e-5))


def _part(parts, what):
    (part,) = [p for p in parts if p.what.startswith(what)]
    return part


def _by_kind(part) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in part.collectives:
        out[c.kind] = out.get(c.kind, 0) + int(c.operand)
    return out


def _groups(part) -> list[tuple[str, int, int]]:
    """(kind, devices, operand bytes) of a part's collectives, as
    test_scatter reads them from the HLO."""
    return sorted(
        (c.kind, part.spans[c.axis][0] * part.spans[c.axis][1], int(c.operand))
        for c in part.collectives
    )


def _compiled(fn, mesh, x):
    axes = mesh.axis_names if len(mesh.axis_names) > 1 else mesh.axis_names[0]
    spec = P(axes)
    g = jax.jit(
        jax.shard_map(
            lambda x, k: fn(x[0], axes, k)[None],
            mesh=mesh,
            in_specs=(spec, P()),
            out_specs=spec,
            check_vma=False,
        )
    )
    return g.lower(x, jax.random.key(0)).compile().as_text()


@pytest.mark.parametrize("two_levels", [False, True], ids=["fsdp", "fsdp-slow-fast"])
@pytest.mark.parametrize(
    "gradients,parameters", [(QSGD4, INT8), (None, None)], ids=["qsgd4-int8", "float32"]
)
def test_bytes_are_the_accountings_and_the_compiled_programs(two_levels, gradients, parameters):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    cluster = _cluster(two_levels)
    sizes = (2, 4) if two_levels else 8
    n = 8 * 1000  # one layer, a multiple of the devices
    s = planning.Sharding(gradients, parameters)
    parts = planning.sharded_parts(s, n, cluster)
    rs, ag = _part(parts, "gradient reduce-scatter"), _part(parts, "parameter all-gather")
    assert (rs.count, ag.count) == (1, 2)  # the backward pass gathers again
    assert len(parts) == 2
    assert planning.sharded_parts(s, n, cluster, regather=False)[0].count == 1
    # What the accounting declares...
    g, p = gradients or jc.codecs.Identity(), parameters or jc.codecs.Identity()
    assert _by_kind(rs) == jc.collectives.scatter_nbytes(g, (n,), F32, sizes)
    assert _by_kind(ag) == jc.collectives.gather_nbytes(p, (n // 8,), F32, sizes)
    # ...and what the compiled collectives send, on the same axes.
    devices = np.asarray(jax.devices()[:8])
    mesh = Mesh(devices.reshape(2, 4), ("slow", "fast")) if two_levels else Mesh(devices, ("d",))
    names = {"slow": 2, "fast": 4}
    x = jnp.zeros((8, n), jnp.float32)
    hlo = _compiled(lambda x, a, k: jc.psum_scatter(x, a, g, key=k, tiled=True).value, mesh, x)
    assert _hlo_collectives(hlo, names) == _groups(rs)
    shard = x[:, : n // 8]
    hlo = _compiled(lambda x, a, k: jc.all_gather(x, a, p, key=k, tiled=True), mesh, shard)
    assert _hlo_collectives(hlo, names) == _groups(ag)


@pytest.mark.parametrize("two_levels", [False, True], ids=["one-level", "two-levels"])
def test_a_steps_bytes_are_the_collectives(two_levels):
    """A row's bytes per device: one reduce-scatter and two all-gathers per
    layer (one without the re-gather), as jc.collectives.ReduceScatter and
    AllGather count what one device sends; bf16 sends half of float32."""
    from jaxcomp._axes import Axes

    cluster = _cluster(two_levels)
    n, layers = 8 * 1_000_000, 3
    ident = jc.codecs.Identity()
    rs, ag = jc.collectives.ReduceScatter(), jc.collectives.AllGather()
    flat = Axes((8,))
    axes = Axes((2, 4)) if two_levels else flat

    def row(s, regather=True):
        return planning.predict_sharded(s, layers * n, cluster, regather=regather, bucket=n)

    gathers = 2
    for regather in (True, False):
        e = row(planning.Sharding(), regather)
        want = rs.send_nbytes(ident, n, F32, flat) + gathers * ag.send_nbytes(
            ident, n // 8, F32, flat
        )
        assert e.device_bytes == pytest.approx(layers * want)
        gathers = 1
    bf16 = row(planning.Sharding(dtype=np.dtype(jnp.bfloat16)))
    assert bf16.device_bytes == pytest.approx(row(planning.Sharding()).device_bytes / 2)
    e = row(planning.Sharding(QSGD4, INT8))
    want = rs.send_nbytes(QSGD4, n, F32, axes) + 2 * ag.send_nbytes(INT8, n // 8, F32, axes)
    assert e.device_bytes == pytest.approx(layers * want)
    k = n // 8
    assert e.gradient_bits == 8 * QSGD4.wire_nbytes((n,)) / n == 4.0625
    assert e.parameter_bits == 8 * INT8.wire_nbytes((k,)) / k  # a shard padded to buckets


def test_hsdp_crosses_processes_with_the_shards_all_reduce_alone():
    cluster = planning.Cluster(2, 4, SLOW, planning.Link(1e12, 2e-6))
    n = 1 << 24
    shard = n // 4
    for s, per_device in (
        (planning.Sharding(hsdp=True), jc.collectives.uncompressed_send_nbytes(4 * shard, 2)),
        (
            planning.Sharding(QSGD4, INT8, hsdp=True),
            jc.collectives.send_nbytes(QSGD4, shard, F32, 2),
        ),
    ):
        e = planning.predict_sharded(s, n, cluster)
        # Each of a process's 4 devices all-reduces its own shard over the 2 processes;
        # the reduce-scatter and the all-gathers stay within the process.
        assert e.label == "hsdp"
        assert e.inter_bytes == pytest.approx(4 * per_device)
    parts = planning.sharded_parts(planning.Sharding(QSGD4, None, hsdp=True), n, cluster)
    rs = _part(parts, "gradient reduce-scatter")
    assert _by_kind(rs) == {"reduce-scatter": 4 * n}  # exact within the process
    across = _part(parts, "gradient all-reduce across processes")
    assert across.residual == shard  # error feedback keeps a shard


def _synthetic_compute():
    codecs = [QSGD4, INT8]
    rates = {repr(c): planning.KernelRates((1 << 20,), (50.0,), (100.0,), 8.0) for c in codecs}
    return planning.Compute("gpu", rates, memcpy_gbps=1000.0, source="synthetic")


def test_qsgd4_beats_float32_on_a_slow_link_and_not_on_a_fast_one():
    compute = _synthetic_compute()

    def ranked(link):
        rows, left_out = planning.plan_sharded(
            100_000_000,
            planning.Cluster(4, 1, link),
            compute,
            codecs=[QSGD4],
            parameters=[None, INT8],
            bucket=1 << 24,
        )
        assert not left_out
        return rows

    slow = ranked(SLOW)
    names = [(e.sharding.name, e.sharding.parameters_name) for e in slow]
    assert names[0] == (QSGD4.spec, INT8.spec)
    assert names.index((QSGD4.spec, "float32")) < names.index(("float32", "float32"))
    assert all(e.kernels > 0 for e in slow if e.sharding.gradients)
    (base,) = [e for e in slow if e.baseline]
    best = slow[0]
    assert base.seconds / best.seconds > 3.5  # ~4.7x fewer bytes, the kernels' time added
    # Where the wire costs nothing, the kernels do: lax's collectives lead.
    fast = ranked(planning.Link(1e15))
    assert [e.sharding.gradients for e in fast[:2]] == [None, None]
    assert {e.sharding.parameters for e in fast[:2]} == {None}


def test_codecs_the_reduce_scatter_does_not_take_are_left_out_with_why():
    cluster = planning.Cluster(2, 4, SLOW, planning.Link(1e12))
    threelc = jc.codecs.ThreeLC()
    rows, left_out = planning.plan_sharded(1 << 22, cluster, codecs=[threelc])
    ((s, why),) = left_out
    assert s.gradients == threelc and not s.hsdp and "variable-rate" in why
    # HSDP all-reduces the shard with jc.psum, which takes it.
    assert [e.label for e in rows if e.sharding.gradients == threelc] == ["hsdp"]


def _run(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--shard-params", "--no-compute", *argv])
    return rc, out.getvalue()


def test_cli_ranks_sharded_training():
    rc, text = _run(
        "--params", "10M", "--processes", "4", "--bandwidth", "100mbit",
        "--codecs", "qsgd:bits=4", "threelc", "--top", "2",
    )  # fmt: skip
    assert rc == 0
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| rank | gradients | parameters | layout")
    assert len(lines) == 1 + 2 + 1  # header, the best two, float32's row
    assert "| `qsgd:bits=4" in lines[1] and "| `int8:bucket_size=512` |" in lines[1]
    assert "| `float32` | `float32` | fsdp |" in lines[-1] and lines[-1].endswith("| 1.00x |")
    assert "parameter all-gathers per layer and step: 2 (" in text
    assert "left out of fsdp: threelc" in text
    rc, text = _run("--params", "10M", "--no-regather", "--param-codecs", "float32")
    assert rc == 0 and "per layer and step: 1 (" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][1:]
    # The parameters' column: exact only (bf16's row trains in bf16).
    assert len(rows) > 2 and {r[2] for r in rows} == {"`float32`", "`bfloat16`"}
    rc, _ = _run("--param-codecs", "int9")
    assert rc == 2
    rc, _ = _run("--algorithms", "ring")
    assert rc == 2


def test_cpu_rows_count_the_compiled_collectives_memory_traffic():
    """On CPUs a row's memory term is XLA's accounting of the compiled
    jc.psum_scatter / jc.all_gather (and lax's), as the all-reduce rows'
    is; the compiled programs run the kernels the plan charges."""
    from jaxcomp._axes import Axes

    rates = {repr(c): planning.KernelRates((1 << 20,), (5.0,), (5.0,), 8.0) for c in (QSGD4, INT8)}
    cpu = planning.Compute("cpu", rates, memcpy_gbps=10.0, source="synthetic")
    gpu = dataclasses.replace(cpu, platform="gpu")
    cluster = planning.Cluster(4, 1, SLOW)
    for s in (planning.Sharding(), planning.Sharding(QSGD4, INT8)):
        on_cpu = planning.predict_sharded(s, 1 << 20, cluster, cpu)
        on_gpu = planning.predict_sharded(s, 1 << 20, cluster, gpu)
        assert on_cpu.memory > on_gpu.memory
        assert (on_cpu.wire, on_cpu.kernels) == (on_gpu.wire, on_gpu.kernels)
    if jc.cpu_available() and jc._ffi.resolve_backend("auto") is not jc._ffi.Backend.XLA:
        n, axes = 1 << 16, Axes((4,))
        for alg, codec, values in (
            (jc.collectives.ReduceScatter(), QSGD4, n),
            (jc.collectives.AllGather(), INT8, n),
        ):
            t = planning.sharded_traffic(alg.name, codec, (4,), values)
            assert t.kernel_calls == len(alg.kernel_calls(codec, values, F32, axes))
