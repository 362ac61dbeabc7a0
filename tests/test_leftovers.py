"""Conveniences that never destroy what they did not make: `demo --fresh` clears only a folder the demo made (its
mark), and an export cleans, on its next run, the temporary folder and the previous version a killed export left
beside its output (a symlink --out is replaced as a link: its target is never touched)."""

from __future__ import annotations

import os

import pytest

import launcher_env
from launcher_env import error_lines, launch, snapshot


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return launcher_env.build(tmp_path_factory.mktemp("env"), n_problems=1)


@pytest.mark.slow  # the demo launcher imports the whole package before it refuses
def test_demo_fresh_refuses_a_folder_it_did_not_make_and_leaves_it_untouched(tmp_path):
    notes = tmp_path / "my_notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("a week of notes")
    before = snapshot(notes)
    proc = launch("demo", f"--workdir={notes}", "--fresh", "--quick")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert error_lines(proc) == [f"demo: --workdir={notes}: not a folder the demo made (no .jaxrl-demo in it); "
                                 "--fresh deletes only those: choose another --workdir, or delete this folder "
                                 "yourself"]
    assert snapshot(notes) == before


@pytest.mark.slow  # jaxrl.demo imports every stage
def test_the_demo_marks_the_folders_it_makes_and_only_those(tmp_path):
    from jaxrl.demo import MARKER, Demo
    Demo(tmp_path / "new").claim_folder()
    assert (tmp_path / "new" / MARKER).is_file()
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "data.csv").write_text("1,2\n")
    Demo(tmp_path / "theirs").claim_folder()
    assert not (tmp_path / "theirs" / MARKER).exists()  # writing beside a user's files never makes them the demo's


def test_an_export_cleans_what_a_killed_export_left_and_replaces_a_symlink_not_its_target(env, tmp_path):
    from jaxrl.export import export_checkpoint
    out = tmp_path / "peft"
    export_checkpoint(env["run"], env["model"], str(out), step=2)
    # a killed export's temporary folder (gigabytes for a merged 4B) and a previous version moved aside as a link
    (tmp_path / ".peft.tmp-killed").mkdir()
    (tmp_path / ".peft.tmp-killed" / "model.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".peft.old-killed")
    export_checkpoint(env["run"], env["model"], str(out), step=5, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "peft"]  # and no lock file left either

    target = tmp_path / "shared_peft"
    target.mkdir()
    (target / "keep.txt").write_text("another user's folder")
    link = tmp_path / "peft_link"
    os.symlink(target, link)
    export_checkpoint(env["run"], env["model"], str(link), step=5, overwrite=True)
    assert link.is_dir() and not link.is_symlink() and (link / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if ".old-" in p.name or ".tmp-" in p.name]


def test_an_export_killed_between_its_two_renames_gets_its_previous_version_back(env, tmp_path):
    from jaxrl.export import export_checkpoint
    from jaxrl.utils.io import OutputExistsError
    out = tmp_path / "peft"
    export_checkpoint(env["run"], env["model"], str(out), step=2)
    before = snapshot(out)
    os.replace(out, tmp_path / ".peft.old-killed")  # the old version moved aside, the new one never renamed in
    with pytest.raises(OutputExistsError):  # put back, so it is an existing output (no --overwrite)
        export_checkpoint(env["run"], env["model"], str(out), step=5)
    assert snapshot(out) == before and not (tmp_path / ".peft.old-killed").exists()
