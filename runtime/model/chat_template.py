"""Chat templates: HF-compatible Jinja rendering in a sandbox (templates come with downloaded checkpoints).

Same environment as transformers' `apply_chat_template`: trim_blocks + lstrip_blocks, the loop-controls
extension, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text and key order.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenfleet.runtime.errors import ConfigError, InvalidRequest


def _raise_exception(message: str) -> None:
    # Templates use this to reject bad conversations (e.g. roles out of order): that is the client's fault.
    raise InvalidRequest(f"chat template: {message}", param="messages")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"invalid chat template: {e}") from e


@functools.lru_cache(maxsize=16)
def template_supports_tools(source: str) -> bool:
    """Whether the template renders a `tools` variable (HF's convention for tool-aware templates): a template
    that ignores it would silently drop the tool definitions from the prompt."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    try:
        return "tools" in meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:
        return False


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    **extra: Any,
) -> str:
    """`special_tokens` supplies bos_token / eos_token / ...; `extra` passes tools, documents, etc."""
    template = compile_chat_template(source)
    try:
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
            **extra,
        )
    except jinja2.TemplateError as e:
        raise InvalidRequest(f"chat template failed: {e}", param="messages") from e
