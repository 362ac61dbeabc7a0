r"""Base training config: every key the trainer and all algorithms (sft, dpo, grpo, ppo) honour.

Algorithm configs start from this one (`config = base.get_config()`, then set `algorithm` and their own block).
Run (any config file, any key overridable on the command line):

    python -m launchers.train --config=configs/base.py --workdir=runs/base \
        --config.model_path=/models/Qwen3.5-4B --config.algorithm=sft --config.data.path=tokens.jsonl \
        --config.data.source=jsonl

Defaults follow the users' earlier stack (seed/000 report): LoRA r16/alpha32 on all linear projections,
checkpoints every 4 optimizer steps, AdamW with a linear decay, micro-batch 1 x grad_accum 8.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.algorithm = "sft"  # a registered trainer: sft | dpo | grpo | ppo | "pkg.module:factory"
    c.model_path = ""  # HF folder (container or text-only); empty: random init of `model_preset`
    c.model_preset = "tiny"  # qwen35.PRESETS key used when model_path is empty
    c.model_overrides = ml_collections.ConfigDict()  # Qwen35Config fields replacing the preset's (random init only)
    c.model_seed = 0  # init seed of a preset model
    c.dtype = "bfloat16"  # base weights and compute; LoRA factors are always fp32
    # activation rematerialisation (jaxrl/models/qwen35/model.py): auto (the least recomputation whose estimated
    # activations fit half the device memory after the weights) | none | matmuls | attention | full | dots |
    # dots_no_batch
    c.remat = "auto"
    c.gdn_chunk_size = 64  # tokens per chunk of the chunked Gated DeltaNet kernel
    c.gdn_state_dtype = "float32"  # Gated DeltaNet decode-state storage: float32 | bfloat16 (fp32 math either way)
    c.steps = 125  # train steps (global batches); the schedule's length
    c.checkpoint_every = 4  # adapter + training state every N steps (and at the end)
    c.keep_checkpoints = 2  # full training states kept (adapters are all kept); None keeps all
    c.checkpoint_async = True  # write checkpoints in the background
    c.seed = 0  # LoRA init, dropout, data order
    c.max_consecutive_nonfinite = 10  # stop (with a checkpoint) after this many skipped updates in a row; 0 never
    c.log_every = 1  # console log cadence when not on a terminal (metrics.jsonl gets every step)
    c.tensorboard = True
    c.logprob_chunk_size = 512  # rows per chunk of the chunked log-prob over the vocab
    c.compile_options = ml_collections.ConfigDict()  # XLA options for the train step's compile (normally none)
    # user objectives loaded and checked before the model is built (jaxrl/train/plugins.py): entries
    # {"kind": dpo_loss|advantage|kl|reward, "name": ..., "path": "file.py:fn"} or "kind:name=file.py:fn"
    c.plugins = ()

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"
    c.optimizer.learning_rate = 1e-6
    c.optimizer.schedule = "linear"  # linear | constant_with_warmup | cosine | constant
    c.optimizer.warmup_steps = 0  # takes precedence over warmup_ratio when > 0
    c.optimizer.warmup_ratio = 0.0
    c.optimizer.weight_decay = 0.0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.999
    c.optimizer.eps = 1e-8
    c.optimizer.max_grad_norm = 1.0  # global-norm clipping; <= 0 disables

    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16
    c.lora.alpha = 32.0
    c.lora.targets = "all-linear"  # "all-linear" | "q_proj,v_proj,..." | a regex over module paths
    c.lora.use_rslora = False
    c.lora.dropout = 0.0

    c.batch = ml_collections.ConfigDict()
    c.batch.micro_batch_size = 1  # rows per forward/backward (per optimizer step: micro_batch_size x grad_accum)
    c.batch.grad_accum = 8  # micro-batches summed into one update

    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (1, -1, 1)  # (data, fsdp, tensor); -1 takes the remaining devices

    c.data = ml_collections.ConfigDict()  # read by the algorithm's task
    c.data.source = "synthetic"
    c.data.path = ""
    c.data.seq_len = 2048
    return c
