"""jaxrl: post-training Qwen3.5 with LoRA in JAX and Flax -- DPO, GRPO, PPO, a sandboxed code verifier, rollouts,
evaluation with intervals, diagnostics and sweeps.

Packages, bottom to top (`LAYERS`). A package imports only packages below it, at module top or inside a function
(tests/test_layers.py checks every import of every module); `jaxrl.demo` (and its settings, `jaxrl.demo_settings`),
`launchers/` and `configs/` sit above them all.
"""

LAYERS = ("utils", "ops", "parallel", "models", "data", "rewards", "export", "generation", "serve", "backends",
          "rollout", "environments", "train", "algorithms", "evaluation", "diagnostics", "sweep")
