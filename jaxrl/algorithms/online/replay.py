"""Replay of groups that carried a signal (`grpo.replay_groups`, TRL PR #4060): a group whose rewards all agree
gives GRPO no gradient, so its rows are replaced by a group of an earlier rollout whose rewards differed.

    replay = GroupReplay(groups=16, max_age=4, group=8)
    replay.open(workdir)
    buffer, metrics = replay.apply(rollout, buffer, signal)   # signal: [groups] bool, this rollout's groups

A rollout's groups with a signal are kept (every buffer array of their rows: ids, masks, advantages, the behaviour
log-probs that are the ratio's denominator, the reference's) in `<workdir>/replay/<rollout>.npz`; a later rollout
replaces its groups without a signal, in order, by the newest kept groups at most `max_age` rollouts old (each used
once per rollout, at most `groups` of them). A replayed row keeps its advantage and its old log-probs, so the clipped
ratio pi_now / pi_then corrects its staleness as it does any off-policy update (the step is off-policy whenever
replay is on). The files make a resumed run replay what the uninterrupted one did. Metrics: `replay/groups` (groups
replaced), `replay/fraction` (rows replayed / rows), `replay/age_mean`, `replay/age_max` (rollouts),
`replay/available` (kept groups in reach), `replay/zero_advantage_rows` (rows whose advantage is 0 after replay).
"""

from __future__ import annotations

import io
import os
from typing import Optional

import jax
import numpy as np

from jaxrl.utils.io import atomic_write_bytes

REPLAY_DIR = "replay"


class GroupReplay:
    """The kept groups and the replacement rule (module docstring)."""

    def __init__(self, *, groups: int, max_age: int, group: int):
        self.groups, self.max_age, self.group = int(groups), int(max_age), int(group)
        self.folder: Optional[str] = None
        self._kept: dict[int, dict] = {}  # rollout -> {key: [k * group, ...]} of its groups with a signal

    def open(self, workdir: str) -> None:
        self.folder = os.path.join(workdir, REPLAY_DIR) if workdir else None

    def apply(self, rollout: int, buffer: dict, signal: np.ndarray) -> tuple[dict, dict]:
        g = self.group
        signal = np.asarray(signal, bool)
        mine = {k: np.asarray(v)[np.repeat(signal, g)] for k, v in buffer.items()}
        candidates = []  # (age, rollout, index of the group in its rollout's kept groups): newest first
        for past in range(rollout - 1, max(rollout - 1 - self.max_age, -1), -1):
            kept = self._load(past)
            if kept is not None:
                n = len(next(iter(kept.values()))) // g if kept else 0
                candidates += [(rollout - past, past, j) for j in range(n)]
        candidates = candidates[:self.groups]
        out = {k: np.array(v, copy=True) for k, v in buffer.items()}
        ages = []
        for j, (target, cand) in enumerate(zip(np.flatnonzero(~signal), candidates)):
            age, past, index = cand
            kept = self._kept[past]
            rows = slice(target * g, (target + 1) * g)
            for key in out:
                if key not in kept:
                    raise ValueError(f"replay: rollout {past}'s kept groups have no {key!r} (the run's buffer keys "
                                     "changed since): remove the replay folder or use a new workdir")
                out[key][rows] = kept[key][index * g:(index + 1) * g]
            ages.append(age)
        self._store(rollout, mine)
        adv = np.asarray(out["advantages"])
        zero = ~np.any(adv.reshape(len(adv), -1) != 0, axis=1)
        n_groups = len(signal)
        return out, {"replay/groups": float(len(ages)), "replay/fraction": float(len(ages)) / max(n_groups, 1),
                     "replay/age_mean": float(np.mean(ages)) if ages else 0.0,
                     "replay/age_max": float(max(ages)) if ages else 0.0,
                     "replay/available": float(len(candidates)),
                     "replay/zero_advantage_rows": float(zero.mean()) if len(zero) else 0.0}

    # the kept groups ----------------------------------------------------------------------------------------------
    def _path(self, rollout: int) -> str:
        return os.path.join(self.folder or "", f"{rollout}.npz")

    def _load(self, rollout: int) -> Optional[dict]:
        if rollout not in self._kept and self.folder is not None and os.path.exists(self._path(rollout)):
            with np.load(self._path(rollout)) as f:
                self._kept[rollout] = {k: f[k] for k in f.files}
        return self._kept.get(rollout)

    def _store(self, rollout: int, arrays: dict) -> None:
        self._kept[rollout] = arrays
        for old in [r for r in self._kept if r <= rollout - self.max_age]:
            del self._kept[old]
        if self.folder is None or jax.process_index() != 0:  # one writer; every host keeps what it made
            return
        os.makedirs(self.folder, exist_ok=True)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write_bytes(self._path(rollout), buf.getvalue())
        for name in os.listdir(self.folder):  # older than any later rollout can reach
            stem = name.split(".")[0]
            if stem.isdigit() and int(stem) <= rollout - self.max_age:
                os.remove(os.path.join(self.folder, name))
