"""Environments by name: the built-ins (imported on first use) and the `environment` plug-ins of a run
(jaxrl.algorithms.plugins registers them, through `as_environment`)."""

from __future__ import annotations

from jaxrl.utils.registry import Registry

__all__ = ["ENVIRONMENTS"]

ENVIRONMENTS = Registry("environment", lazy={
    "answer_retry": "jaxrl.environments.answer_retry:AnswerRetry",
    "code_feedback": "jaxrl.environments.code_feedback:CodeFeedback",
    "python_tool": "jaxrl.environments.python_tool:PythonTool",
}, hint="Or add one of your own as an `environment` plug-in (jaxrl.algorithms.plugins)")
