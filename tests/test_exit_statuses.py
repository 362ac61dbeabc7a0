"""The launchers' exit statuses as documented: docs/reference/interfaces.md's table is the one the code renders from
its own error types, the statuses the issue found wrong are the documented ones (a refused resume 1, an unknown
reward 2), and the reward lists of `evaluate --help` / `rollout --help` are the registry's."""

from __future__ import annotations

import re
from pathlib import Path

from absl import flags

ROOT = Path(__file__).resolve().parents[1]


def test_the_exit_status_table_in_interfaces_md_is_the_one_the_code_renders():
    from launchers._main import exit_status_table
    doc = (ROOT / "docs" / "reference" / "interfaces.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- exit-status-table[^>]*-->\n(.*?)<!-- /exit-status-table -->", doc, re.S)
    assert found, "docs/reference/interfaces.md lost its exit-status-table markers"
    assert found.group(1) == exit_status_table(), (
        "regenerate the table: python -c 'from launchers._main import exit_status_table; print(exit_status_table())'")


def test_the_statuses_the_issue_found_wrong_are_the_documented_ones():
    from jaxrl.rollout.runner import RewardChoiceError, check_reward_choice
    from jaxrl.utils.io import ResumeError
    from jaxrl.train.loop import NonFiniteError
    from launchers._main import EXIT_NONFINITE, EXIT_REFUSED, EXIT_USAGE, exit_status_of, project_error_types

    def raised(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (the error as a launcher would see it)
            return e
        raise AssertionError("nothing raised")

    assert exit_status_of(ResumeError("a resume of other settings")) == EXIT_REFUSED  # train's refused resume too
    assert exit_status_of(raised(lambda: check_reward_choice("nope", {}))) == EXIT_USAGE
    assert exit_status_of(NonFiniteError("stopped")) == EXIT_NONFINITE
    types = project_error_types()
    assert "ResumeError" in types[EXIT_REFUSED] and "OutputInUseError" in types[EXIT_REFUSED]
    assert RewardChoiceError.__name__ in types[EXIT_USAGE] and types[EXIT_NONFINITE] == ["NonFiniteError"]


def test_the_config_reference_lists_every_registered_reward():
    from jaxrl.rewards import REWARDS
    doc = (ROOT / "docs" / "reference" / "config.md").read_text(encoding="utf-8")
    [row] = [line for line in doc.splitlines() if line.startswith("| `reward.name` |")]
    assert sorted(re.findall(r"`(\w+)`", row.split("|")[3])) == sorted(REWARDS.names())


def test_every_registered_reward_is_listed_by_the_help_of_evaluate_and_rollout():
    from jaxrl.evaluation import flags as evaluate_flags
    from jaxrl.rewards import REWARDS
    from jaxrl.rollout import flags as rollout_flags
    for module in (evaluate_flags, rollout_flags):
        values = flags.FlagValues()
        module.define_flags(values)
        help_text = values["reward"].help
        assert all(name in help_text for name in REWARDS.names()), (module.__name__, help_text)


def test_the_launcher_table_of_interfaces_md_lists_every_launcher():
    doc = (ROOT / "docs" / "reference" / "interfaces.md").read_text(encoding="utf-8")
    table = doc[doc.index("| launcher | job |"):]
    table = table[:table.index("\n\n")]
    listed = set(re.findall(r"`(\w+)`", "".join(line.split("|")[1] for line in table.splitlines())))
    launchers = {p.stem for p in (ROOT / "launchers").glob("*.py") if not p.stem.startswith("_")}
    assert launchers <= listed, sorted(launchers - listed)
