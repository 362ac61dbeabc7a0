"""The one training loop every algorithm runs on.

    task = get_task_factory(config.algorithm)(config, model, mesh)   # an algorithm's Task (jaxrl.algorithms)
    Trainer(config, model, task, workdir, mesh=mesh).run()            # resumes from workdir by itself

or all of it from a config: `jaxrl.algorithms.run.run_training(config, workdir)` (what `launchers/train.py`
calls). `config` is a resolved `jaxrl.algorithms.config.TrainConfig` (what the loop reads of it: `TrainerConfig`); the
Task contract and the order in which its phases are called: jaxrl.train.task.

Each step: (rollout when due) -> batch -> split into [grad_accum, micro_batch_size, ...] -> sharded over data x
fsdp -> one jitted step (accumulation, update, non-finite masking) -> metrics line. Every `checkpoint_every` steps
(and at the end) the task's checkpoint phase runs (e.g. DPO's held-out evaluation; its record is written to
metrics.jsonl) and then an adapter artifact and the full state are saved: in that order, so a state on disk always
has its checkpoint record beside it (a kill before the state commits resumes from an earlier step and redoes
both). A checkpoint that cannot be written (a read-only folder) stops the run in one line naming the folder and
the cause, at its save or at the step after (jaxrl.train.checkpoints), and before the first step when the folder
refuses a probe file; the checkpoints written before stay as they were. `max_consecutive_nonfinite` skipped
updates in a row (0 = never stop) save a checkpoint and raise
NonFiniteError.

One writer per workdir: process 0 holds the workdir's lock (`.jaxrl.lock`, jaxrl.utils.io.writer_lock) from the
Trainer's creation to the end of `run()`; a second run on the same workdir is refused (OutputInUseError naming the
first one's pid) before it touches a checkpoint.

Settings per step range: `config.json` holds the settings of the steps trained last. A run resumed with other
settings first records the previous ones, with the steps they trained, in `config_history.jsonl` (one line per
range: {"first_step", "last_step", "config"}); a finished run resumed with other settings trains nothing and
keeps config.json as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from jaxrl.data.formats import CONFIG_FILE
from jaxrl.models.lora import lora_targets_report
from jaxrl.models.qwen35.model import Qwen35
from jaxrl.parallel import sharding as shd
from jaxrl.parallel.distributed import barrier, is_main_process
from jaxrl.parallel.mesh import mesh_from_config
from jaxrl.utils.io import ResumeError
from jaxrl.train import checkpoints as ckpt_lib
from jaxrl.train.metrics import CONFIG_HISTORY, MetricsWriter, Progress, atomic_write_text
from jaxrl.train.wandb_log import open_mirror
from jaxrl.train.optim import make_optimizer, reset_adam_moments
from jaxrl.train.state import ParamCodec, TrainState, adapter_params, create_train_state, init_train_state
from jaxrl.train.step import jit_train_step, make_train_step, put_batch, split_batch
from jaxrl.train.task import Task, TaskContext
from jaxrl.utils import interrupt
from jaxrl.utils.io import check_not_locked, folder_lock_file, iter_json_lines, writer_lock
from jaxrl.train.settings import TrainerConfig


_LOCK_HINT = "wait for it to finish (it resumes from its own checkpoints), or use another --workdir"


def workdir_lock(workdir: str):
    """The lock of a run's workdir (one writer; module docstring): held by process 0 only, so a run of several
    processes on one shared workdir still works."""
    if not is_main_process():
        return contextlib.nullcontext()
    return writer_lock(folder_lock_file(workdir), workdir, hint=_LOCK_HINT)


def check_workdir_free(workdir: str) -> None:
    """OutputInUseError now when another process trains in `workdir` (writes nothing): a launcher refuses before
    loading a model; the Trainer takes the lock itself. Process 0 only, as it alone takes the lock (another process
    of the same run may look after process 0 took it)."""
    if is_main_process():
        check_not_locked(folder_lock_file(workdir), workdir, hint=_LOCK_HINT)


class NonFiniteError(RuntimeError):
    """Too many non-finite updates in a row; a checkpoint was saved before this was raised."""


@dataclasses.dataclass
class RunResult:
    final_step: int
    state: TrainState
    records: list  # the metrics records written by this process in this run


def _nonfinite_reason(m: dict, groups: list[str]) -> str:
    parts = []
    loss = m["loss"]
    if not math.isfinite(loss):
        parts.append(f"loss is {loss}")
    if groups:
        parts.append("non-finite gradients in " + ", ".join(groups))
    return "; ".join(parts) or "non-finite update"


# Keys that change the shape of the training state: resuming across a change cannot work. `ema.decay` counts only
# as on (a number) or off (None): the EMA's value may change between resumes, its presence may not.
STATE_KEYS = ("lora.rank", "lora.targets", "algorithm", "model_path", "model_preset", "model_overrides",
              "optimizer.name", "optimizer.max_grad_norm", "ema.decay")
_PRESENCE_KEYS = ("ema.decay",)


def check_same_run(config: TrainerConfig, workdir: str, step: Optional[int] = None) -> None:
    """ResumeError when `workdir` holds a run (a training state; `step`: its newest, found on disk when None) whose
    config.json differs from `config` in a key that shapes the training state (STATE_KEYS). Reads only."""
    path = os.path.join(workdir, CONFIG_FILE)
    if step is None:
        state_dir = os.path.join(workdir, ckpt_lib.CHECKPOINTS, ckpt_lib.STATE)
        steps = [int(n) for n in os.listdir(state_dir) if n.isdigit()] if os.path.isdir(state_dir) else []
        step = max(steps) if steps else None
    if step is None or not os.path.exists(path):
        return
    with open(path) as f:
        old = json.load(f)
    new = config.to_json()

    def get(d, dotted):
        for part in dotted.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d

    def differs(key):
        if key in _PRESENCE_KEYS:
            return (get(old, key) is None) != (get(new, key) is None)
        return get(old, key) != get(new, key)

    changed = [k for k in STATE_KEYS if differs(k)]
    if changed:
        detail = ", ".join(f"{k}: {get(old, k)!r} -> {get(new, k)!r}" for k in changed)
        raise ResumeError(f"{workdir} holds a run (checkpoint of step {step}) whose config differs in keys "
                         f"that shape the training state ({detail}); resume with the same values or use a "
                         f"new --workdir")


class Trainer:
    """Holds the model split (graphdef, trainable, frozen base), mesh, optimizer and the jitted step.

    fault_fn (tests): `fault_fn(step) -> None | (loss_add, grad_add)` compiles the fault-injection variant
    of the step and adds those values (e.g. nan, inf) at the chosen 0-based steps; `fault_group` restricts the
    gradient fault to one parameter group. on_step_end(steps_done, trainer): called after each step's metrics
    and checkpoint (the launcher's test-only kill switch).
    """

    def __init__(self, config: TrainerConfig, model: nnx.Module, task, workdir: str, *, mesh=None,
                 fault_fn: Optional[Callable] = None, fault_group: Optional[str] = None,
                 on_step_end: Optional[Callable] = None):
        self.config, self.task, self.workdir = config, task, workdir
        self.mesh = mesh if mesh is not None else mesh_from_config(config.mesh)
        self.fault_fn, self.on_step_end = fault_fn, on_step_end
        self.steps = config.steps
        self.micro_batch_size = config.batch.micro_batch_size
        self.grad_accum = config.batch.grad_accum
        self.checkpoint_every = config.checkpoint_every
        self.max_nonfinite = config.max_consecutive_nonfinite
        self.compile_options = dict(config.compile_options)

        if not isinstance(task, Task):
            raise TypeError(f"the algorithm's factory returned a {type(task).__name__}, not a jaxrl.train.task.Task "
                            "subclass (the phases the Trainer calls)")
        trainable = task.trainable
        self.graphdef, trainable_state, frozen = nnx.split(model, trainable, ...)
        self.codec = ParamCodec(trainable_state)
        if not self.codec.names:
            raise ValueError("nothing to train: the model has no variable matching the task's `trainable` filter "
                             "(apply LoRA first: config.lora)")
        self.frozen = jax.device_put(frozen, shd.nnx_state_shardings(frozen, self.mesh))
        self.optimizer, self.schedule = make_optimizer(config.optimizer, self.steps)
        init_params = {k: v.astype(jnp.float32) for k, v in self.codec.to_flat(trainable_state).items()}
        self.ema_decay = config.ema.decay  # None: no EMA
        ema = self.ema_decay is not None
        abstract = jax.eval_shape(lambda p: init_train_state(p, self.optimizer, 0, ema), init_params)
        self.state_shardings = shd.train_state_shardings(abstract, self.mesh)
        self.state: TrainState = create_train_state(init_params, self.optimizer, config.seed,
                                                    shardings=self.state_shardings, ema=ema)
        self.step_fn = make_train_step(task.objective, self.optimizer, self.schedule, self.graphdef, self.codec,
                                       fault_injection=fault_fn is not None, fault_group=fault_group,
                                       ema_decay=self.ema_decay)
        self._compiled = {}
        try:
            self.lora_report = lora_targets_report(model)
        except ValueError:
            self.lora_report = None
        # what checkpoints record of the model (a Qwen3.5; another module, as a test's, records nothing)
        self.model_config = model.config.to_dict() if isinstance(model, Qwen35) else None
        self.main = is_main_process()
        self._exit = contextlib.ExitStack()  # the workdir's lock, released at the end of run()
        self._exit.enter_context(workdir_lock(workdir))  # before Orbax opens (and cleans) the checkpoint folders
        self.ckpt = ckpt_lib.RunCheckpoints(workdir, keep=config.keep_checkpoints, async_save=config.checkpoint_async,
                                            ema=ema)

    # ------------------------------------------------------------------------------------------------------------
    def current_model(self) -> nnx.Module:
        """The policy as it is now (adapters with the current parameters); for rollouts and evaluation."""
        return nnx.merge(self.graphdef, self.codec.to_state(self.state.params), self.frozen)

    def _abstract_state(self):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state,
                            self.state_shardings)

    def _step_callable(self, batch: dict):
        """(compiled step for this batch layout, seconds spent compiling it now: 0 when cached)."""
        key = tuple((k, v.shape, str(v.dtype)) for k, v in sorted(batch.items()))
        compile_s = 0.0
        if key not in self._compiled:
            t0 = time.perf_counter()
            jitted = jit_train_step(self.step_fn, self.mesh, self.state, self.frozen, batch,
                                    fault_injection=self.fault_fn is not None)
            args = (self.state, self.frozen, batch)
            if self.fault_fn is not None:
                args = args + (self._fault(None),)
            self._compiled[key] = jitted.lower(*args).compile(compiler_options=self.compile_options or None)
            compile_s = time.perf_counter() - t0
            logging.info("compiled the train step for batch %s in %.1f s", {k: v.shape for k, v in batch.items()},
                         compile_s)
            if jax.process_count() > 1:
                # The first run of a program sets up its CPU (gloo) communicator with a fixed 30 s deadline, and
                # one process may compile much slower than another (a compilation-cache miss, a loaded host).
                barrier(f"train step {len(self._compiled)} compiled")
        return self._compiled[key], compile_s

    def _fault(self, value) -> dict:
        loss_add, grad_add = (0.0, 0.0) if value is None else value
        rep = shd.replicated(self.mesh)
        return {"loss": jax.device_put(jnp.float32(loss_add), rep), "grad": jax.device_put(jnp.float32(grad_add), rep)}

    def _adapter_meta(self, step: int) -> dict:
        cfg = self.config
        return {"step": step, "lora": self.lora_report, "model": self.model_config,
                "model_path": cfg.model_path, "algorithm": cfg.algorithm}

    def save(self, step: int) -> None:
        """Checkpoint after `step` train steps (asynchronous when checkpoint_async)."""
        data_state = self.task.state_dict()
        if data_state is None:  # the step count is the task's position
            data_state = {"position": step}
        meta = {"step": step, "data_state": data_state, "config": self.config.to_json()}
        self.ckpt.save(step, self.state, meta, *self._adapters(step))

    def _adapters(self, step: int) -> tuple:
        """(adapter params, meta, EMA params, EMA meta) of the state held now, as saved at `step`."""
        ema_meta = None
        if self.state.ema:  # its own adapter: the adapter's meta plus what it averages
            ema_meta = {**self._adapter_meta(step), "ema": {"decay": self.ema_decay, "step": step,
                                                            "over": "lora_factors"}}
        return adapter_params(self.state.params), self._adapter_meta(step), self.state.ema, ema_meta

    def _save_adapters(self, step: int) -> None:
        self.ckpt.save_adapters(step, *self._adapters(step))

    def restore_latest(self) -> int:
        """Restore the newest intact training state in the workdir; returns the steps it had done (0: none). A
        damaged newer state is moved to checkpoints/corrupt/ (ckpt_lib.RunCheckpoints.restore_newest), with a
        warning naming its file."""
        if self.ckpt.latest_step() is None:
            return 0
        latest, state, meta, set_aside = self.ckpt.restore_newest(self._abstract_state())
        for err, moved in set_aside:
            logging.warning("%s: corrupted checkpoint (%s); moved it to %s and resumed from the newest intact step, %d",
                            err.path, err.reason, moved, latest)
        self.state = state
        self.task.load_state_dict(meta.get("data_state", {}))
        stale = self.ckpt.drop_adapters_after(latest)
        logging.info("resumed from %s/%d (step %d)%s", self.ckpt.state_dir, latest, latest,
                     f"; removed adapter folders of unfinished steps {stale}" if stale else "")
        emas = self.ckpt.emas.all_steps() if self.ckpt.emas is not None and self.state.ema else [latest]
        if latest not in self.ckpt.adapter_steps() or latest not in emas:
            # the process died after this state's save and before its adapter's (the state is saved first): the
            # adapter an evaluation or an export reads is written now, from the state it would have been saved from
            logging.warning("the adapter of step %d was never written (the run stopped between the two saves); "
                            "writing it from the restored state", latest)
            self._save_adapters(latest)
            self.ckpt.wait()
        return latest

    def _write_config(self, start: int) -> None:
        """config.json of the settings this run trains with; the previous settings, when they differ and trained
        steps 1..`start`, go to config_history.jsonl first (module docstring)."""
        if not self.main:
            return
        path = os.path.join(self.workdir, CONFIG_FILE)
        new = self.config.to_json()
        try:
            with open(path) as f:
                old = self.config.restate(json.load(f))  # as this version writes the same settings
        except (OSError, json.JSONDecodeError):
            old = None
        if old == new:
            return
        if old is not None:
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if start >= self.steps:
                logging.warning("%s: the config differs from the run's in %s, but the run has done its %d steps: "
                                "nothing is trained, config.json is kept", path, changed, start)
                return
            if start > 0:
                kept = self._record_settings_history(old, start)
                logging.warning("%s: the config differs from the previous run's in %s; the settings of steps %s are "
                                "kept in %s", path, changed, kept, CONFIG_HISTORY)
        atomic_write_text(path, json.dumps(new, indent=2, sort_keys=True) + "\n")

    def _record_settings_history(self, old: dict, start: int) -> str:
        """Appends the settings `old` of the steps up to `start` to config_history.jsonl (ranges after `start`,
        left by runs whose steps are redone now, are cut); returns the range recorded ("a-b")."""
        path = os.path.join(self.workdir, CONFIG_HISTORY)
        ranges = []
        if os.path.exists(path):
            for line in iter_json_lines(path):
                rec = line.value
                if line.error is None and isinstance(rec, dict) and rec.get("first_step", start + 1) <= start:
                    ranges.append({**rec, "last_step": min(int(rec["last_step"]), start)})
        first = max((r["last_step"] for r in ranges), default=0) + 1
        if first <= start:
            ranges.append({"first_step": first, "last_step": start, "config": old})
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in ranges))
        return f"{first}-{start}"

    # ------------------------------------------------------------------------------------------------------------
    def context(self) -> TaskContext:
        """What the task may use of this run (jaxrl.train.task)."""
        return TaskContext(workdir=self.workdir, mesh=self.mesh, current_policy=self.current_model,
                           checkpoint_steps=self.ckpt.state_steps, keep_checkpoints=self.config.keep_checkpoints)

    def run(self) -> RunResult:
        # the workdir's lock, taken in __init__ (and again here for a second run() of this Trainer), is released
        # when the run ends however it ends
        with workdir_lock(self.workdir), self._exit:
            return self._run()

    def _run(self) -> RunResult:
        os.makedirs(self.workdir, exist_ok=True)
        start = self.restore_latest()
        if start < self.steps:  # a folder that cannot take a checkpoint: refused before anything else is written
            self.ckpt.check_writable()
        self._write_config(start)
        writer = MetricsWriter(self.workdir, tensorboard=self.config.tensorboard, enabled=self.main,
                               mirror=open_mirror(self.config, self.workdir, enabled=self.main))
        writer.truncate_after(start)
        progress = Progress(self.steps, initial=start, log_every=self.config.log_every, enabled=self.main)
        records = []
        try:
            if start < self.steps:
                self.task.setup(self.context())
            for step in range(start, self.steps):
                interrupt.check(lambda: self._stop_message(start, saved=False))  # a signal before any step ran
                t0 = time.perf_counter()
                if self.task.needs_rollout(step):
                    try:
                        self.task.rollout(step, self.current_model())
                    except interrupt.Interrupted as e:  # a signal while waiting for rollout servers (a hung one)
                        self._stop_in_rollout(step, start, e)
                out = self.task.batch(step)
                batch, host_metrics = out if isinstance(out, tuple) else (out, {})
                batch = {k: np.asarray(v) for k, v in batch.items()}
                expected = self.micro_batch_size * self.grad_accum
                for k, v in batch.items():
                    if v.shape[:1] != (expected,):
                        raise ValueError(f"task batch[{k!r}] has shape {v.shape}; the global batch is "
                                         f"batch.micro_batch_size x batch.grad_accum = {expected} rows")
                if self.task.resets_optimizer(step):
                    self.state = reset_adam_moments(self.state)
                    host_metrics = {**host_metrics, "optimizer/reset": 1.0}
                    logging.info("step %d: the optimizer's moments start over", step + 1)
                num_tokens = self.task.num_tokens(batch)
                split = put_batch(split_batch(batch, self.grad_accum), self.mesh)
                fn, compile_s = self._step_callable(split)
                args = (self.state, self.frozen, split)
                if self.fault_fn is not None:
                    args = args + (self._fault(self.fault_fn(step)),)
                self.state, metrics = fn(*args)
                m = {k: v.item() for k, v in jax.device_get(metrics).items()}
                dt = time.perf_counter() - t0 - compile_s  # step time without a first-call compilation
                done = step + 1
                record = self._record(done, m, num_tokens, dt, host_metrics)
                if compile_s:
                    record["compile_time_s"] = compile_s
                records.append(record)
                writer.write(record)
                progress.update(done, record)
                if record["update_skipped"]:
                    logging.warning("step %d: update skipped (%s); %d skipped so far, %d in a row", done,
                                    record["nonfinite_reason"], record["skipped_updates"],
                                    record["nonfinite_consecutive"])
                if self.max_nonfinite > 0 and record["nonfinite_consecutive"] >= self.max_nonfinite:
                    self.save(done)
                    self.ckpt.wait()
                    raise NonFiniteError(
                        f"training stopped after step {done}: {record['nonfinite_consecutive']} non-finite updates "
                        f"in a row (max_consecutive_nonfinite={self.max_nonfinite}); last: "
                        f"{record['nonfinite_reason']}. The training state was saved to "
                        f"{self.ckpt.state_dir}/{done}; see {writer.path} (nonfinite_reason, nonfinite_groups).")
                if done % self.checkpoint_every == 0 or done == self.steps:
                    # the checkpoint's record first, then the state (module docstring): no kill loses the record
                    extra = self.task.on_checkpoint(done, self.current_model())
                    if extra:
                        writer.write({"step": done, **extra})
                    self.save(done)
                    # the saves before this one have landed (a save waits for the one in flight), with the states
                    # they pruned deleted; this one's pruning is told at the next checkpoint or at the end
                    self.task.on_saved(self.ckpt.state_steps())
                self.ckpt.raise_failed_save()  # a checkpoint that failed in the background ends the run now
                if self.on_step_end is not None:
                    self.on_step_end(done, self)
                if interrupt.requested() is not None:  # SIGINT / SIGTERM: this step is done; save it and stop
                    self.save(done)
                    self.ckpt.wait()
                    self.task.on_saved(self.ckpt.state_steps())
                    interrupt.check(lambda: self._stop_message(done, saved=True))
        finally:
            progress.close()
            writer.close()
            self.ckpt.wait()
        self.task.on_saved(self.ckpt.state_steps())  # every save landed: the states on disk are the run's last word
        return RunResult(final_step=int(jax.device_get(self.state.step)), state=self.state, records=records)

    def _stop_in_rollout(self, done: int, start: int, stopped: interrupt.Interrupted) -> None:
        """A signal stopped the rollout of step `done` + 1 (its partial rollout is dropped: nothing of it was
        written): the last finished step is checkpointed, if it is not already, and the run stops there."""
        if done > start and self.ckpt.latest_step() != done:
            self.save(done)
            self.ckpt.wait()
            self.task.on_saved(self.ckpt.state_steps())
        raise interrupt.Interrupted(stopped.signum, f"{stopped}; {self._stop_message(done, saved=done > 0)}")

    def _stop_message(self, done: int, saved: bool) -> str:
        where = (f"checkpoint of step {done} in {self.ckpt.state_dir}/{done}" if saved else
                 f"newest checkpoint: step {done}" if done else "no step done")
        return f"training stopped after step {done} of {self.steps} ({where}); rerun the same command to resume"

    def _record(self, done: int, m: dict, num_tokens: int, dt: float, host_metrics: dict) -> dict:
        groups = sorted(k.split("/", 1)[1] for k, v in m.items() if k.startswith("finite/") and not v)
        record = {"step": done}
        for key in ("loss", "grad_norm", "update_norm", "lora_norm", "learning_rate"):
            record[key] = float(m[key])
        skipped = bool(m["update_skipped"])
        record.update(update_skipped=int(skipped), skipped_updates=int(m["nonfinite_total"]),
                      nonfinite_consecutive=int(m["nonfinite_consecutive"]), loss_finite=bool(m["loss_finite"]),
                      nonfinite_groups=groups, tokens=int(num_tokens), step_time_s=dt,
                      tokens_per_s=num_tokens / dt if dt > 0 else 0.0)
        if skipped:
            record["nonfinite_reason"] = _nonfinite_reason(m, groups)
        skip = set(record) | {"update_skipped", "nonfinite_total", "nonfinite_consecutive", "loss_finite"}
        for k, v in m.items():
            if k not in skip and not k.startswith("finite/"):
                record[k] = float(v)
        for k, v in host_metrics.items():
            record[k] = v
        return record
