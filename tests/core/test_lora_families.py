"""A LoRA adapter on every model family: greedy output token-identical to HF transformers + PEFT (Mixtral: its
attention projections; the experts take no adapter)."""

from __future__ import annotations

import pytest

from peft_adapters import ALL_PROJECTIONS, ATTENTION, make_peft_adapter, peft_greedy
from treadle import Engine, SamplingParams
from treadle.core.lora.adapter import LoRAAdapterError
from treadle.testing import models

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 64], [300, 301, 9]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
FAMILIES = {
    "mistral": (models.make_tiny_mistral, ALL_PROJECTIONS),
    "qwen2": (models.make_tiny_qwen2, ALL_PROJECTIONS),
    "qwen3": (models.make_tiny_qwen3, ALL_PROJECTIONS),
    "mixtral": (models.make_tiny_mixtral, ATTENTION),
    "qwen3_moe": (models.make_tiny_qwen3_moe, ATTENTION),
}


def _engine(base: str, paths: dict[str, str]) -> Engine:
    return Engine({"model": {"path": base, "device": "cpu", "dtype": "float32"}, "cache": {"max_total_tokens": 512},
                   "lora": {"paths": paths}, "plugins": ["treadle.plugins.lora_backends.torch"]})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_peft(family, tmp_path):
    make, targets = FAMILIES[family]
    base = make(tmp_path / "base")
    adapter = make_peft_adapter(base, tmp_path / "adapter", rank=8, targets=targets)
    expected = peft_greedy(base, adapter, PROMPTS, GREEDY.max_new_tokens)
    assert expected != peft_greedy(base, None, PROMPTS, GREEDY.max_new_tokens)
    with _engine(base, {"a": adapter}) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path=["a", "a"])
        assert [o.token_ids for o in outputs] == expected


def test_mixtral_refuses_an_adapter_of_projections_it_does_not_have(tmp_path):
    base = models.make_tiny_mixtral(tmp_path / "mixtral")
    llama = models.make_tiny_llama(tmp_path / "llama")
    adapter = make_peft_adapter(llama, tmp_path / "mlp", rank=4, targets=["gate_proj"])
    with pytest.raises(LoRAAdapterError, match=r"mlp.gate_proj is not a projection of this model \(it has "
                                               r"k_proj, o_proj, q_proj, v_proj"):
        _engine(base, {"mlp": adapter})
