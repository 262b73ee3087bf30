"""Pieces both examples share: the ``--codec`` parser, the mesh, the gradient
transformation (plain or compressed all-reduce), the data-parallel training
loop, the progress bar and the command-line flags.

The parameters are replicated over the ``"data"`` mesh axis (every device
applies the same all-reduced update); the optimizer state is laid out by
``jc.optax.init``: the error-feedback residuals are shaped like the
parameters, each device's its own row of arrays sharded over ``"data"``; the
rest is replicated (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

AXIS = "data"

# Names that select the uncompressed baseline: a float32 ``lax.pmean``.
UNCOMPRESSED = ("float32", "none", "fp32")


def simulate_devices(n: int = 8) -> None:
    """Asks XLA for ``n`` host devices; must run before jax is imported."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """A parsed ``--codec`` argument: a codec name and its keyword parameters."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def uncompressed(self) -> bool:
        return self.name in UNCOMPRESSED

    @property
    def powersgd(self) -> bool:
        """``powersgd[:rank=R,warm_start=false,...]``: jc.optax.powersgd, not a codec."""
        return self.name == "powersgd"

    def build(self):
        """The :mod:`jaxcomp.codecs` codec, or None for the float32 baseline."""
        if self.uncompressed:
            return None
        if self.powersgd:
            raise ValueError("powersgd is a transformation (jc.optax.powersgd), not a codec")
        import jaxcomp as jc

        return jc.codecs.get(self.name, **dict(self.params))

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params)


def parse_codec(spec: str) -> CodecSpec:
    """Parses ``NAME[:KEY=VALUE[,KEY=VALUE...]]`` into a :class:`CodecSpec`.

    ``NAME`` is a :func:`jaxcomp.codecs.names` entry, or ``float32`` for the
    uncompressed baseline; ``bfloat16``/``float16`` are short for
    ``cast:dtype=...``. Values are read as bool (true/false), int, float or
    else string. Examples: ``qsgd:bits=4``, ``qsgd:bits=8,bucket_size=256``,
    ``onebit``, ``topk:fraction=0.01``, ``threelc:sparsity=1.5``; and
    ``powersgd:rank=4`` (``jc.optax.powersgd``, with its keyword arguments).

    Raises:
      ValueError: for an empty name, a parameter without ``=``, or (when the
        codec is built) an unknown codec or a bad parameter.
    """
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if not name:
        raise ValueError(f"--codec: expected NAME[:KEY=VALUE,...], got {spec!r}")
    if name in ("bfloat16", "float16") and not rest:
        return CodecSpec("cast", (("dtype", name),))
    params = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--codec: parameter {item!r} of {spec!r} is not KEY=VALUE")
        params.append((key.strip(), _value(value.strip())))
    if name in UNCOMPRESSED and params:
        raise ValueError(f"--codec: {name} takes no parameters, got {spec!r}")
    return CodecSpec(name, tuple(params))


def make_mesh(num_devices: int | None = None, batch: int | None = None):
    """A 1-D mesh, axis ``"data"``, over devices of JAX's default platform:
    the GPUs where there are (JAX_PLATFORMS=cpu asks for the CPU instead),
    else the CPU devices (8 simulated ones after simulate_devices).

    Args:
      num_devices: how many; None for all of them, or where ``batch`` is
        given, the most that divide it.
      batch: the global batch, split evenly over the devices.
    Raises:
      ValueError: fewer devices than asked for, with what to do about it
        on this platform, or a batch that does not split evenly.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    platform = devices[0].platform
    if num_devices is None:
        num_devices = len(devices)
        while batch and batch % num_devices:
            num_devices -= 1
    if len(devices) < num_devices:
        if platform == "cpu":
            advice = (
                f"set XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} before "
                "jax is imported"
            )
        else:
            advice = (
                f"ask for at most {len(devices)} (--num-devices), or simulate "
                f"{num_devices} CPU devices with JAX_PLATFORMS=cpu"
            )
        raise ValueError(
            f"num_devices={num_devices} but JAX sees {len(devices)} {platform} device(s): {advice}"
        )
    if batch and batch % num_devices:
        raise ValueError(f"the global batch {batch} does not split over {num_devices} devices")
    return Mesh(np.array(devices[:num_devices]), (AXIS,))


def describe_devices(mesh) -> str:
    """ "8 simulated CPU devices", "1 NVIDIA H200 GPU": what a mesh runs on."""
    d = mesh.devices.flat[0]
    n = mesh.devices.size
    if d.platform == "cpu":
        simulated = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
        return f"{n} {'simulated ' if simulated else ''}CPU device{'s' if n > 1 else ''}"
    return f"{n} {d.device_kind} {d.platform.upper()}{'s' if n > 1 else ''}"


def kernels_line(mesh) -> str:
    """The kernels the codecs run on the mesh's platform, for the first line
    of the examples' output: "CPU kernels avx2", "CUDA kernels on NVIDIA H200"."""
    import jaxcomp as jc

    d = mesh.devices.flat[0]
    if d.platform == "cpu":
        return f"CPU kernels {jc._ffi.cpu_isa()}" if jc.cpu_available() else "pure-JAX codecs"
    if d.platform in ("gpu", "cuda") and jc.cuda_available():
        return f"CUDA kernels on {d.device_kind}"
    return f"pure-JAX codecs on {d.device_kind}"


def pmean_gradients(axis_name: str = AXIS):
    """The uncompressed baseline as an optax transformation: float32
    ``lax.pmean`` of every gradient leaf over ``axis_name``."""
    import jax
    import optax
    from jax import lax

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: lax.pmean(g, axis_name), updates), state

    return optax.GradientTransformation(init, update)


def gradient_transformation(
    spec: CodecSpec,
    *,
    error_feedback: bool,
    algorithm: str = "auto",
    min_compress_size: int = 1024,
    seed: int = 0,
    server_error_feedback: bool = True,
):
    """The all-reduce stage of the optimizer chain for ``spec``: the float32
    baseline, ``jc.optax.powersgd`` (its parameters from the spec; the
    algorithm and min_compress_size do not apply), or
    ``jc.optax.compress_gradients`` (docs/training.md)."""
    if spec.uncompressed:
        return pmean_gradients(AXIS)
    import jaxcomp as jc

    if spec.powersgd:
        return jc.optax.powersgd(
            AXIS, error_feedback=error_feedback, seed=seed, **dict(spec.params)
        )

    return jc.optax.compress_gradients(
        spec.build(),
        axis_name=AXIS,
        error_feedback=error_feedback,
        server_error_feedback=server_error_feedback,
        algorithm=algorithm,
        min_compress_size=min_compress_size,
        seed=seed,
    )


def per_replica(opt_state) -> bool:
    """Whether the replicas keep parameters of their own
    (``jc.optax.diloco``), laid out with one copy per device."""
    import jaxcomp as jc

    return isinstance(opt_state, jc.optax.DiLoCoState)


def model_params(params, opt_state):
    """The parameters to evaluate: DiLoCo's anchor (the replicas' last
    synchronized parameters), else ``params``."""
    return opt_state.anchor if per_replica(opt_state) else params


def step_telemetry(spec: CodecSpec, opt_state, num_params: int, num_devices: int):
    """(bits per element, bytes sent by one device) of the last step, traced.

    For the float32 baseline: 32 bits per element and a ring all-reduce's
    per-device send volume, 2 (P-1)/P x 4 bytes per element, the reference
    ``jc.optax.telemetry`` measures its compression ratio against.
    """
    import jax.numpy as jnp

    if spec.uncompressed and not per_replica(opt_state):
        p = num_devices
        wire = 2.0 * (p - 1) / p * 4.0 * num_params if p > 1 else 0.0
        return jnp.float32(32.0), jnp.float32(wire)
    import jaxcomp as jc

    t = jc.optax.telemetry(opt_state)
    return t["bits_per_element"].astype(jnp.float32), t["wire_bytes"].astype(jnp.float32)


def make_train_loop(spec: CodecSpec, tx, mesh, loss_fn, param_shapes, num_params: int):
    """A jitted ``run(params, opt_state, data_key, start, num_steps)``.

    ``params`` are replicated (per replica, one copy per device sharded
    over ``"data"``, under ``jc.optax.diloco``); ``opt_state`` is laid out
    by ``jc.optax.init`` (per-device residuals sharded over ``"data"``).

    It runs ``num_steps`` data-parallel steps inside one ``jax.shard_map``
    (a ``lax.fori_loop``): on every device, ``loss_fn(params, key)`` with a
    key folded from ``data_key``, the step and the device index (so each
    device draws its own minibatch) returns ``(loss, accuracy)``; the
    gradient goes through ``tx`` (whose first stage all-reduces it).

    Returns ``(params, opt_state, metrics)``, metrics being the means over the
    steps and devices of loss, accuracy, bits per element and wire bytes.
    """
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    ndev = mesh.shape[AXIS]
    state_shapes = jax.eval_shape(tx.init, param_shapes)
    own = per_replica(state_shapes)
    param_specs = jax.tree.map(lambda _: P(AXIS) if own else P(), param_shapes)
    if spec.uncompressed and not own:  # no per-device state: all replicated
        specs = jax.tree.map(lambda _: P(), state_shapes)
    else:
        specs = jc.optax.state_specs(state_shapes, AXIS)

    def local(params, opt_state, data_key, start, num_steps):
        dev = lax.axis_index(AXIS)
        if own:  # this replica's copy
            params = jax.tree.map(lambda a: a[0], params)

        def body(i, carry):
            params, opt_state, sums = carry
            key = jax.random.fold_in(jax.random.fold_in(data_key, start + i), dev)
            (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, key)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            bits, wire = step_telemetry(spec, opt_state, num_params, ndev)
            return params, opt_state, sums + jnp.stack([loss, acc, bits, wire])

        sums = jnp.zeros((4,), jnp.float32)
        params, opt_state, sums = lax.fori_loop(0, num_steps, body, (params, opt_state, sums))
        if own:
            params = jax.tree.map(lambda a: a[None], params)
        return params, opt_state, lax.pmean(sums / num_steps, AXIS)

    @functools.partial(jax.jit, static_argnums=4, donate_argnums=(0, 1))
    def run(params, opt_state, data_key, start, num_steps):
        f = jax.shard_map(
            functools.partial(local, num_steps=num_steps),
            mesh=mesh,
            in_specs=(param_specs, specs, P(), P()),
            out_specs=(param_specs, specs, P()),
            # the compressed mean is identical on every device, but comes out
            # of all_gathers JAX types as per-device (docs/training.md)
            check_vma=False,
        )
        return f(params, opt_state, data_key, start)

    return run


def check_config(config, *, min_steps: int = 1) -> None:
    """The checks every example's config passes before a run."""
    if config.steps < min_steps or config.log_every < 1:
        raise ValueError(f"steps must be >= {min_steps} and log_every >= 1")
    if config.num_devices is not None and config.global_batch_size % config.num_devices:
        raise ValueError(
            f"global_batch_size ({config.global_batch_size}) must be a multiple of "
            f"num_devices ({config.num_devices})"
        )


def start(trainer, config, workdir, *, verbose: bool) -> dict:
    """One run of ``config`` with a trainer compiled for it (any seed):
    the parameters and data key from ``config.seed``, the optimizer state
    laid out on the trainer's mesh (the codec's PRNG key seeded per run),
    then :func:`fit`."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    init_key, data_key = jax.random.split(jax.random.key(config.seed))
    params = jax.device_put(trainer.init_params(init_key), NamedSharding(trainer.mesh, P()))
    opt_state = jc.optax.init(trainer.make_tx(config.seed), params, trainer.mesh, AXIS)
    if per_replica(opt_state):  # one copy per device
        n = trainer.mesh.shape[AXIS]
        params = jax.jit(
            lambda p: jax.tree.map(lambda a: jax.numpy.stack([a] * n), p),
            out_shardings=NamedSharding(trainer.mesh, P(AXIS)),
        )(params)
    return fit(trainer, params, opt_state, data_key, config, workdir, verbose=verbose)


def fit(trainer, params, opt_state, data_key, config, workdir, *, verbose: bool) -> dict:
    """The training loop both examples share: ``config.steps`` steps in
    pieces of ``config.log_every``, an evaluation and a log line after each.

    ``trainer`` provides ``run`` (:func:`make_train_loop`), ``evaluate``
    (params -> (test loss, test accuracy)), ``spec`` and ``num_params``.
    """
    import json
    import pathlib
    import time

    import jax.numpy as jnp
    import numpy as np

    spec = trainer.spec
    history: list[dict[str, float]] = []
    bar = progress(config.steps, enabled=verbose, desc=str(spec))
    train_seconds = 0.0
    for start, n in chunks(config.steps, config.log_every):
        t0 = time.perf_counter()
        params, opt_state, metrics = trainer.run(params, opt_state, data_key, jnp.int32(start), n)
        metrics = np.asarray(metrics, np.float64)
        train_seconds += time.perf_counter() - t0
        test_loss, test_acc = (float(v) for v in trainer.evaluate(model_params(params, opt_state)))
        row = {
            "step": start + n,
            "loss": metrics[0],
            "accuracy": metrics[1],
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "bits_per_element": metrics[2],
            "wire_bytes": metrics[3],
        }
        row = {k: (v if k == "step" else float(v)) for k, v in row.items()}
        history.append(row)
        bar.update(n)
        if verbose:
            bar.write(log_line(row["step"], {k: v for k, v in row.items() if k != "step"}))
    bar.close()
    weights = np.diff([0] + [h["step"] for h in history])

    def mean(k):
        return float(np.average([h[k] for h in history], weights=weights))

    result = {
        "codec": str(spec),
        "error_feedback": bool(config.error_feedback and not spec.uncompressed),
        "seed": config.seed,
        "steps": config.steps,
        "num_params": trainer.num_params,
        "test_accuracy": history[-1]["test_accuracy"],
        "test_loss": history[-1]["test_loss"],
        "bits_per_element": mean("bits_per_element"),
        "wire_bytes": mean("wire_bytes"),
        "train_seconds": train_seconds,
        "history": history,
        "params": model_params(params, opt_state),
    }
    if workdir is not None:
        out = pathlib.Path(workdir)
        out.mkdir(parents=True, exist_ok=True)
        record = {k: v for k, v in result.items() if k != "params"}
        with open(out / "metrics.json", "w") as f:
            json.dump({"config": dataclasses.asdict(config), **record}, f, indent=1)
    return result


def progress(total: int, *, enabled: bool = True, desc: str = "train") -> Any:
    """A tqdm progress bar over training steps (a silent stand-in if disabled)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True)


def chunks(total: int, every: int) -> Iterator[tuple[int, int]]:
    """Splits ``total`` steps into (start, length) pieces of at most ``every``."""
    start = 0
    while start < total:
        n = min(every, total - start)
        yield start, n
        start += n


def log_line(step: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step:5d}"]
    for k, v in metrics.items():
        if k in ("wire_bytes",):
            parts.append(f"{k} {int(v):,d}")
        elif isinstance(v, float) and (abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3)):
            parts.append(f"{k} {v:.3e}")
        else:
            parts.append(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}")
    return "  ".join(parts)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def add_flags(ap) -> None:
    """The command-line flags both examples take."""
    import argparse

    ap.add_argument("--config", help="Python file with get_config() (default: configs/default.py)")
    ap.add_argument(
        "--codec",
        help="NAME[:KEY=VALUE,...], e.g. float32, qsgd:bits=4, onebit, int8, topk:fraction=0.01",
    )
    ap.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep what compression dropped for the next step (default: on)",
    )
    ap.add_argument("--algorithm", help="jc.psum algorithm: auto, allgather, two_phase, ring")
    ap.add_argument(
        "--num-devices",
        type=int,
        help="devices of the mesh (default: every GPU, else 8 simulated CPU devices)",
    )
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--log-every", type=int)
    ap.add_argument("--learning-rate", type=float)
    ap.add_argument("--workdir", help="write metrics.json here")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or log lines")


def load_config(path: str | os.PathLike):
    """Calls ``get_config()`` of the Python config file at ``path``."""
    import importlib.util
    import pathlib

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found (run from the repository root)")
    module_spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config()


def config_from_flags(args, *, default: str):
    """The config file's ``get_config()`` with the flags given overriding its fields."""
    import pathlib

    path = args.config or str(pathlib.Path(__file__).resolve().parent.parent / default)
    config = load_config(path)
    overrides = {
        "codec": args.codec,
        "error_feedback": args.error_feedback,
        "algorithm": args.algorithm,
        "num_devices": args.num_devices,
        "steps": args.steps,
        "seed": args.seed,
        "log_every": args.log_every,
        "learning_rate": args.learning_rate,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "codec" in overrides:
        parse_codec(overrides["codec"])  # fail early on a malformed spec
    return dataclasses.replace(config, **overrides)


# Bytes per element of the HLO dtypes a collective can carry.
_HLO_ITEMSIZE = {
    "f64": 8, "f32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s64": 8, "u64": 8,
    "s32": 4, "u32": 4, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1,
}  # fmt: skip

_COLLECTIVE = re.compile(
    r"= (?P<result>.*?) (?P<kind>all-gather|all-to-all|reduce-scatter|all-reduce|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$",
    re.MULTILINE,
)


def _hlo_nbytes(types: str) -> int:
    """Bytes of an HLO result type (a tuple's elements summed)."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", types):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += _HLO_ITEMSIZE[dtype] * n
    return total


def _replica_groups(rest: str, num_devices: int) -> list[list[int]]:
    """The replica groups of a collective, from its explicit
    ``{{0,1},{2,3}}`` or iota ``[G,P]<=[dims]T(perm)`` form."""
    import numpy as np

    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", rest)
    if m:
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m[1])]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        dims = [int(d) for d in m[3].split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m[4]:
            ids = ids.transpose([int(d) for d in m[4].split(",")])
        return ids.reshape(int(m[1]), int(m[2])).tolist()
    return [list(range(num_devices))]  # replica_groups={}: every device


def collective_traffic(hlo_text: str, mesh) -> list[dict]:
    """Every collective of a compiled SPMD program (``compiled.as_text()``)
    and the bytes one device sends in it, counted as docs/collectives.md
    counts them (``jc.collectives.send_nbytes``): ``(P-1)/P`` of an
    all-gather's result, of an all-to-all's operand (XLA:CPU returns it as
    a tuple, summed) and of a reduce-scatter's operand (``P`` times its
    result), ``2 (P-1)/P`` of an all-reduce's (a ring), every byte of a
    collective-permute.

    Returns:
      One dict per collective instruction: ``kind``, ``group`` (devices per
      replica group, ``P``), ``axes`` (the mesh axes its groups span) and
      ``sent`` (bytes per device).
    """
    import numpy as np

    # Groups name devices by their place in the mesh (SPMD partition ids).
    shape = mesh.devices.shape
    out = []
    for m in _COLLECTIVE.finditer(hlo_text):
        kind, nbytes = m["kind"], _hlo_nbytes(m["result"])
        groups = _replica_groups(m["rest"], mesh.devices.size)
        p = len(groups[0])
        # The mesh axes along which the first group's devices differ.
        coords = np.array(np.unravel_index(groups[0], shape)).T
        axes = tuple(name for k, name in enumerate(mesh.axis_names) if len(set(coords[:, k])) > 1)
        if kind == "collective-permute":
            sent = float(nbytes)
        elif p <= 1:
            sent = 0.0
        elif kind == "all-reduce":
            sent = 2.0 * (p - 1) / p * nbytes
        elif kind == "reduce-scatter":
            sent = float((p - 1) * nbytes)
        else:  # all-gather: its result; all-to-all: operand and result alike
            sent = (p - 1) / p * nbytes
        out.append({"kind": kind, "group": p, "axes": axes, "sent": sent})
    return out
