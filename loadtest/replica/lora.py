"""LoRA adapters a replica serves, as vLLM's `--lora-modules` and its load/unload routes
register them.

Registering an adapter only gives its name a meaning to the API; it takes no GPU slot. The
engine loads adapters into its `max_loras` slots when it schedules their requests
(`engine.py`). Adapters are numbered from 1 in registration order, as vLLM numbers its
`lora_int_id`s, and a number is never given twice, even after an unload: a KV event's
`lora_id` must not come to mean another adapter.

A request names its adapter in `model` (vLLM), as `BASE:ADAPTER` in `model` (SGLang), or in
`/generate`'s `lora_path` (SGLang, which takes a registered adapter's name there).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    lora_id: int
    created: int  # Unix time of registration, for its model card
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """vLLM's two forms: `NAME=PATH`, or JSON `{"name", "path", "base_model_name"}`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        name, equals, path = text.partition("=")
        if not equals:
            raise ValueError(
                f"invalid --lora-modules entry {text!r}: expected NAME=PATH or a JSON object"
            ) from None
        return _module(name, path, None, text)
    if not isinstance(data, dict):
        raise ValueError(f"invalid --lora-modules entry {text!r}: JSON must be an object")
    unknown = set(data) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(
            f"invalid --lora-modules entry {text!r}: unknown keys {', '.join(sorted(unknown))}"
        )
    return _module(data.get("name"), data.get("path"), data.get("base_model_name"), text)


def _module(name: object, path: object, base: object, text: str) -> LoraModule:
    if not isinstance(name, str) or not name:
        raise ValueError(f"invalid --lora-modules entry {text!r}: the name is empty")
    if not isinstance(path, str) or not path:
        raise ValueError(f"invalid --lora-modules entry {text!r}: the path is empty")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"invalid --lora-modules entry {text!r}: base_model_name must be a string")
    return LoraModule(name, path, base)


class LoraRegistry:
    def __init__(self, base_model: str, modules: Iterable[LoraModule] = ()) -> None:
        self.base_model = base_model
        self._adapters: dict[str, LoraAdapter] = {}
        # Every name ever registered, with its latest number: a request admitted before its
        # adapter was unloaded still stores blocks under that number.
        self._ids: dict[str, int] = {}
        self._next_id = 1
        for module in modules:
            self.register(module.name, module.path, module.base_model_name)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __iter__(self) -> Iterator[LoraAdapter]:
        """The registered adapters in registration order."""
        return iter(self._adapters.values())

    def __len__(self) -> int:
        return len(self._adapters)

    def register(self, name: str, path: str, base_model_name: str | None = None) -> LoraAdapter:
        if not name or not path:
            raise ValueError("an adapter needs a name and a path")
        if name == self.base_model:
            raise ValueError(f"the adapter name '{name}' is the base model's")
        if name in self._adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        adapter = LoraAdapter(name, path, self._next_id, int(time.time()), base_model_name)
        self._next_id += 1
        self._adapters[name] = adapter
        self._ids[name] = adapter.lora_id
        return adapter

    def unregister(self, name: str) -> LoraAdapter:
        """KeyError when no adapter has that name."""
        return self._adapters.pop(name)

    def lora_id(self, name: str) -> int | None:
        return self._ids.get(name)

    def adapter_for(self, model: str | None) -> str | None:
        """The adapter a request's `model` names; None for the base model (or no model).
        LookupError when it names neither."""
        if not model or model == self.base_model:
            return None
        if model in self._adapters:
            return model
        prefix = self.base_model + ":"  # SGLang's BASE:ADAPTER
        if model.startswith(prefix) and model[len(prefix) :] in self._adapters:
            return model[len(prefix) :]
        raise LookupError(model)
