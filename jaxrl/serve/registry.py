"""The models a server serves: its base and the LoRA adapters loaded under names (at start-up or at run time), and
which of them the held model carries now.

    registry = AdapterRegistry(model, base_name="base", base_dir=HF_DIR, layout="container",
                               allowed_roots=("/runs",), max_model_len=8192)
    registry.load("dpo28", "/runs/dpo/export/peft_28")        # ApiError naming the field for a refusal
    registry.served("dpo28"), registry.cards(), registry.attach("dpo28")

Runtime loads read only absolute paths under the allowed roots (resolved, symlinks followed) and answer the same
error for a missing path as for a folder that holds no adapter (no probing the file system). The digest a card
shows is read back from the parameters the adapter was attached with (`attached_digest`): what a trainer syncing
its adapter compares with its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Optional, Sequence

from jaxrl.models.peft import is_peft_folder, mismatch_message, read_adapter, read_peft_adapter
from jaxrl.models.adapters import AdapterError, attach, attached_digest, check_against_model, detach
from jaxrl.serve.protocol import ApiError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Served:
    """One served model: the base (adapter None) or an adapter. Reloading a name in place makes a new entry, so
    the object identifies the weights (the serve loop takes a new snapshot when it changes)."""

    name: str
    path: str
    adapter: object = None  # jaxrl Adapter; None for the base
    digest: Optional[str] = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


class AdapterRegistry:
    """The base and the adapters by name (module docstring); thread safe."""

    def __init__(self, model, *, base_name: str, base_dir: str, layout: str, allowed_roots: Sequence[str],
                 max_model_len: int):
        self.model, self.layout, self.max_model_len = model, layout, int(max_model_len)
        self.base = Served(base_name, os.path.abspath(base_dir))
        self.adapters: dict[str, Served] = {}
        self.allowed_roots = tuple(os.path.realpath(r) for r in allowed_roots)
        self._attached: Optional[Served] = None  # the entry the held model carries now (None: the base)
        self._lock = threading.Lock()

    def cards(self) -> dict:
        """GET /v1/models: the base, then each adapter with its folder, parent and digest."""
        def card(s: Served, parent: Optional[str]) -> dict:
            out = {"id": s.name, "object": "model", "created": s.created, "owned_by": "jaxrl", "root": s.path,
                   "parent": parent, "max_model_len": self.max_model_len}
            if s.adapter is not None:
                out["adapter_digest"] = s.digest
            return out
        with self._lock:
            return {"object": "list", "data": [card(self.base, None)] +
                    [card(s, self.base.name) for s in self.adapters.values()]}

    def served(self, model: Optional[str]) -> Served:
        """The entry of a request's `model` (None or "" or the base's name: the base); ApiError 404 otherwise."""
        with self._lock:
            if model in (None, "", self.base.name):
                return self.base
            if model in self.adapters:
                return self.adapters[model]
        raise ApiError(f"The model `{model}` does not exist.", 404, "model")

    def _check_path(self, path: str) -> str:
        """The resolved folder of a runtime load; ApiError unless it lies under the allowed roots."""
        if not os.path.isabs(path):
            raise ApiError(f"lora_path must be an absolute path, got {path!r}", param="lora_path")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.allowed_roots):
            roots = ", ".join(self.allowed_roots) or "none: start the server with --allowed_lora_roots"
            raise ApiError(f"lora_path {path} is not under the server's allowed adapter roots ({roots})",
                           param="lora_path")
        return real

    def load(self, name: str, path: str, load_inplace: bool = False, runtime: bool = True) -> str:
        """Reads and checks an adapter (PEFT folder or trainer checkpoint) and registers it as model `name`.
        runtime: a request's path (confined to the allowed roots); False for --lora_modules at start-up."""
        if not name or not path:
            raise ApiError("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base.name:
            raise ApiError(f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if "\x00" in value:  # os.path would raise ValueError deep inside the checks
                raise ApiError(f"{field} contains a NUL character", param=field)
        with self._lock:
            if name in self.adapters and not load_inplace:
                raise ApiError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", param="lora_name")
        folder = self._check_path(path) if runtime else os.path.abspath(path)
        try:
            if is_peft_folder(folder):
                adapter, layout = read_peft_adapter(folder)
                if layout != self.layout:
                    raise ApiError(mismatch_message(layout, self.layout, path), param="lora_path")
            else:
                adapter = read_adapter(folder)
            check_against_model(adapter, self.model)
        except (AdapterError, OSError, ValueError) as e:
            if isinstance(e, ApiError):
                raise
            if runtime:  # the same answer for a missing path and a folder without an adapter
                raise ApiError(f"Loading lora {name} failed: no adapter could be loaded from {path}",
                               param="lora_path") from None
            raise ApiError(f"Loading lora {name} from {path} failed: {e}") from None
        with self._lock:
            self.adapters[name] = Served(name, folder, adapter, adapter.digest())
        logger.info("loaded adapter %s from %s (%d modules, rank %d)", name, folder, len(adapter.modules),
                    adapter.rank)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        with self._lock:
            if not name:
                raise ApiError("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
            if name not in self.adapters:
                raise ApiError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name")
            del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def attach(self, name: str) -> Served:
        """Makes the held model carry model `name` (its adapter, or none for the base) and returns its entry; the
        digest of what the parameters hold is read back and must be the adapter's. Called from the serve loop's
        thread only (it alone touches the held model)."""
        served = self.served(name)
        if self._attached is served:
            return served
        detach(self.model)
        self._attached = None
        if served.adapter is not None:
            attach(self.model, served.adapter)
            got = attached_digest(self.model)
            if got != served.digest:  # what the parameters hold now, read back
                raise RuntimeError(f"attached adapter digest {got} != {served.digest} of {served.path}")
        self._attached = served
        return served
