"""The persistent compilation cache of every launcher (jaxrl/utils/compile_cache.py, --compilation_cache in
launchers/_main.py): the default folder, the flag that moves or disables it, an inherited JAX_COMPILATION_CACHE_DIR
that wins, and a rerun of a launcher that loads its programs instead of compiling them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.utils import compile_cache
from launcher_env import ROOT, SAMPLING, error_lines, launch, launch_env


def test_default_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "jaxrl" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == str(tmp_path / "home" / ".cache" / "jaxrl" / "xla")
    assert compile_cache.resolve(None) == compile_cache.default_dir()
    assert compile_cache.resolve("none") is None and compile_cache.resolve("") is None
    assert compile_cache.resolve("rel/x") == os.path.abspath("rel/x")


def test_a_folder_that_cannot_be_written_is_named_without_creating_anything(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert compile_cache.unwritable(str(afile / "x" / "y")) == f"{afile} is not a folder"
    assert compile_cache.unwritable(str(tmp_path / "new" / "deeper")) is None
    assert not (tmp_path / "new").exists()  # jax creates the folder at its first compile


def test_child_env_sets_what_jax_reads_and_keeps_an_inherited_folder(tmp_path):
    env = compile_cache.child_env(str(tmp_path / "c"), {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "c"),
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    inherited = {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
    assert compile_cache.child_env(str(tmp_path / "c"), inherited) == inherited
    assert compile_cache.child_env("none", {"PATH": "/bin"}) == {"PATH": "/bin"}


def test_every_launcher_lists_the_flag_and_a_bad_folder_is_one_line(tmp_path):
    # launchers.plan imports no jax: three processes that stop before any work, in about a second
    proc = launch("plan", "--helpshort", timeout=120)
    assert proc.returncode == 0 and "--compilation_cache: JAX's persistent compilation cache" in proc.stdout
    # launchers.sweep keeps the flag of its own (the folder its points share)
    proc = launch("sweep", "--helpshort", timeout=120)
    assert proc.returncode == 0 and "--compilation_cache: JAX persistent compilation cache shared by the points" \
        in proc.stdout
    afile = tmp_path / "afile"
    afile.write_text("")
    env = launch_env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "launchers.plan", f"--compilation_cache={afile}/x"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert error_lines(proc) == [f"plan: --compilation_cache={afile}/x: {afile} is not a folder; give a writable "
                                 "folder, or none"]


def entries(folder: Path) -> set[str]:
    """jax's cache entries in a folder (`<key>-cache` files)."""
    return {p.name for p in folder.glob("*-cache")} if folder.exists() else set()


@pytest.mark.heavy  # builds the tiny model folder and runs a rollout three times (about a minute each on 2 cores)
def test_a_rerun_loads_its_programs_from_the_cache_and_none_writes_nothing(tmp_path):
    """Run 1 uses the default folder (under XDG_CACHE_HOME) and compiles; run 2 names that same folder with the
    flag and compiles nothing: every program is a cache hit and no entry is added; run 3 (--compilation_cache=
    none) neither reads nor writes any folder."""
    import launcher_env
    built = launcher_env.build(tmp_path / "env")
    xdg = tmp_path / "xdg"
    default = xdg / "jaxrl" / "xla"
    env = launch_env(extra={"XDG_CACHE_HOME": str(xdg), "JAX_LOG_COMPILES": "1",  # one WARNING line per program
                            # the tiny programs compile in under the default second; a GPU job's take longer
                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                            "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"})
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test suite's own cache would win

    def rollout(i, *extra):
        args = (f"--problems={built['problems']}", f"--model={built['model']}", f"--out={tmp_path / f'r{i}.jsonl'}",
                "--reward=exact_match", *SAMPLING, *extra)
        proc = subprocess.run([sys.executable, "-m", "launchers.rollout", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        programs = proc.stderr.count("Finished XLA compilation of")  # compiled or loaded from the cache
        hits = proc.stderr.count("Persistent compilation cache hit for")
        return programs, hits

    programs, hits = rollout(1)
    written = entries(default)
    assert programs >= 1 and hits == 0 and len(written) >= 1
    programs2, hits2 = rollout(2, f"--compilation_cache={default}")
    assert programs2 == programs and hits2 == len(written)  # nothing compiled again
    assert entries(default) == written
    programs3, hits3 = rollout(3, "--compilation_cache=none")
    assert programs3 == programs and hits3 == 0
    assert entries(default) == written and sorted(p.name for p in xdg.iterdir()) == ["jaxrl"]
