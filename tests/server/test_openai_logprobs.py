"""/v1/completions log-probs as evaluation clients use them (lm-eval-harness's loglikelihood requests):
``echo=True, logprobs=k, max_tokens=0`` returns the prompt's own token log-probs, checked against HF transformers'
log-softmax on the same tiny model, through the official openai client and a real server."""

from __future__ import annotations

import signal
from itertools import accumulate

import openai
import pytest
import torch

from treadle.server.launch import ServerHandle, launch_server

MODEL = "tiny"
PROMPT = "The capital of France is Paris. The quick"
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, make_config) -> ServerHandle:
    handle = launch_server(make_config(tiny_model_dir), timeout=180)
    yield handle
    handle.shutdown(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_model_dir))


def hf_reference(hf, ids: list[int], k: int) -> tuple[list[float | None], list[dict[str, float] | None]]:
    """HF's log-prob of each token given the ones before it, and the OpenAI top-``k`` entry of each position."""
    model, tokenizer = hf
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    token_logprobs: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for pos in range(1, len(ids)):
        row = log_probs[pos - 1]
        top = torch.topk(row, k)
        entry: dict[str, float] = {}
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            entry.setdefault(tokenizer.decode([token_id]), value)
        entry.setdefault(tokenizer.decode([ids[pos]]), row[ids[pos]].item())
        token_logprobs.append(row[ids[pos]].item())
        tops.append(entry)
    return token_logprobs, tops


def hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    model, _ = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return out[0, len(ids):].tolist()


def assert_matches_reference(logprobs, hf, ids: list[int], k: int) -> None:
    _, tokenizer = hf
    expected_logprobs, expected_tops = hf_reference(hf, ids, k)
    assert logprobs.tokens == [tokenizer.decode([token_id]) for token_id in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(expected_logprobs[1:], abs=TOLERANCE)
    assert len(logprobs.top_logprobs) == len(ids)
    for got, expected in zip(logprobs.top_logprobs[1:], expected_tops[1:]):
        assert got == pytest.approx(expected, abs=TOLERANCE) and len(got) <= k + 1
    assert logprobs.text_offset == list(accumulate((len(t) for t in logprobs.tokens[:-1]), initial=0))


@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("prompt_kind", ["text", "token ids"])
def test_echo_with_no_new_tokens_scores_the_prompt(client: openai.OpenAI, hf, k: int, prompt_kind: str) -> None:
    ids = hf[1].encode(PROMPT)
    prompt = PROMPT if prompt_kind == "text" else ids
    completion = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=k, max_tokens=0)
    choice = completion.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 0 and completion.usage.prompt_tokens == len(ids)
    assert_matches_reference(choice.logprobs, hf, ids, k)
    assert "".join(choice.logprobs.tokens) == choice.text  # byte-level: the offsets index the returned text


def test_a_batch_of_token_id_prompts_scores_each_prompt(client: openai.OpenAI, hf) -> None:
    """lm-eval-harness's local-completions sends its requests so: several tokenized prompts in one call."""
    batch = [hf[1].encode(PROMPT), hf[1].encode("Hello world! How are you"), hf[1].encode("Once upon")]
    completion = client.completions.create(model=MODEL, prompt=batch, echo=True, logprobs=1, max_tokens=0,
                                           temperature=0, seed=1234)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    for choice, ids in zip(completion.choices, batch):
        assert_matches_reference(choice.logprobs, hf, ids, 1)


def test_echo_with_new_tokens_covers_prompt_then_completion(client: openai.OpenAI, hf) -> None:
    ids = hf[1].encode(PROMPT)
    continuation = hf_greedy(hf, ids, 4)
    completion = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=4,
                                           temperature=0, extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert choice.text == PROMPT + hf[1].decode(continuation)
    assert_matches_reference(choice.logprobs, hf, ids + continuation, 2)
    # Greedy: each new token is its position's most likely one (lm-eval-harness's is_greedy check).
    for token, top in zip(choice.logprobs.tokens[len(ids):], choice.logprobs.top_logprobs[len(ids):]):
        assert max(top, key=top.get) == token


def test_streamed_echo_log_probs_add_up_to_the_whole_response(client: openai.OpenAI, hf) -> None:
    ids = hf[1].encode(PROMPT)
    options = dict(model=MODEL, prompt=ids, echo=True, logprobs=3, max_tokens=5, temperature=0,
                   extra_body={"ignore_eos": True})
    whole = client.completions.create(**options).choices[0]
    parts = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for chunk in client.completions.create(stream=True, **options):
        choice = chunk.choices[0]
        text += choice.text
        for key in parts:
            parts[key] += getattr(choice.logprobs, key)
    assert text == whole.text
    assert parts["tokens"] == whole.logprobs.tokens and parts["text_offset"] == whole.logprobs.text_offset
    assert parts["token_logprobs"][0] is None
    assert parts["token_logprobs"][1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=TOLERANCE)


def test_without_echo_the_log_probs_are_the_completions_own(client: openai.OpenAI, hf) -> None:
    ids = hf[1].encode(PROMPT)
    continuation = hf_greedy(hf, ids, 3)
    choice = client.completions.create(model=MODEL, prompt=ids, logprobs=1, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0]
    expected, _ = hf_reference(hf, ids + continuation, 1)
    assert choice.logprobs.tokens == [hf[1].decode([t]) for t in continuation]
    assert choice.logprobs.token_logprobs == pytest.approx(expected[len(ids):], abs=TOLERANCE)
    assert choice.logprobs.text_offset[0] == 0 and len(choice.logprobs.top_logprobs) == 3


def test_chat_top_logprobs_without_logprobs_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs" and "logprobs" in info.value.body["message"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           logprobs=True, top_logprobs=2)
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2
