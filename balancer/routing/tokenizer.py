"""Prompts as token ids, exactly as the engine will tokenize them (precise mode).

An engine's KV events name blocks of token ids, so kvlb can only look a prompt up in them if
it cuts the same ids. A model directory's `tokenizer.json` and chat template give them
locally (the `tokenizers` library and a sandboxed Jinja, as transformers renders templates);
without a directory, the engine's own `/tokenize` endpoint answers, at the cost of one round
trip per request.

What each route means, as vLLM treats it: chat messages are rendered by the template with the
generation prompt and tokenized without adding special tokens (the template writes them);
a completion prompt, SGLang's `text` and an embedding input are tokenized with them; token
ids given by the client are used as they are.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("kvlb.tokenizer")


class TokenizerError(Exception):
    """A model directory that cannot serve as a tokenizer (config or start-up error)."""


def _load_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        return json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    return None


def _special_token(value: Any) -> str:
    if isinstance(value, Mapping):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ModelTokenizer:
    """One model directory's tokenizer and chat template."""

    def __init__(self, directory: str | Path) -> None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(
                "precise mode needs the tokenizers and jinja2 packages: pip install 'kvlb[events]'"
            ) from None
        root = Path(directory)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{root}: no tokenizer.json")
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
            config_file = root / "tokenizer_config.json"
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
            template = _load_template(root, config)
        except (OSError, ValueError, Exception) as exc:  # tokenizers raises plain Exception
            raise TokenizerError(f"{root}: cannot load the tokenizer: {exc}") from None
        self.directory = root
        self._template = None
        if template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(template)
        self._specials = {
            "bos_token": _special_token(config.get("bos_token")),
            "eos_token": _special_token(config.get("eos_token")),
        }

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, data: Mapping[str, Any]) -> str | None:
        """The chat request's messages through the template, or None when it cannot be
        rendered (no template, malformed messages: the engine will say what is wrong)."""
        messages = data.get("messages")
        if self._template is None or not isinstance(messages, list):
            return None
        flattened = []
        for message in messages:
            if not isinstance(message, Mapping):
                return None
            content = message.get("content")
            if isinstance(content, list):  # text parts, joined as vLLM does for string templates
                content = "\n".join(
                    part.get("text", "") for part in content
                    if isinstance(part, Mapping) and part.get("type") == "text"
                )
            flattened.append({**message, "content": content})
        try:
            return self._template.render(
                messages=flattened,
                tools=data.get("tools"),
                add_generation_prompt=data.get("add_generation_prompt", True),
                **self._specials,
            )
        except Exception as exc:  # a template error is the request's problem, not kvlb's
            log.debug("chat template failed: %s", exc)
            return None

    def prompt_ids(self, route: str, data: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None when this request has no single prompt to route on."""
        if route == "/v1/chat/completions":
            text = self.render_chat(data)
            return None if text is None else self.encode(text, add_special_tokens=False)
        ids = given_ids(route, data)
        if ids is not None:
            return ids
        prompt = _single_prompt(route, data)
        return self.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else None


def _single_prompt(route: str, data: Mapping[str, Any]) -> Any:
    prompt = data.get({"/generate": "text", "/v1/embeddings": "input"}.get(route, "prompt"))
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    return prompt


def given_ids(route: str, data: Mapping[str, Any]) -> list[int] | None:
    """Token ids the client sent instead of text (SGLang's `input_ids`, a completion prompt
    of ids): used as they are, no tokenizer needed."""
    if route == "/v1/chat/completions":
        return None
    ids = data.get("input_ids") if route == "/generate" else _single_prompt(route, data)
    if isinstance(ids, list) and ids and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 32 for i in ids
    ):
        return ids
    return None


def _raise_template_error(message: str) -> None:
    raise ValueError(message)


def tokenize_request_body(route: str, data: Mapping[str, Any]) -> bytes | None:
    """The body of an engine `/tokenize` call that tokenizes this request's prompt as the
    engine would serve it, or None when the request has no prompt that endpoint takes."""
    model = data.get("model")
    if route == "/v1/chat/completions":
        messages = data.get("messages")
        if not isinstance(messages, list):
            return None
        body: dict[str, Any] = {"messages": messages, "add_generation_prompt": True}
        if data.get("tools"):
            body["tools"] = data["tools"]
    else:
        prompt = _single_prompt(route, data)
        if not isinstance(prompt, str):
            return None
        body = {"prompt": prompt}
    if isinstance(model, str):
        body["model"] = model
    return orjson.dumps(body)
