"""Chat templates rendered client-side, the way transformers renders them.

transformers (utils/chat_template_utils.py) compiles a template in an immutable sandbox with
trim_blocks, lstrip_blocks and loop controls, replaces the `tojson` filter with one that does
not HTML-escape, and adds `raise_exception` and `strftime_now`; the special tokens are template
variables. The same here, so a prompt rendered by tandem's client is the prompt transformers
would render. jinja2 is an optional dependency: `pip install 'tandem-client[chat]'`.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

Conversation = list[dict[str, Any]]
# Appended to the final message to find where it ends after rendering (continue_final_message).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as exc:
        raise ImportError(
            "apply_chat_template renders the model's chat template with jinja2, which is not "
            "installed: pip install 'tandem-client[chat]' (or pip install jinja2)"
        ) from exc
    return jinja2


@functools.lru_cache(maxsize=8)
def compile_template(template: str):
    jinja2 = _jinja2()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _render_one(
    compiled,
    conversation: Conversation,
    continue_final_message: bool | str,
    variables: dict[str, Any],
) -> str:
    if not conversation:
        raise ValueError(
            "cannot apply a chat template to an empty conversation: give at least one message"
        )
    if not continue_final_message:
        return compiled.render(messages=conversation, **variables)
    key = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = conversation[-1].get(key)
    if not isinstance(final, str):
        raise ValueError(
            f"continue_final_message is set but the final message has no text {key!r} to continue"
        )
    messages = [*conversation[:-1], {**conversation[-1], key: final + _CONTINUE_TAG}]
    rendered = compiled.render(messages=messages, **variables)
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at == -1 or final.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the chat template drops the final message"
        )
    # A template that keeps whitespace leaves the tag intact; one that trims it needs a trim too.
    return (
        rendered[:at]
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        else rendered[:at].rstrip()
    )


def render_chat_template(
    template: str,
    conversation: Conversation | list[Conversation],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables: Any,
) -> str | list[str]:
    """Renders one conversation (a list of messages) or a batch of them (a list of such lists)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible: the first continues "
            "the last message, the second starts a new assistant message"
        )
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    compiled = compile_template(template)
    variables = {
        **variables,
        "tools": tools,
        "documents": documents,
        "add_generation_prompt": add_generation_prompt,
    }
    is_batch = bool(conversation) and isinstance(conversation[0], (list, tuple))
    batch = conversation if is_batch else [conversation]
    rendered = [_render_one(compiled, list(c), continue_final_message, variables) for c in batch]
    return rendered if is_batch else rendered[0]
