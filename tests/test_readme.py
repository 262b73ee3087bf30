"""The README's usage example runs as written."""

import math
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        scope: dict = {}
        exec(compile(block, str(README), "exec"), scope)
        if "payload" in scope:
            assert scope["payload"].nbytes == 508_040


def _run_doc(name: str) -> tuple[list[str], dict]:
    """Runs every python block of docs/``name`` in one session (later
    blocks use earlier names); returns the blocks and the session's names."""
    doc = README.parent / "docs" / name
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, str(doc), "exec"), scope)
    return blocks, scope


def test_collectives_doc_example_runs():
    blocks, scope = _run_doc("collectives.md")
    assert scope["mean"].shape == (4096,) and scope["sent"].shape == (8, 4096)
    assert len(blocks) == 3 and len(scope["log"]) > 0
    assert scope["shard"].shape == (8, 512) and scope["gathered"].shape == (8, 4096)


def test_training_doc_example_runs():
    doc = README.parent / "docs" / "training.md"
    block = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)[0]
    scope: dict = {}
    exec(compile(block, str(doc), "exec"), scope)
    stats = scope["stats"]
    assert int(stats["step"]) == 20 and float(stats["compression_ratio"]) > 4
    assert float(scope["loss"]) < 0.2


def test_fsdp_doc_examples_run():
    blocks, scope = _run_doc("fsdp.md")
    assert len(blocks) == 5
    assert math.isfinite(float(scope["loss"]))  # the stacked model's step
    assert scope["step"].num_devices == 8  # the HSDP step, over (2, 4)
    from jax.sharding import PartitionSpec as P

    assert scope["tp_params"]["w2"].sharding.spec == P("model", "fsdp")
    assert math.isfinite(float(scope["tp_loss"]))
    assert [r.shape[0] for r in scope["s4"].residuals] == [4, 4, 4]  # moved onto 4 devices


def test_ci_runs_the_readme_test_command():
    text = README.read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    test_cmd = next(c for c in commands if "pytest" in c)
    ci = (README.parent / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()
