"""The chat template of the GPT-2-style model: how /v1/chat/completions turns messages into one prompt.

GPT-2's vocabulary has no chat tokens (only `<|endoftext|>`), so the template is plain text that the model can
learn from ordinary dialogue:

    System: You answer in one word.\n
    \n
    User: What is 2+2?\n
    \n
    Assistant: Four.\n
    \n
    User: And 3+3?\n
    \n
    Assistant:

Each message is `"{Role}: {content}\n\n"` with its content stripped of surrounding whitespace; roles `system`
and `developer` are `System`, `user` is `User`, `assistant` is `Assistant`. The prompt ends with `"Assistant:"`
(no trailing space: GPT-2's BPE spells a word with its leading space, so the model writes " Four", and the
leading whitespace of the reply is dropped). Generation stops at `<|endoftext|>` or when the model starts the
next turn: at `STOP` ("\nUser:" or "\nSystem:"), on top of any `stop` the request gives. A literal
`<|endoftext|>` in a message is text, never the special token (the tokenizer has no special tokens).
"""
from __future__ import annotations

from typing import Sequence

ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
ASSISTANT_PREFIX = "Assistant:"
STOP = ("\nUser:", "\nSystem:")


class ChatTemplateError(ValueError):
    """A message has a role the template does not know."""


def render(messages: Sequence[tuple[str, str]]) -> str:
    """The prompt for `messages` ((role, content) pairs, oldest first), ending where the assistant answers."""
    parts = []
    for i, (role, content) in enumerate(messages):
        if role not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        parts.append(f"{ROLES[role]}: {content.strip()}\n\n")
    return "".join(parts) + ASSISTANT_PREFIX
