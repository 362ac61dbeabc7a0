"""Every training-config key with its one default: the top level, the training core's blocks and each built-in
algorithm's blocks. configs/base.py and the algorithm configs build from here; `run_training` fills a config's
missing keys from here and refuses an unknown key in any block.

    config = default_config("dpo")             # a ConfigDict of every key a DPO run reads
    resolve(config)                            # in place: missing keys get their defaults; a typo is an error
    DPO.resolve(config.get("dpo"), "dpo")      # one block as a plain dict (what the algorithm reads)

A trainer registered by users (jaxrl.algorithms.tasks) may declare its own blocks
(`factory.config_blocks`); without them its `data` block is taken as it is.
"""

from __future__ import annotations

from typing import Mapping, Optional

import ml_collections

from jaxrl.utils.config import Block, Key, Schema

# ------------------------------------------------------------------------------------------------ the top level

TOP = {
    "algorithm": Key("sft", str, "a registered trainer: sft | dpo | grpo | ppo | 'pkg.module:factory'"),
    "model_path": Key("", str, "HF folder (container or text-only); empty: random init of `model_preset`"),
    "model_preset": Key("tiny", str, "qwen35.PRESETS key used when model_path is empty"),
    "model_overrides": Key({}, dict, "Qwen35Config fields replacing the preset's (random init only)"),
    "model_seed": Key(0, int, "init seed of a preset model"),
    "dtype": Key("bfloat16", str, "base weights and compute; LoRA factors are always fp32"),
    "remat": Key("auto", str, "activation rematerialisation of the training forward: auto (the least "
                 "recomputation whose estimated activations fit half the device memory after the weights) | none | "
                 "matmuls (keep projection outputs) | attention (keep attention / GDN outputs) | full | dots | "
                 "dots_no_batch"),
    "gdn_chunk_size": Key(0, int, "tokens per chunk of the chunked Gated DeltaNet form (training, prefill); 0: "
                          "auto, the key head dim within 16..64 (64 for the 4B and 9B; 16 for a tiny model)"),
    "gdn_state_dtype": Key("float32", str, "storage dtype of the Gated DeltaNet state in decode caches: float32 | "
                           "bfloat16 (half the bytes a decode step moves; fp32 math either way; drift in "
                           "docs/benchmarks.md)"),
    "attention_implementation": Key("auto", str, "full-attention kernel: auto (cudnn on a GPU with bf16/fp16, "
                                    "else xla) | cudnn | xla"),
    "steps": Key(125, int, "train steps (global batches); the schedule's length"),
    "checkpoint_every": Key(4, int, "adapter + training state every N steps (and at the end)"),
    "keep_checkpoints": Key(2, (int, type(None)), "full training states kept (adapters are all kept); None: all"),
    "checkpoint_async": Key(True, bool, "write checkpoints in the background"),
    "seed": Key(0, int, "LoRA init, dropout, data order"),
    "max_consecutive_nonfinite": Key(10, int, "stop (with a checkpoint) after this many skipped updates in a "
                                     "row; 0 never"),
    "log_every": Key(1, int, "console log cadence when not on a terminal (metrics.jsonl gets every step)"),
    "tensorboard": Key(True, bool, "TensorBoard event files beside metrics.jsonl"),
    "logprob_chunk_size": Key(512, int, "rows per chunk of the chunked log-prob over the vocab"),
    "compile_options": Key({}, dict, "XLA options of every jitted program of the run (normally none)"),
    "plugins": Key((), (tuple, list, str, dict), "user objectives loaded and checked before the model is built "
                   "(jaxrl.algorithms.plugins): {'kind', 'name', 'path'} entries or 'kind:name=file.py:fn'"),
}

# Labels the family configs (configs/dpo.py, grpo.py, ppo.py) record in config.json; no code reads them.
LABELS = {
    "run": Key("", str, "the family config's named run (configs/dpo.py run=...)"),
    "start": Key("", str, "which weights model_path points to (base | m0)"),
    "probe": Key("", str, "the family config's named probe (configs/grpo.py probe=...)"),
}

OPTIMIZER = Block("optimizer", {
    "name": Key("adamw", str, "only adamw"),
    "learning_rate": Key(1e-6, float, "peak learning rate"),
    "schedule": Key("linear", str, "linear | constant_with_warmup | cosine | constant"),
    "warmup_steps": Key(0, int, "takes precedence over warmup_ratio when > 0"),
    "warmup_ratio": Key(0.0, float),
    "weight_decay": Key(0.0, float),
    "b1": Key(0.9, float),
    "b2": Key(0.999, float),
    "eps": Key(1e-8, float),
    "max_grad_norm": Key(1.0, float, "global-norm clipping; <= 0 disables"),
})

LORA = Block("lora", {
    "rank": Key(16, int),
    "alpha": Key(32.0, float),
    "targets": Key("all-linear", (str, list, tuple), "'all-linear' | 'q_proj,v_proj,...' | a regex over module "
                   "paths"),
    "use_rslora": Key(False, bool),
    "dropout": Key(0.0, float),
    "allow_vllm_unpackable": Key(False, bool, "allow targets vLLM 0.33 cannot serve (in_proj_z without "
                                 "in_proj_qkv); refused by default (docs/vllm.md)"),
})

BATCH = Block("batch", {
    "micro_batch_size": Key(1, int, "rows per forward/backward (a step: micro_batch_size x grad_accum rows)"),
    "grad_accum": Key(8, int, "micro-batches summed into one update"),
})

MESH = Block("mesh", {
    "shape": Key((1, -1, 1), tuple, "(data, fsdp, tensor); -1 takes the remaining devices"),
})

CORE_BLOCKS = {"optimizer": OPTIMIZER, "lora": LORA, "batch": BATCH, "mesh": MESH}

# ------------------------------------------------------------------------------------------------ algorithms

SFT_DATA = Block("data", {
    "source": Key("synthetic", str, "synthetic (arithmetic progressions) | jsonl"),
    "path": Key("", str, "jsonl: one {'input_ids': [...], 'loss_mask': [...]} per line"),
    "seq_len": Key(2048, int, "rows are cut / right-padded to it"),
})

DPO = Block("dpo", {
    "loss_type": Key("sigmoid", (str, list, tuple), "a registered loss, or several comma-separated "
                     "('sigmoid,sft' = RPO)"),
    "loss_weights": Key((), tuple, "one weight per loss_type; () = all 1"),
    "beta": Key(0.1, float),
    "label_smoothing": Key(0.0, float, "robust, exo_pair, aot, aot_unpaired, simpo"),
    "simpo_gamma": Key(0.5, float, "SimPO target margin"),
    "discopop_tau": Key(0.05, float),
    "f_divergence": Key("reverse_kl", str, "reverse_kl | forward_kl | js_divergence | alpha_divergence"),
    "f_alpha": Key(0.5, float),
    "plugin": Key("", str, "'my_losses.py:fn[,other.py:fn2]': loaded like `plugins` entries of kind dpo_loss "
                  "(registered by function name) before training"),
    "precompute_ref_logps": Key(True, bool, "False: a second forward with the adapters off in every step"),
    "ref_batch_size": Key(0, int, "rows per reference / evaluation pass; 0 = batch.micro_batch_size"),
})

DPO_DATA = Block("data", {
    "source": Key("pairs", str, "pairs | synthetic"),
    "pairs": Key("", str, "pairs.jsonl, a frozen cohort folder, or a build folder holding cohort/"),
    "problems": Key("", str, "problems.jsonl supplying `messages` of pairs that have none"),
    "tokenizer": Key("", str, "HF tokenizer folder; '' = model_path"),
    "max_length": Key(2048, int, "prompt + completion tokens of one sequence"),
    "max_prompt_length": Key(0, int, "0 = bounded by max_length only"),
    "overlong": Key("truncate_prompt", str, "truncate_prompt (cut the prompt from the left) | drop"),
    "min_prompt_tokens": Key(64, int, "truncate_prompt keeps at least this many prompt tokens, else the pair is "
                             "dropped"),
    "enable_thinking": Key(False, bool, "the chat template's generation prompt (as the pairs were sampled)"),
    "pad_multiple": Key(64, int, "sequence-length bucket"),
    "eval_fraction": Key(0.0, float, "held-out share of the pairs (seeded by pair id), scored at every "
                         "checkpoint"),
    "eval_pairs": Key("", str, "or a separate held-out pairs file"),
    "expected_pairs": Key(0, int, "> 0: refuse a pair set of any other size (e.g. 1000 for the frozen cohort)"),
    "synthetic_pairs": Key(256, int, "source = synthetic: arithmetic-progression pairs (dpo_data.synthetic_pairs)"),
    "synthetic_prompt_len": Key(6, int),
    "synthetic_completion_len": Key(4, int),
    "synthetic_num_tokens": Key(0, int, "tokens [2, 2 + n) (0 = the whole vocabulary)"),
})

ONLINE_DATA = Block("data", {
    "source": Key("problems", str, "problems (problems.jsonl + tokenizer + chat template) | token_task "
                  "(synthetic ids)"),
    "problems": Key("", str, "problems.jsonl (jaxrl.data.problems schema)"),
    "tokenizer": Key("", str, "HF tokenizer folder; '' = model_path"),
    "enable_thinking": Key(False, bool, "the chat template's generation prompt"),
    "max_prompt_len": Key(2048, int, "P: prompts are left-padded to it; longer prompts follow on_overlong"),
    "on_overlong": Key("skip", str, "skip (logged and counted) | error; prompts are never cut"),
    "prompt_len": Key(6, int, "source = token_task (the CPU learning task, jaxrl.rewards.toy.TokenTask)"),
    "num_classes": Key(2, int),
    "score_tokens": Key(0, int, "completion tokens scored; 0 = all max_new_tokens"),
})

REWARD = Block("reward", {
    "name": Key("code", str, "jaxrl.rewards.get_reward name or 'module:function'"),
    "score": Key("partial", str, "the RewardResult field that is the scalar reward: partial | strict"),
}, extra=True, doc="every other key is a keyword argument of the reward's constructor")

GRPO = Block("grpo", {
    "num_generations": Key(8, int, "K samples per prompt (a group)"),
    "prompts_per_step": Key(20, int, "prompts per rollout (= per optimizer step when N = B_global)"),
    "max_new_tokens": Key(4096, int, "C: the completion cap"),
    "temperature": Key(1.0, float),
    "top_p": Key(1.0, float),
    "top_k": Key(0, int),
    "num_iterations": Key(1, int, "passes over each rollout (TRL num_iterations, 'mu')"),
    "scale_rewards": Key("group", str, "group | batch | none (Dr. GRPO)"),
    "advantage_estimator": Key("grpo", str, "grpo (honours scale_rewards) | rloo | dr_grpo | grpo_batch_std | a "
                               "plug-in"),
    "epsilon_low": Key(0.2, float),
    "epsilon_high": Key(0.2, float, "DAPO clip-higher: 0.28"),
    "delta": Key(0.0, float, "> 0: two-sided clipping, the ratio is also capped at delta (INTELLECT-2; e.g. 4.0)"),
    "importance_sampling_level": Key("token", str, "token | sequence (GSPO)"),
    "beta": Key(0.04, float, "KL coefficient; 0 skips the reference pass"),
    "kl_estimator": Key("k3", str, "k1 | k2 | k3 | low_var_kl | abs | k3+ | a plug-in"),
    "aggregation": Key("sequence_mean", str, "sequence_mean (grpo) | token_mean (dapo) | dr_grpo"),
    "mask_truncated": Key(False, bool, "truncated completions give no gradient (still counted as sequences)"),
    "drop_zero_variance_groups": Key(False, bool, "groups whose rewards are all equal leave the loss and its "
                                     "normalisers"),
    "overlong_buffer": Key(0, int, "> 0: DAPO soft overlong penalty over the last `overlong_buffer` tokens of "
                           "the cap"),
    "overlong_penalty": Key(1.0, float, "its maximum"),
    "recompute_old_logprobs": Key(False, bool, "teacher-forced old log-probs instead of the sampler's "
                                  "(forced when the compute dtype is not float32 or temperature != 1)"),
    "entropy_coef": Key(0.0, float),
    "log_entropy": Key(True, bool, "the `entropy` metric (one more reduction over the vocab per chunk)"),
    "rollout_batch_size": Key(0, int, "sampler rows per compiled call; 0 = the whole rollout"),
    "logprob_batch_size": Key(8, int, "rows per reference / old-log-prob pass"),
})

PPO = Block("ppo", {
    "prompts_per_rollout": Key(32, int),
    "num_generations": Key(1, int, "samples per prompt"),
    "max_new_tokens": Key(1024, int),
    "temperature": Key(1.0, float),
    "top_p": Key(1.0, float),
    "top_k": Key(0, int),
    "init_kl_coef": Key(0.05, float),
    "adaptive_kl": Key(False, bool, "TRL: fixed; True: Ziegler et al. (verl / OpenRLHF)"),
    "kl_target": Key(0.1, float, "KL the adaptive controller steers to: the mean over sequences of their "
                     "token-mean KL (verl, OpenRLHF)"),
    "kl_horizon": Key(10000.0, float),
    "kl_estimator": Key("k1", str, "k1 | k3 (or any registered kl)"),
    "gamma": Key(1.0, float),
    "lam": Key(0.95, float),
    "whiten_rewards": Key(False, bool),
    "whiten_advantages": Key(True, bool),
    "cliprange": Key(0.2, float),
    "cliprange_value": Key(0.2, float, "0 = unclipped value loss"),
    "vf_coef": Key(0.1, float),
    "epochs": Key(4, int, "passes over each rollout"),
    "minibatches": Key(1, int, "global batches per pass: prompts_per_rollout x num_generations = minibatches x "
                       "B_global"),
    "value_head_detach": Key(False, bool, "True: the value loss trains only the head (no gradient into the LoRA "
                             "factors)"),
    "value_learning_rate": Key(0.0, float, "the value head's (peak) learning rate; 0 = optimizer.learning_rate"),
    "entropy_coef": Key(0.0, float),
    "log_entropy": Key(True, bool),
    "rollout_batch_size": Key(0, int, "sampler rows per compiled call; 0 = the whole rollout"),
    "logprob_batch_size": Key(8, int, "rows per teacher-forced pass"),
})

ALGORITHMS = {
    "sft": {"data": SFT_DATA},
    "dpo": {"dpo": DPO, "data": DPO_DATA},
    "grpo": {"grpo": GRPO, "data": ONLINE_DATA, "reward": REWARD},
    "ppo": {"ppo": PPO, "data": ONLINE_DATA, "reward": REWARD},
}
ALGORITHM_LABELS = {"dpo": ("run", "start"), "grpo": ("run", "start", "probe"), "ppo": ("run", "start")}
OPEN_DATA = Block("data", {}, extra=True, doc="the data block of an algorithm that declares no blocks")

CORE = Schema(TOP, CORE_BLOCKS)  # what the training core reads (jaxrl.train)


def schema_for(algorithm: str, blocks: Optional[Mapping[str, Block]] = None) -> Schema:
    """The whole schema of a run of `algorithm`: the top level, the core blocks and the algorithm's blocks
    (`blocks`, else the built-in algorithm's, else an open `data` block)."""
    own = dict(blocks) if blocks is not None else ALGORITHMS.get(algorithm, {"data": OPEN_DATA})
    labels = {k: LABELS[k] for k in ALGORITHM_LABELS.get(algorithm, ())}
    return Schema({**TOP, **labels}, {**CORE_BLOCKS, **own})


def default_config(algorithm: str = "sft") -> ml_collections.ConfigDict:
    """Every key a run of the built-in `algorithm` reads, at its default."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"default_config: algorithm={algorithm!r}; built-in algorithms: {sorted(ALGORITHMS)}")
    config = schema_for(algorithm).config_dict()
    config.algorithm = algorithm
    return config


def resolve(config, blocks: Optional[Mapping[str, Block]] = None, *, strict: bool = True):
    """Fill `config` (a ConfigDict) in place from the schema of its algorithm and check every key; returns it."""
    algorithm = config.get("algorithm", None) or TOP["algorithm"].default
    TOP["algorithm"].check("algorithm", algorithm)
    return schema_for(algorithm, blocks).resolve(config, strict=strict)


__all__ = ["ALGORITHMS", "ALGORITHM_LABELS", "BATCH", "CORE", "CORE_BLOCKS", "DPO", "DPO_DATA", "GRPO", "LORA", "MESH",
           "ONLINE_DATA", "OPEN_DATA", "OPTIMIZER", "PPO", "REWARD", "SFT_DATA", "TOP", "LABELS", "default_config",
           "resolve", "schema_for"]
