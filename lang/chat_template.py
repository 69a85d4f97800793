"""Role markers (the text before and after each message) taken from a tokenizer's chat template.

A program's text only ever grows, so role blocks cannot re-render the whole
conversation; instead the template is rendered once with placeholder contents
and cut around them. The first message of a conversation gets its own prefix,
because templates often put a BOS token or a default system prompt there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.lang.ir import ROLES

_PLACEHOLDER = "\x00{}\x00"
# A conversation that ends with the role in question, for each role, so the
# prefix of a non-first message can be measured after a realistic predecessor.
_LEAD_IN = {
    "system": [],
    "user": [("user", "u"), ("assistant", "a")],
    "assistant": [("user", "u")],
}


@dataclass(frozen=True)
class RoleMarkers:
    """The text a chat template puts around one message of a role."""

    first_prefix: str  # when the message opens the conversation
    prefix: str  # after earlier messages
    suffix: str


class ChatTemplate:
    """Role markers for system/user/assistant, derived from an HF tokenizer's ``chat_template``.

    Tokenizers without a template get plain ``"<role>: "`` / ``"\\n"`` markers.
    """

    def __init__(self, markers: dict[str, RoleMarkers]) -> None:
        self.markers = markers

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "ChatTemplate":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            return cls.plain()
        return cls({role: _markers_for(tokenizer, role) for role in ROLES})

    @classmethod
    def plain(cls) -> "ChatTemplate":
        return cls({role: RoleMarkers(f"{role}: ", f"{role}: ", "\n") for role in ROLES})

    def begin(self, role: str, first: bool) -> str:
        markers = self._get(role)
        return markers.first_prefix if first else markers.prefix

    def end(self, role: str) -> str:
        return self._get(role).suffix

    def _get(self, role: str) -> RoleMarkers:
        if role not in self.markers:
            raise ValueError(f"unknown chat role {role!r}; expected one of {', '.join(ROLES)}")
        return self.markers[role]


def _render(tokenizer: Any, messages: list[tuple[str, str]]) -> str:
    return tokenizer.apply_chat_template(
        [{"role": role, "content": content} for role, content in messages], tokenize=False
    )


def _markers_for(tokenizer: Any, role: str) -> RoleMarkers:
    content = _PLACEHOLDER.format(role)
    alone = _cut(tokenizer, [], role, content)
    later = _cut(tokenizer, _LEAD_IN[role] or [("user", "u")], role, content)
    if alone is None and later is None:
        raise ValueError(
            f"the tokenizer's chat template cannot render a {role} message; "
            f"use a tokenizer whose template accepts system/user/assistant roles"
        )
    # Some templates (strict user/assistant alternation) refuse a lone message;
    # then the first message simply gets the ordinary prefix.
    first_prefix, suffix = alone if alone is not None else later
    prefix = later[0] if later is not None else first_prefix
    return RoleMarkers(first_prefix, prefix, suffix)


def _cut(tokenizer: Any, lead_in: list[tuple[str, str]], role: str, content: str) -> tuple[str, str] | None:
    """(prefix, suffix) of a ``role`` message rendered after ``lead_in``, or None when the template refuses."""
    try:
        before = _render(tokenizer, lead_in) if lead_in else ""
        after = _render(tokenizer, lead_in + [(role, content)])
    except Exception:  # jinja templates raise on conversations they do not accept
        return None
    if not after.startswith(before) or content not in after:
        return None
    cut = after.index(content)
    return after[len(before) : cut], after[cut + len(content) :]
