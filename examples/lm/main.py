"""Trains the byte-level transformer LM with a compressed gradient all-reduce.

    python -m examples.lm.main --codec qsgd:bits=4 --steps 400
    python -m examples.lm.main --codec float32 --workdir /tmp/lm

Run from the repository root. ``--config`` names a Python file whose
``get_config()`` returns a ``train.Config`` (default: configs/default.py);
the other flags override its fields.
"""

from __future__ import annotations

from examples import common

common.simulate_devices(8)  # before jax is imported (by train below)

import argparse  # noqa: E402

from examples.lm import train  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m examples.lm.main",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_flags(ap)
    args = ap.parse_args(argv)
    config = common.config_from_flags(args, default="examples/lm/configs/default.py")
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
