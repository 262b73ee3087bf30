"""Trains the byte-level transformer LM with a compressed gradient all-reduce.

    python -m examples.lm.main --codec qsgd:bits=4 --steps 400
    python -m examples.lm.main --codec float32 --workdir /tmp/lm
    python -m examples.lm.main --codec onebit --optimizer onebit_adam
    python -m examples.lm.main --sync-every 50 --codec int8 --no-error-feedback   # DiLoCo
    python -m examples.lm.main --shard-params --codec qsgd:bits=4 --param-codec int8   # FSDP
    python -m examples.lm.main --shard-params --replicas 2 --codec qsgd:bits=4   # HSDP
    python -m jaxcomp launch -n 2 --devices-per-process 4 -- python -m examples.lm.main --shard-params

Run from the repository root. ``--config`` names a Python file whose
``get_config()`` returns a ``train.Config`` (default: configs/default.py);
the other flags override its fields.
"""

from __future__ import annotations

from examples import common

common.simulate_devices(8)  # before jax is imported (by train below)

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jaxcomp as jc  # noqa: E402
from examples.lm import train  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m examples.lm.main",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_flags(ap)
    ap.add_argument(
        "--optimizer",
        choices=("adamw", "onebit_adam"),
        help="adamw after compress_gradients (default), or jc.optax.onebit_adam",
    )
    ap.add_argument(
        "--freeze-steps", type=int, help="onebit_adam's warm-up (default: 30%% of the steps)"
    )
    ap.add_argument(
        "--send",
        choices=("auto", "momentum", "gradient"),
        help="what onebit_adam sends after its warm-up (default: auto)",
    )
    ap.add_argument(
        "--sync-every",
        type=int,
        help="DiLoCo: synchronize every this many steps (jc.optax.diloco; default 0: "
        "data parallelism); --codec then compresses the pseudo-gradient",
    )
    ap.add_argument("--outer-lr", type=float, help="DiLoCo's outer SGD lr (default 0.7)")
    ap.add_argument("--fragments", type=int, help="Streaming DiLoCo: fragments (default 1)")
    ap.add_argument("--overlap-steps", type=int, help="Streaming DiLoCo: tau (default 0)")
    ap.add_argument("--alpha", type=float, help="Streaming DiLoCo: mixing factor (default 0)")
    ap.add_argument(
        "--shard-params",
        action="store_true",
        default=None,
        help="sharded training (docs/fsdp.md): parameters, Adam's state and residuals sharded "
        "over the devices; --codec compresses the gradient reduce-scatter",
    )
    ap.add_argument(
        "--param-codec",
        help="with --shard-params: the parameter all-gather's codec, NAME[:KEY=VALUE,...] "
        "(default float32: exact; int8, fp8, mx, bfloat16)",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        help="with --shard-params: HSDP, the shards replicated over this many groups "
        "(a replicas x devices/replicas mesh; only that axis's traffic compressed)",
    )
    args = ap.parse_args(argv)
    config = common.config_from_flags(args, default="examples/lm/configs/default.py")
    extra = {"optimizer": args.optimizer, "freeze_steps": args.freeze_steps, "send": args.send}
    extra.update(
        sync_every=args.sync_every,
        outer_lr=args.outer_lr,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        alpha=args.alpha,
        shard_params=args.shard_params,
        param_codec=args.param_codec,
        replicas=args.replicas,
    )
    if args.param_codec is not None:
        common.parse_codec(args.param_codec)  # fail early on a malformed spec
    config = dataclasses.replace(config, **{k: v for k, v in extra.items() if v is not None})
    jc.launch.initialize()  # under `python -m jaxcomp launch`: join the other processes
    result = train.train_and_evaluate(config, args.workdir, verbose=not args.quiet)
    print(
        f"final: held-out loss {result['test_loss']:.4f} nats/byte  "
        f"perplexity {result['test_perplexity']:.2f}  next-byte accuracy "
        f"{result['test_accuracy']:.4f}  bits/element {result['bits_per_element']:.3f}  "
        f"wire bytes/step {result['wire_bytes']:,.0f}"
    )
    return result


if __name__ == "__main__":
    main()
