"""The documented vLLM environment (vllm_backend.ENV_RECIPE, docs/guides/vllm.md) resolves, with pip's own resolver against
PyPI, to the vLLM version the backend targets, for a GPU machine (CPython 3.12, manylinux x86_64); and vLLM 0.33
cannot share jaxrl's environment (its transformers pin excludes ours), which is why it has its own."""

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from jaxrl.backends.openai_client import TARGET_VLLM
from jaxrl.backends.vllm_backend import ENV_RECIPE, VLLM_REQUIREMENT, VLLM_VERSION

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple"
# the wheel tags of a GPU machine: pip does not widen --platform to older manylinux versions itself
TARGET = (["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
          + [a for v in range(17, 36) for a in ("--platform", f"manylinux_2_{v}_x86_64")]
          + ["--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64"])


def dry_run(requirements, report):
    return subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--isolated", "--no-cache-dir", "--index-url", INDEX, "--report", str(report), *TARGET,
                           *requirements], capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def pypi():
    try:
        urllib.request.urlopen(f"{INDEX}/vllm/", timeout=15).close()
    except OSError as e:
        pytest.skip(f"PyPI is unreachable from here ({e}); this test resolves the vLLM environment against it")


def test_docs_give_the_recipe_the_backend_states():
    doc = (ROOT / "docs" / "guides/vllm.md").read_text()
    for line in ENV_RECIPE:
        assert line in doc, line
    assert ENV_RECIPE[1].endswith(f"'{VLLM_REQUIREMENT}'")
    assert tuple(int(p) for p in VLLM_VERSION.split(".")[:2]) == TARGET_VLLM


@pytest.mark.heavy
@pytest.mark.slow
def test_the_recipe_resolves_to_the_targeted_vllm(pypi, tmp_path):
    requirement = re.search(r"pip install '([^']+)'", ENV_RECIPE[1]).group(1)
    proc = dry_run([requirement], tmp_path / "report.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                 for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    print(f"vllm {installed['vllm']}, torch {installed.get('torch')}, transformers {installed.get('transformers')}; "
          f"{len(installed)} packages")
    assert tuple(int(p) for p in installed["vllm"].split(".")[:2]) == TARGET_VLLM
    assert installed["vllm"] == VLLM_VERSION


@pytest.mark.slow
def test_vllm_033_cannot_share_jaxrls_transformers(pypi, tmp_path):
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ours = next(d for d in deps if re.match(r"transformers\b", d))
    proc = dry_run([VLLM_REQUIREMENT, ours], tmp_path / "report.json")
    assert proc.returncode != 0 and "transformers" in proc.stderr, proc.stderr[-3000:]
