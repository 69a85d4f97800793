"""The expressions a program appends to its state: text, role blocks, ``gen`` and ``select``.

They are plain values; :class:`treadle.lang.state.ProgramState` interprets them
when a program does ``s += expr``. ``a + b`` concatenates expressions (and
strings) into one :class:`Concat`, so ``"Answer: " + gen("a")`` is one expression.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Union

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every frontend expression; supports ``+`` with strings and other expressions."""

    def __add__(self, other: "ExprLike") -> "Concat":
        return Concat([self, as_expr(other)])

    def __radd__(self, other: "ExprLike") -> "Concat":
        return Concat([as_expr(other), self])


ExprLike = Union[str, Expr]


@dataclass
class Text(Expr):
    """Literal prompt text, appended unchanged."""

    text: str


@dataclass
class Concat(Expr):
    """Several expressions run one after the other."""

    parts: list[Expr]

    def __post_init__(self) -> None:
        flat: list[Expr] = []
        for part in self.parts:
            flat.extend(part.parts if isinstance(part, Concat) else [part])
        self.parts = flat


@dataclass
class Gen(Expr):
    """Generate text into variable ``name``; unset sampling fields use the run's defaults."""

    name: str | None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None

    def sampling_overrides(self) -> dict:
        """The sampling fields this call sets explicitly, in /generate's vocabulary."""
        values = {
            "max_new_tokens": self.max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "regex": self.regex,
            "json_schema": self.json_schema,
        }
        return {key: value for key, value in values.items() if value is not None}


@dataclass
class Select(Expr):
    """Append whichever of ``choices`` the model finds most likely, and store it in ``name``."""

    name: str | None
    choices: list[str]


@dataclass
class Role(Expr):
    """A chat message of ``role`` whose content is the expressions in ``content``."""

    role: str
    content: list[Expr] = field(default_factory=list)


def as_expr(value: ExprLike) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(
        f"a program can only append str or treadle.lang expressions (gen, select, user, ...), "
        f"got {type(value).__name__}: {value!r}"
    )


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    regex: str | None = None,
    *,
    stop_token_ids: list[int] | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    json_schema: str | dict | None = None,
) -> Gen:
    """Generate text and store it as ``s[name]``.

    ``regex`` or ``json_schema`` (a dict or JSON text) constrain decoding with
    the backend's grammar engine: the text matches them unless ``max_tokens``
    cuts it short. The backend checks them; an invalid one fails the program.
    """
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"gen({name!r}): max_tokens must be >= 0, got {max_tokens}")
    if regex is not None and json_schema is not None:
        raise ValueError(f"gen({name!r}): give regex or json_schema, not both")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            raise ValueError(f"gen({name!r}): invalid regex {regex!r}: {exc}") from None
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    return Gen(
        name=name,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        regex=regex,
        json_schema=json_schema,
    )


def select(name: str | None = None, choices: list[str] | tuple[str, ...] = ()) -> Select:
    """Pick the choice with the highest mean token log-probability after the current text."""
    choices = list(choices)
    if not choices:
        raise ValueError(f"select({name!r}) needs at least one choice")
    for choice in choices:
        if not isinstance(choice, str) or choice == "":
            raise ValueError(f"select({name!r}): every choice must be a non-empty string, got {choice!r}")
    return Select(name=name, choices=choices)


def _role(role: str, content: tuple[ExprLike, ...]) -> Role:
    return Role(role=role, content=[as_expr(part) for part in content])


def system(*content: ExprLike) -> Role:
    """A system message; the backend tokenizer's chat template wraps it."""
    return _role("system", content)


def user(*content: ExprLike) -> Role:
    """A user message; the backend tokenizer's chat template wraps it."""
    return _role("user", content)


def assistant(*content: ExprLike) -> Role:
    """An assistant message, usually holding a ``gen``; the chat template wraps it."""
    return _role("assistant", content)
