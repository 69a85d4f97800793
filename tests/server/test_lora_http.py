"""LoRA adapters over real HTTP with the official openai client: ``<model>:<adapter>`` names, /v1/models, the native
``lora_path``, loading and unloading at run time (admin key, allowed folders, unloading waits for its requests), and
bad folders refused while the server keeps serving."""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest

from peft_adapters import ALL_PROJECTIONS, make_peft_adapter, peft_greedy
from treadle.core.config import ServerConfig
from treadle.server.launch import ServerHandle, launch_server

API_KEY, ADMIN_KEY = "user-key", "admin-key"
PROMPT = [5, 17, 42, 8, 99, 3, 250, 11, 7, 64]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-http")
    (root / "allowed").mkdir()
    return {"root": str(root),
            "a": make_peft_adapter(tiny_model_dir, root / "a", rank=8, targets=ALL_PROJECTIONS, seed=1),
            "b": make_peft_adapter(tiny_model_dir, root / "allowed" / "b", rank=16, seed=2)}


@pytest.fixture(scope="module")
def references(tiny_model_dir, folders) -> dict[str | None, list[int]]:
    refs = {name: peft_greedy(tiny_model_dir, folders[name], [PROMPT], NEW_TOKENS)[0] for name in ("a", "b")}
    refs[None] = peft_greedy(tiny_model_dir, None, [PROMPT], NEW_TOKENS)[0]
    return refs


@pytest.fixture(scope="module")
def server(tiny_model_dir, folders) -> ServerHandle:
    config = ServerConfig(
        model={"path": tiny_model_dir, "served_model_name": "tiny", "dtype": "float32"},
        cache={"max_total_tokens": 4096},
        server={"port": 0, "log_level": "warning", "api_key": API_KEY, "admin_api_key": ADMIN_KEY},
        lora={"paths": {"a": folders["a"]}, "allowed_dirs": [f"{folders['root']}/allowed"], "max_rank": 16},
        plugins=["treadle.plugins.lora_backends.torch"],
    )
    handle = launch_server(config, timeout=180)
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def admin(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as c:
        yield c


def generate(admin: httpx.Client, lora_path: str | None, max_new_tokens: int = NEW_TOKENS) -> httpx.Response:
    return admin.post("/generate", json={"input_ids": PROMPT, "lora_path": lora_path, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})


def complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_native_and_openai_requests_run_their_adapter(client, admin, references):
    assert generate(admin, "a").json()["output_ids"] == references["a"]
    assert generate(admin, None).json()["output_ids"] == references[None]
    adapted, base = complete(client, "tiny:a"), complete(client, "tiny")
    assert adapted.model == "tiny:a"
    assert adapted.choices[0].text == generate(admin, "a").json()["text"]
    assert base.choices[0].text == generate(admin, None).json()["text"]
    assert adapted.choices[0].text != base.choices[0].text


def test_models_lists_the_adapters(client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny:a"]
    assert client.models.retrieve("tiny:a").root.endswith("/a")


def test_unknown_adapter_is_a_400_naming_the_loaded_ones(client, admin):
    with pytest.raises(openai.BadRequestError, match=r"unknown LoRA adapter 'nope'; loaded adapters: a"):
        complete(client, "tiny:nope")
    body = generate(admin, "nope").json()
    assert "loaded adapters: a" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        complete(client, "other:a")


def test_load_and_unload_at_run_time(client, admin, folders, references):
    user = httpx.post(f"{admin.base_url}/load_lora_adapter", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"lora_name": "b", "lora_path": folders["b"]})
    assert user.status_code == 401
    assert admin.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": folders["b"]}).json()["success"]
    assert "tiny:b" in [m.id for m in client.models.list().data]
    assert generate(admin, "b").json()["output_ids"] == references["b"]
    assert admin.post("/unload_lora_adapter", json={"lora_name": "b"}).json()["success"]
    with pytest.raises(openai.BadRequestError, match="unknown LoRA adapter 'b'"):
        complete(client, "tiny:b")


def test_unloading_waits_for_the_adapters_requests(admin, folders):
    assert admin.post("/load_lora_adapter", json={"lora_name": "slow", "lora_path": folders["b"]}).json()["success"]
    finished: list[dict] = []
    worker = threading.Thread(target=lambda: finished.append(generate(admin, "slow", max_new_tokens=200).json()))
    worker.start()
    while admin.get("/get_server_info").json()["kv"]["running"] == 0 and worker.is_alive():
        pass
    unloaded = admin.post("/unload_lora_adapter", json={"lora_name": "slow"}, timeout=120).json()
    worker.join()
    assert unloaded["success"]
    assert finished[0]["meta_info"]["completion_tokens"] == 200  # ran to its end under the adapter


def test_bad_folders_are_refused_and_the_server_keeps_serving(admin, folders, references):
    shutil.copytree(folders["b"], f"{folders['root']}/outside")
    escape = f"{folders['root']}/allowed/../outside"  # resolved before it is checked
    outside = admin.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": escape})
    assert outside.status_code == 403 and "outside the allowed folders" in outside.json()["error"]["message"]
    broken = Path(folders["root"]) / "allowed" / "broken"
    shutil.copytree(folders["b"], broken)
    (broken / "adapter_model.safetensors").unlink()
    refused = admin.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(broken)})
    assert refused.status_code == 400
    assert "adapter_model.safetensors is missing" in refused.json()["error"]["message"]
    taken = admin.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": folders["b"]})
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    assert generate(admin, "a").json()["output_ids"] == references["a"]
