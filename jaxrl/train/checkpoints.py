"""Orbax checkpoints of a training run: adapter-only artifacts per step, plus resumable training states.

Layout under `<workdir>/checkpoints/` (Orbax CheckpointManager folders, one per step, named by the number of
train steps completed):

    adapters/<step>/adapter/   {name: fp32 array}: the LoRA factors only (`...q_proj.lora.lora_A` [r, in],
                                `...lora_B` [out, r]); what users share and `export` reads. Never deleted.
    adapters/<step>/meta/      JSON: step, lora (rank, alpha, scale, use_rslora, dropout, modules, by_name),
                                model (Qwen35Config dict), model_path.
    ema/<step>/adapter/, meta/ with `ema.decay` set: the EMA of the LoRA factors at that step, in the format of
                                adapters/<step> (its own adapter; meta adds ema: {decay, step, over}). Never
                                deleted.
    state/<step>/state/        the full TrainState (params, optimizer state, step, schedule position, rng,
                                non-finite counters, the EMA), sharded as in training.
    state/<step>/meta/         JSON: step, data_state (the data position), config (resolved).
                                Only the newest `keep_checkpoints` states are kept (the heavy part).

Saves are atomic: Orbax writes each step into a temporary folder and renames it when complete, so a process
killed during a save leaves the previous complete step as the newest one (unfinished temporaries are ignored
and cleaned). The state of step N is saved before its adapter (and EMA adapter), so an adapter folder never
outlives a state that failed to land; on resume, adapter and EMA folders newer than the restored state are removed
(they are re-created, identically, as training reaches them again), and the restored state's own adapter, when a
kill landed between the two saves, is written from it (`save_adapters`).

    ckpt = RunCheckpoints(workdir, keep=2, ema=True)
    ckpt.save(step, state, state_meta, adapter_params, adapter_meta, ema_params, ema_meta)
    step = ckpt.latest_step()                        # newest complete training state, or None
    state, meta = ckpt.restore(step, abstract_state)

Reading an adapter checkpoint back: `jaxrl.models.adapters.load_adapter(path, step)`.

A checkpoint that cannot be written (a read-only folder, a path the OS refuses) ends the run at once in one line,
"cannot write the checkpoint of step N to DIR: <cause>; ...", raised by `save` (Orbax creates each step's folder
in the caller's thread, so the refusal is raised there) or, for a failure in Orbax's background threads, by
`raise_failed_save` / `wait`. Nothing written before is touched: the earlier steps stay the newest complete ones.
`check_writable` is the same refusal up front, before a step is trained (a probe file in each folder). A full
disk keeps its own error (the launcher's one line naming the file).

A damaged training state (a file truncated or overwritten after it landed: a full disk, a copy cut short) is a
CorruptCheckpointError naming the file; `restore_newest` then falls back to the newest intact step and moves
the damaged ones to `<workdir>/checkpoints/corrupt/` (never deleted: they may still be worth a look).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Optional

import orbax.checkpoint as ocp

from jaxrl.models.adapters import ADAPTERS, CHECKPOINTS, EMA
from jaxrl.utils.io import CorruptCheckpointError, damaged_file, disk_full

STATE = "state"
CORRUPT = "corrupt"


def _manager(directory: str, max_to_keep: Optional[int], item_names: tuple, async_save: bool,
             barrier_prefix: str) -> ocp.CheckpointManager:
    # Several processes: each manager's save runs barriers (`async_write_complete.<step>`, `ThreadSaveMultiHost
    # ValueHolder:set_value_start`, ...) named only by the step, or not at all. The state and adapter managers
    # save the same step at the same time in their background threads, so without a prefix of their own the two
    # wait on one barrier name at once and the coordination service refuses the second ("Barrier ... is already
    # ongoing"): every multi-process save failed.
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=async_save,
                                           cleanup_tmp_directories=True,
                                           # the step's folder is made in the caller's thread: a refused folder
                                           # raises from save(). Made in the background (Orbax's default), the
                                           # refusal left the threads waiting for that folder blocked for
                                           # Orbax's 300 s coordination timeout, and the process could not exit.
                                           async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                                           multiprocessing_options=ocp.options.MultiprocessingOptions(
                                               barrier_sync_key_prefix=barrier_prefix))
    # Handlers named up front (not learnt from the first save): item_metadata of a step written by an earlier
    # process is then readable before anything is restored, which `restore` needs to tell a pre-EMA state apart.
    handlers = {name: ocp.JsonCheckpointHandler() if name == "meta" else ocp.StandardCheckpointHandler()
                for name in item_names}
    return ocp.CheckpointManager(os.path.abspath(directory), item_handlers=handlers, options=options)


class RunCheckpoints:
    """The Orbax managers of one run (see the module docstring): states, adapters, and with `ema` the EMA adapters.
    The EMA manager also opens when the run's folder already holds EMA adapters, so that a resume cleans them too."""

    def __init__(self, workdir: str, keep: Optional[int] = 2, async_save: bool = True, ema: bool = False):
        if keep is not None and keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 (or None to keep all), got {keep}")
        root = os.path.join(workdir, CHECKPOINTS)
        self.adapter_dir = os.path.join(root, ADAPTERS)
        self.state_dir = os.path.join(root, STATE)
        self.ema_dir = os.path.join(root, EMA)
        self.states = _manager(self.state_dir, keep, ("state", "meta"), async_save, "jaxrl_state")
        self.adapters = _manager(self.adapter_dir, None, ("adapter", "meta"), async_save, "jaxrl_adapters")
        self.emas = (_manager(self.ema_dir, None, ("adapter", "meta"), async_save, "jaxrl_ema")
                     if ema or os.path.isdir(self.ema_dir) else None)
        self._managers = [m for m in (self.states, self.adapters, self.emas) if m is not None]
        self._pending: dict[int, int] = {}  # id(manager) -> the step it saved last (named by a failure's message)

    def latest_step(self) -> Optional[int]:
        """Newest complete training state (None when the run has none)."""
        return self.states.latest_step()

    def adapter_steps(self) -> list[int]:
        return sorted(self.adapters.all_steps())

    def state_steps(self) -> list[int]:
        """The steps whose training-state folder is on disk now (finished or being written)."""
        if not os.path.isdir(self.state_dir):
            return []
        return sorted(int(d) for d in os.listdir(self.state_dir) if d.isdigit())

    def save(self, step: int, state, state_meta: dict, adapter_params: dict, adapter_meta: dict,
             ema_params: Optional[dict] = None, ema_meta: Optional[dict] = None) -> None:
        """Save the full state, then the adapter (then the EMA adapter, when given), of `step` (asynchronously when
        enabled; the device-to-host copy happens before this returns, so the caller may donate `state` right
        after). A folder the OS refuses: the module docstring's one-line OSError."""
        if step in self.states.all_steps():  # already saved (e.g. a stop right after a cadence save)
            return
        self._save(self.states, step, ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(state_meta)))
        self.save_adapters(step, adapter_params, adapter_meta, ema_params, ema_meta)

    def save_adapters(self, step: int, adapter_params: dict, adapter_meta: dict,
                      ema_params: Optional[dict] = None, ema_meta: Optional[dict] = None) -> None:
        """Save the adapter (and the EMA adapter) of `step`: after its state in `save`; on resume, again for a state
        whose adapter a kill between the two saves left unwritten (jaxrl.train.loop.Trainer.restore_latest)."""
        items = [(self.adapters, adapter_params, adapter_meta)]
        if ema_params:
            if self.emas is None:
                raise ValueError("RunCheckpoints: EMA adapters given to a run opened without ema=True")
            items.append((self.emas, ema_params, ema_meta))
        for manager, params, meta in items:
            if step in manager.all_steps():
                manager.delete(step)
            self._save(manager, step, ocp.args.Composite(adapter=ocp.args.StandardSave(params),
                                                         meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        """Block until every pending save is complete on disk (a save that failed: its one-line OSError)."""
        for manager in self._managers:
            self._write(manager, self._pending.get(id(manager)), manager.wait_until_finished)

    def raise_failed_save(self) -> None:
        """The one-line OSError of a save that failed in Orbax's background threads, as soon as it ended (without
        waiting for a save still under way): the run stops now rather than at its next checkpoint."""
        for manager in self._managers:
            if not manager.is_saving_in_progress():
                self._write(manager, self._pending.get(id(manager)), manager.wait_until_finished)

    def check_writable(self) -> None:
        """The one-line OSError now when a checkpoint folder cannot take a file (read-only, owned by another
        user): a run refused before it trains a step it could not save. Writes and removes one probe file per
        folder."""
        for manager in self._managers:
            failure = None
            try:
                fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=str(manager.directory))
                os.close(fd)
                os.remove(probe)
            except OSError as e:
                failure = self._unwritable(e, str(manager.directory), None)
            if failure is not None:
                raise failure

    def _save(self, manager: ocp.CheckpointManager, step: int, args: ocp.args.Composite) -> None:
        self._pending[id(manager)] = step
        self._write(manager, step, lambda: manager.save(step, args=args))

    def _write(self, manager: ocp.CheckpointManager, step: Optional[int], write: Callable[[], None]) -> None:
        """Runs `write` (a save of `step` by `manager`, or a wait for one); an OS error other than a full disk
        becomes the one-line OSError of `_unwritable`."""
        failure = None
        try:
            write()
        except OSError as e:
            failure = self._unwritable(e, str(manager.directory), step)
            if failure is None:
                raise
        if failure is not None:
            # raised outside the `except`: chained to the OS error, the launcher would print that error's path (a
            # temporary folder) in its generic line instead of this one
            raise failure

    def _unwritable(self, err: OSError, folder: str, step: Optional[int]) -> Optional[OSError]:
        """The one-line error of a checkpoint write the OS refused in `folder`; None for a full disk (the
        launcher's own line names the file)."""
        if disk_full(err) is not None:
            return None
        what = f"the checkpoint of step {step}" if step is not None else "checkpoints"
        cause = err.strerror or str(err)
        newest = self.states.latest_step()
        resume = f"the newest complete checkpoint, step {newest}" if newest is not None else "the start"
        return OSError(f"cannot write {what} to {folder}: {cause}; make it writable (or use another --workdir) and "
                       f"rerun the same command: it resumes from {resume}")

    def restore(self, step: int, abstract_state) -> tuple:
        """(state, meta) of `step`; `abstract_state` gives structure, dtypes and shardings
        (jax.ShapeDtypeStruct leaves with `sharding`). CorruptCheckpointError when its files are damaged."""
        try:
            saved = self.states.item_metadata(step)["state"]
            # a state written before TrainState had `ema` (no EMA then): restored by field name, without it
            legacy = "ema" not in dict(getattr(saved, "tree", saved) or {}) and not abstract_state.ema
            target = {k: v for k, v in abstract_state._asdict().items() if k != "ema"} if legacy else abstract_state
            restored = self.states.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 (damage is told apart from every other failure below)
            damage = damaged_file(e, os.path.join(self.state_dir, str(step)))
            if damage is None:
                raise
            raise damage from e
        state = type(abstract_state)(**restored.state, ema={}) if legacy else restored.state
        return state, dict(restored.meta)

    def restore_newest(self, abstract_state) -> tuple:
        """(step, state, meta, set_aside) of the newest intact training state, or (None, None, None, []) when the
        run has none. Damaged newer steps are moved to checkpoints/corrupt/ once an older one restored;
        set_aside lists (CorruptCheckpointError, where it was moved). When every step is damaged nothing is
        moved and the newest one's error is raised."""
        damaged = []
        for step in sorted(self.states.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, abstract_state)
            except CorruptCheckpointError as e:
                damaged.append((step, e))
                continue
            moved = [(e, self.set_aside(s)) for s, e in damaged]
            return step, state, meta, moved
        if damaged:
            err = damaged[0][1]
            raise CorruptCheckpointError(err.path, f"{err.reason}; no older intact training state in "
                                                   f"{self.state_dir} to resume from")
        return None, None, None, []

    def set_aside(self, step: int) -> str:
        """Moves the state of `step` to checkpoints/corrupt/state_<step>[_N]; returns where."""
        root = os.path.join(os.path.dirname(self.state_dir), CORRUPT)
        os.makedirs(root, exist_ok=True)
        dest, n = os.path.join(root, f"{STATE}_{step}"), 1
        while os.path.exists(dest):
            dest, n = os.path.join(root, f"{STATE}_{step}_{n}"), n + 1
        os.replace(os.path.join(self.state_dir, str(step)), dest)
        self.states.reload()
        return dest

    def drop_adapters_after(self, step: int) -> list[int]:
        """Delete adapter (and EMA adapter) folders newer than `step` (left by a run that died before its state
        landed); returns their steps."""
        stale = set()
        for manager in (self.adapters, self.emas):
            for s in [s for s in (manager.all_steps() if manager is not None else []) if s > step]:
                manager.delete(s)
                stale.add(s)
        return sorted(stale)

    def close(self) -> None:
        self.wait()
        for manager in self._managers:
            manager.close()


def remove_run_checkpoints(workdir: str) -> None:
    """Delete a run's checkpoints (tests / explicit restarts only)."""
    shutil.rmtree(os.path.join(workdir, CHECKPOINTS), ignore_errors=True)
