"""The kit's chat template: a chat turn rendered as the (prompt, code) rows every stage trains on.

Training rows are ``prompt_text(p) ++ c ++ EOS`` (:mod:`privcode.models.encoding`), where
:func:`prompt_text` is ``p.rstrip() + "\\n"`` (nothing for an empty prompt). A chat maps onto
that format one message at a time (:data:`CHAT_TEMPLATE`, Jinja)::

    system     s.rstrip() + "\\n\\n"        (dropped when blank)
    user       prompt_text(u)
    assistant  a + EOS                    (the last one, with add_generation_prompt, no EOS)

so ``[user p, assistant c]`` renders exactly the training text of ``(p, c)``, and a request
``[user p]`` (``add_generation_prompt``) is the training prompt the model continues.
Torch-free. Design notes: docs/architecture.md, "models/chat.py".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CHAT_ROLES", "CHAT_TEMPLATE", "ChatError", "prompt_text", "render_chat"]

CHAT_ROLES = ("system", "user", "assistant")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if content.strip() -%}{{ content.rstrip() }}{{ '\\n\\n' }}{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{%- if content.strip() -%}{{ content.rstrip() }}{{ '\\n' }}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ content }}{%- if not (loop.last and add_generation_prompt) -%}{{ eos_token }}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


class ChatError(ValueError):
    """A chat the template cannot render (an unknown role, a non-text content)."""


def prompt_text(prompt: str) -> str:
    """The training text of a prompt: ``prompt.rstrip() + "\\n"``, or ``""`` when blank."""
    return prompt.rstrip() + "\n" if prompt.strip() else ""


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    template: str | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """``messages`` (``{"role", "content"}``, content text) as the text the model continues.

    ``template``: the artifact's recorded template (None: :data:`CHAT_TEMPLATE`). The
    tokenizer supplies ``eos_token``; roles other than :data:`CHAT_ROLES` are refused."""
    for i, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise ChatError(f"messages[{i}]: role must be one of {', '.join(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ChatError(f"messages[{i}]: content must be text")
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        chat_template=template or CHAT_TEMPLATE,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    if not isinstance(text, str):
        raise ChatError("the chat template did not render text")
    return text
