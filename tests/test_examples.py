"""Smoke tests of the Flax examples: a couple of steps each, tiny configs."""

import dataclasses
import json
import math
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The examples are not installed: import them from the source tree, after the
# installed packages (jaxcomp must stay the installed one).
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

pytest.importorskip("flax")
pytest.importorskip("sklearn")

from examples import common  # noqa: E402


def test_parse_codec():
    assert common.parse_codec("float32").uncompressed
    s = common.parse_codec("QSGD:bits=4, bucket_size=256")
    assert s == common.CodecSpec("qsgd", (("bits", 4), ("bucket_size", 256)))
    assert str(s) == "qsgd:bits=4,bucket_size=256"
    assert s.build().bits == 4
    assert common.parse_codec("bfloat16").build().dtype == "bfloat16"
    assert common.parse_codec("natural:stochastic=false").build().stochastic is False
    assert common.parse_codec("onebit").build().bucket_size == 64


def test_mesh_takes_the_default_platforms_devices():
    """num_devices=None: every device of JAX's default platform (here the 8
    simulated CPU devices), as many as divide the batch; a short platform
    says what to do there."""
    import jax

    n = len(jax.devices())
    assert common.make_mesh().size == n
    assert common.make_mesh(None, 128).size == max(d for d in range(1, n + 1) if 128 % d == 0)
    assert common.make_mesh(None, 3 * 7).size == max(d for d in range(1, n + 1) if 21 % d == 0)
    assert common.make_mesh(1).size == 1
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=99"):
        common.make_mesh(99)
    with pytest.raises(ValueError, match="does not split"):
        common.make_mesh(3, 128)
    assert "CPU device" in common.describe_devices(common.make_mesh(2))


@pytest.mark.parametrize(
    "spec", ["", ":bits=4", "qsgd:bits", "float32:bits=4"], ids=["empty", "noname", "noeq", "f32"]
)
def test_parse_codec_rejects(spec):
    with pytest.raises(ValueError, match="--codec"):
        common.parse_codec(spec)


def test_unknown_codec_and_bad_parameter():
    with pytest.raises(ValueError, match="unknown codec"):
        common.parse_codec("nosuchcodec").build()
    with pytest.raises(ValueError, match="bits"):
        common.parse_codec("qsgd:bits=99").build()


def _finite(result):
    return all(math.isfinite(h[k]) for h in result["history"] for k in h)


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["float32", "qsgd:bits=4"])
def test_image_classifier_steps(codec, tmp_path):
    from examples.image_classifier import main, train

    argv = ["--config", str(ROOT / "examples/image_classifier/configs/tiny.py")]
    result = main.main([*argv, "--codec", codec, "--quiet", "--workdir", str(tmp_path)])
    assert [h["step"] for h in result["history"]] == [1, 2]
    assert _finite(result)
    assert 0.0 <= result["test_accuracy"] <= 1.0
    n = result["num_params"]
    if codec == "float32":
        assert result["bits_per_element"] == 32.0
        assert result["wire_bytes"] == pytest.approx(2 * 7 / 8 * 4 * n)
    else:  # 4-bit payloads, the biases in float32
        assert 4.0 < result["bits_per_element"] < 8.0
        assert 0 < result["wire_bytes"] < 2 * 7 / 8 * 4 * n
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["config"]["codec"] == codec and record["steps"] == 2
    assert isinstance(train.Config(), train.Config)


@pytest.mark.slow
def test_image_classifier_learns_and_is_reproducible():
    from examples.image_classifier import train
    from examples.image_classifier.configs import tiny

    config = dataclasses.replace(
        tiny.get_config(), codec="onebit", steps=20, log_every=10, global_batch_size=64
    )
    a = train.train_and_evaluate(config, verbose=False)
    b = train.train_and_evaluate(config, verbose=False)
    assert a["history"] == b["history"]  # same seed: the same run, bit for bit
    assert a["history"][-1]["loss"] < a["history"][0]["loss"]
    c = train.train_and_evaluate(dataclasses.replace(config, seed=1), verbose=False)
    assert c["history"] != a["history"]


@pytest.mark.slow
def test_lm_steps():
    from examples.lm import main

    argv = ["--config", str(ROOT / "examples/lm/configs/tiny.py"), "--codec", "int8", "--quiet"]
    result = main.main(argv)
    assert _finite(result)
    assert result["test_loss"] < 7.0  # about log(256) = 5.5 untrained
    assert result["test_perplexity"] == pytest.approx(math.exp(result["test_loss"]))
    assert result["bits_per_element"] < 32.0


@pytest.mark.slow
def test_lm_steps_with_onebit_adam():
    from examples.lm import main

    tiny = str(ROOT / "examples/lm/configs/tiny.py")
    argv = ["--config", tiny, "--codec", "onebit", "--optimizer", "onebit_adam", "--quiet"]
    result = main.main([*argv, "--steps", "4", "--freeze-steps", "2"])
    assert _finite(result)
    assert result["test_loss"] < 7.0
    with pytest.raises(ValueError, match="compressed codec"):
        main.main(["--config", tiny, "--codec", "float32", "--optimizer", "onebit_adam", "--quiet"])


@pytest.mark.slow
def test_lm_steps_with_diloco():
    """The LM example's DiLoCo options: jc.optax.diloco with the int8
    pseudo-gradient every 2 steps on 4 devices; the wire bytes are one
    synchronization's over 2, and the model evaluated is the anchor."""
    import jax
    import jax.numpy as jnp

    import jaxcomp as jc
    from examples.lm import main

    if len(jax.devices()) < 4:  # the example's mesh: the default backend's devices
        pytest.skip("needs 4 devices of the default backend")
    tiny = str(ROOT / "examples/lm/configs/tiny.py")
    argv = ["--config", tiny, "--codec", "int8", "--no-error-feedback", "--quiet"]
    result = main.main([*argv, "--sync-every", "2", "--steps", "4", "--num-devices", "4"])
    assert _finite(result)
    assert result["test_loss"] < 7.0
    int8 = jc.codecs.get("int8")
    n = result["num_params"]
    want = jc.collectives.send_nbytes(int8, n, jnp.float32, 4) / 2
    assert result["wire_bytes"] == pytest.approx(want, rel=1e-6)
    assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(result["params"]))


@pytest.mark.slow
def test_lm_steps_with_sharded_params(tmp_path):
    """--shard-params: int8 all-gather and QSGD-4 reduce-scatter with error
    feedback, 2 steps; the parameters come back in the model's shapes."""
    import jax

    from examples.lm import main, train

    tiny = str(ROOT / "examples/lm/configs/tiny.py")
    argv = ["--config", tiny, "--shard-params", "--codec", "qsgd:bits=4", "--param-codec", "int8"]
    result = main.main([*argv, "--quiet", "--workdir", str(tmp_path)])
    assert _finite(result)
    assert result["test_loss"] < 7.0
    assert [h["step"] for h in result["history"]] == [1, 2]
    assert result["wire_bytes"] > 0
    model = train.ByteLM(width=16, num_layers=1, num_heads=2, context=16)
    tokens = jax.numpy.zeros((1, 16), jax.numpy.int32)
    shapes = jax.eval_shape(lambda k: model.init(k, tokens)["params"], jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, result["params"]) == jax.tree.map(
        lambda a: a.shape, shapes
    )


def test_collective_traffic_counts_bytes_per_device_and_axes():
    """common.collective_traffic on a compiled (2 x 4) program: an exact
    all-gather, reduce-scatter and all-reduce, counted per device as
    docs/collectives.md counts them, each on the mesh axes it spans."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("slow", "fast"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def f(x):
        g = lax.all_gather(x, "fast", tiled=True)  # f32[4 * 64] result
        r = lax.psum_scatter(g, "fast", tiled=True)  # operand f32[256], result f32[64]
        return lax.psum(r, "slow")  # f32[64]

    spec = P(("slow", "fast"))
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    text = step.lower(jnp.ones((8 * 64,))).compile().as_text()
    got = {(c["kind"], c["axes"]): c for c in common.collective_traffic(text, mesh)}
    assert got[("all-gather", ("fast",))]["sent"] == 3 / 4 * 256 * 4
    assert got[("reduce-scatter", ("fast",))]["sent"] == 3 / 4 * 256 * 4
    assert got[("all-reduce", ("slow",))]["sent"] == 2 * 1 / 2 * 64 * 4
    assert {c["group"] for c in got.values()} == {2, 4}


def test_config_flags_override():
    import argparse

    ap = argparse.ArgumentParser()
    common.add_flags(ap)
    args = ap.parse_args(["--codec", "int8", "--steps", "7", "--no-error-feedback"])
    config = common.config_from_flags(args, default="examples/image_classifier/configs/default.py")
    assert (config.codec, config.steps, config.error_feedback) == ("int8", 7, False)
    with pytest.raises(ValueError, match="--codec"):
        common.config_from_flags(
            ap.parse_args(["--codec", "qsgd:4"]),
            default="examples/image_classifier/configs/default.py",
        )
