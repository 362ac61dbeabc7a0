"""Online RL (GRPO, PPO, distillation): the pieces they share, in one place.

Modules: `settings` (the parts of their config blocks: data, sampling, policy loss, rollout correction, the
asynchronous policy), `prompts` (rollout r's prompts and the reward), `rollouts` (samples of the current policy on a
rollout backend, through the episode loop, as fixed-shape arrays), `passes` (the teacher-forced passes by role:
reference, old, mismatch), `buffer` (rollouts onto train steps; the rollout buffer on disk), `correction` (rollout
correction and the sampler-trainer mismatch), `controller` (where a rollout comes from, and the asynchronous
policy: sampling ahead, partial rollouts, the staleness bound, the proximal pass), `task` (the Task phases over
them).
"""
