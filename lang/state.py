"""ProgramState: the growing text of a running program, its variables, and how each expression runs.

``s += expr`` runs ``expr`` right away in the calling thread: the text grows,
``gen``/``select`` call the backend and store their results (``s[name]``).
A state made by ``run(..., stream=True)`` also records every appended piece,
which :meth:`ProgramState.text_iter` yields to another thread as it arrives.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

from treadle.lang.backend import Backend, Completion
from treadle.lang.ir import Concat, Expr, ExprLike, Gen, Role, Select, Text, as_expr


class ProgramState:
    """The state ``s`` a program receives: text so far, variables, chat messages, meta info.

    Read results with ``s["name"]``, the full prompt+output text with :meth:`text`,
    the chat turns with :meth:`messages`, and per-call accounting (finish reason,
    prompt/cached/completion tokens, ``select`` scores) with :meth:`get_meta_info`.
    """

    def __init__(self, backend: Backend, default_sampling: dict[str, Any] | None = None, stream: bool = False) -> None:
        self.backend = backend
        self.default_sampling = dict(default_sampling or {})
        self._text = ""
        self._vars: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._messages: list[dict[str, str]] = []
        self._open_role: tuple[str, int] | None = None  # (role, offset where its content starts)
        # Streaming: every appended piece as (variable or None, text), readable by any
        # number of text_iter() calls, each from the start.
        self._chunks: list[tuple[str | None, str]] | None = [] if stream else None
        self._chunk_added = threading.Condition()
        # Set by Program.run(stream=True): the thread running the body and its outcome.
        self._runner: threading.Thread | None = None
        self._finished = threading.Event()
        self._error: BaseException | None = None
        if not stream:
            self._finished.set()

    # ---- the program-facing API -------------------------------------------------------

    def __iadd__(self, other: ExprLike) -> "ProgramState":
        self._run(as_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        self._wait_if_foreign()
        if name not in self._vars:
            known = ", ".join(sorted(self._vars)) or "none yet"
            raise KeyError(f"no variable {name!r} in this program state; variables: {known}")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self._wait_if_foreign()
        return name in self._vars

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self._vars[name] = value

    def variables(self) -> dict[str, Any]:
        self._wait_if_foreign()
        return dict(self._vars)

    def text(self) -> str:
        self._wait_if_foreign()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The completed role blocks as ``[{"role": ..., "content": ...}, ...]``."""
        self._wait_if_foreign()
        return [dict(message) for message in self._messages]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        self._wait_if_foreign()
        if name not in self._meta:
            raise KeyError(f"no gen/select named {name!r} has run in this program state")
        return self._meta[name]

    def fork(self, n: int) -> "ForkGroup":
        """``n`` copies of this state that continue independently from the current text.

        The shared text is prefilled once first, so every branch's requests reuse
        it from the backend's radix cache instead of recomputing it.
        """
        if n < 1:
            raise ValueError(f"fork(n) needs n >= 1, got {n}")
        if self._text:
            self.backend.cache_prefix(self.backend.encode(self._text))
        return ForkGroup([self._copy() for _ in range(n)])

    @contextmanager
    def system(self) -> Iterator["ProgramState"]:
        with self._role_block("system"):
            yield self

    @contextmanager
    def user(self) -> Iterator["ProgramState"]:
        with self._role_block("user"):
            yield self

    @contextmanager
    def assistant(self) -> Iterator["ProgramState"]:
        with self._role_block("assistant"):
            yield self

    # ---- streaming -------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the text as it is produced (only ``var_name``'s text when given).

        On a state that was not run with ``stream=True`` this yields the finished
        text (or variable) once.
        """
        if self._chunks is None:
            yield self._vars.get(var_name, "") if var_name else self._text
            return
        read = 0
        while True:
            with self._chunk_added:
                self._chunk_added.wait_for(lambda: read < len(self._chunks) or self._finished.is_set())
                fresh = self._chunks[read:]
                done = self._finished.is_set() and read + len(fresh) == len(self._chunks)
            read += len(fresh)
            for chunk_var, chunk in fresh:
                if var_name is None or chunk_var == var_name:
                    yield chunk
            if done:
                break
        self.wait()

    def wait(self, timeout: float | None = None) -> "ProgramState":
        """Block until a streaming run has finished; re-raise the program's error if it failed."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the program did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def error(self) -> BaseException | None:
        """The exception that ended a streaming run, if any."""
        return self._error

    # ---- running expressions ------------------------------------------------------------

    def _run(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._run(part)
        elif isinstance(expr, Role):
            with self._role_block(expr.role):
                for part in expr.content:
                    self._run(part)
        elif isinstance(expr, Gen):
            self._run_gen(expr)
        elif isinstance(expr, Select):
            self._run_select(expr)
        else:
            raise TypeError(f"cannot run expression of type {type(expr).__name__}")

    @contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        if self._open_role is not None:
            raise ValueError(f"cannot open a {role} block inside the open {self._open_role[0]} block")
        template = self.backend.chat_template
        self._append(template.begin(role, first=not self._text))
        self._open_role = (role, len(self._text))
        try:
            yield
        finally:
            start = self._open_role[1]
            self._open_role = None
        self._messages.append({"role": role, "content": self._text[start:]})
        self._append(template.end(role))

    def _run_gen(self, expr: Gen) -> None:
        merged = {**self.default_sampling, **expr.sampling_overrides()}
        params = {key: value for key, value in merged.items() if value is not None}
        input_ids = self._prompt_ids("gen", expr.name)
        streaming = self._chunks is not None
        if streaming:
            completion = self._stream_gen(input_ids, params, expr.name)
        else:
            completion = self.backend.generate(input_ids, params)
        if completion.finish_reason == "abort":
            detail = f": {completion.matched_stop}" if completion.matched_stop else ""
            raise RuntimeError(f"gen({expr.name!r}) was aborted by the backend{detail}")
        value = completion.text
        if not streaming:
            self._append(value, expr.name)
        if expr.name is not None:
            self._vars[expr.name] = value
            self._meta[expr.name] = completion.meta_info()

    def _stream_gen(self, input_ids: list[int], params: dict[str, Any], name: str | None) -> Completion:
        streamed = ""
        for item in self.backend.generate_stream(input_ids, params):
            if isinstance(item, Completion):
                # The final text is authoritative (stop strings are trimmed only at the end).
                if item.text.startswith(streamed):
                    self._append(item.text[len(streamed) :], name)
                else:
                    raise RuntimeError(
                        f"streamed text {streamed!r} is not a prefix of the final text {item.text!r}"
                    )
                return item
            streamed += item
            self._append(item, name)
        raise RuntimeError("the backend's stream ended without a final result")

    def _run_select(self, expr: Select) -> None:
        prefix_ids = self._prompt_ids("select", expr.name)
        sequences = [self.backend.encode(self._text + choice) for choice in expr.choices]
        # A choice can merge with the end of the prefix into different tokens; score
        # everything after the longest common token prefix (never the first token).
        starts = [max(1, min(_common_prefix_len(prefix_ids, ids), len(ids) - 1)) for ids in sequences]
        if len(sequences) > 1:
            # Prefill the shared prefix once so every choice reads it from the radix cache.
            self.backend.cache_prefix(prefix_ids[: min(starts)])
        scored = self.backend.score(sequences, starts)
        normalized = [sum(s.token_logprobs) / len(s.token_logprobs) for s in scored]
        best = max(range(len(expr.choices)), key=lambda i: normalized[i])
        choice = expr.choices[best]
        self._append(choice, expr.name)
        if expr.name is not None:
            self._vars[expr.name] = choice
            self._meta[expr.name] = {
                "choices": list(expr.choices),
                "normalized_logprobs": normalized,
                "token_logprobs": [s.token_logprobs for s in scored],
                "cached_tokens": [s.cached_tokens for s in scored],
            }

    def _prompt_ids(self, call: str, name: str | None) -> list[int]:
        if not self._text:
            raise ValueError(f"{call}({name!r}) needs some text before it; the program state is empty")
        return self.backend.encode(self._text)

    def _append(self, text: str, var_name: str | None = None) -> None:
        if not text:
            return
        self._text += text
        if self._chunks is not None:
            with self._chunk_added:
                self._chunks.append((var_name, text))
                self._chunk_added.notify_all()

    def _copy(self) -> "ProgramState":
        child = ProgramState(self.backend, self.default_sampling)
        child._text = self._text
        child._vars = dict(self._vars)
        child._meta = dict(self._meta)
        child._messages = [dict(message) for message in self._messages]
        child._open_role = self._open_role
        return child

    # ---- used by Program.run(stream=True) -------------------------------------------

    def _start_streaming(self, runner: threading.Thread) -> None:
        self._runner = runner
        self._finished.clear()

    def _finish_streaming(self, error: BaseException | None) -> None:
        with self._chunk_added:
            self._error = error
            self._finished.set()
            self._chunk_added.notify_all()

    def _wait_if_foreign(self) -> None:
        # Inside the program body (the runner thread) reads see the text so far;
        # any other thread gets the finished result of a streaming run.
        if self._runner is not None and threading.current_thread() is not self._runner:
            self.wait()


class ForkGroup(list):
    """The branches made by :meth:`ProgramState.fork`; ``group += expr`` runs ``expr`` on all in parallel."""

    def __iadd__(self, other: ExprLike) -> "ForkGroup":  # type: ignore[override]
        expr = as_expr(other)

        def extend(state: ProgramState) -> None:
            state += expr

        with ThreadPoolExecutor(max_workers=len(self)) as pool:
            list(pool.map(extend, self))
        return self

    def join(self) -> "ForkGroup":
        """Branches run eagerly, so they are already complete; kept for SGLang-style programs."""
        return self


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
