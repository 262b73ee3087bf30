"""Command line: ``python -m jaxcomp {demo,bench,info,plan,launch} ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcomp as jc
    from jaxcomp._bench import default_codecs, make_input

    n = args.size
    x = make_input(n, seed=args.seed)
    key = jax.random.key(args.seed)
    xs = np.asarray(x, np.float64)
    print(f"jaxcomp {jc.__version__}: compressing a gradient-like float32 tensor of {n} elements")
    print(f"{jc._ffi.kernels_line()}\n")
    header = f"{'codec':58s} {'bits/elt':>8s} {'ratio':>7s} {'wire bytes':>11s} {'rel. error':>10s} {'ffi == xla':>10s}"
    print(header)
    print("-" * len(header))
    for codec in [jc.codecs.Identity(), *default_codecs()]:
        p = jax.jit(lambda x, k, c=codec: c.encode(x, k))(x, key)
        y = np.asarray(jax.jit(lambda p, c=codec: c.decode(p))(p), np.float64)
        err = np.linalg.norm(y - xs) / np.linalg.norm(xs)
        same = "-"
        if jc.cpu_available() or jc.cuda_available():
            q = jax.jit(lambda x, k, c=codec: c.encode(x, k, backend="xla"))(x, key)
            same = (
                "yes"
                if all(np.asarray(p[k]).tobytes() == np.asarray(q[k]).tobytes() for k in p.arrays)
                else "NO"
            )
        used = int(p.used_nbytes)  # below p.nbytes only for variable-rate codecs
        print(
            f"{codec!r:58s} {8 * used / n:8.2f} {4 * n / used:6.1f}x {used:11d} "
            f"{err:10.2e} {same:>10s}"
        )
    print(
        "\nwire bytes: what the payload needs (ThreeLC: its used stream, within a buffer of "
        "the no-ZRE size);\nratio: float32 bytes / wire bytes; "
        "rel. error: ||decode(encode(x)) - x|| / ||x||"
    )
    del jnp
    return 0


def _bench(args: argparse.Namespace) -> int:
    from jaxcomp import _bench

    codecs = _bench.default_codecs()
    if args.codec:
        codecs = [c for c in codecs if any(s.lower() in repr(c).lower() for s in args.codec)]
    sizes = [1 << e for e in args.log2_sizes]
    rows = _bench.measure(codecs, sizes, backends=args.backends, reps=args.reps, log=print)
    print()
    print(_bench.markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": _bench.environment(), "rows": [r.__dict__ for r in rows]},
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 0


def _info(args: argparse.Namespace) -> int:
    import jaxcomp as jc
    from jaxcomp._bench import environment

    print(f"jaxcomp {jc.__version__}")
    for k, v in environment().items():
        print(f"{k}: {v}")
    print(f"kernels: {jc._ffi.kernels_line()}")
    print(f"codecs: {', '.join(jc.codecs.names())}")
    return 0


def _start_cpu_devices(count: int) -> None:
    """The plan compiles the all-reduce on a CPU mesh to read XLA's memory
    traffic: ask JAX for that many CPU devices before its backends start
    (if they already have, the devices present are used)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass


def _cluster(args: argparse.Namespace):
    from jaxcomp import planning

    inter = planning.Link(
        planning.parse_rate(args.bandwidth), planning.parse_seconds(args.latency), args.goodput
    )
    intra = None
    if args.intra_bandwidth:
        intra = planning.Link(
            planning.parse_rate(args.intra_bandwidth), planning.parse_seconds(args.intra_latency)
        )
    return planning.Cluster(args.processes, args.devices_per_process, inter, intra)


def _compute(args: argparse.Namespace, codecs, extra=()):
    """The codecs' speed: read from --compute, or measured now for
    ``codecs`` and the ``extra`` codecs other rows run."""
    from jaxcomp import planning
    from jaxcomp.codecs.base import Rate

    if args.no_compute:
        return None
    if args.compute:
        return planning.load_compute(args.compute, share=args.cpu_share)
    # The sparse codecs' dense stage runs its value codec's kernels too.
    nested = [c.value_codec for c in codecs if c.rate is Rate.SPARSE and c.value_codec is not None]
    measured = list(dict.fromkeys([*codecs, *nested, *(c for c in extra if c is not None)]))
    return planning.measure_compute(measured, 1 << args.compute_size, share=args.cpu_share)


def _cluster_line(cluster) -> str:
    intra = cluster.intra
    return (
        f"{cluster.processes} process(es) x {cluster.devices_per_process} device(s); "
        f"link {cluster.inter.bandwidth / 1e9:g} Gbit/s, {cluster.inter.latency * 1e6:g} us"
        + (
            f"; within a process {intra.bandwidth / 1e9:g} Gbit/s, {intra.latency * 1e6:g} us"
            if intra
            else ""
        )
    )


def _compute_line(compute) -> str:
    return f"compute: {compute.source + f', share {compute.share:g}' if compute else 'left out'}"


def _plan_header(n: int, k: int, cluster, compute, error_feedback: bool, methods) -> str:
    return (
        f"{n:,} float32 gradient values per device in {k} all-reduce(s); "
        + _cluster_line(cluster)
        + f"\n{_compute_line(compute)}"
        + f"\nerror feedback: {'counted' if error_feedback else 'left out'}"
        + (
            f"\nother methods: PowerSGD's factors for a transformer of width {methods.width} "
            f"(--width); DiLoCo: one exchange every {methods.sync_every} steps, per step "
            "(--sync-every); 1-bit Adam after its warm-up"
            if methods
            else ""
        )
        + "\nheld-out loss: its change against float32 in the accuracy study "
        "(docs/accuracy.md), SGD on an MLP, AdamW or 1-bit Adam on a transformer LM\n"
    )


def _plan(args: argparse.Namespace) -> int:
    from jaxcomp import codecs as jcc
    from jaxcomp import planning

    if args.testbed or args.check:
        # The project's test bed is no part of the package.
        print(
            "python -m jaxcomp plan: error: --testbed and --check are gone from the package; "
            "in a checkout of the repository, run python benchmarks/plan_check.py (the test "
            "bed's links and its measured rows), or describe a link with --bandwidth, "
            "--latency and --goodput",
            file=sys.stderr,
        )
        return 2
    _start_cpu_devices(planning.TRAFFIC_MAX_DEVICES)
    try:  # a unit or a codec spec the user mistyped: one line, not a traceback
        codecs = [jcc.get(s) for s in args.codecs] if args.codecs else planning.default_codecs()
        cluster = _cluster(args)
        n = planning.parse_count(args.params)
        methods = planning.Methods(
            n, args.width, powersgd_rank=args.powersgd_rank, sync_every=args.sync_every
        )
    except (ValueError, TypeError) as e:
        print(f"python -m jaxcomp plan: error: {e}", file=sys.stderr)
        return 2
    codecs = [c for c in codecs if c.bits_per_element() >= args.min_bits]
    bucket = max(1, int(args.bucket_mb * (1 << 20)) // 4) if args.bucket_mb else None
    if args.shard_params:
        return _plan_sharded(args, codecs, cluster, n, bucket)
    # The other methods' codecs (1-bit Adam's, DiLoCo's) are measured too.
    compute = _compute(args, codecs, () if args.algorithms else methods.codecs)
    ef = not args.no_error_feedback
    rows = planning.plan(
        n,
        cluster,
        compute,
        codecs=codecs,
        algorithms=args.algorithms,
        error_feedback=ef,
        bucket=bucket,
        methods=methods,
    )
    k = 1 if not bucket or n <= bucket else -(-n // bucket)
    print(_plan_header(n, k, cluster, compute, ef, None if args.algorithms else methods))
    print(planning.table(rows, args.top))
    if compute is not None and not args.algorithms:
        for c in methods.codecs:
            if repr(c) not in compute.kernels:
                print(f"\nleft out: the rows of {c.spec} (no compute figures in {compute.source})")
    if args.json:
        with open(args.json, "w") as f:
            out = [_json_row(e) for e in rows]
            json.dump(out, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


def _param_codecs(specs):
    """The parameter all-gather's codecs: None for "float32" (exact)."""
    from jaxcomp import codecs as jcc

    return [None if s.lower() in ("float32", "f32", "none") else jcc.get(s) for s in specs]


def _sharded_header(n: int, k: int, cluster, compute, args) -> str:
    gathers = (
        "2 (the forward pass, and the backward pass's re-gather of a layer that "
        "jax.checkpoint rematerializes, as ZeRO-3 does; --no-regather: 1)"
        if args.regather
        else "1 (the forward pass; the backward pass keeps the gathered layer: --regather "
        "counts its re-gather)"
    )
    return (
        f"{n:,} parameters sharded in {k} layer(s); "
        + _cluster_line(cluster)
        + f"\n{_compute_line(compute)}"
        + f"\nerror feedback: {'counted' if not args.no_error_feedback else 'left out'}"
        + f"\nparameter all-gathers per layer and step: {gathers}"
        + "\nlayouts: fsdp: sharded over every device; fsdp(slow, fast): the same where "
        "processes have several devices, the gradient reduce-scatter exact within a process "
        "and compressed across, the parameter all-gather compressed across; hsdp: sharded "
        "within a process and replicated across, exact within, the gradient shard all-reduced "
        "across the processes with its codec (jc.psum, algorithm auto)\n"
    )


def _plan_sharded(args: argparse.Namespace, codecs, cluster, n: int, bucket) -> int:
    """``plan --shard-params``: sharded training's collectives ranked
    against float32 sharded training."""
    from jaxcomp import planning

    if args.algorithms:
        print(
            "python -m jaxcomp plan: error: --algorithms picks all-reduce algorithms; "
            "--shard-params ranks sharded training, whose collectives are the reduce-scatter "
            "and all-gather (HSDP's all-reduce across processes runs jc.psum's auto)",
            file=sys.stderr,
        )
        return 2
    try:
        params = _param_codecs(args.param_codecs)
    except (ValueError, TypeError) as e:
        print(f"python -m jaxcomp plan: error: {e}", file=sys.stderr)
        return 2
    compute = _compute(args, codecs, params)
    rows, left_out = planning.plan_sharded(
        n,
        cluster,
        compute,
        codecs=codecs,
        parameters=params,
        regather=args.regather,
        error_feedback=not args.no_error_feedback,
        bucket=bucket,
    )
    k = 1 if not bucket or n <= bucket else -(-n // bucket)
    print(_sharded_header(n, k, cluster, compute, args))
    print(planning.sharded_table(rows, args.top))
    gone: dict[tuple[str, str], str] = {}
    for s, why in left_out:
        name = s.name if s.gradients else s.parameters_name
        gone.setdefault((s.layout, name), why.split(". ")[0])
    for (layout, name), why in gone.items():
        print(f"\nleft out of {layout}: {name}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([_json_sharded_row(e) for e in rows], f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


def _json_sharded_row(e) -> dict:
    s = e.sharding
    row = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name != "sharding"}
    return {
        "gradients": s.name,
        "parameters": s.parameters_name,
        "layout": s.layout,
        **row,
        "seconds": e.seconds,
    }


def _json_row(e) -> dict:
    from jaxcomp import planning

    row = {**dataclasses.asdict(e), "codec": e.name, "seconds": e.seconds}
    sgd, adam = planning.measured_loss(e)
    return {**row, "held_out_loss_sgd": sgd, "held_out_loss_adam": adam}


def _add_plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="predict and rank every codec x algorithm for a model and a cluster (docs/choosing.md)",
        description="Predicts the all-reduce time of every codec and algorithm (the alpha-beta "
        "model of the library's own bytes, plus the codecs' kernels measured on this machine) "
        "and ranks them against lax.psum. See docs/choosing.md.",
    )
    p.add_argument("--params", default="100M", help="gradient values per device (100M, 1B, 4.25e6)")
    p.add_argument("--processes", type=int, default=4, help="processes (nodes) (default 4)")
    p.add_argument("--devices-per-process", type=int, default=1, help="devices of each process")
    p.add_argument("--bandwidth", default="10gbit", help="between processes, per process (10gbit)")
    p.add_argument("--latency", default="50us", help="between processes, per message (50us)")
    p.add_argument(
        "--goodput",
        type=float,
        default=1.0,
        help="fraction of --bandwidth transfers get (TCP over Ethernet, 1500 MTU: 0.94)",
    )
    p.add_argument(
        "--intra-bandwidth", help="between the devices of a process, per device (900GB/s)"
    )
    p.add_argument("--intra-latency", default="5us", help="within a process, per message (5us)")
    p.add_argument("--testbed", help=argparse.SUPPRESS)  # gone: benchmarks/plan_check.py
    p.add_argument(
        "--bucket-mb",
        type=float,
        default=64.0,
        help="MiB of gradient per all-reduce (with --shard-params: per layer) (64)",
    )
    p.add_argument(
        "--codecs", nargs="*", help="codec specs (qsgd:bits=4 bf16 ...); default: one of each"
    )
    p.add_argument("--algorithms", nargs="*", help="only these algorithms")
    p.add_argument(
        "--min-bits",
        type=float,
        default=0.0,
        help="leave out codecs of fewer bits per element (8 for Adam, docs/training.md)",
    )
    p.add_argument(
        "--no-error-feedback", action="store_true", help="leave error feedback's cost out"
    )
    p.add_argument("--compute", help="a `python -m jaxcomp bench --json` file instead of measuring")
    p.add_argument("--no-compute", action="store_true", help="the wire alone, no codec compute")
    p.add_argument("--compute-size", type=int, default=22, help="log2 of the size measured (22)")
    p.add_argument(
        "--cpu-share",
        type=float,
        default=1.0,
        help="how many times slower than measured the compute runs (processes sharing the cores)",
    )
    p.add_argument(
        "--width",
        type=int,
        help="the model's hidden size, for PowerSGD's factors (default: from --params, "
        "a transformer 100 times as wide as deep)",
    )
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD's rank (4)")
    p.add_argument(
        "--sync-every", type=int, default=500, help="DiLoCo's steps per synchronization (500)"
    )
    p.add_argument(
        "--shard-params",
        action="store_true",
        help="rank sharded training (FSDP, and HSDP where processes have several devices): the "
        "gradient reduce-scatter with each codec and the parameter all-gather with each of "
        "--param-codecs, against float32 and bf16 sharded training (docs/choosing.md)",
    )
    p.add_argument(
        "--param-codecs",
        nargs="+",
        default=["float32", "int8"],
        help="with --shard-params: the parameter all-gather's codecs, float32 for exact "
        "(default: float32 int8)",
    )
    p.add_argument(
        "--regather",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --shard-params: count the backward pass's re-gather of each layer's "
        "parameters (jax.checkpoint, as ZeRO-3 does; default: counted)",
    )
    p.add_argument("--top", type=int, help="print only the best rows")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--check", help=argparse.SUPPRESS)  # gone: benchmarks/plan_check.py
    p.set_defaults(fn=_plan)


def _launch(args: argparse.Namespace) -> int:
    from jaxcomp import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return launch.run(
            command,
            args.n,
            devices_per_process=args.devices_per_process,
            grace_seconds=args.grace,
        )
    except ValueError as e:  # no command, a count below 1
        why = str(e).removeprefix("jaxcomp launch: ")
        print(f"python -m jaxcomp launch: error: {why}", file=sys.stderr)
        return 2
    except OSError as e:  # a command that cannot start
        print(f"python -m jaxcomp launch: cannot start {command[0]!r}: {e}", file=sys.stderr)
        return 127


def _add_launch_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a script as N local processes joined by jax.distributed (docs/training-loop.md)",
        description="Starts N processes of COMMAND on this machine, joined by jax.distributed "
        "over loopback: each calls jaxcomp.launch.initialize() before its first JAX "
        "computation. Every output line is prefixed with its process's rank; when one "
        "process fails, or on Ctrl-C, all are stopped, and the exit status is the first "
        "failure's. A COMMAND starting with a .py file or `python` runs with this Python.",
        usage="python -m jaxcomp launch [-h] -n N [--devices-per-process K] [--grace S] "
        "-- COMMAND ...",
    )
    p.add_argument("-n", type=int, required=True, help="number of processes")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        metavar="K",
        help="simulated CPU devices of each process, or GPUs given to each (default 1)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds the processes get to exit after SIGTERM before SIGKILL (default 5)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="script.py ARGS, or python -m ...")
    p.set_defaults(fn=_launch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomp",
        description="jaxcomp: compressed gradient communication for data-parallel JAX.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{demo,bench,info,plan,launch}"
    )

    p = sub.add_parser("demo", help="compress a gradient-like tensor with every codec")
    p.add_argument("--size", type=int, default=1 << 20, help="elements (default 2^20)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_demo)

    p = sub.add_parser("bench", help="encode/decode throughput of the codecs (GB/s vs memcpy)")
    p.add_argument(
        "--log2-sizes",
        type=int,
        nargs="+",
        default=[20, 24],
        metavar="E",
        help="input sizes as powers of two (default: 20 24)",
    )
    p.add_argument("--codec", nargs="*", help="only codecs whose name contains one of these")
    p.add_argument("--backends", nargs="+", default=["ffi", "xla"], choices=["ffi", "xla"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", help="also write the results to this JSON file")
    p.set_defaults(fn=_bench)

    p = sub.add_parser("info", help="versions, kernels and codecs available")
    p.set_defaults(fn=_info)

    _add_plan_parser(sub)
    _add_launch_parser(sub)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
