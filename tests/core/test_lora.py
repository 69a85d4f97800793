"""LoRA adapters through the Engine: token-identical to HF transformers + PEFT, alone and mixed in one batch with the
base model, prefix-cache isolation between adapters, host eviction, slot-limited admission and bad folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from peft_adapters import ALL_PROJECTIONS, make_peft_adapter, peft_greedy
from treadle import Engine, SamplingParams
from treadle.core.config import ConfigError, load_config
from treadle.core.lora.adapter import LoRAAdapterError
from treadle.core.request import InvalidRequestError
from treadle.testing.engine import assert_kv_accounted

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2], [300, 301, 9], [5, 17, 42, 8, 99, 3, 250, 11, 200, 12]]
NEW_TOKENS = 8
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TORCH_BACKEND = "treadle.plugins.lora_backends.torch"  # listed so a checkout not reinstalled since finds it


def lora_engine(base: str, paths: dict[str, str], **lora) -> Engine:
    return Engine({"model": {"path": base, "device": "cpu", "dtype": "float32"}, "cache": {"max_total_tokens": 2048},
                   "lora": {"paths": paths, **lora}, "plugins": [TORCH_BACKEND]})


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """Rank 8 on all seven projections, rank 64 on attention, and rank 16 with rsLoRA and alpha 32 on the MLP."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r8": make_peft_adapter(tiny_llama_dir, root / "r8", rank=8, targets=ALL_PROJECTIONS, seed=1),
        "r64": make_peft_adapter(tiny_llama_dir, root / "r64", rank=64, seed=2, std=0.05),
        "rs16": make_peft_adapter(tiny_llama_dir, root / "rs16", rank=16, alpha=32, use_rslora=True,
                                  targets=["gate_proj", "up_proj", "down_proj"], seed=3),
    }


@pytest.fixture(scope="module")
def references(tiny_llama_dir, adapters) -> dict[str | None, list[list[int]]]:
    refs = {name: peft_greedy(tiny_llama_dir, path, PROMPTS, NEW_TOKENS) for name, path in adapters.items()}
    refs[None] = peft_greedy(tiny_llama_dir, None, PROMPTS, NEW_TOKENS)
    return refs


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, adapters):
    with lora_engine(tiny_llama_dir, adapters, max_rank=64) as engine:
        yield engine


def test_references_differ(references):
    """Each adapter changes the greedy output (or the parity tests below could not fail)."""
    outputs = [tuple(map(tuple, references[name])) for name in ("r8", "r64", "rs16", None)]
    assert len(set(outputs)) == 4


@pytest.mark.parametrize("name", ["r8", "r64", "rs16"])
def test_one_adapter_matches_peft(engine, references, name):
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=name)
    assert [o.token_ids for o in outputs] == references[name]
    assert_kv_accounted(engine)


def test_adapters_and_base_mixed_in_one_batch(engine, references):
    engine.flush_cache()
    names = ["r8", None, "r64", "rs16", "r64", None, "r8", "rs16", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    assert [o.token_ids for o in outputs] == [references[n][i % len(PROMPTS)] for i, n in enumerate(names)]
    assert_kv_accounted(engine)


def test_prefix_cache_is_kept_per_adapter(engine, references):
    """The same prompt under r8, r64 and the base: three continuations, each its cold run's, and no run reuses
    a prefix another adapter computed; a second run under the same adapter does reuse it."""
    engine.flush_cache()
    prompt = PROMPTS[0]
    first = {name: engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
             for name in ("r8", "r64", None)}
    assert {name: out.token_ids for name, out in first.items()} == {n: references[n][0] for n in first}
    assert [out.cached_tokens for out in first.values()] == [0, 0, 0]
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="r64")
    assert again.token_ids == references["r64"][0]
    assert again.cached_tokens == len(prompt) - 1
    assert_kv_accounted(engine)


def test_unknown_adapter_is_refused_naming_the_loaded_ones(engine):
    with pytest.raises(InvalidRequestError, match=r"unknown LoRA adapter 'nope'.*r64, r8, rs16"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="nope")


def test_fewer_slots_and_host_copies_than_adapters_in_use(tiny_llama_dir, adapters, references):
    """Two device slots and one host copy for three adapters in one call: requests wait for a slot, evicted host
    copies are read again, and every output is still its solo run's."""
    with lora_engine(tiny_llama_dir, adapters, max_rank=64, max_loras_per_batch=2, max_loaded_loras=1) as engine:
        assert len(engine.scheduler.lora.loaded) == 1
        names = ["r8", "r64", "rs16", None, "rs16", "r8"]
        outputs = engine.generate(input_ids=[PROMPTS[1]] * len(names), sampling_params=GREEDY, lora_path=names)
        assert [o.token_ids for o in outputs] == [references[n][1] for n in names]
        assert len(engine.scheduler.lora.loaded) <= 2  # at most the one in use beyond the limit
        assert_kv_accounted(engine)


def _broken_copy(source: str, root: Path, name: str, edit) -> str:
    folder = root / name
    shutil.copytree(source, folder)
    edit(folder)
    return str(folder)


def _set_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_bad_adapter_folders_are_refused_and_the_engine_keeps_serving(engine, adapters, references, tmp_path):
    source = adapters["r8"]
    cases = {
        _broken_copy(source, tmp_path, "no-weights",
                     lambda f: (f / "adapter_model.safetensors").unlink()): "adapter_model.safetensors is missing",
        _broken_copy(source, tmp_path, "no-config",
                     lambda f: (f / "adapter_config.json").unlink()): "adapter_config.json is missing",
        _broken_copy(source, tmp_path, "too-wide",
                     lambda f: _set_config(f, r=128)): "rank 128 is above lora.max_rank 64",
        _broken_copy(source, tmp_path, "embeddings",
                     lambda f: _set_config(f, target_modules=["q_proj", "embed_tokens"])): "'embed_tokens' is not",
        _broken_copy(source, tmp_path, "dora", lambda f: _set_config(f, use_dora=True)): "DoRA",
        str(tmp_path / "absent"): "does not exist",
    }
    for folder, message in cases.items():
        with pytest.raises(LoRAAdapterError, match=message):
            engine.load_lora_adapter("broken", folder)
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        engine.load_lora_adapter("r8", source)
    assert engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, lora_path="r8").token_ids == references["r8"][1]


def test_unsupported_module_in_the_weights_is_refused(engine, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    def add_head(folder: Path) -> None:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
        key = next(iter(tensors))
        tensors["base_model.model.lm_head.lora_A.weight"] = tensors[key].clone()
        tensors["base_model.model.lm_head.lora_B.weight"] = tensors[key].clone()
        save_file(tensors, str(folder / "adapter_model.safetensors"))

    folder = _broken_copy(adapters["r8"], tmp_path, "head", add_head)
    with pytest.raises(LoRAAdapterError, match="target module 'lm_head'"):
        engine.load_lora_adapter("head", folder)


def test_load_and_unload_at_run_time(engine, adapters, references):
    engine.load_lora_adapter("again", adapters["r64"])
    out = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, lora_path="again")
    assert out.token_ids == references["r64"][2]
    engine.unload_lora_adapter("again")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'again'"):
        engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, lora_path="again")
    assert_kv_accounted(engine)


def test_without_a_lora_section_nothing_is_built(tiny_llama_dir):
    with Engine({"model": {"path": tiny_llama_dir, "device": "cpu"}, "cache": {"max_total_tokens": 256}}) as engine:
        assert engine.scheduler.lora is None
        assert not any(getattr(m, "output_deltas", ()) for m in engine.scheduler.worker.runner.model.modules())
        with pytest.raises(InvalidRequestError, match="serves no adapters"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="r8")


def test_config_is_validated():
    with pytest.raises(ConfigError, match="lora.max_rank"):
        load_config(overrides={"lora.max_rank": 300}, use_env=False)
    with pytest.raises(ConfigError, match="lora.max_loras_per_batch"):
        load_config(overrides={"lora.max_loras_per_batch": 0}, use_env=False)
    defaults = load_config(use_env=False)
    assert not defaults.lora.requested
    # A config crosses processes as a dump, every key then given: still no LoRA.
    assert not type(defaults)(**defaults.model_dump()).lora.requested
    assert load_config(overrides={"lora.max_loras_per_batch": 2}, use_env=False).lora.requested


def test_fp8_base_weights_take_16_bit_adapters(tmp_path, adapters):
    """An FP8 checkpoint (the tiny Llama's weights quantized) serves the tiny Llama's adapters: the slots hold the
    model's 16-bit dtype, the adapter changes the output, and a mixed batch equals each request's solo run."""
    from treadle.testing.models import make_tiny_fp8_llama

    base = make_tiny_fp8_llama(tmp_path / "fp8")
    with lora_engine(base, {"r8": adapters["r8"]}) as engine:
        lora = engine.scheduler.lora
        assert {p.a.dtype for p in lora.projections.values()} == {torch.float32}
        weights = {m.weight.dtype for m in engine.scheduler.worker.runner.model.modules()
                   if hasattr(m, "output_deltas") and m.output_deltas}
        assert weights == {torch.float8_e4m3fn}
        solo = {name: engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path=name).token_ids
                for name in ("r8", None)}
        assert solo["r8"] != solo[None]
        mixed = engine.generate(input_ids=[PROMPTS[0]] * 2, sampling_params=GREEDY, lora_path=["r8", None])
        assert [o.token_ids for o in mixed] == [solo["r8"], solo[None]]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_prefix_aware_policies_order_requests_of_every_adapter(tiny_llama_dir, adapters, references, policy):
    """The prefix-aware policies match each request among its own adapter's prefixes (and drop none)."""
    config = {"model": {"path": tiny_llama_dir, "device": "cpu", "dtype": "float32"},
              "cache": {"max_total_tokens": 2048}, "scheduler": {"policy": policy},
              "lora": {"paths": adapters, "max_rank": 64}, "plugins": [TORCH_BACKEND]}
    with Engine(config) as engine:
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="r8")  # cached under r8 only
        names = [None, "r8", "r64", "r8", None, "rs16"]
        outputs = engine.generate(input_ids=[PROMPTS[i % 3] for i in range(6)], sampling_params=GREEDY,
                                  lora_path=names)
        assert [o.token_ids for o in outputs] == [references[n][i % 3] for i, n in enumerate(names)]
        assert [o.cached_tokens > 0 for o in outputs] == [False, True, False, True, False, False]
