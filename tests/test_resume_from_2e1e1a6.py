"""A run started on commit 2e1e1a6 (before the settings moved to their owners, issue 47) resumes on this code: each
fixture under tests/fixtures/resume_2e1e1a6/<algorithm>/workdir is what a tiny sft / dpo / grpo / ppo / distill run
(configs/<algorithm>_tiny.py, 4 steps, a checkpoint every 2: fixture_config.py) left on disk when it was SIGKILLed
after step 2's checkpoint on 2e1e1a6 (make_resume_fixture.py, run at that commit), with the metrics of steps 3-4 and
the step-4 adapter the uninterrupted run wrote there. Resumed from its config.json (and, for grpo and distill, from
the family config), a copy trains steps 3-4 to the same numbers and the same adapter: bit for bit where the JAX
version and the CPU are the ones the fixture was made with (as on the machine that made it: jax 0.10.2, the project's
2-core Xeon, `make test-heavy`'s XLA flags), within float32 rounding elsewhere (another XLA may round otherwise; the comparison says which it did).
"""

import hashlib
import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "resume_2e1e1a6"
MADE_WITH = {"jax": "0.10.2", "jaxlib": "0.10.2", "machine": "x86_64", "cpu": "Intel(R) Xeon(R) Processor",
             "xla_flags": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
TIMING = ("step_time_s", "tokens_per_s", "compile_time_s")
# Metrics the code logs since 2e1e1a6 (new keys, not changed values): the resumed steps may carry them.
ADDED_METRICS = {"reward/group_best_mean"}
ADDED_PREFIXES = ("layout/",)  # the online layout's counters (issue 51), logged by every online step since


def added_since(key: str) -> bool:
    """A metric the code logs since the fixtures were written (2e1e1a6): absent from them, not a difference."""
    return key in ADDED_METRICS or key.startswith(ADDED_PREFIXES)


def is_timing(key: str) -> bool:
    return key in TIMING or key.endswith("_s") or key.startswith("time/")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def same_platform() -> bool:
    """Bit-exactness needs the fixture's JAX, CPU and XLA flags (`make test-heavy` sets those; a bare `pytest`
    compiles at another optimisation level, and the rounding moves in the last bits)."""
    import os

    import jax
    import jaxlib
    flags = os.environ.get("XLA_FLAGS", "").split()
    return (jax.__version__, jaxlib.__version__, platform.machine(), cpu_model(), flags) == (
        MADE_WITH["jax"], MADE_WITH["jaxlib"], MADE_WITH["machine"], MADE_WITH["cpu"], MADE_WITH["xla_flags"].split())


def copy_fixture(algo: str, tmp_path: Path) -> tuple[Path, dict]:
    """The fixture's workdir copied to `tmp_path` (relocated: nothing in it may depend on where it was made) and
    its config.json; distill's teacher is copied beside it and config.json pointed at the copy."""
    src = FIXTURES / algo
    workdir = tmp_path / "workdir"
    shutil.copytree(src / "workdir", workdir)
    config = json.loads((workdir / "config.json").read_text())
    if (src / "teacher").is_dir():
        shutil.copytree(src / "teacher", tmp_path / "teacher")
        config["distill"]["teacher_path"] = str(tmp_path / "teacher")
    return workdir, config


def family_config(algo: str, config: dict):
    sys.path.insert(0, str(FIXTURES))
    try:
        import fixture_config
    finally:
        sys.path.remove(str(FIXTURES))
    family = fixture_config.get_config(algo)
    if algo == "distill":
        family.distill.teacher_path = config["distill"]["teacher_path"]
    return family


CASES = [(a, "config.json") for a in ("sft", "dpo", "grpo", "ppo", "distill")] + [(a, "family config")
                                                                                  for a in ("grpo", "distill")]


@pytest.mark.heavy  # seven resumed tiny runs of two steps each
@pytest.mark.parametrize("algo,given", CASES, ids=[f"{a}-{g.replace(' ', '_')}" for a, g in CASES])
def test_a_run_started_on_2e1e1a6_resumes_to_the_same_steps_and_adapter(algo, given, tmp_path):
    from jaxrl.algorithms.run import run_training
    from jaxrl.models.adapters import load_adapter

    expected = json.loads((FIXTURES / algo / "expected.json").read_text())
    workdir, config = copy_fixture(algo, tmp_path)
    steps_on_disk = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps_on_disk)) == [1, 2]  # what the killed run had written (DPO adds an eval line at 2)
    result = run_training(config if given == "config.json" else family_config(algo, config), str(workdir))
    assert [r["step"] for r in result.records][-2:] == [3, 4]
    # metrics.jsonl rather than result.records: DPO's eval line at step 4 is written there too
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    got = [r for r in map(json.loads, lines) if r["step"] in (3, 4)]
    want = expected["metrics_steps_3_4"]
    assert [r["step"] for r in got] == [r["step"] for r in want] and {r["step"] for r in got} == {3, 4}
    exact = same_platform()
    for a, b in zip(want, got):
        assert sorted(k for k in a if not is_timing(k)) == sorted(k for k in b if not is_timing(k)
                                                                 and not added_since(k))
        for key in a:
            if is_timing(key):
                continue
            if exact or not isinstance(a[key], float):
                assert b[key] == a[key] or (a[key] != a[key] and b[key] != b[key]), (a["step"], key, a[key], b[key])
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7, nan_ok=True), (a["step"], key)
    params, _ = load_adapter(str(workdir), step=4)
    reference = np.load(FIXTURES / algo / "expected_adapter.npz")
    assert sorted(params) == sorted(expected["adapter"]) == sorted(reference.files)
    for name, value in params.items():
        value = np.ascontiguousarray(value)
        if exact:
            assert hashlib.sha256(value.tobytes()).hexdigest() == expected["adapter"][name]["sha256"], name
        else:
            np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-7, err_msg=name)
