"""Compressed all-reduce vs lax.psum over emulated slow links.

One JAX process per network namespace, each with one CPU device, joined by
jax.distributed (gloo); every host's link to a shared bridge is shaped with
tbf in both directions (the test bed of the project's testbed notes). For
each process count P, link rate and (codec, algorithm), the time of one
all-reduce of N float32 per process is the median over iterations of the
slowest process, beside lax.psum's, the bytes each device hands to the
collectives, and the alpha-beta prediction (bandwidth term only: tbf has no
delay).

    sudo python benchmarks/collectives.py                     # the full sweep
    sudo python benchmarks/collectives.py --procs 2 --rates 1gbit --log2-n 20
    sudo python benchmarks/collectives.py --steps --procs 4   # the optimizer step

`--steps` times what training runs instead: the whole data-parallel step
(gradients in, new parameters and optimizer state out) over four matrices of
N/4 values (2048 x 2048 at the default N): `lax.pmean` + sgd, and per codec
the bare `jc.pmean(grad).value` of every leaf + sgd beside the full
`optax.chain(jc.optax.compress_gradients(codec), optax.sgd)` update with its
error feedback, and `optax.chain(jc.optax.powersgd(rank=4), optax.sgd)`, the
state carried from step to step. `--step-codecs` picks some of those rows
(the docs are then left alone).

Needs root, iproute2 (ip, tc) and the tbf qdisc; skips with a message where
any is missing. Times the installed jaxcomp (`pip install .`), and refuses to
run where its CPU kernels are not built, unless `--twins` asks for the
pure-JAX twins. Writes benchmarks/results/collectives.json and, for a sweep of both
rates, the section between the markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- collectives:begin -->", "<!-- collectives:end -->"
BRIDGE_NS = "jcbr"
SUBNET = "10.77.0"
# (codec name, params, algorithm)
CASES = [
    ("threelc", {"sparsity": 1.0}, "two_phase"),
    ("threelc", {"sparsity": 1.0}, "allgather"),
    ("topk", {"fraction": 0.01}, "sparse"),
    ("qsgd", {"bits": 4, "bucket_size": 512}, "two_phase"),
    ("qsgd", {"bits": 4, "bucket_size": 512}, "allgather"),
    ("qsgd", {"bits": 4, "bucket_size": 512}, "ring"),
    ("qsgd", {"bits": 8, "bucket_size": 512}, "two_phase"),
    ("int8", {"bucket_size": 512}, "two_phase"),
    ("onebit", {"bucket_size": 64}, "two_phase"),
    ("cast", {"dtype": "bfloat16"}, "two_phase"),
    ("cast", {"dtype": "bfloat16"}, "ring"),
    ("fp8", {"format": "e4m3"}, "two_phase"),
    ("mx", {"element": "e4m3"}, "two_phase"),
    ("mx", {"element": "e2m1"}, "two_phase"),
]
# The codecs of the optimizer-step rows (--steps), each with the defaults and
# the algorithm `auto` picks, as users run them; "spec@algorithm" names
# another algorithm (the ring for the bf16 cast: see benchmarks/links.py).
# "powersgd:rank=R" is jc.optax.powersgd (no bare row: its all-reduces are
# plain lax.pmean of the factors).
STEP_CODECS = [
    "qsgd:bits=4",
    "onebit",
    "topk:fraction=0.01",
    "bf16",
    "bf16@ring",
    "powersgd:rank=4",
]
STEP_BEGIN, STEP_END = "<!-- optax-step-links:begin -->", "<!-- optax-step-links:end -->"
RATES = {"1gbit": ("256kb", "5ms", 1e9), "100mbit": ("32kb", "20ms", 1e8)}


# ---------------------------------------------------------------------------
# The test bed
# ---------------------------------------------------------------------------
def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def probe() -> str | None:
    """Why the bed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian: iproute2)"
    name = f"jcprobe{random.randrange(1 << 20)}"
    try:
        run("ip", "netns", "add", name)
        run("ip", "-n", name, "link", "add", "pa0", "type", "veth", "peer", "name", "pb0")
        r = run(
            "tc",
            "-n",
            name,
            "qdisc",
            "add",
            "dev",
            "pa0",
            "root",
            "tbf",
            "rate",
            "1gbit",
            "burst",
            "256kb",
            "latency",
            "5ms",
            check=False,
        )
        if r.returncode != 0:
            return f"tbf qdisc unavailable: {r.stderr.strip()}"
    except subprocess.CalledProcessError as e:
        return f"cannot create a network namespace: {e.stderr.strip()}"
    finally:
        run("ip", "netns", "del", name, check=False)
    return None


@contextlib.contextmanager
def bed(procs: int, rate: str, tag: str = ""):
    """Namespaces ns0..ns{P-1} on a bridge, every link shaped to ``rate``.
    ``tag`` names a second bed beside the default one (its own namespaces;
    the subnet is private to each bridge, so the addresses can repeat)."""
    burst, latency, _ = RATES[rate]
    hostname = socket.gethostname()
    bridge = BRIDGE_NS + tag
    hosts = [f"jcns{tag}{i}" for i in range(procs)]
    made: list[str] = []  # torn down at the end: only what this call created

    def add(ns: str) -> None:
        r = run("ip", "netns", "add", ns, check=False)
        if r.returncode != 0:
            raise RuntimeError(
                f"cannot create network namespace {ns} ({r.stderr.strip()}): is another "
                "job's test bed up? (`ip netns list`)"
            )
        made.append(ns)

    try:
        add(bridge)
        run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, ns in enumerate(hosts):
            add(ns)
            run(
                "ip",
                "link",
                "add",
                f"veth{i}",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                f"vbr{i}",
                "netns",
                bridge,
            )
            run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", f"veth{i}")
            run("ip", "-n", ns, "link", "set", f"veth{i}", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", bridge, "link", "set", f"vbr{i}", "master", "br0")
            run("ip", "-n", bridge, "link", "set", f"vbr{i}", "up")
            for netns, dev in ((ns, f"veth{i}"), (bridge, f"vbr{i}")):
                run(
                    "tc",
                    "-n",
                    netns,
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst,
                    "latency",
                    latency,
                )
            # gloo advertises the address the hostname resolves to.
            etc = pathlib.Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{SUBNET}.{i + 1} {hostname}\n")
        yield hosts
    finally:
        for ns in reversed(made):
            run("ip", "netns", "del", ns, check=False)
            if ns != bridge:
                shutil.rmtree(pathlib.Path("/etc/netns") / ns, ignore_errors=True)


# ---------------------------------------------------------------------------
# One process of the job
# ---------------------------------------------------------------------------
@contextlib.contextmanager
def free_bed(tag: str, procs: int, rate: str, wait: float):
    """The test bed of namespaces tagged ``tag`` (:func:`bed`), once no
    other run holds them: a script's runs wait for each other's beds, up to
    ``wait`` seconds."""
    names = {BRIDGE_NS + tag, *(f"jcns{tag}{i}" for i in range(procs))}
    deadline = time.monotonic() + wait
    while True:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        busy = names & {line.split()[0] for line in listed.splitlines() if line.strip()}
        if not busy:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test bed's namespaces {sorted(busy)} stay in use")
        print(f"waiting for namespaces {sorted(busy)} (another run's test bed)", flush=True)
        time.sleep(10)
    with bed(procs, rate, tag=tag) as hosts:
        yield hosts


def join(args: argparse.Namespace, axis: str):
    """Joins this process to the job (jax.distributed over the test bed's
    bridge, or at ``args.coordinator`` where a script runs on loopback
    without the bed) and returns the one-axis mesh of its devices."""
    import jax

    host = getattr(args, "coordinator", None) or f"{SUBNET}.1"
    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(
        coordinator_address=f"{host}:{args.port}",
        num_processes=args.procs,
        process_id=args.pid,
        initialization_timeout=120,
    )
    return jax.make_mesh((args.procs,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def add_worker_args(ap: argparse.ArgumentParser) -> None:
    """The hidden options a launched process of the job is given."""
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)


def time_calls(call, iters: int) -> list[float]:
    """Seconds of ``iters`` calls of ``call`` (after one to compile and warm
    up), each started together on every process; ``call`` returns what to
    wait for."""
    import jax
    from jax.experimental import multihost_utils

    jax.block_until_ready(call())
    times = []
    for _ in range(iters):
        multihost_utils.sync_global_devices("iter")
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return times


def worker(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = join(args, "data")

    import jaxcomp as jc

    if not args.twins and not jc.cpu_available():
        raise SystemExit("jaxcomp's CPU kernels are not importable in this process")
    n = 1 << args.log2_n
    sharding = NamedSharding(mesh, P("data"))
    # Gradient-like data: Laplacian (heavier tails than a Gaussian).
    local = np.random.default_rng(args.pid).laplace(size=(1, n)).astype(np.float32)
    x = jax.make_array_from_process_local_data(sharding, local, (args.procs, n))
    key = jax.random.key(0)

    def timed(f) -> list[float]:
        return time_calls(lambda: f(x, key), args.iters)

    def timed_steps(f, params, state, grads) -> list[float]:
        # The step donates the parameters (a copy of them each) and the state.
        carry = [jax.tree.map(jnp.copy, params), state]

        def call():
            carry[:] = f(carry[0], carry[1], grads)
            return carry[0]

        return time_calls(call, args.iters)

    def shard(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))

    if args.steps:
        rows = step_rows(args, mesh, local, timed_steps)
        pathlib.Path(args.out).write_text(json.dumps({"times": rows, "wire": {}}))
        jax.distributed.shutdown()
        return
    rows = {"psum": timed(shard(lambda x, k: jax.lax.psum(x, "data")))}
    wire = {}
    for name, params, alg in CASES:
        codec = jc.codecs.get(name, **params)

        def f(x, k, c=codec, a=alg):
            r = jc.psum(x[0], "data", c, key=k, algorithm=a, all_to_all=args.all_to_all)
            return r.value[None]

        case = f"{name}|{json.dumps(params)}|{alg}"
        rows[case] = timed(shard(f))  # compiled at its first call
        # The bytes this process handed to each collective, as the program
        # ran (capacity tiers follow the data): one more call, logged.
        with jc.collectives.wire_log() as log:
            jax.block_until_ready(shard(lambda x, k, f=f: f(x, k))(x, key))
        kinds: dict[str, int] = {}
        for kind, nbytes in log:
            kinds[kind] = kinds.get(kind, 0) + nbytes
        wire[case] = kinds
    pathlib.Path(args.out).write_text(json.dumps({"times": rows, "wire": wire}))
    jax.distributed.shutdown()


def step_rows(args, mesh, local, timed_steps) -> dict[str, list[float]]:
    """The optimizer-step rows (``--steps``): this process's times of the
    plain step and, per codec of STEP_CODECS, the bare and the full update."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    n = local.shape[1]
    shape = (2048, 2048) if n == 1 << 24 else (n // 4,)
    names = [f"m{i}" for i in range(4)]
    replicated = NamedSharding(mesh, P())
    params = {k: jax.device_put(np.zeros(shape, np.float32), replicated) for k in names}
    grads = {
        k: jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("data")),
            local[:, i * (n // 4) : (i + 1) * (n // 4)].reshape(1, *shape),
            (args.procs, *shape),
        )
        for i, k in enumerate(names)
    }
    sgd = optax.sgd(1e-3)

    def step(update, specs):
        def body(p, s, g):
            u, s = update(p, s, jax.tree.map(lambda a: a[0], g))
            return optax.apply_updates(p, u), s

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), specs, P("data")),
            out_specs=(P(), specs),
            check_vma=False,
        )
        # Parameters and state donated, as jc.data_parallel does: with the
        # state alone, XLA may give the new parameters the buffers of
        # residuals of their size and copy every such residual each step.
        return jax.jit(mapped, donate_argnums=(0, 1))

    def plain(p, s, g):
        return sgd.update(jax.lax.pmean(g, "data"), s, p)

    rows = {"step|pmean": timed_steps(step(plain, P()), params, sgd.init(params), grads)}
    for spec in args.step_codecs:
        if spec.startswith("powersgd:rank="):
            tx = optax.chain(jc.optax.powersgd("data", int(spec.split("=")[1])), sgd)
            state = jc.optax.init(tx, params, mesh, "data")
            specs = jc.optax.state_specs(state, "data")
            rows[f"step|{spec}|full"] = timed_steps(
                step(lambda p, s, g, tx=tx: tx.update(g, s, p), specs), params, state, grads
            )
            continue
        name, _, alg = spec.partition("@")
        codec, alg = jc.codecs.get(name), alg or "auto"

        def bare(p, s, g, c=codec, a=alg):
            key = jax.random.key(0)
            mean = {
                k: jc.pmean(
                    g[k],
                    "data",
                    c,
                    key=jax.random.fold_in(key, i),
                    algorithm=a,
                    all_to_all=args.all_to_all,
                ).value
                for i, k in enumerate(names)
            }
            return sgd.update(mean, s, p)

        rows[f"step|{spec}|bare"] = timed_steps(step(bare, P()), params, sgd.init(params), grads)
        tx = optax.chain(jc.optax.compress_gradients(codec, "data", algorithm=alg), sgd)
        state = jc.optax.init(tx, params, mesh, "data")
        specs = jc.optax.state_specs(state, "data")
        rows[f"step|{spec}|full"] = timed_steps(
            step(lambda p, s, g, tx=tx: tx.update(g, s, p), specs), params, state, grads
        )
    return rows


def launch(
    hosts: list[str], args: argparse.Namespace, tmp: pathlib.Path
) -> tuple[dict[str, list[list[float]]], dict[str, dict[str, int]]]:
    port = random.randrange(20000, 60000)
    procs = []
    for i, ns in enumerate(hosts):
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            "timeout",
            str(args.timeout),
            sys.executable,
            __file__,
            "--worker",
            "--port",
            str(port),
            "--procs",
            str(len(hosts)),
            "--pid",
            str(i),
            "--log2-n",
            str(args.log2_n),
            "--iters",
            str(args.iters),
            "--out",
            str(tmp / f"{i}.json"),
        ]
        cmd += ["--all-to-all", args.all_to_all]
        if args.twins:
            cmd.append("--twins")
        if args.steps:
            cmd += ["--steps", "--step-codecs", *args.step_codecs]
        # The workers import jaxcomp as this process would: the installed
        # package, or with PYTHONPATH a checkout, which loads the installed
        # kernels built from its sources (jaxcomp/_ffi.py); a worker without
        # kernels refuses to time the twins in their place.
        env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = [p.communicate()[0] for p in procs]
    for i, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"process {i} failed ({p.returncode}):\n{logs[i][-3000:]}")
    results: dict[str, list[list[float]]] = {}
    wire: dict[str, dict[str, int]] = {}
    for i in range(len(hosts)):
        out = json.loads((tmp / f"{i}.json").read_text())
        for k, v in out["times"].items():
            results.setdefault(k, []).append(v)
        for k, kinds in out["wire"].items():  # the largest over processes
            for kind, b in kinds.items():
                wire.setdefault(k, {})[kind] = max(wire.get(k, {}).get(kind, 0), b)
    return results, wire


def run_job(cmds: list[list[str]], hosts: list[str] | None, timeout: float, tmp) -> list[str]:
    """Runs one job: process ``i`` runs ``cmds[i]`` (its own ``timeout``
    wrapper included) in namespace ``hosts[i]``, or on loopback for None,
    in a session of its own, its output in ``tmp``. Waits at most
    ``timeout`` + 30 s for all of them, kills what is left of their
    process groups, prints process 0's output and raises with the tail of
    any that failed. Returns every process's output."""
    procs, logs = [], []
    for i, cmd in enumerate(cmds):
        if hosts is not None:
            cmd = ["ip", "netns", "exec", hosts[i], *cmd]
        env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
        env.pop("PYTHONPATH", None)
        log = open(f"{tmp}/{i}.log", "w+")  # closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    try:
        deadline = time.monotonic() + timeout + 30
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # whatever is left of this job's process groups
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    print(texts[0], end="", flush=True)
    for i, p in enumerate(procs):
        if p.returncode != 0:
            raise RuntimeError(f"process {i} failed ({p.returncode}):\n{texts[i][-3000:]}")
    return texts


def run_workers(
    script, procs: int, flags: list[str], hosts: list[str] | None, timeout: float, prefix: str
) -> list[dict]:
    """Runs ``script --worker`` in ``procs`` processes as one job
    (:func:`run_job`: in the namespaces ``hosts``, or on loopback for None,
    each process under ``timeout``), with ``--port``, ``--procs``, ``--pid``
    and ``--out`` followed by ``flags``; each worker writes its results as
    JSON to ``--out``. Returns them in process order."""
    port = random.randrange(20000, 60000)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        cmds = []
        for i in range(procs):
            cmd = ["timeout", "-k", "10", str(timeout), sys.executable, str(script)]
            cmd += ["--worker", "--port", str(port), "--procs", str(procs), "--pid", str(i)]
            cmd += ["--out", f"{tmp}/{i}.json", *flags]
            if hosts is None:
                cmd += ["--coordinator", "127.0.0.1"]
            cmds.append(cmd)
        run_job(cmds, hosts, timeout, tmp)
        return [json.loads(pathlib.Path(f"{tmp}/{i}.json").read_text()) for i in range(procs)]


def predict(kind_bytes: dict[str, int], procs: int, rate_bps: float) -> float:
    """Bandwidth term of the alpha-beta model for the collectives' operands."""
    bytes_out = (
        kind_bytes.get("all-gather", 0) * (procs - 1)
        + kind_bytes.get("all-to-all", 0) * (procs - 1) / procs
        + kind_bytes.get("collective-permute", 0)
        + kind_bytes.get("all-reduce", 0) * 2 * (procs - 1) / procs
    )
    return 8 * bytes_out / rate_bps


def step_table(procs: int, rate: str, slowest: dict[str, float], codecs) -> list[tuple]:
    """Rows (procs, rate, codec, update, seconds, x pmean step, x bare) of
    the optimizer-step measurements of one test bed."""
    base = slowest["step|pmean"]
    rows = [(procs, rate, "float32", "lax.pmean + sgd", base, 1.0, None)]
    for spec in codecs:
        full = slowest[f"step|{spec}|full"]
        if f"step|{spec}|bare" not in slowest:  # PowerSGD
            rows.append((procs, rate, spec, "jc.optax.powersgd + sgd", full, base / full, None))
            continue
        bare = slowest[f"step|{spec}|bare"]
        rows.append((procs, rate, spec, "bare jc.pmean + sgd", bare, base / bare, 1.0))
        rows.append((procs, rate, spec, "compress_gradients + sgd", full, base / full, full / bare))
    return rows


def write_steps(args: argparse.Namespace, n: int, table: list[tuple]) -> int:
    """The optimizer-step results: JSON, and the section between the markers
    in docs/benchmarks.md when both link rates ran."""
    out = pathlib.Path(args.json or ROOT / "benchmarks" / "results" / "optax_step_links.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = ("procs", "rate", "codec", "update", "seconds", "speedup_vs_pmean_step", "x_bare")
    out.write_text(
        json.dumps(
            {"n_per_process": n, "rows": [dict(zip(keys, r, strict=True)) for r in table]},
            indent=1,
        )
    )
    lines = [
        STEP_BEGIN,
        f"Command: `sudo python benchmarks/collectives.py {' '.join(sys.argv[1:])}`; four "
        f"matrices of {n // 4} float32 per process (Laplacian), the step's parameters and "
        f"optimizer state carried from step to step; median of {args.iters} steps of the "
        "slowest process. Speedup: the `lax.pmean` + sgd step's time over the row's; "
        "x bare: the full update's time over the bare all-reduce's (same codec and "
        "algorithm: `auto` unless the codec reads `@algorithm`).",
        "",
        "| P | link | codec | update | time s | speedup vs pmean step | x bare |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {p} | {r} | `{c}` | {u} | {t:.3f} | {sp:.2f}x | "
            + ("" if xb is None else f"{xb:.2f}")
            + " |"
            for p, r, c, u, t, sp, xb in table
        ],
        STEP_END,
    ]
    if len(args.rates) > 1 and args.step_codecs == STEP_CODECS:
        write_section("The optimizer step over emulated links", STEP_BEGIN, STEP_END, lines)
    return 0


def write_section(title: str, begin: str, end: str, lines: list[str]) -> None:
    """Replaces the text between the markers in docs/benchmarks.md (a new
    section titled ``title`` at its end where they are missing) with
    ``lines``, which start and end with the markers."""
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text()
    if begin not in text:
        text += f"\n## {title}\n\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    doc.write_text(head + "\n".join(lines) + rest.split(end, 1)[1])
    print(f"updated {doc}")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"], choices=list(RATES))
    ap.add_argument(
        "--log2-n", type=int, default=24, help="float32 values per process (default 2^24)"
    )
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    ap.add_argument(
        "--json",
        help="where to write the results (default benchmarks/results/collectives.json, "
        "or optax_step_links.json with --steps)",
    )
    ap.add_argument(
        "--twins",
        action="store_true",
        help="time the pure-JAX twins (JAXCOMP_BACKEND=xla) instead of the kernels",
    )
    ap.add_argument(
        "--all-to-all",
        default="auto",
        choices=["auto", "native", "pairwise"],
        help="how the jc.psum / bare jc.pmean rows run the all-to-all (jc.psum's all_to_all; "
        "compress_gradients keeps 'auto')",
    )
    ap.add_argument(
        "--steps",
        action="store_true",
        help="time the optimizer step (plain, bare jc.pmean, full compress_gradients) "
        "instead of the bare all-reduces",
    )
    ap.add_argument(
        "--step-codecs",
        nargs="+",
        default=STEP_CODECS,
        help=f"with --steps: the rows to time (default: {' '.join(STEP_CODECS)})",
    )
    add_worker_args(ap)
    args = ap.parse_args()
    if args.worker:
        args.procs = args.procs[0] if isinstance(args.procs, list) else args.procs
        worker(args)
        return 0

    if args.twins:
        os.environ["JAXCOMP_BACKEND"] = "xla"  # inherited by the workers
    import jax.numpy as jnp

    import jaxcomp as jc

    if not args.twins and not jc.cpu_available():
        print(
            "benchmarks/collectives.py: jaxcomp's CPU kernels are not loaded "
            f"({jc._ffi.why_not_loaded('_jaxcomp_cpu')}); "
            "or pass --twins to time the pure-JAX twins",
            file=sys.stderr,
        )
        return 2
    why = probe()
    if why:
        print(f"skipped: the emulated-link test bed {why}")
        return 0

    n = 1 << args.log2_n
    table, records = [], []
    for procs in args.procs:
        for rate in args.rates:
            rate_bps = RATES[rate][2]
            tmp = pathlib.Path(f"/tmp/jc-collectives-{os.getpid()}")
            tmp.mkdir(exist_ok=True)
            with bed(procs, rate) as hosts:
                res, wire = launch(hosts, args, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            slowest = {k: max(statistics.median(t) for t in v) for k, v in res.items()}
            if args.steps:
                table += step_table(procs, rate, slowest, args.step_codecs)
                for row in table[-len(slowest) :]:
                    print(" | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in row))
                continue
            base = slowest.pop("psum")
            base_pred = predict({"all-reduce": 4 * n}, procs, rate_bps)
            table.append((procs, rate, "float32", "lax.psum", 4 * n, base, base_pred, 1.0))
            for key, t in slowest.items():
                name, params, alg = key.split("|")
                codec = jc.codecs.get(name, **json.loads(params))
                kinds = wire[key]
                bound = jc.collectives.operand_nbytes(codec, (n,), jnp.float32, procs, alg)
                if codec.name != "threelc" and alg != "sparse":
                    assert kinds == bound, (key, kinds, bound)  # fixed rate: as accounted
                table.append(
                    (
                        procs,
                        rate,
                        repr(codec),
                        alg,
                        sum(kinds.values()),
                        t,
                        predict(kinds, procs, rate_bps),
                        base / t,
                    )
                )
            for row in table[-len(slowest) - 1 :]:
                print(
                    " | ".join(str(c) if not isinstance(c, float) else f"{c:.3f}" for c in row),
                    flush=True,
                )
                records.append(
                    dict(
                        zip(
                            (
                                "procs",
                                "rate",
                                "codec",
                                "algorithm",
                                "operand_bytes",
                                "seconds",
                                "predicted_seconds",
                                "speedup_vs_psum",
                            ),
                            row,
                            strict=True,
                        )
                    )
                )
    if args.steps:
        return write_steps(args, n, table)
    # lax.psum's alpha-beta time per bed: the first row of each.
    limits = {(p, r): pr for p, r, c, a, b, t, pr, s in table if a == "lax.psum"}
    out = pathlib.Path(args.json or ROOT / "benchmarks" / "results" / "collectives.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"n_per_process": n, "rows": records}, indent=1))
    lines = [
        BEGIN,
        f"Command: `sudo python benchmarks/collectives.py {' '.join(sys.argv[1:])}`; {n} float32 per "
        f"process (Laplacian, gradient-like), median of {args.iters} iterations of the slowest "
        "process. Operand bytes: what each process handed to the collectives as the program ran "
        "(`jc.collectives.wire_log`; for ThreeLC, the capacity tier its data needed), the "
        "largest over processes.",
        "",
        "Byte limit: the speedup the bytes allow, lax.psum's alpha-beta time over the row's; "
        "the last column is the measured speedup as a fraction of it.",
        "",
        "| P | link | codec | algorithm | operand bytes/device | time s | alpha-beta s "
        "| speedup vs lax.psum | byte limit | fraction of the byte limit |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[
            f"| {p} | {r} | `{c}` | {a} | {b} | {t:.3f} | {pr:.3f} | {s:.1f}x "
            f"| {limits[p, r] / pr:.1f}x | {s / (limits[p, r] / pr):.0%} |"
            for p, r, c, a, b, t, pr, s in table
        ],
        END,
    ]
    if len(args.rates) > 1:
        write_section("Compressed all-reduce over emulated links", BEGIN, END, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
