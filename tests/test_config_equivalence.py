"""Every config resolves to the values it resolved to before the settings moved to their owners (issue 47): the
corpus `tests/fixtures/config_corpus/2e1e1a6.jsonl.gz` holds every config the whole test suite (all tiers) and
every preset of every family file under configs/ resolved on commit 2e1e1a6, with what `resolve` / `complete`
returned then (the input as JSON, the output as config.json holds it, or the error). Each resolves the same now:
the same keys with the same values (types included: 1 is not 1.0), the same errors. The intended differences are
named: distillation's block no longer has the asynchronous keys it inherited and refused (`RETIRED`; a config.json
written before, which holds them at their defaults, still resolves), and the partial-rollouts refusal names only
the requirements that are not met (`IMPROVED`). Keys added since (`ADDED`, issue 48) appear at their defaults, which
keep what the corpus's configs did: issue 48's loss keys, issue 50's fleet wait and environment step limit, issue
51's layout."""

import gzip
import json
import re
from pathlib import Path

import pytest

from jaxrl.algorithms import config as run_config
from jaxrl.algorithms.run import resolve_config
from jaxrl.algorithms.tasks import registered

CORPUS = Path(__file__).resolve().parent / "fixtures" / "config_corpus" / "2e1e1a6.jsonl.gz"
# the one refusal whose message changed on purpose: it listed requirements that were met as if they were not
IMPROVED = ".partial_rollouts continues rows across policy versions: it needs "
# block -> keys the block no longer has (and had at these defaults in every config.json of 2e1e1a6)
RETIRED = {"distill": {"max_staleness": 0, "off_policy_loss": "behaviour", "overlap": False, "partial_rollouts": False}}
# block -> keys added after 2e1e1a6, at the defaults that keep the behaviour the corpus's configs had
LOSS_KEYS = {"policy_loss": "ppo_clip", "policy_loss_options": {}, "ref_reset_every": 0, "ref_reset_optimizer": False}
# issue 50: the fleet's wait (a nested server block's key), the environment step limit; issue 51: the layout
FLEET = {"fleet_wait_s": 600.0}
ONLINE_KEYS = {"layout": "auto", "rollout_server": FLEET}
ADDED = {"grpo": {**LOSS_KEYS, **ONLINE_KEYS, "kl_in_reward": 0.0, "replay_groups": 0, "replay_max_age": 4,
                  "pass_at_k_k": 0, "step_timeout_s": 600.0},
         "ppo": {**LOSS_KEYS, **ONLINE_KEYS, "step_timeout_s": 600.0},
         "distill": {**ONLINE_KEYS, "teacher_server": FLEET},
         # the online algorithms' data block (DPO's and SFT's have none of these)
         "data": {"sampler": "uniform", "curriculum_window": 1, "curriculum_set_aside": 8, "curriculum_solved": 1.0,
                  "curriculum_failed": 0.0}}


def records() -> list[dict]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def without_retired(output: dict) -> dict:
    out = dict(output)
    for block, keys in RETIRED.items():
        if block in out:
            assert all(out[block][k] == v for k, v in keys.items()), (block, {k: out[block][k] for k in keys})
            out[block] = {k: v for k, v in out[block].items() if k not in keys}
    return out


def without_added(output: dict, added: dict = ADDED) -> dict:
    """`output` without the keys added since 2e1e1a6 (each at its default); a dict in `added` names the keys added
    inside a nested block that existed then (its other keys stay)."""
    out = dict(output)
    for block, keys in added.items():
        if isinstance(out.get(block), dict):
            inner = {k: v for k, v in keys.items() if isinstance(v, dict) and v and isinstance(out[block].get(k), dict)}
            present = {k: v for k, v in keys.items() if k in out[block] and k not in inner}
            assert all(out[block][k] == v for k, v in present.items()), (block, {k: out[block][k] for k in present})
            out[block] = {k: v for k, v in out[block].items() if k not in present}
            out[block].update(without_added(out[block], inner))
    return out


def without_added_names(message: str) -> str:
    """An unknown-key error lists the block's keys: the added ones are taken out of that list."""
    names = {k for keys in ADDED.values() for k, v in keys.items() if not (isinstance(v, dict) and v)}
    for key in sorted(names | set(FLEET), key=len, reverse=True):
        message = re.sub(rf"(?<![\w.]){key}, ", "", message)
    return message


def test_the_corpus_covers_every_algorithm_and_both_entry_points():
    recs = records()
    assert len(recs) >= 200
    assert {r["input"].get("algorithm") or "sft" for r in recs} == {"sft", "dpo", "grpo", "ppo", "distill"}
    assert {r["fn"] for r in recs} == {"resolve", "complete"}


@pytest.mark.filterwarnings("ignore:.*rollout_backend_kwargs is deprecated:FutureWarning")  # configs that use it
@pytest.mark.parametrize("record", records(), ids=lambda r: f"{r['fn']}-{r['input'].get('algorithm') or 'sft'}")
def test_every_config_resolves_as_before(record):
    config = record["input"]
    name = config.get("algorithm")
    algorithm = registered(name or run_config.TrainConfig.algorithm)
    if record["fn"] == "resolve":  # the composer itself, as the corpus recorded it (the reward's and model's own
        # checks come after it, in jaxrl.algorithms.run.resolve_config)
        run = lambda: run_config.resolve(json.loads(json.dumps(config)), algorithm).to_json()  # noqa: E731
    else:
        run = lambda: run_config.complete(config, algorithm,  # noqa: E731
                                          strict=record["strict"] and name is not None and algorithm is not None)
    if "error" in record:
        kind, _, message = record["error"].partition(": ")
        with pytest.raises(Exception) as raised:
            run()
        assert type(raised.value).__name__ == kind
        if IMPROVED in message:  # it now names only the requirements that are not met, each as it did
            head, _, needs = str(raised.value).partition(IMPROVED)
            assert message.startswith(head + IMPROVED)
            assert all(need in message for need in needs.split(" and ")), (needs, message)
        else:
            assert without_added_names(str(raised.value)) == message
        return
    want = without_retired(record["output"])
    got = without_added(run())
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)  # the same keys and values


def test_a_config_json_of_2e1e1a6_with_the_retired_keys_resolves_and_another_value_is_refused():
    distill = next(r for r in records() if r["fn"] == "resolve" and r["input"].get("algorithm") == "distill")
    old = distill["output"]
    assert all(k in old["distill"] for k in RETIRED["distill"])  # what such a config.json holds
    assert "max_staleness" not in resolve_config(old).to_json()["distill"]
    changed = json.loads(json.dumps(old))
    changed["distill"]["max_staleness"] = 1
    with pytest.raises(ValueError, match=r"distill.max_staleness=1: distillation trains on-policy"):
        resolve_config(changed)
