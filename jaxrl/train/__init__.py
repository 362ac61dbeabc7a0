"""The training core every algorithm runs on: LoRA state, optimizer, the jitted step, checkpoints, metrics.

    from jaxrl.train.loop import Trainer
    Trainer(config, model, task, workdir, mesh=mesh).run()   # resumes from workdir by itself

Modules: objective (the loss protocol, next-token), optim (AdamW + schedules), state (TrainState), step (the
jitted step), checkpoints (Orbax layout), metrics (jsonl, TensorBoard, progress), inference (batched
teacher-forced passes), loop (Trainer). Algorithms, their tasks and `run_training` (config -> model + task ->
Trainer) live in jaxrl.algorithms; nothing here imports them.
"""
