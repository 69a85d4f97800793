"""A Qwen-family model end to end: the hermes parser picked by family, a template that renders tools and
opens <think> itself, think_tags reasoning — through the openai client.

The model is a tiny random Qwen3; a regex makes it write what a real Qwen3 would (reasoning, then a
<tool_call> block), so the test checks treadle's reading of it, not the model.
"""

from __future__ import annotations

import json
import signal

import openai
import pytest

from treadle.core.config import ServerConfig
from treadle.server.launch import ServerHandle, launch_server

MODEL = "tiny-qwen"
# Qwen-style: tools in a system block, calls as <tool_call> blocks, results as <tool_response>,
# and the generation prompt opens the reasoning block for the model.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# What a real Qwen3 writes after its template's "<think>\n": reasoning, the end tag, then the call.
REPLY = r'[a-z]{3,12}</think>\n\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerHandle:
    from transformers import AutoTokenizer

    from treadle.testing.models import make_tiny_qwen3
    from treadle.testing.tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen3-tools")
    make_tiny_qwen3(path)
    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    config = ServerConfig(model={"path": str(path), "served_model_name": MODEL}, reasoning={"parser": "think_tags"},
                          cache={"max_total_tokens": 4096}, server={"port": 0, "log_level": "warning"})
    handle = launch_server(config, timeout=180)
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_qwen_reply_splits_into_reasoning_and_a_hermes_call(client: openai.OpenAI) -> None:
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                   max_tokens=200, temperature=0, extra_body={"regex": REPLY})
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content.isalpha()  # the template opened <think>; the reply only closes it
    assert choice.message.content in (None, "")
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})

    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for c in delta.tool_calls or []:
            if c.id is not None:
                calls[c.index] = [c.function.name, c.function.arguments or ""]
            else:
                calls[c.index][1] += c.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, finish) == (choice.message.reasoning_content, "tool_calls")
    assert content == (choice.message.content or "")
    assert calls == {0: ["get_weather", call.function.arguments]}


def test_template_renders_tools_and_the_call_history(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Weather in Paris?"}]
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]

    def prompt_tokens(messages, **fields) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **fields)
        return reply.usage.prompt_tokens

    plain = prompt_tokens(question)
    with_tools = prompt_tokens(question, tools=[WEATHER])
    tools_json = json.dumps(WEATHER)  # the template writes the tool itself (no fallback instructions)
    assert with_tools > plain and with_tools - plain < len(tools_json) + 40
    assert prompt_tokens(history, tools=[WEATHER]) > with_tools + len('{"name": "get_weather"') // 4
