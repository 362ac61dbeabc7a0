"""Environments of multi-turn episodes and the one loop that samples episodes (a single-turn rollout is a one-turn
episode of that loop), below the algorithms and evaluation that use them.

    base.py           the `Environment` protocol (reset / step; `tools`, `solved`, `seed`), `Turn`, the checks
    code_feedback.py  the built-in `code_feedback`; python_tool.py: the built-in `python_tool`
    limits.py         the environment thread: each environment call waited for at most `step_timeout_s`, Ctrl-C honoured
    registry.py       ENVIRONMENTS by name (built-ins and `environment` plug-ins)
    runner.py         `EpisodeRunner`: episodes through any rollout backend (live rows on the jax backend)
    settings.py       `EpisodeSettings`: the episode keys of an online algorithm's block (no jax: configs import it)

The names below are imported on first use, so `jaxrl.environments.settings` stays light.
"""

from __future__ import annotations

from jaxrl.utils.registry import lazy_exports

_EXPORTS = {
    "Environment": "jaxrl.environments.base", "Turn": "jaxrl.environments.base",
    "as_environment": "jaxrl.environments.base", "check_messages": "jaxrl.environments.base",
    "ENVIRONMENTS": "jaxrl.environments.registry",
    "Episode": "jaxrl.environments.runner", "EpisodeRunner": "jaxrl.environments.runner",
    "EpisodeSettings": "jaxrl.environments.settings",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
