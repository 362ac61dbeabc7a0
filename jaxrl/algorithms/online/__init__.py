"""Online RL (GRPO, PPO): the pieces both algorithms share, in one place.

Modules: `prompts` (rollout r's prompts and the reward), `rollouts` (samples of the current policy on a rollout
backend, as fixed-shape arrays), `passes` (the teacher-forced passes by role: reference, old, mismatch), `buffer`
(rollouts onto train steps; the rollout buffer on disk), `correction` (rollout correction and the sampler-trainer
mismatch), `task` (the Task phases over them, overlap of sampling with training).
"""
