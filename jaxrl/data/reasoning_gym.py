r"""reasoning-gym tasks as problems: generated once from a seed, written as canonical problems, frozen into splits.

    python -m launchers.import_problems --tasks=spell_backward,basic_arithmetic \
        --task_configs='{"basic_arithmetic": {"max_terms": 2, "max_digits": 1}}' --size=2000 --eval_size=400 \
        --output=data/rg/train.jsonl --split_dir=data/rg/splits

The design (docs/guides/tasks.md): a reasoning-gym task is *imported*, not read live. The generator writes the
training draw to `--output` (the problems.jsonl schema of jaxrl.data.problems) and freezes a second, disjoint
draw into dev / held-out splits with jaxrl.data.splits' manifest. Everything downstream reads problems files and
is unchanged: launchers.rollout, build_pairs, train (`data.source='problems'`: GRPO, PPO, distillation; SFT on
`sft_rows`), evaluate and the report. A live `data.source` would give each launcher a second way to get problems
and would have no file to freeze, hash and prove unchanged.

Each problem: the task's question as the user message (the answer format's instruction as the system message),
the task's answer as its one test's output (what SFT rows and `exact_match` read), and `metadata`:

    {"reward": "reasoning_gym", "answer_format": {"extract": "tag", "tag": "answer"},
     "reasoning_gym": {"task": "spell_backward", "kwargs": {...create_dataset's keyword arguments...},
                       "index": 17, "version": "0.1.25"}}

The `reasoning_gym` reward (jaxrl.rewards.reasoning_gym) rebuilds the task's own entry from `kwargs` and `index`
and calls the task's `score_answer` on it: the entry's metadata is not read back from JSON, which changes it for
some tasks (tuples become lists; arc_agi then scores a right answer 0.05).

Determinism: task t of a draw d ("train" | "eval") is `create_dataset(t, **config, seed=S, size=n)` with S
derived from (--task_seed, t, d), so the same flags give the same problems on any machine with the same package
version (`problems_sha256` in the manifest). The eval draw keeps only problems whose question is in neither the
training draw nor earlier in the eval draw, so dev and held-out never hold a training problem (nor one twice).
Counts per task follow `--task_weights` (largest remainder; equal weights by default).

The package is an optional extra: `require()` refuses in one line naming `pip install -e '.[tasks]'`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from typing import Any, Mapping, Optional, Sequence

from jaxrl.data.chat import encode_prompts
from jaxrl.data.problems import Problem, problems_jsonl_bytes
from jaxrl.data.answers import EXTRACTIONS, check_extraction, format_answer
from jaxrl.utils.dataclass_flags import flag_field
from jaxrl.utils.registry import nearest

__all__ = ["DISTRIBUTION", "INSTALL", "TaskSettings", "Generated", "check_tasks", "generate", "generator_record",
           "require", "sft_rows", "version"]

DISTRIBUTION = "reasoning-gym"
INSTALL = "pip install -e '.[tasks]'"
SOURCE = "reasoning_gym"
# The instruction of each answer format (the system message; --system_prompt replaces it).
INSTRUCTIONS = {"tag": "Give your final answer between <{tag}> and </{tag}>.",
                "last_line": "Give your final answer alone on the last line.",
                "all": "Answer with the final answer only.",
                "regex": ""}
RESERVED = ("seed", "size")  # create_dataset keywords this module sets (--task_seed, --size / --eval_size)


def require():
    """The reasoning_gym module; KeyError saying what to install when it is missing. KeyError because that is what
    a registry lookup of an unavailable entry raises: every check that looks a reward up passes it on (as a user
    error of one line, launchers/_main.py) rather than swallowing it as a signature it cannot read."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise KeyError(f"reasoning-gym tasks need the optional package {DISTRIBUTION} ({e}); install it: "
                       f"{INSTALL}") from None
    return reasoning_gym


def version() -> str:
    """The installed distribution's version (the module's own __version__ lags its releases)."""
    return importlib.metadata.version(DISTRIBUTION)


def _parse_configs(value: Any) -> dict:
    text = value if isinstance(value, str) else json.dumps(value)
    try:
        parsed = json.loads(text) if text else {}
    except ValueError as e:
        raise ValueError(f"--task_configs: not JSON ({e})") from None
    if not isinstance(parsed, dict) or not all(isinstance(v, dict) for v in parsed.values()):
        raise ValueError('--task_configs: expected a JSON object {task: {key: value}}, e.g. '
                         '\'{"basic_arithmetic": {"max_terms": 2}}\'')
    return parsed


def _parse_weights(value: Any) -> dict:
    text = value if isinstance(value, str) else json.dumps(value)
    try:
        parsed = json.loads(text) if text else {}
    except ValueError as e:
        raise ValueError(f"--task_weights: not JSON ({e})") from None
    if not isinstance(parsed, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in parsed.values()):
        raise ValueError('--task_weights: expected a JSON object {task: weight}, e.g. \'{"spell_backward": 2}\'')
    return parsed


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """What launchers.import_problems generates when --tasks is given (its fields are the launcher's flags)."""

    tasks: tuple[str, ...] = flag_field((), help="reasoning-gym task names (comma-separated): generate their problems "
                                        "instead of importing files (docs/guides/tasks.md).")
    task_configs: dict = flag_field(default_factory=dict, parse=_parse_configs,
                                    help='Each task\'s own config, JSON: {"task": {"key": value}} (the keys of the '
                                    "task's config class; seed and size are set by --task_seed and --size).")
    task_weights: dict = flag_field(default_factory=dict, parse=_parse_weights,
                                    help='Weights of a composite, JSON: {"task": weight} (default: equal).')
    size: int = flag_field(1000, help="Training problems to generate (split over the tasks by weight).")
    eval_size: int = flag_field(200, help="Evaluation problems, frozen into dev / held-out splits, none of them "
                                "a training problem.")
    task_seed: int = flag_field(0, help="Seed of the generation: the same seed gives the same problems.")
    answer_format: str = flag_field("tag", choices=EXTRACTIONS, help="How the answer is asked for and extracted "
                                    "(the reward's default): tag (<answer>...</answer>), last_line, all, regex "
                                    "(--answer_pattern).")
    answer_tag: str = flag_field("answer", help="The tag of --answer_format=tag.")
    answer_pattern: Optional[str] = flag_field(None, help="The regular expression of --answer_format=regex (the last "
                                               "match; its first group when it has one).")
    system_prompt: Optional[str] = flag_field(None, help="The system message of every problem (default: the answer "
                                              "format's one-line instruction; '' = none).")


# ------------------------------------------------------------------------------------------------ checks
@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """The checked generation: each task's create_dataset keywords (less seed and size) and its counts."""

    configs: dict[str, dict]
    train: dict[str, int]
    eval: dict[str, int]


def _allocate(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """`total` split over the tasks in proportion to `weights`, largest remainder first (ties: the task order)."""
    norm = sum(weights.values())
    exact = {t: total * w / norm for t, w in weights.items()}
    counts = {t: int(v) for t, v in exact.items()}
    order = sorted(weights, key=lambda t: -(exact[t] - counts[t]))
    for t in order[:total - sum(counts.values())]:
        counts[t] += 1
    return counts


def check_tasks(s: TaskSettings) -> TaskPlan:
    """ValueError (one line naming the flag) for a task the package lacks, a config key a task does not take, a
    config the task refuses, a weight of a task not generated, or a bad size; KeyError when the package is missing."""
    require()
    from reasoning_gym.factory import DATASETS
    if not s.tasks:
        raise ValueError("--tasks: name at least one reasoning-gym task")
    if len(set(s.tasks)) != len(s.tasks):
        raise ValueError(f"--tasks: a task is named twice: {list(s.tasks)}")
    if s.size < 0 or s.eval_size < 0 or s.size + s.eval_size == 0:
        raise ValueError(f"--size={s.size} and --eval_size={s.eval_size} must be >= 0, one of them > 0")
    check_extraction(s.answer_format, s.answer_tag, s.answer_pattern)
    for name in s.tasks:
        if name not in DATASETS or name == "composite":  # composite is its own mixer; --task_weights is ours
            close = nearest(name, [n for n in DATASETS if n != "composite"])
            raise ValueError(f"--tasks: reasoning-gym {version()} has no task {name!r}"
                             + (f" (did you mean {close!r}?)" if close else "")
                             + f"; list its {len(DATASETS) - 1} tasks with: python -c \"from reasoning_gym.factory "
                             "import DATASETS; print(sorted(DATASETS))\"")
    for where, table in (("--task_configs", s.task_configs), ("--task_weights", s.task_weights)):
        stray = [t for t in table if t not in s.tasks]
        if stray:
            raise ValueError(f"{where}: {stray[0]!r} is not among --tasks ({', '.join(s.tasks)})")
    if any(w <= 0 for w in s.task_weights.values()):
        raise ValueError(f"--task_weights: every weight must be > 0, got {s.task_weights}")
    configs = {}
    for name in s.tasks:
        config = dict(s.task_configs.get(name, {}))
        keys = [f.name for f in dataclasses.fields(DATASETS[name][1])]
        for key in config:
            if key in RESERVED:
                raise ValueError(f"--task_configs: {name}.{key} is set by --task_seed / --size; leave it out")
            if key not in keys:
                close = nearest(key, keys)
                raise ValueError(f"--task_configs: task {name!r} takes no config key {key!r}"
                                 + (f" (did you mean {close!r}?)" if close else "")
                                 + f"; its keys: {', '.join(k for k in keys if k not in RESERVED)}")
        _dataset(name, {**config, "seed": 0, "size": 1})  # the task's own validation, now
        configs[name] = config
    weights = {t: float(s.task_weights.get(t, 1.0)) for t in s.tasks}
    return TaskPlan(configs, _allocate(s.size, weights), _allocate(s.eval_size, weights))


def _dataset(name: str, kwargs: Mapping[str, Any]):
    """create_dataset(name, **kwargs); a config the task refuses (reasoning-gym validates with assert) is a
    ValueError of one line."""
    rg = require()
    try:
        return rg.create_dataset(name, **kwargs)
    except Exception as e:  # noqa: BLE001 - the task's own validation: AssertionError, TypeError, ValueError ...
        shown = {k: v for k, v in kwargs.items() if k not in RESERVED}
        raise ValueError(f"--task_configs: task {name!r} refuses the config {json.dumps(shown)}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")) from None


# ------------------------------------------------------------------------------------------------ generation
def draw_seed(seed: int, task: str, draw: str) -> int:
    """The reasoning-gym seed of `task` in draw `draw` (< 2**32, its ReseedingDataset's range)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{task}:{draw}".encode()).digest()[:4], "big")


@dataclasses.dataclass
class Generated:
    train: list[Problem]
    eval: list[Problem]
    plan: TaskPlan
    dropped: dict[str, int]  # eval draws left out per task: their question was a training one (or an earlier one)

    def sha256(self) -> str:
        """The hash of every generated problem (training draw, then the eval draw): the manifest's
        `problems_sha256`, equal on every machine for the same flags and package version."""
        return hashlib.sha256(problems_jsonl_bytes(self.train) + problems_jsonl_bytes(self.eval)).hexdigest()


def _problem(s: TaskSettings, task: str, kwargs: Mapping[str, Any], draw: str, index: int, entry: Mapping,
             pkg_version: str) -> Problem:
    system = s.system_prompt if s.system_prompt is not None else INSTRUCTIONS[s.answer_format].format(tag=s.answer_tag)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": str(entry["question"])}]
    answer_format = {"extract": s.answer_format, "tag": s.answer_tag, "pattern": s.answer_pattern}
    return Problem.from_dict({
        "id": f"rg/{task}/seed{s.task_seed}/{draw}/{index}",
        "messages": messages, "test_type": "stdin", "fn_name": None, "starter_code": "",
        "tests": [{"input": "", "output": "" if entry["answer"] is None else str(entry["answer"])}],
        "time_limit_s": None, "source": SOURCE,
        "metadata": {"reward": "reasoning_gym", "answer_format": answer_format,
                     "reasoning_gym": {"task": task, "kwargs": dict(kwargs), "index": index,
                                       "version": pkg_version}},
    }, where=f"reasoning-gym {task} #{index}")


def generate(s: TaskSettings) -> Generated:
    """The training and eval draws of `s` (module docstring), checked first (check_tasks)."""
    plan = check_tasks(s)
    pkg_version = version()
    train: list[Problem] = []
    evals: list[Problem] = []
    dropped: dict[str, int] = {}
    for task in s.tasks:
        config = plan.configs[task]
        n = plan.train[task]
        kwargs = {**config, "seed": draw_seed(s.task_seed, task, "train"), "size": max(n, 1)}
        dataset = _dataset(task, kwargs)
        seen = set()
        for i in range(n):
            entry = dataset[i]
            seen.add(str(entry["question"]))
            train.append(_problem(s, task, kwargs, "train", i, entry, pkg_version))
        want = plan.eval[task]
        if not want:
            continue
        # Enough draws to find `want` new questions where the task's space allows; past that, refuse (below).
        budget = 4 * want + 64
        kwargs = {**config, "seed": draw_seed(s.task_seed, task, "eval"), "size": budget}
        dataset = _dataset(task, kwargs)
        kept = 0
        for i in range(budget):
            entry = dataset[i]
            question = str(entry["question"])
            if question in seen:
                continue
            seen.add(question)
            evals.append(_problem(s, task, kwargs, "eval", i, entry, pkg_version))
            kept += 1
            if kept == want:
                break
        if kept < want:
            raise ValueError(f"--eval_size: task {task!r} gave only {kept} of {want} eval problems unlike its "
                             f"{n} training ones in {budget} draws; lower --eval_size or --size, or widen its "
                             "config")
        dropped[task] = i + 1 - kept
    return Generated(train, evals, plan, dropped)


def generator_record(s: TaskSettings, generated: Generated, train_path: str, train_sha256: str) -> dict:
    """The manifest's `generator` entry: package and version, seed, tasks (config, weight, counts), the answer
    format, the training file and the hash of every generated problem."""
    from reasoning_gym.factory import DATASETS
    tasks = {}
    for task in s.tasks:
        resolved = dataclasses.asdict(DATASETS[task][1](**generated.plan.configs[task]))
        tasks[task] = {"config": generated.plan.configs[task],
                       "resolved_config": {k: v for k, v in resolved.items() if k not in RESERVED},
                       "weight": float(s.task_weights.get(task, 1.0)), "train": generated.plan.train[task],
                       "eval": generated.plan.eval[task], "eval_draws_dropped": generated.dropped.get(task, 0),
                       "train_seed": draw_seed(s.task_seed, task, "train"),
                       "eval_seed": draw_seed(s.task_seed, task, "eval")}
    return {"package": DISTRIBUTION, "version": version(), "task_seed": s.task_seed, "tasks": tasks,
            "answer_format": {"extract": s.answer_format, "tag": s.answer_tag, "pattern": s.answer_pattern},
            "system_prompt": s.system_prompt, "train": {"path": str(train_path), "sha256": train_sha256,
                                                        "count": len(generated.train)},
            "problems_sha256": generated.sha256()}


# ------------------------------------------------------------------------------------------------ SFT rows
def sft_rows(tokenizer, problems: Sequence[Problem], *, max_len: int = 2048, enable_thinking: bool = False
             ) -> list[dict]:
    """Supervised rows of the generated answers (algorithm = "sft", data.source = jsonl): the chat-templated prompt,
    then the task's answer in the problem's answer format and <|im_end|>, the loss on the answer only."""
    enc = encode_prompts(tokenizer, [p.messages for p in problems], enable_thinking, max_len, on_overlong="skip",
                         names=[p.id for p in problems])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for i, ids in zip(enc.kept, enc.ids):
        fmt = problems[i].metadata.get("answer_format", {})
        text = format_answer(problems[i].tests[0].output, fmt.get("extract", "tag"), fmt.get("tag", "answer"))
        target = tokenizer.encode(text, add_special_tokens=False) + [end]
        rows.append({"input_ids": [int(t) for t in ids] + target, "loss_mask": [0] * len(ids) + [1] * len(target)})
    return rows
