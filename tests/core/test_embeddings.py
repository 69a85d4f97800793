"""Embedding models (model.task: embed): pooled final hidden states equal HF transformers' for tiny Qwen3/Qwen2."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine
from treadle.core.request import InvalidRequestError
from treadle.testing.embedding import hf_embeddings, make_tiny_embedding_model
from treadle.testing.engine import assert_kv_accounted

PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6],
    [5, 17, 42, 8, 99, 3, 250, 11, 200, 12],  # shares an 8-token prefix with the first
    [300, 301, 9],
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6, 120, 121, 122, 123, 124],
]
# Until the package is reinstalled with this branch's entry points, the built-in poolings are named here.
PLUGINS = ["treadle.plugins.poolings.builtin"]


def make_engine(model_dir: str, **sections) -> Engine:
    config = {"model": {"path": model_dir, "dtype": "float32", "device": "cpu"}, "cache": {"max_total_tokens": 2048},
              "plugins": PLUGINS}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return Engine(config)


def assert_close(got: list[list[float]], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for vector, reference in zip(got, want):
        torch.testing.assert_close(torch.tensor(vector), reference, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory) -> str:
    return make_tiny_embedding_model(tmp_path_factory.mktemp("qwen3-emb"), "qwen3", pooling="last")


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3-lm"))


@pytest.fixture(scope="module")
def qwen2_mean(tmp_path_factory) -> str:
    return make_tiny_embedding_model(tmp_path_factory.mktemp("qwen2-emb"), "qwen2", pooling="mean", normalize=False)


@pytest.mark.parametrize("scheduler", [{}, {"chunked_prefill_size": 5}, {"disable_overlap": True}],
                         ids=["whole", "chunked", "no-overlap"])
def test_last_token_normalized_matches_hf(qwen3_last, scheduler):
    want = hf_embeddings(qwen3_last, PROMPTS, "last", normalize=True)
    with make_engine(qwen3_last, scheduler=scheduler) as engine:
        assert engine.resolved_config.model.task == "embed"  # from modules.json
        assert engine.resolved_config.model.pooling == "last"
        batch = engine.encode(input_ids=PROMPTS)
        single = engine.encode(input_ids=PROMPTS[0])
        assert_close([o.embedding for o in batch], want)
        assert_close([single.embedding], want[:1])
        assert single.cached_tokens > 0  # the radix cache served the repeated prompt's prefix
        assert_kv_accounted(engine)


@pytest.mark.parametrize("scheduler", [{}, {"chunked_prefill_size": 5}], ids=["whole", "chunked"])
def test_mean_pooling_unnormalized_matches_hf(qwen2_mean, scheduler):
    want = hf_embeddings(qwen2_mean, PROMPTS, "mean", normalize=False)
    with make_engine(qwen2_mean, scheduler=scheduler) as engine:
        assert not engine.resolved_config.model.normalize_embeddings
        assert_close([o.embedding for o in engine.encode(input_ids=PROMPTS)], want)
        # Mean pooling reads every position: a repeated prompt is computed again, not served from the cache.
        again = engine.encode(input_ids=PROMPTS[0])
        assert again.cached_tokens == 0
        assert_close([again.embedding], want[:1])
        assert_kv_accounted(engine)


def test_cls_pooling_from_config(qwen2_mean):
    want = hf_embeddings(qwen2_mean, PROMPTS, "cls", normalize=True)
    with make_engine(qwen2_mean, model={"pooling": "cls", "normalize_embeddings": True},
                     scheduler={"chunked_prefill_size": 5}) as engine:
        assert_close([o.embedding for o in engine.encode(input_ids=PROMPTS)], want)


def test_causal_lm_served_for_embeddings(tiny_qwen3_dir):
    """A causal-LM checkpoint with model.task: embed: its lm_head is skipped; last-token, normalized."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.nn.functional.normalize(hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)
                for ids in PROMPTS]
    with make_engine(tiny_qwen3_dir, model={"task": "embed"}) as engine:
        assert engine.scheduler.worker.runner.model.lm_head is None
        assert_close([o.embedding for o in engine.encode(input_ids=PROMPTS)], want)


def test_dimensions(qwen3_last):
    with make_engine(qwen3_last, model={"matryoshka": True}) as engine:
        full = engine.encode(input_ids=PROMPTS[0]).embedding
        short = engine.encode(input_ids=PROMPTS[0], dimensions=16).embedding
        assert len(short) == 16
        torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0))
        with pytest.raises(InvalidRequestError, match="between 1 and 64"):
            engine.encode(input_ids=PROMPTS[0], dimensions=65)
    with make_engine(qwen3_last) as engine:
        with pytest.raises(InvalidRequestError, match="cannot be shortened") as info:
            engine.encode(input_ids=PROMPTS[0], dimensions=16)
        assert info.value.param == "dimensions"


def test_task_mismatch_is_refused(qwen3_last, tiny_qwen3_dir):
    with make_engine(qwen3_last) as engine:
        with pytest.raises(InvalidRequestError, match="serves embeddings") as info:
            engine.generate(input_ids=PROMPTS[0])
        assert info.value.code == "model_task_mismatch"
    with make_engine(tiny_qwen3_dir) as engine:
        assert engine.resolved_config.model.task == "generate"
        with pytest.raises(InvalidRequestError, match="serves no embeddings"):
            engine.encode(input_ids=PROMPTS[0])


@pytest.mark.parametrize("name", ["last", "mean", "cls"])
def test_builtin_poolings_conform(name):
    from treadle.core.embedding.pooling import BUILTIN_POOLINGS
    from treadle.testing import check_pooling

    check_pooling(BUILTIN_POOLINGS[name])


class MaxPooling:
    """A plugin's pooling: the largest value of each hidden dimension over the prompt."""

    def first_needed_position(self, prompt_len):
        return 0

    def reduce(self, hidden, chunk):
        out = torch.full((int(chunk.starts.shape[0]), hidden.shape[1]), float("-inf"))
        rows = chunk.owner[:, None].expand(-1, hidden.shape[1])
        return out.scatter_reduce_(0, rows, hidden.float(), "amax")

    def combine(self, earlier, part, first_position):
        return torch.maximum(earlier, part)

    def finish(self, pooled, prompt_len):
        return pooled


class MaxPoolingPlugin:
    from treadle.core.hookspecs import hookimpl

    @staticmethod
    @hookimpl
    def treadle_register_poolings(register):
        register("max", MaxPooling)


def test_a_plugin_adds_a_pooling(qwen2_mean):
    """A checkpoint whose Pooling config says max tokens is served by a plugin's ``max`` pooling."""
    from transformers import AutoModel

    from treadle.core.registry import build_registry
    from treadle.testing import check_pooling

    check_pooling(MaxPooling)
    hf = AutoModel.from_pretrained(qwen2_mean, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(torch.tensor([ids])).last_hidden_state[0].amax(0) for ids in PROMPTS]
    registry = build_registry(PLUGINS, extra_plugins=[MaxPoolingPlugin()])
    config = {"model": {"path": qwen2_mean, "pooling": "max", "dtype": "float32"},
              "cache": {"max_total_tokens": 2048}, "scheduler": {"chunked_prefill_size": 4}}
    with Engine(config, registry=registry) as engine:
        assert_close([o.embedding for o in engine.encode(input_ids=PROMPTS)], want)
