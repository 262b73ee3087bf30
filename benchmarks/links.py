"""The collectives themselves over the emulated slow links, without codecs:
how close each of XLA's CPU collectives (over gloo) comes to the bandwidth
term of the alpha-beta model, which bounds every compressed algorithm built
on it.

    sudo python benchmarks/links.py                 # 4 processes, 100 Mbit
    sudo python benchmarks/links.py --rate 1gbit --procs 2

One JAX process per network namespace, one CPU device each, on the test bed
of benchmarks/collectives.py. Each row: the median over 3 calls of the
slowest process. Rows: ``lax.psum`` of float32 and of bfloat16 (the CPU
backend widens a 16-bit all-reduce to float32, so it costs the float32
time), ``lax.all_to_all`` and ``lax.all_gather`` of bytes with the operand
sizes of the two-phase all-reduce of a bfloat16 payload, the same all-to-all
as P - 1 pairwise ``ppermute`` rounds, one round at a time, and one
``ppermute`` hop.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import collectives as bed_lib  # the test bed


def pairwise_all_to_all(a, axis_name, size):
    """``all_to_all(a, axis, 0, 0)`` as P - 1 rounds of ``ppermute``: in
    round s device d sends its row for d + s and receives d - s's row for
    it; each round waits for the previous one (one flow per link
    direction at a time)."""
    from jax import lax

    me = lax.axis_index(axis_name)
    out = lax.dynamic_update_index_in_dim(a * 0, lax.dynamic_index_in_dim(a, me, 0, False), me, 0)
    got = None
    for s in range(1, size):
        send = lax.dynamic_index_in_dim(a, (me + s) % size, 0, False)
        if got is not None:
            send, _ = lax.optimization_barrier((send, got))
        got = lax.ppermute(send, axis_name, [(d, (d + s) % size) for d in range(size)])
        out = lax.dynamic_update_index_in_dim(out, got, (me - s) % size, 0)
    return out


def cases(procs: int, n: int):
    """(label, function of the local [1, m] array, local elements, dtype,
    bytes one process sends in the bandwidth model)."""
    from jax import lax

    chunk = 2 * n // procs  # a bf16 payload of n values, cut per owner, in bytes
    ring = 2 * (procs - 1) / procs
    return [
        ("lax.psum float32", lambda x: lax.psum(x, "d"), n, "float32", ring * 4 * n),
        ("lax.psum bfloat16", lambda x: lax.psum(x, "d"), n, "bfloat16", ring * 2 * n),
        (
            "lax.all_to_all bytes",
            lambda x: lax.all_to_all(x.reshape(procs, -1), "d", 0, 0).reshape(1, -1),
            procs * chunk,
            "uint8",
            (procs - 1) * chunk,
        ),
        (
            "pairwise ppermute all-to-all bytes",
            lambda x: pairwise_all_to_all(x.reshape(procs, -1), "d", procs).reshape(1, -1),
            procs * chunk,
            "uint8",
            (procs - 1) * chunk,
        ),
        (
            "lax.all_gather bytes",
            lambda x: lax.all_gather(x[0], "d").reshape(1, -1)[:, : x.shape[1]],
            chunk,
            "uint8",
            (procs - 1) * chunk,
        ),
        (
            "lax.ppermute bytes (one hop)",
            lambda x: lax.ppermute(x, "d", [(i, (i + 1) % procs) for i in range(procs)]),
            chunk,
            "uint8",
            chunk,
        ),
    ]


def worker(args) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = bed_lib.join(args, "d")
    times = {}
    for label, fn, m, dtype, _ in cases(args.procs, 1 << args.log2_n):
        local = np.ones((1, m), jnp.dtype(dtype))
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("d")), local, (args.procs, m)
        )
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        times[label] = statistics.median(bed_lib.time_calls(lambda f=f, x=x: f(x), args.iters))
    pathlib.Path(args.out).write_text(json.dumps(times))
    jax.distributed.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rate", default="100mbit", choices=list(bed_lib.RATES))
    ap.add_argument("--log2-n", type=int, default=24, help="values per process (default 2^24)")
    ap.add_argument("--iters", type=int, default=3)
    bed_lib.add_worker_args(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    why = bed_lib.probe()
    if why:
        print(f"skipped: the emulated-link test bed {why}")
        return 0
    port = random.randrange(20000, 60000)
    with tempfile.TemporaryDirectory() as tmp, bed_lib.bed(args.procs, args.rate) as hosts:
        procs = []
        for i, ns in enumerate(hosts):
            cmd = ["ip", "netns", "exec", ns, sys.executable, __file__, "--worker"]
            cmd += ["--pid", str(i), "--port", str(port), "--procs", str(args.procs)]
            cmd += ["--log2-n", str(args.log2_n), "--iters", str(args.iters)]
            cmd += ["--out", f"{tmp}/{i}.json"]
            env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
        if any(p.wait() for p in procs):
            raise RuntimeError("a worker failed")
        results = [
            json.loads(pathlib.Path(f"{tmp}/{i}.json").read_text()) for i in range(len(hosts))
        ]
    rate = bed_lib.RATES[args.rate][2]
    print(
        f"{args.procs} processes, {args.rate}, 2^{args.log2_n} values per process, "
        f"median of {args.iters} calls of the slowest process"
    )
    print("| collective | bytes sent per process | time s | model s | over the model |")
    print("|---|---|---|---|---|")
    for label, _, _, _, sent in cases(args.procs, 1 << args.log2_n):
        t = max(r[label] for r in results)
        model = 8 * sent / rate
        print(f"| {label} | {sent:.0f} | {t:.3f} | {model:.3f} | {100 * (t / model - 1):+.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
