"""DPO train-step throughput: jaxrl's DPO trainer vs TRL's DPOTrainer (PEFT LoRA), same model, pairs, batch, length.

    python -m benchmarks.bench_dpo                          # both reference modes; prints a table and JSON
    python -m benchmarks.bench_dpo --pairs=4 --prompt_len=128 --completion_len=127 --steps=6 --modes=in_step

Both sides load the same small Qwen3.5 checkpoint (`benchmarks.common.SMALL_TEXT_CONFIG`: hidden 256, 4 layers,
vocab 2048), attach LoRA r16 / alpha 32 (dropout 0) to the 12 projections, and train sigmoid DPO (beta 0.1) with
AdamW (constant lr 5e-6, clipping 1.0) in fp32 on the CPU with the same thread count, on the same synthetic pairs
(`jaxrl.data.dpo_data.synthetic_pairs`): every pair has a `prompt_len`-token prompt and two `completion_len` +
1 (eos) token completions, so there is no padding on either side and a step is 2 x pairs x T tokens.

* jaxrl: the real `run_training` path (launchers/train.py): `DPOTask` batches, the jitted step (one forward of
  chosen + rejected, chunked log-probs, accumulation scan, non-finite masking), metrics to the host each step.
* TRL: `trl.DPOTrainer` (1.16) with `peft_config`; the pairs are text over a word-level tokenizer whose ids are
  exactly the pairs' ids (checked after TRL's tokenisation), so both sides see the same tokens.

Two reference modes, each its own ratio: `in_step` (the reference is a second forward with the adapters off in
every step: jaxrl `dpo.precompute_ref_logps=False`, TRL's default with PEFT) and `precomputed` (reference
log-probs computed once before training: jaxrl's default, TRL `precompute_ref_log_probs=True`). Step times are
the median (and the best) of the timed steps after `warmup` steps (compilation for JAX, allocator warm-up for
torch), a step being the time between consecutive step ends on both sides. Each side runs in its own
subprocess, `--rounds` times in alternating order, and per side the round with the fastest median step counts:
on shared cores other processes only ever add time (and torch's spinning OpenMP threads suffer more from it
than XLA's pool, which skews a single contended run towards jaxrl). Tokens per CPU-second (process CPU time,
all threads) are reported too; the per-step times of the counted round are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import SMALL_TEXT_CONFIG, save_small_hf, set_cpu_threads, table

LORA = dict(rank=16, alpha=32.0)
LR = 5e-6
BETA = 0.1
MODES = ("in_step", "precomputed")


class StepClock:
    """Wall and process-CPU time at the end of every step; a step's time is the gap to the previous step's end
    (so both sides are timed alike: batch, step, metrics to the host, logging). CPU seconds (all threads) are
    the number that other processes on shared cores disturb least."""

    def __init__(self):
        self.ticks: list[tuple[float, float]] = []

    def tick(self, *_args, **_kw) -> None:
        self.ticks.append((time.perf_counter(), time.process_time()))

    def summary(self, warmup: int, tokens: int) -> dict:
        wall = [b[0] - a[0] for a, b in zip(self.ticks, self.ticks[1:])]
        cpu = [b[1] - a[1] for a, b in zip(self.ticks, self.ticks[1:])]
        # gap i is step i+2 (1-based); skip the warm-up steps
        wall_t, cpu_t = wall[max(warmup - 1, 0):], cpu[max(warmup - 1, 0):]
        return {"step_s": statistics.median(wall_t), "best_step_s": min(wall_t),
                "cpu_s_per_step": statistics.median(cpu_t), "timed_steps": len(wall_t),
                "tokens_per_step": tokens, "step_times_s": wall, "step_cpu_s": cpu}


def make_pairs(n: int, prompt_len: int, completion_len: int) -> list[dict]:
    from jaxrl.data.dpo_data import synthetic_pairs
    return synthetic_pairs(n, SMALL_TEXT_CONFIG["vocab_size"], seed=0, prompt_len=prompt_len,
                           completion_len=completion_len, eos_id=SMALL_TEXT_CONFIG["eos_token_id"])


# ------------------------------------------------------------------------------------------------- jaxrl


def jax_worker(model_dir: str, pairs_path: str, pairs: int, seq_len: int, steps: int, warmup: int, mode: str,
               workdir: str) -> dict:
    from configs import base
    from jaxrl.algorithms.run import run_training

    c = base.get_config()
    c.algorithm = "dpo"
    c.model_path, c.dtype, c.remat = model_dir, "float32", "none"
    c.steps = warmup + steps
    c.checkpoint_every = c.steps  # one save, after the last (timed) step
    c.checkpoint_async, c.tensorboard = False, False
    c.optimizer.learning_rate, c.optimizer.schedule = LR, "constant"
    c.optimizer.warmup_steps, c.optimizer.weight_decay, c.optimizer.max_grad_norm = 0, 0.0, 1.0
    c.lora.rank, c.lora.alpha, c.lora.targets, c.lora.dropout = LORA["rank"], LORA["alpha"], "all-linear", 0.0
    c.batch.micro_batch_size, c.batch.grad_accum = pairs, 1
    c.mesh.shape = (1, 1, 1)
    c.dpo = dict(loss_type="sigmoid", beta=BETA, precompute_ref_logps=(mode == "precomputed"),
                 ref_batch_size=pairs)
    c.data = dict(source="pairs", pairs=pairs_path, max_length=seq_len, pad_multiple=seq_len, min_prompt_tokens=1)
    clock = StepClock()
    t0 = time.perf_counter()
    result = run_training(c, workdir, on_step_end=clock.tick)
    total_s = time.perf_counter() - t0
    recs = result.records
    return {**clock.summary(warmup, recs[-1]["tokens"]), "first_loss": recs[0]["loss"], "last_loss": recs[-1]["loss"],
            "compile_s": recs[0].get("compile_time_s", 0.0), "total_s": total_s}


# ------------------------------------------------------------------------------------------------- TRL


def word_tokenizer(vocab_size: int):
    """A word-level fast tokenizer: token i <-> the word `t{i}` (0 = <|endoftext|> pad, 1 = <|im_end|> eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def torch_worker(model_dir: str, pairs_path: str, pairs: int, seq_len: int, steps: int, warmup: int, mode: str,
                 workdir: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import Qwen3_5ForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from jaxrl.models.lora import ALL_LINEAR

    with open(pairs_path) as f:
        records = [json.loads(line) for line in f]
    words = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    # TRL appends the eos text itself; completions start with a space so that prompt + completion splits alike
    rows = [{"prompt": words(r["prompt_ids"]), "chosen": " " + words(r["chosen_ids"][:-1]),
             "rejected": " " + words(r["rejected_ids"][:-1])} for r in records]
    tokenizer = word_tokenizer(SMALL_TEXT_CONFIG["vocab_size"])
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=workdir, per_device_train_batch_size=pairs, gradient_accumulation_steps=1,
                     max_steps=warmup + steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, max_grad_norm=1.0, beta=BETA, loss_type=["sigmoid"], max_length=None,
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False,
                     seed=0, dataloader_num_workers=0, precompute_ref_log_probs=(mode == "precomputed"),
                     disable_tqdm=True)
    peft_config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                             target_modules=list(ALL_LINEAR))
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         peft_config=peft_config)
    first = trainer.train_dataset[0]
    want = records[0]
    if (first["prompt_ids"] != want["prompt_ids"] or first["chosen_ids"] != want["chosen_ids"]
            or first["rejected_ids"] != want["rejected_ids"]):
        raise AssertionError("TRL tokenised the pairs differently from the ids jaxrl trains on")

    clock = StepClock()

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.tick()

    trainer.add_callback(Tick())
    t0 = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {**clock.summary(warmup, 2 * pairs * seq_len), "first_loss": losses[0], "last_loss": losses[-1],
            "compile_s": 0.0, "total_s": total_s}


# ------------------------------------------------------------------------------------------------- driver


def _spawn(side: str, env: dict, **kw) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "benchmarks.bench_dpo", f"--worker={side}", f"--json_out={out}",
           *(f"--{k}={v}" for k, v in kw.items())]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=dict(os.environ, **env))
    if proc.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def run(pairs: int = 4, prompt_len: int = 128, completion_len: int = 127, steps: int = 6, warmup: int = 2,
        modes=MODES, rounds: int = 2) -> dict:
    """Both sides, each reference mode, in fresh subprocesses, `rounds` times in alternating order (jaxrl first,
    then TRL first, ...); per side the round with the fastest median step counts (other processes on shared
    cores only ever slow a round down). Ratio = jaxrl tokens/s / TRL tokens/s."""
    threads = set_cpu_threads()
    seq_len = prompt_len + completion_len + 1
    result = {"pairs_per_step": pairs, "seq_len": seq_len, "tokens_per_step": 2 * pairs * seq_len,
              "timed_steps": steps, "warmup_steps": warmup, "rounds": rounds, "threads": threads,
              "loss": "sigmoid", "beta": BETA, "lora": f"r{LORA['rank']}/alpha{int(LORA['alpha'])} all-linear",
              "dtype": "float32", "modes": {}}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = os.path.join(folder, "model")
        save_small_hf(model_dir, seed=0)
        pairs_path = os.path.join(folder, "pairs.jsonl")
        with open(pairs_path, "w") as f:
            for rec in make_pairs(pairs * (warmup + steps), prompt_len, completion_len):
                f.write(json.dumps(rec) + "\n")
        # later rounds reuse the first round's XLA programs (compile time is reported, never timed)
        env = {"JAX_COMPILATION_CACHE_DIR": os.path.join(folder, "jax_cache"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        for mode in modes:
            kw = dict(model_dir=model_dir, pairs_path=pairs_path, pairs=pairs, seq_len=seq_len, steps=steps,
                      warmup=warmup, mode=mode)
            runs = {"jaxrl": [], "trl": []}
            for i in range(rounds):
                order = (("jaxrl", "jax"), ("trl", "torch"))
                for name, side in (order if i % 2 == 0 else order[::-1]):
                    runs[name].append(_spawn(side, env, workdir=os.path.join(folder, f"{name}_{mode}_{i}"), **kw))
            entry = {}
            for name, rs in runs.items():
                r = min(rs, key=lambda x: x["step_s"])
                entry[name] = dict(r, tokens_per_s=r["tokens_per_step"] / r["step_s"],
                                   best_tokens_per_s=r["tokens_per_step"] / r["best_step_s"],
                                   tokens_per_cpu_s=r["tokens_per_step"] / r["cpu_s_per_step"],
                                   rounds_step_s=[x["step_s"] for x in rs])
            for key in ("tokens_per_s", "best_tokens_per_s", "tokens_per_cpu_s"):
                entry[f"ratio_{key}"] = entry["jaxrl"][key] / entry["trl"][key]
            result["modes"][mode] = entry
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--completion_len", type=int, default=127)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=2)
    for hidden in ("worker", "json_out", "model_dir", "pairs_path", "workdir", "mode"):
        parser.add_argument(f"--{hidden}", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seq_len", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        set_cpu_threads()
        fn = jax_worker if args.worker == "jax" else torch_worker
        result = fn(args.model_dir, args.pairs_path, args.pairs, args.seq_len, args.steps, args.warmup, args.mode,
                    args.workdir)
        with open(args.json_out, "w") as f:
            json.dump(result, f)
        return
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"--modes: unknown {bad}; choose from {MODES}")
    result = run(args.pairs, args.prompt_len, args.completion_len, args.steps, args.warmup, modes, args.rounds)
    rows = [dict(mode=mode, side=side, **{k: result["modes"][mode][side][k] for k in
                                          ("tokens_per_s", "best_tokens_per_s", "tokens_per_cpu_s", "step_s",
                                           "rounds_step_s", "cpu_s_per_step", "first_loss", "last_loss",
                                           "compile_s")})
            for mode in result["modes"] for side in ("jaxrl", "trl")]
    for row in rows:
        row["rounds_step_s"] = " ".join(f"{t:.2f}" for t in row["rounds_step_s"])
    print(table(rows, ["mode", "side", "tokens_per_s", "best_tokens_per_s", "tokens_per_cpu_s", "step_s",
                       "rounds_step_s", "cpu_s_per_step", "first_loss", "last_loss", "compile_s"]))
    for mode, entry in result["modes"].items():
        print(f"{mode}: ratio jaxrl / TRL: tokens/s {entry['ratio_tokens_per_s']:.2f} (median step), "
              f"{entry['ratio_best_tokens_per_s']:.2f} (best step); tokens per CPU-second "
              f"{entry['ratio_tokens_per_cpu_s']:.2f}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
