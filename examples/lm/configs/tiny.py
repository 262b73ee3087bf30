"""A few steps of a one-layer, 16-wide model: for smoke tests."""

import dataclasses

from examples.lm.configs import default


def get_config():
    return dataclasses.replace(
        default.get_config(),
        steps=2,
        log_every=1,
        global_batch_size=16,
        context=16,
        width=16,
        num_layers=1,
        num_heads=2,
        eval_windows=8,
    )
