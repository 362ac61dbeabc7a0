"""The training core every algorithm runs on: LoRA state, optimizer, the jitted step, checkpoints, metrics.

    from jaxrl.train.loop import Trainer
    Trainer(config, model, task, workdir, mesh=mesh).run()   # resumes from workdir by itself

Modules: task (the Task contract and its phases), objective (the loss protocol, next-token), optim (AdamW +
schedules), state (TrainState), step (the jitted step), checkpoints (Orbax layout), metrics (jsonl, TensorBoard,
progress), loop (Trainer). Many rows through one jitted forward: jaxrl.parallel.batched_forward. Algorithms, their
tasks and `run_training` (config -> model + task -> Trainer) live in jaxrl.algorithms; nothing here imports them.
"""
