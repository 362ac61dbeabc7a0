"""Serving: the OpenAI-compatible HTTP server over the generation engine (`python -m launchers.serve`).

    from jaxrl.serve import CompletionServer, ServeLimits, ServerThread

Modules: `app` (the server, its routes, body limits, the uvicorn thread), `protocol` (request models, the error
shape), `handlers` (completions and chat), `registry` (the base and its adapters), `loop` (the thread that drives
the engine and scores), `text` (per-token texts), `settings` (the launcher's settings, its flags).
"""

from jaxrl.serve.settings import ServeLimits, ServeSettings

__all__ = ["ServeLimits", "ServeSettings"]
