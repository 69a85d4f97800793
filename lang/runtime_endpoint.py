"""RuntimeEndpoint: programs run against a treadle server through its native ``POST /generate``."""

from __future__ import annotations

import json
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterator

from treadle.lang.backend import Backend, Completion, Scored, slice_scores


if TYPE_CHECKING:
    import httpx


class RuntimeEndpointError(RuntimeError):
    """The server answered a request with an error, or with something that is not /generate's format."""


class RuntimeEndpoint(Backend):
    """A running treadle server at ``base_url`` (e.g. ``RuntimeEndpoint("http://127.0.0.1:30000")``).

    Prompts are tokenized here, with the server model's tokenizer: it is loaded
    from ``tokenizer_path`` when given, else from the model folder the server
    reports in ``/get_server_info`` (so by default client and server share a machine).
    Safe to use from several threads; the server batches concurrent requests.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        tokenizer_path: str | None = None,
        timeout: float | None = 600.0,
    ) -> None:
        try:
            import httpx
        except ImportError:
            raise ImportError("RuntimeEndpoint needs httpx: pip install httpx") from None
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._tokenizer_path = tokenizer_path

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        path = self._tokenizer_path or self._served_tokenizer_path()
        return AutoTokenizer.from_pretrained(path)

    def get_server_info(self) -> dict[str, Any]:
        response = self._client.get("/get_server_info")
        _raise_for_status(response, "GET /get_server_info")
        return response.json()

    def flush_cache(self) -> None:
        _raise_for_status(self._client.post("/flush_cache"), "POST /flush_cache")

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Completion:
        body = self._post_generate({"input_ids": input_ids, "sampling_params": sampling_params})
        return _completion(body)

    def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Iterator[str | Completion]:
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "stream": True}
        sent = ""
        last: dict[str, Any] | None = None
        with self._client.stream("POST", "/generate", json=payload) as response:
            if response.status_code != 200:
                response.read()
                _raise_for_status(response, "POST /generate (stream)")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeEndpointError(f"{self.base_url} POST /generate stream failed: {event['error']}")
                last = event
                text = event.get("text", "")
                if text.startswith(sent) and len(text) > len(sent):
                    yield text[len(sent) :]
                    sent = text
        if last is None:
            raise RuntimeEndpointError(f"{self.base_url} POST /generate stream ended without any result")
        yield _completion(last)

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[Scored]:
        logprob_start_len = min(starts)
        body = self._post_generate(
            {
                "input_ids": sequences,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": logprob_start_len,
            }
        )
        if not isinstance(body, list) or len(body) != len(sequences):
            raise RuntimeEndpointError(f"POST /generate with {len(sequences)} inputs did not return a list of as many")
        per_sequence = [[pair[0] for pair in item["meta_info"]["input_token_logprobs"]] for item in body]
        scored = slice_scores(sequences, starts, logprob_start_len, per_sequence)
        for result, item in zip(scored, body):
            result.cached_tokens = item["meta_info"].get("cached_tokens", 0)
        return scored

    def shutdown(self) -> None:
        self._client.close()

    def _post_generate(self, payload: dict[str, Any]) -> Any:
        response = self._client.post("/generate", json=payload)
        _raise_for_status(response, "POST /generate")
        return response.json()

    def _served_tokenizer_path(self) -> str:
        info = self.get_server_info()
        model_info = info.get("model_info") or {}
        model_config = (info.get("config") or {}).get("model") or {}
        path = model_config.get("tokenizer_path") or model_info.get("model_path") or info.get("model_path")
        if path is None and "model" in (info.get("config") or {}) and model_config.get("path") is None:
            from treadle.core.loading.default_model import default_model

            path = default_model()  # the server runs the embedded model
        if not path:
            raise RuntimeEndpointError(
                f"{self.base_url}/get_server_info does not say which model it serves; "
                f"pass RuntimeEndpoint(..., tokenizer_path=...)"
            )
        return path


def _completion(body: dict[str, Any]) -> Completion:
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    return Completion(
        text=body.get("text", ""),
        output_ids=list(body.get("output_ids") or []),
        finish_reason=finish.get("type") if isinstance(finish, dict) else finish,
        matched_stop=finish.get("matched") if isinstance(finish, dict) else None,
        prompt_tokens=meta.get("prompt_tokens", 0),
        completion_tokens=meta.get("completion_tokens", 0),
        cached_tokens=meta.get("cached_tokens", 0),
    )


def _raise_for_status(response: "httpx.Response", what: str) -> None:
    if response.status_code == 200:
        return
    try:
        detail: Any = response.json()
    except ValueError:
        detail = response.text
    raise RuntimeEndpointError(f"{what} to {response.url} failed with HTTP {response.status_code}: {detail}")
