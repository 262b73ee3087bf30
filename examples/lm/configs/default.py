"""Default hyperparameters: a 2-layer, 64-wide byte-level transformer."""

from examples.lm.train import Config


def get_config() -> Config:
    return Config(
        codec="float32",
        error_feedback=True,
        steps=400,
        global_batch_size=64,
        context=64,
        learning_rate=3e-3,
        log_every=100,
        seed=0,
    )
