"""Smoke tests of the teacher-student example (the accuracy study's task):
a few steps of a tiny config."""

import dataclasses
import math
import pathlib
import sys
import types

import optax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The examples are not installed: import them from the source tree, after the
# installed packages (jaxcomp must stay the installed one).
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

pytest.importorskip("flax")

from examples import common  # noqa: E402

TINY = str(ROOT / "examples/teacher/configs/tiny.py")


def _finite(result):
    return all(math.isfinite(h[k]) for h in result["history"] for k in h)


def test_task_is_fixed_and_labels_are_spread():
    import jax
    import numpy as np

    from examples.teacher import train

    config = common.load_config(TINY)
    x, y = train.Teacher(config).sample(jax.random.key(0), 4096)
    _, y2 = train.Teacher(config).sample(jax.random.key(0), 4096)
    assert (np.asarray(y) == np.asarray(y2)).all()  # the task_seed fixes the teacher
    freq = np.bincount(np.asarray(y), minlength=config.num_classes) / len(y)
    assert freq.min() > 0.01 and freq.max() < 0.3  # every class occurs, none dominates
    assert x.shape == (4096, config.input_dim)
    _, y3 = train.Teacher(dataclasses.replace(config, task_seed=7)).sample(jax.random.key(0), 4096)
    assert (np.asarray(y3) != np.asarray(y)).any()


@pytest.mark.parametrize("codec", ["float32", "qsgd:bits=4"])
def test_teacher_steps(codec, tmp_path):
    from examples.teacher import main

    argv = ["--config", TINY, "--codec", codec, "--quiet", "--workdir", str(tmp_path)]
    result = main.main(argv)
    assert [h["step"] for h in result["history"]] == [2, 4]
    assert _finite(result)
    assert 0.0 <= result["test_accuracy"] <= 1.0
    assert 0.0 < result["test_loss"] < 5.0
    assert result["train_seconds"] > 0
    n = result["num_params"]
    if codec == "float32":
        assert result["bits_per_element"] == 32.0
        assert result["wire_bytes"] == pytest.approx(2 * 7 / 8 * 4 * n)
    else:  # 4-bit payloads for the two large kernels, the rest in float32
        assert 4.0 < result["bits_per_element"] < 12.0
        assert 0 < result["wire_bytes"] < 2 * 7 / 8 * 4 * n
    assert (tmp_path / "metrics.json").is_file()


def test_seeds_pair_and_differ():
    from examples.teacher import train

    config = dataclasses.replace(common.load_config(TINY), log_every=4)
    a = train.train_and_evaluate(config, verbose=False)
    b = train.train_and_evaluate(config, verbose=False)
    c = train.train_and_evaluate(dataclasses.replace(config, seed=1), verbose=False)
    assert a["history"] == b["history"]  # same seed: the same run, bit for bit
    assert c["history"] != a["history"]
    assert _finite(c)


def test_server_error_feedback_reaches_compress_gradients(monkeypatch):
    import jaxcomp as jc
    from examples.teacher import train

    calls = []

    def fake(codec, axis_name, **kwargs):
        calls.append(kwargs)
        return optax.identity()

    monkeypatch.setattr(jc.optax, "compress_gradients", fake)

    def make_tx(config, seed):  # Trainer.make_tx reads only config and spec
        trainer = types.SimpleNamespace(config=config, spec=common.parse_codec(config.codec))
        return train.Trainer.make_tx(trainer, seed)

    config = train.Config(codec="onebit", algorithm="two_phase")
    for flag in (True, False):
        make_tx(dataclasses.replace(config, server_error_feedback=flag), 3)
        assert calls[-1]["server_error_feedback"] is flag
        assert calls[-1]["algorithm"] == "two_phase" and calls[-1]["seed"] == 3
    # float32 is a plain pmean whatever the flag
    make_tx(dataclasses.replace(config, codec="float32", server_error_feedback=False), 0)
    assert len(calls) == 2
