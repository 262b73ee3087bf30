"""The optimizer step users run: ``optax.chain(compress_gradients(codec),
sgd)`` against the plain data-parallel step (``lax.pmean`` of the gradients,
then sgd), on N CPU devices of one process.

    python benchmarks/optax_step.py                 # 8 devices, ~4.2M parameters
    python benchmarks/optax_step.py --devices 4 --codecs qsgd:bits=4 onebit
    python benchmarks/optax_step.py --devices 4 --matrices 4 --bare   # 4 x 2048x2048
    python benchmarks/optax_step.py --devices 4 --matrices 4 --codecs powersgd:rank=4 qsgd:bits=4
    python benchmarks/optax_step.py --devices 4 --matrices 4 --bare --reps 9 --rounds 3
    python benchmarks/optax_step.py --devices 4 --fast 2 --matrices 4 --bare   # 2 x 2, hierarchical

Each step takes per-device gradients and the optimizer state and returns the
new parameters and state (jit + shard_map, parameters and state donated, as
``jc.data_parallel`` donates them: where only the state is, XLA may give
the new parameters the buffers of residuals of their size, and every such
residual is then copied at each step), so it times the whole update: error feedback, fusion, encode, the collectives, decode and
the sgd update. The devices share this machine's memory and cores, so no
link is slow here: the figure is the step's compute and copy overhead over
``lax.pmean``, not the speedup over a slow network (benchmarks/collectives.py).

``--calls`` adds, per codec with a one-pass kernel
(``Codec.feedback_kernel``), the same full update with error feedback's
compressions as the separate calls (add, encode, decode, subtract) the
kernel replaces: the before and after of the kernel, in one run.

``--rows`` adds, per codec with a decode-and-accumulate kernel
(``Codec.decode_sum_kernel``), the bare and the full update with the
payloads a device receives decoded row by row, then summed, as before the
kernel: its before and after, in one run.

``--profile`` prints, per codec, where the full update's time goes: XLA's
CPU profile of a few steps (``jax.profiler``), per operation of the compiled
step, with the bytes each one writes (from the compiled HLO); and, for the
plain, bare and full steps, the temporary memory of the compiled program
and the minor page faults and system time per step. XLA's CPU runtime
allocates the temporaries afresh at every run, and the kernel zeroes every
page of them on first touch, so on the CPU a temporary costs about as much
as a pass that writes it.

Every step is compiled first, then timed: ``--reps`` steps each, in a
row (the default), or with ``--rounds R`` in R interleaved rounds of
``reps / R`` steps of every step in turn, so that a change in the
machine's load over the run falls on every row alike rather than on the
rows timed while it lasted (the ratios are what this benchmark is for).

``--bare`` adds, per codec, the bare all-reduce with the same codec and
algorithm (``jc.pmean(grad).value`` of every leaf, then sgd: no error
feedback, no fusion, no residual update), the figure the full update is
compared with.

``--floor`` adds, per codec, the memory floor of error feedback: the plain
step plus one pass per leaf, in ``jnp`` with no codec, that reads the
gradient and the residual and writes what one fused pass must write, the
new residual and a payload of the codec's size (bits per element of the
leaf). Error feedback done in one pass costs at least that over the plain
step; the full update's distance to it is what a fused kernel can win.
With ``--bare`` too, it adds the bare all-reduce's step plus one pass per
leaf that reads a residual and writes the new one: error feedback's own
traffic on top of the encode the bare step runs. Its "x bare jc.pmean" is
the least any error feedback can cost over the bare all-reduce on this
machine, fused kernels or not.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import pathlib
import re
import resource
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--codecs", nargs="+", default=["qsgd:bits=4", "onebit", "int8", "bf16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every step in R interleaved rounds of reps/R steps each (the machine's "
        "drift then falls on every row alike); 1: each step's reps in a row",
    )
    ap.add_argument(
        "--matrices",
        type=int,
        default=0,
        help="K: a tree of K 2048x2048 float32 matrices instead of the MLP-like default",
    )
    ap.add_argument("--bare", action="store_true", help="also time the bare jc.pmean per codec")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time the memory floor of one-pass error feedback per codec",
    )
    ap.add_argument(
        "--calls",
        action="store_true",
        help="also time the full update with the separate calls in place of one-pass kernels",
    )
    ap.add_argument(
        "--rows",
        action="store_true",
        help="also time the bare and full updates with the received payloads decoded row by "
        "row in place of decode-and-accumulate kernels",
    )
    ap.add_argument(
        "--profile", action="store_true", help="per-operation profile of the full update"
    )
    ap.add_argument(
        "--fast",
        type=int,
        default=1,
        help="F > 1: a (devices / F, F) mesh of axes (node, local), reduced over both "
        "(the hierarchical algorithm)",
    )
    ap.add_argument("--algorithm", default="auto", help="compress_gradients' algorithm")
    ap.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compress_gradients' error_feedback (default on)",
    )
    ap.add_argument(
        "--server-error-feedback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="two-level error feedback (the default); --no-server-error-feedback: one-level",
    )
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp.collectives import feedback as _feedback

    if args.fast > 1:
        # Two axes, ("node", "local"): jc's hierarchical algorithm (float32
        # over the fast axis, the codec over the slow one).
        if args.devices % args.fast:
            raise SystemExit(f"--fast {args.fast} must divide --devices {args.devices}")
        axis = ("node", "local")
        mesh = jax.make_mesh((args.devices // args.fast, args.fast), axis)
    else:
        axis = "data"
        mesh = jax.make_mesh((args.devices,), (axis,))
    # An MLP-like tree: two 1024x1024 and one 2048x1024 weight, biases.
    shapes = {"w1": (1024, 1024), "b1": (1024,), "w2": (1024, 2048), "b2": (2048,),
              "w3": (2048, 1024), "b3": (1024,)}  # fmt: skip
    if args.matrices:
        shapes = {f"m{i}": (2048, 2048) for i in range(args.matrices)}
    params = jax.device_put(
        {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}, NamedSharding(mesh, P())
    )
    n = sum(int(p.size) for p in params.values())
    keys = jax.random.split(jax.random.key(0), len(shapes))
    grads = {
        k: jax.random.normal(kk, (args.devices, *s), jnp.float32)
        for kk, (k, s) in zip(keys, shapes.items(), strict=True)
    }
    grads = jax.device_put(grads, NamedSharding(mesh, P(axis)))

    profiles: list[str] = []

    def profile(step, state, label: str, steps: int = 3, top: int = 14) -> None:
        """The ops of the compiled step that take the most time (summed over
        the devices, per step) and the bytes each writes."""
        f = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        written = {}
        for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = \(?(\w+)\[([\d,]*)\]", f.as_text(), re.M):
            dims = [int(d) for d in m.group(3).split(",") if d]
            itemsize = {"pred": 1, "u8": 1, "s8": 1, "bf16": 2, "f16": 2, "u16": 2}.get(
                m.group(2), 4
            )
            written[m.group(1)] = int(np.prod(dims, dtype=np.int64)) * itemsize
        p, state = f(fresh(), state, grads)
        jax.block_until_ready(p)
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp)
            for _ in range(steps):
                p, state = f(p, state, grads)
                jax.block_until_ready(p)
            jax.profiler.stop_trace()
            (trace,) = pathlib.Path(tmp).rglob("*.trace.json.gz")
            events = json.loads(gzip.open(trace).read())["traceEvents"]
        total: dict[str, float] = {}
        for e in events:
            if e.get("ph") == "X" and e["name"] in written:
                total[e["name"]] = total.get(e["name"], 0.0) + e["dur"] / 1e3 / steps
        lines = [
            f"\n{label}: the {top} costliest operations (ms per step, summed over devices)",
            "| operation | ms | MiB written per device |",
            "|---|---|---|",
        ]
        for name, ms in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"| `{name}` | {ms:.1f} | {written[name] / 2**20:.1f} |")
        profiles.append("\n".join(lines))

    footprints: list[str] = []

    def footprint(step, state, label: str, steps: int = 5) -> None:
        """Temporary MiB of the compiled step (per device program), minor
        page faults and system milliseconds per step."""
        f = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        temp = f.memory_analysis().temp_size_in_bytes
        p, state = f(fresh(), state, grads)
        jax.block_until_ready(p)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(steps):
            p, state = f(p, state, grads)
            jax.block_until_ready(p)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        faults = (r1.ru_minflt - r0.ru_minflt) / steps
        system = (r1.ru_stime - r0.ru_stime) / steps * 1e3
        footprints.append(f"| {label} | {temp / 2**20:.0f} | {faults:.0f} | {system:.0f} |")

    jobs: list[dict] = []  # every timed step, run by run_rounds

    @contextlib.contextmanager
    def patched(obj, name, value):
        """``obj.name = value`` while a step is traced (in timed): jit caches
        traces per function, so each patched step is a function of its own."""
        old = getattr(obj, name)
        setattr(obj, name, value)
        try:
            yield
        finally:
            setattr(obj, name, old)

    def fresh():
        """A copy of the parameters, for a step that donates them."""
        return jax.tree.map(jnp.copy, params)

    def timed(step, state) -> dict:
        """Compiles ``step`` and runs it once; :func:`run_rounds` times it.
        The step donates the parameters and the state, as ``jc.data_parallel``
        does: each job carries a copy of the parameters of its own."""
        f = jax.jit(step, donate_argnums=(0, 1))
        p, state = f(fresh(), state, grads)
        jax.block_until_ready(p)
        job = {"f": f, "params": p, "state": state, "times": []}
        jobs.append(job)
        return job

    def run_rounds() -> None:
        """``--reps`` steps of every job, in ``--rounds`` interleaved rounds."""
        rounds = max(1, min(args.rounds, args.reps))
        for r in range(rounds):
            n = args.reps // rounds + (r < args.reps % rounds)
            for job in jobs:
                p, state = job["params"], job["state"]
                for _ in range(n):
                    t0 = time.perf_counter()
                    p, state = job["f"](p, state, grads)
                    jax.block_until_ready(p)
                    job["times"].append(time.perf_counter() - t0)
                job["params"], job["state"] = p, state

    def ms(job: dict) -> float:
        return statistics.median(job["times"])

    def row(label: str, job: dict, tail=""):
        """``job``'s table row, a function of the plain step's ms, for once
        it is timed: ms, x the plain step, then the cells ``tail`` (a string,
        or a function that makes them from the timings)."""

        def cells(base: float) -> str:
            rest = tail() if callable(tail) else tail
            return f"| {label} | {ms(job) * 1e3:.1f} | {ms(job) / base:.2f} |" + rest

        return cells

    sgd = optax.sgd(1e-3)

    def make_step(update, state_specs=None):
        """The step (jitted by ``timed``) of a per-device ``update(p, s,
        local_grads) -> (updates, s)``: shard_map over the devices, the
        updates applied; the state replicated unless ``state_specs``."""
        state_specs = P() if state_specs is None else state_specs

        def body(p, s, g):
            u, s = update(p, s, jax.tree.map(lambda a: a[0], g))
            return optax.apply_updates(p, u), s

        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), state_specs, P(axis)),
            out_specs=(P(), state_specs),
            check_vma=False,
        )

    def plain(p, s, g):
        return sgd.update(lax.pmean(g, axis), s, p)

    def bare_pmean(codec):
        def update(p, s, g):
            k = jax.random.key(0)
            mean = {
                name: jc.pmean(
                    v, axis, codec, key=jax.random.fold_in(k, i), algorithm=args.algorithm
                ).value
                for i, (name, v) in enumerate(sorted(g.items()))
            }
            return sgd.update(mean, s, p)

        return update

    def per_device(tree):
        """``tree`` of ``{leaf: [devices, ...]}`` arrays, one row per device."""
        return jax.device_put(tree, NamedSharding(mesh, P(axis)))

    def zero_residuals():
        return {k: jnp.zeros((args.devices, *v.shape), jnp.float32) for k, v in params.items()}

    def floor(codec):
        """The plain step plus one pass per leaf that reads the gradient and
        the residual and writes the new residual and a payload of the
        codec's bits per element: the bytes of one-pass error feedback,
        with no codec arithmetic (the payload is the max of each group of
        32 / bits values, one float32 per group). Residuals and payloads
        are state, so that XLA writes both out."""
        group = {k: max(1, round(32 / codec.bits_per_element(v.shape))) for k, v in params.items()}

        def one_pass(g, r, k):
            acc = g + r
            flat = acc.reshape(-1)
            groups = flat[: flat.size // k * k].reshape(-1, k)
            return acc * 0.5, jnp.max(groups, axis=1)[None]

        def update(p, s, g):
            opt, residuals, _ = s
            out = {name: one_pass(g[name], residuals[name], group[name]) for name in g}
            u, opt = sgd.update(lax.pmean(g, axis), opt, p)
            new_residuals = {name: o[0] for name, o in out.items()}
            return u, (opt, new_residuals, {name: o[1] for name, o in out.items()})

        payloads = {
            k: jnp.zeros((args.devices, v.size // group[k]), jnp.float32) for k, v in params.items()
        }
        state = (sgd.init(params), *per_device((zero_residuals(), payloads)))
        return make_step(update, (P(), P(axis), P(axis))), state

    def bare_residual(codec):
        """The bare all-reduce's step plus one pass per leaf that reads a
        float32 residual and writes the new one (state, so that XLA writes it
        out): the traffic error feedback adds to the encode the bare step
        already runs, with nothing else. No error feedback, fused or not,
        costs less over the bare all-reduce than this row."""
        update = bare_pmean(codec)

        def with_residual(p, s, g):
            opt, residuals = s
            u, opt = update(p, opt, g)
            return u, (opt, {name: r * 0.5 for name, r in residuals.items()})

        state = (sgd.init(params), per_device(zero_residuals()))
        return make_step(with_residual, (P(), P(axis))), state

    base_job = timed(make_step(plain), sgd.init(params))
    if args.profile:
        footprint(make_step(plain), sgd.init(params), "`lax.pmean` + sgd")
    extra = [c for c, on in (("x bare jc.pmean", args.bare), ("x floor", args.floor)) if on]
    blank = " |" * len(extra)
    rows = [row("`lax.pmean` + sgd", base_job, blank)]
    for spec in args.codecs:
        if spec.startswith("powersgd"):  # "powersgd:rank=R": jc.optax.powersgd, no codec
            rank = int(spec.partition("rank=")[2] or 4)
            tx = optax.chain(jc.optax.powersgd(axis, rank), sgd)
            state = jc.optax.init(tx, params, mesh, axis)
            job = timed(
                make_step(
                    lambda p, s, g, tx=tx: tx.update(g, s, p), jc.optax.state_specs(state, axis)
                ),
                state,
            )
            rows.append(row(f"`{spec}` jc.optax.powersgd + sgd", job, blank))
            continue
        codec = jc.codecs.get(spec)
        ctx = jc.optax.compress_gradients(
            codec,
            axis,
            algorithm=args.algorithm,
            error_feedback=args.error_feedback,
            server_error_feedback=args.server_error_feedback,
        )
        tx = optax.chain(ctx, sgd)
        state = jc.optax.init(tx, params, mesh, axis)
        specs = jc.optax.state_specs(state, axis)
        full = timed(make_step(lambda p, s, g, tx=tx: tx.update(g, s, p), specs), state)
        calls_job = rows_job = rows_bare = None
        if args.calls and codec.feedback_kernel:
            # The one-pass test answering no: every compression of error
            # feedback is then the separate calls.
            with patched(_feedback, "one_pass", lambda codec, dtype: False):
                calls_step = make_step(lambda p, s, g, tx=tx: tx.update(g, s, p), specs)
                calls_job = timed(calls_step, jc.optax.init(tx, params, mesh, axis))
        if args.rows and codec.decode_sum_kernel:
            with patched(type(codec), "decode_sum_kernel", False):
                rows_step = make_step(lambda p, s, g, tx=tx: tx.update(g, s, p), specs)
                rows_job = timed(rows_step, jc.optax.init(tx, params, mesh, axis))
                if args.bare:
                    rows_bare = timed(make_step(bare_pmean(codec)), sgd.init(params))
        if args.profile:
            footprint(make_step(bare_pmean(codec)), sgd.init(params), f"`{spec}` bare jc.pmean")
            footprint(
                make_step(
                    lambda p, s, g, tx=tx: tx.update(g, s, p), jc.optax.state_specs(state, axis)
                ),
                jc.optax.init(tx, params, mesh, axis),
                f"`{spec}` compress_gradients + sgd",
            )
            profile(
                make_step(
                    lambda p, s, g, tx=tx: tx.update(g, s, p), jc.optax.state_specs(state, axis)
                ),
                jc.optax.init(tx, params, mesh, axis),
                f"`{spec}` compress_gradients + sgd",
            )
        ratios = []  # the full update against the bare all-reduce and the floor
        if args.bare:
            bare_job = timed(make_step(bare_pmean(codec)), sgd.init(params))
            ratios.append(bare_job)
            tail = " 1.00 |" + (" |" if args.floor else "")
            if rows_bare is not None:
                label = f"`{spec}` bare jc.pmean (value only, rows decoded) + sgd"
                rows.append(row(label, rows_bare, tail))
            rows.append(row(f"`{spec}` bare jc.pmean (value only) + sgd", bare_job, tail))
            if args.floor:
                bound = timed(*bare_residual(codec))
                label = f"`{spec}` bare jc.pmean + sgd + one residual pass in jnp"
                rows.append(
                    row(label, bound, lambda b=bound, j=bare_job: f" {ms(b) / ms(j):.2f} | |")
                )
        if args.floor:
            floor_job = timed(*floor(codec))
            ratios.append(floor_job)
            tail = (" |" if args.bare else "") + " 1.00 |"
            label = f"`{spec}` floor: `lax.pmean` + sgd + one EF pass in jnp"
            rows.append(row(label, floor_job, tail))
        alg = args.algorithm
        if alg == "auto" and args.fast > 1:
            slow = jc.collectives.choose_algorithm(codec, n // args.fast, args.devices // args.fast)
            alg = f"auto: hierarchical, {slow} over node"
        elif alg == "auto":
            alg = f"auto: {jc.collectives.choose_algorithm(codec, n, args.devices)}"
        levels = "two-level" if args.server_error_feedback else "one-level"
        if not args.error_feedback:
            levels = "no"
        variants = (
            (rows_job, ", rows decoded", [rows_bare, *ratios[1:]] if rows_bare else ratios),
            (calls_job, ", separate calls", ratios),
            (full, "", ratios),
        )
        for job, how, against in variants:
            if job is not None:
                rows.append(
                    row(
                        f"`{spec}` compress_gradients ({alg}, {levels} EF{how}) + sgd",
                        job,
                        lambda j=job, against=against: "".join(
                            f" {ms(j) / ms(r):.2f} |" for r in against
                        ),
                    )
                )
    run_rounds()
    rounds = "" if args.rounds <= 1 else f", in {min(args.rounds, args.reps)} interleaved rounds"
    print(f"{args.devices} devices, {n} float32 parameters, median of {args.reps} steps{rounds}")
    print(jc._ffi.kernels_line())  # the twins run where the kernels did not load
    print("| step | ms | x plain pmean step |" + "".join(f" {c} |" for c in extra))
    print("|---|---|---|" + "---|" * len(extra))
    for row in rows:
        print(row(ms(base_job)))
    if footprints:
        print("\nMemory: temporaries of the compiled step, what they cost at run time")
        print("| step | temp MiB per device | minor page faults per step | system ms per step |")
        print("|---|---|---|---|")
        print("\n".join(footprints))
    for text in profiles:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
