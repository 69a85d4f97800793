"""``@function`` programs and how they run: once, streamed, or as an ordered batch."""

from __future__ import annotations

import functools
import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from treadle.lang.backend import Backend
from treadle.lang.state import ProgramState

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | None) -> None:
    """Use ``backend`` for every ``run``/``run_batch`` that does not name one."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend | None:
    return _default_backend


class Program:
    """A frontend program: a Python function whose first parameter is the state ``s``.

    ``run(*args, **kwargs)`` calls it with a fresh :class:`ProgramState` and returns
    that state; sampling keywords of ``run`` (``temperature``, ``max_new_tokens``, ...)
    are the defaults for every ``gen`` that does not set its own.
    """

    def __init__(self, func: Callable[..., Any]) -> None:
        parameters = list(inspect.signature(func).parameters)
        if not parameters:
            raise TypeError(f"@function {func.__name__} must take the program state as its first parameter")
        self.func = func
        self.signature = inspect.signature(func)
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        stream: bool = False,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        stop: str | list[str] | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program; with ``stream=True`` return at once and run it in a background thread."""
        sampling = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "stop": stop,
            "frequency_penalty": frequency_penalty,
            "presence_penalty": presence_penalty,
            "ignore_eos": ignore_eos,
        }
        state = ProgramState(self._backend(backend), sampling, stream=stream)
        bound = self._bind(state, args, kwargs)
        if not stream:
            self.func(*bound.args, **bound.kwargs)
            return state

        def body() -> None:
            error: BaseException | None = None
            try:
                self.func(*bound.args, **bound.kwargs)
            except BaseException as exc:  # handed to the reader by wait()/text_iter()
                error = exc
            state._finish_streaming(error)

        runner = threading.Thread(target=body, name=f"treadle-lang-{self.__name__}", daemon=True)
        state._start_streaming(runner)
        runner.start()
        return state

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per dict of arguments, ``num_threads`` at a time; states come back in input order."""
        for index, item in enumerate(batch_kwargs):
            if not isinstance(item, dict):
                raise TypeError(f"run_batch: item {index} must be a dict of the program's arguments, got {item!r}")
        if "stream" in sampling:
            raise TypeError("run_batch does not stream; call run(..., stream=True) per program instead")
        if num_threads == "auto":
            num_threads = min(32, (os.cpu_count() or 1) * 4)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"run_batch: num_threads must be 'auto' or an int >= 1, got {num_threads!r}")
        resolved = self._backend(backend)
        if not batch_kwargs:
            return []
        with ThreadPoolExecutor(max_workers=min(num_threads, len(batch_kwargs))) as pool:
            futures = [pool.submit(self.run, backend=resolved, **sampling, **item) for item in batch_kwargs]
            return [future.result() for future in futures]

    def _backend(self, backend: Backend | None) -> Backend:
        chosen = backend if backend is not None else _default_backend
        if chosen is None:
            raise RuntimeError(
                f"no backend for program {self.__name__!r}: pass backend=... to run(), or call "
                f"treadle.lang.set_default_backend(EngineBackend(engine) or RuntimeEndpoint(url))"
            )
        return chosen

    def _bind(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            return self.signature.bind(state, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"program {self.__name__}{self.signature}: {exc}") from None


def function(func: Callable[..., Any]) -> Program:
    """Decorator turning ``def prog(s, ...)`` into a :class:`Program`."""
    return Program(func)
