"""GRPO over episodes learns to use the environment's feedback: on the Alphabet environment (tests/episode_envs.py)
the alphabet the answer must use is told only after the first answer, so a policy that ignores the feedback
expects at most 0.5 and a one-turn policy scores 0. A tiny model is warmed up (SFT, as the demo does) on the
episode format only, answering its second turn in a RANDOM alphabet; GRPO over 2-turn episodes must then teach it
to read the feedback. Measured by evaluation over episodes on held-out prompts, against the warm-up model."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from configs import base as base_config
from configs import grpo as grpo_config
from jaxrl.algorithms.run import run_training
from jaxrl.data.chat import format_chat, load_tokenizer, turn_delta_ids
from jaxrl.data.tiny_tokenizer import build_tiny_tokenizer, minimal_vocab_size
from jaxrl.evaluation.runner import EvalConfig, ModelSpec, run_evaluation
from jaxrl.export import export_checkpoint
from jaxrl.models.qwen35.config import tiny
from jaxrl.models.qwen35.tiny_checkpoint import write_tiny_checkpoint

ENVS = Path(__file__).resolve().parent / "episode_envs.py"
DIGITS, LETTERS = "0123456789", "abcdefghijklmnopqrstuvwxyz"
WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "lemon", "piano", "zebra", "north", "candle")
HELDOUT = ("forest", "silver", "rocket", "garden", "bridge", "castle", "desert", "engine", "falcon", "glacier",
           "harbor", "island")  # prompts never trained on
CAP, P, E = 6, 48, 80


def problems(words, tag):
    return [{"id": f"{tag}/{w}", "messages": [{"role": "user", "content": f"Say {w}."}], "test_type": "stdin",
             "tests": [{"input": "", "output": ""}]} for w in words]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def settings(c, model_path, steps, lr, rank, micro_batch, accum=1):
    c.model_preset, c.model_path, c.dtype, c.remat = "", os.fspath(model_path), "float32", "none"
    c.steps, c.checkpoint_every, c.keep_checkpoints = steps, steps, 1
    c.optimizer.learning_rate, c.optimizer.schedule = lr, "constant_with_warmup"
    c.optimizer.warmup_steps, c.optimizer.warmup_ratio, c.optimizer.weight_decay = 2, 0.0, 0.0
    c.lora.rank, c.lora.alpha = rank, 2.0 * rank
    c.batch.micro_batch_size, c.batch.grad_accum = micro_batch, accum
    c.mesh.shape, c.logprob_chunk_size = (1, 1, 1), 64
    c.tensorboard, c.checkpoint_async = False, False
    c.compile_options = {"xla_backend_optimization_level": 0}
    return c


def warm_up_rows(tok, train, seed=0, copies=8):
    """Episodes in the runner's token layout (prompt, turn 1, the observation's template delta, turn 2), loss on
    both answers; the second answer's alphabet is drawn at random, NOT from the observation."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(copies):
        for p in train:
            prompt = format_chat(tok, p["messages"], False)
            first = tok.encode("ok", add_special_tokens=False) + [end]
            asked = ("digits", "letters")[int(rng.integers(0, 2))]
            delta = turn_delta_ids(tok, [{"role": "user", "content": f"Answer in {asked}."}], False, stop_id=end)
            alphabet = (DIGITS, LETTERS)[int(rng.integers(0, 2))]
            second = tok.encode("".join(rng.choice(list(alphabet), size=int(rng.integers(2, 5)))),
                                add_special_tokens=False) + [end]
            ids = prompt + first + delta + second
            rows.append({"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(first) + [0] * len(delta)
                         + [1] * len(second)})
    return rows


@pytest.mark.heavy
@pytest.mark.slow
def test_grpo_over_episodes_learns_to_use_the_feedback(tmp_path):
    root = tmp_path
    train, heldout = problems(WORDS, "train"), problems(HELDOUT, "heldout")
    write_jsonl(root / "train.jsonl", train)
    write_jsonl(root / "heldout.jsonl", heldout)
    pre = root / "pretrained"
    corpus = [m["content"] for p in train + heldout for m in p["messages"]]
    corpus += [DIGITS, LETTERS, "system user assistant\n", "Answer in digits. Answer in letters. ok"]
    vocab = minimal_vocab_size(corpus, printable_ascii=False)
    build_tiny_tokenizer(os.fspath(pre), corpus, vocab_size=vocab, printable_ascii=False)
    cfg = tiny(vocab_size=vocab + 4, num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
               eos_token_id=1)
    write_tiny_checkpoint(os.fspath(pre), cfg, seed=0, layout="container", head_scale=10.0)
    tok = load_tokenizer(os.fspath(pre))

    # 1. warm-up: the episode format, the second answer in a random alphabet (a feedback-blind policy)
    write_jsonl(root / "sft.jsonl", warm_up_rows(tok, train))
    c = settings(base_config.get_config(), pre, steps=60, lr=3e-3, rank=16, micro_batch=32)
    c.algorithm, c.data.source, c.data.path, c.data.seq_len = "sft", "jsonl", os.fspath(root / "sft.jsonl"), 144
    run_training(c, os.fspath(root / "m0"))
    export_checkpoint(os.fspath(root / "m0"), os.fspath(pre), os.fspath(root / "base"), merge=True, overwrite=True)

    # 2. GRPO over 2-turn episodes of the Alphabet environment
    c = settings(grpo_config.get_config("model=tiny"), root / "base", steps=40, lr=5e-3, rank=8, micro_batch=48)
    c.plugins = (f"environment:alphabet={ENVS}:Alphabet",)
    g = c.grpo
    g.environment, g.max_turns, g.max_episode_tokens = "alphabet", 2, E
    g.num_generations, g.prompts_per_step, g.max_new_tokens = 8, 6, CAP
    g.temperature, g.beta, g.logprob_batch_size = 1.0, 0.0, 48
    c.data.source, c.data.problems, c.data.max_prompt_len = "problems", os.fspath(root / "train.jsonl"), P
    records = run_training(c, os.fspath(root / "grpo")).records
    print("GRPO reward", [round(r["reward/mean"], 2) for r in records])

    # 3. held-out prompts, episodes sampled by the evaluation: the GRPO adapter against the warm-up model
    results = run_evaluation(EvalConfig(
        problems=os.fspath(root / "heldout.jsonl"), base=os.fspath(root / "base"), out=os.fspath(root / "eval"),
        models=[ModelSpec("grpo", "adapter", os.fspath(root / "grpo"))], num_samples=8, temperature=1.0,
        max_new_tokens=CAP, max_prompt_len=P, environment=f"{ENVS}:Alphabet", max_turns=2, max_episode_tokens=E,
        dtype="float32", batch_size=64, n_resamples=500, progress=False, reward="code"))
    base, grpo = results["models"]["base"], results["models"]["grpo"]
    print("held-out reward", base["partial_reward_mean"], "->", grpo["partial_reward_mean"],
          "solved within 2", base["episodes"]["solved_within"]["2"], "->", grpo["episodes"]["solved_within"]["2"])
    # a policy that does not read the feedback expects at most 0.5; the warm-up model is one
    assert base["partial_reward_mean"] < 0.65
    assert grpo["intervals"]["partial_reward_mean"][0] > 0.5
    rows = {r["metric"]: r for r in results["comparisons"] if r["model"] == "grpo"}
    # the paired gains over the warm-up model on the held-out prompts, reward and success within 2 turns
    assert rows["partial_reward_mean"]["ci_low"] > 0 and rows["strict_rate"]["ci_low"] > 0, rows
    within = {name: [m["episodes"]["solved_within"][t]["rate"] for t in ("1", "2")] for name, m in
              (("base", base), ("grpo", grpo))}
    # success within 2 turns above the warm-up's and above one turn's (the first answer cannot be right: 0)
    assert within["grpo"][1] > within["base"][1] + 0.15 and within["grpo"][0] == within["base"][0] == 0.0, within
