"""Images and videos over HTTP to a Qwen2.5-VL server: chat image_url parts (data:, file://, http(s)), video_url and
video (frame list) parts, and /generate image_data and video_data give HF transformers' greedy tokens; bad images,
videos, paths and URLs are 400s naming the problem."""

from __future__ import annotations

import base64
import io
import signal

import httpx
import openai
import pytest

from treadle.core.config import ServerConfig
from treadle.server.launch import ServerHandle, launch_server
from treadle.testing.multimodal import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_END_ID, VISION_START_ID, \
    animated_gif, hf_vl_greedy, make_tiny_qwen2_5_vl, random_image
from treadle.testing.tokenizer import make_tiny_tokenizer

PLUGINS = ["treadle.plugins.models.qwen2_5_vl"]  # until the package is reinstalled with this branch's entry points
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen2_5_vl-text")
    make_tiny_qwen2_5_vl(path)
    make_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    image = random_image(120, 90, seed=5)
    image.save(folder / "cat.png")
    return folder, image, data_url(image)


def data_url(image, format: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return f"data:image/{format.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def server(model_dir, media) -> ServerHandle:
    folder = media[0]
    handle = launch_server(ServerConfig(
        model={"path": model_dir, "served_model_name": "tiny"}, cache={"max_total_tokens": 4096},
        server={"port": 0, "log_level": "warning"}, plugins=PLUGINS,
        multimodal={"local_media_folders": [str(folder)], "max_images_per_request": 2, "fetch_timeout": 2,
                                   "max_videos_per_request": 1, "max_video_frames": 4}),
        timeout=180)
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


def chat(server: ServerHandle, url: str) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}]}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)


def test_chat_image_and_generate_match_hf(server, model_dir, media):
    from transformers import AutoConfig, AutoTokenizer

    from treadle.core.multimodal.processor import MultimodalProcessor

    folder, image, data_url = media
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = [5, 17, VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, 42, 8]
    generated = httpx.post(f"{server.base_url}/generate", json={
        "input_ids": prompt, "image_data": data_url,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert generated.status_code == 200, generated.text
    processor = MultimodalProcessor.for_model(model_dir, AutoConfig.from_pretrained(model_dir))
    expanded = processor.process(prompt, [image])[0]
    assert generated.json()["output_ids"] == hf_vl_greedy(model_dir, expanded, [image], NEW_TOKENS)[0]

    by_data, by_file = chat(server, data_url), chat(server, f"file://{folder / 'cat.png'}")
    assert by_data.status_code == 200, by_data.text
    assert by_file.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is this?" + tokenizer.decode([VISION_START_ID, IMAGE_TOKEN_ID,
                                                                         VISION_END_ID])}],
        tokenize=False, add_generation_prompt=True)
    ids = processor.process(tokenizer.encode(rendered, add_special_tokens=False), [image])[0]
    want = hf_vl_greedy(model_dir, ids, [image], NEW_TOKENS)[0]
    assert len(by_data.json()["choices"][0]["logprobs"]["content"]) == NEW_TOKENS
    assert by_data.json()["choices"][0]["message"]["content"] == tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("url, code, message", [
    ("data:image/png;base64,aGVsbG8=", "invalid_image", "not a readable image"),
    ("file:///etc/passwd", "media_path_not_allowed", "outside the folders"),
    ("http://127.0.0.1:9/cat.png", "image_fetch_failed", "could not fetch"),
    ("ftp://example.com/cat.png", None, "unsupported image or video URL"),
])
def test_bad_images_are_400(server, url, code, message):
    response = chat(server, url)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["code"] == code


def test_too_many_images_is_400(server, media):
    data_url = media[2]
    response = httpx.post(f"{server.base_url}/generate", json={
        "input_ids": [5] + [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID] * 3, "image_data": [data_url] * 3,
        "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert response.status_code == 400
    assert "max_images_per_request = 2" in response.json()["error"]["message"]


def test_openai_client_image_url(server, media):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": media[2]}},
                                     {"type": "text", "text": "Describe."}]}])
    assert reply.choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="module")
def video(media):
    """Three frames (few colours, so a GIF holds them exactly) as PNG data: URLs and as a GIF at 2 frames per second
    in the media folder."""
    frames = [random_image(100, 80, seed=seed).quantize(64).convert("RGB") for seed in (7, 8, 9)]
    (media[0] / "clip.gif").write_bytes(animated_gif(frames, duration_ms=500))
    return frames, [data_url(frame) for frame in frames]


def test_video_over_http_matches_hf(server, model_dir, media, video):
    """/generate video_data (frame URLs) gives HF's greedy tokens for the frames treadle's processor prepares; the
    openai client's chat with a frame-list part and with a video_url (the same frames as a GIF file) answers the
    same text."""
    from transformers import AutoConfig, AutoTokenizer

    from treadle.core.multimodal.processor import MultimodalProcessor

    frames, frame_urls = video
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": tokenizer.decode([VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID]) + "Describe."}],
        tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(rendered, add_special_tokens=False)
    generated = httpx.post(f"{server.base_url}/generate", json={
        "input_ids": prompt, "video_data": [frame_urls],
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert generated.status_code == 200, generated.text
    ids, inputs = MultimodalProcessor.for_model(model_dir, AutoConfig.from_pretrained(model_dir)).process(
        prompt, [], video_data=[frames])
    tokens = generated.json()["output_ids"]
    assert tokens == hf_vl_greedy(model_dir, ids, [], NEW_TOKENS, videos=inputs.items)[0]

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for part in ({"type": "video", "video": frame_urls},
                 {"type": "video_url", "video_url": {"url": f"file://{media[0] / 'clip.gif'}"}}):
        reply = client.chat.completions.create(model="tiny", max_tokens=NEW_TOKENS, temperature=0, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "Describe."}]}])
        assert reply.choices[0].message.content == tokenizer.decode(tokens, skip_special_tokens=True)


def test_bad_videos_are_400(server, video):
    frame_urls = video[1]
    marks = [VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID]
    for videos, message, code in [
            ([frame_urls, frame_urls], "max_videos_per_request = 1", "too_many_videos"),
            ([frame_urls * 2], "max_video_frames = 4", "video_too_large"),
            (["data:image/gif;base64,aGVsbG8="], "not a video this server can decode", "invalid_video"),
            (["file:///etc/hosts"], "outside the folders", "media_path_not_allowed")]:
        response = httpx.post(f"{server.base_url}/generate", json={
            "input_ids": [5] + marks * len(videos), "video_data": videos, "sampling_params": {"max_new_tokens": 2}},
            timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["code"] == code, error
