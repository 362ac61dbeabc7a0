"""launchers/convert: HF -> Orbax -> HF is lossless, run as a real subprocess like a user would."""

import os
import subprocess
import sys

import numpy as np
import pytest

import jax.numpy as jnp

from conftest import jitted_forward
from jaxrl.models import qwen35
from jaxrl.models.qwen35.orbax_io import load_orbax_params

from test_qwen35_checkpoint import read_all

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_convert(*args):
    proc = subprocess.run([sys.executable, "-m", "launchers.convert", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_hf_to_orbax_to_hf_round_trip(hf_container, tmp_path):
    folder, _ = hf_container
    orbax_dir, hf_out = str(tmp_path / "orbax"), str(tmp_path / "hf")
    assert "wrote orbax" in run_convert("--to=orbax", f"--src={folder}", f"--out={orbax_dir}")
    restored = load_orbax_params(orbax_dir)
    original = qwen35.from_pretrained(folder)
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 250, size=(1, 30)))
    np.testing.assert_array_equal(np.asarray(jitted_forward(restored)(ids)), np.asarray(jitted_forward(original)(ids)))
    run_convert("--to=hf", f"--src={orbax_dir}", f"--base={folder}", f"--out={hf_out}")
    assert read_all(folder) == read_all(hf_out)


@pytest.mark.slow
def test_convert_refuses_to_overwrite_and_needs_base(hf_container, tmp_path):
    folder, _ = hf_container
    out = str(tmp_path / "o")
    run_convert("--to=orbax", f"--src={folder}", f"--out={out}")
    proc = subprocess.run([sys.executable, "-m", "launchers.convert", "--to=orbax", f"--src={folder}",
                           f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "already exists" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "launchers.convert", "--to=hf", f"--src={out}",
                           f"--out={tmp_path / 'h'}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "--to=hf needs --base" in proc.stderr
