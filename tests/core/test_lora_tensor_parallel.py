"""LoRA under tensor parallelism on the CPU (gloo): A and B sharded like the base weights (q/k/v/gate/up by output
rows, KV heads replicated; o/down by input columns, the delta added before the all-reduce) give HF + PEFT's tokens."""

from __future__ import annotations



from peft_adapters import ALL_PROJECTIONS, make_peft_adapter, peft_greedy
from treadle.core.engine import Engine
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.models import make_tiny_llama

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2], [300, 301, 9]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_tp2_adapters_match_peft(tmp_path, stores):
    # One KV head for two ranks: k_proj and v_proj's B rows are replicated like the base weights.
    base = make_tiny_llama(tmp_path / "llama", num_key_value_heads=1)
    adapters = {"all": make_peft_adapter(base, tmp_path / "all", rank=8, targets=ALL_PROJECTIONS),
                "attn": make_peft_adapter(base, tmp_path / "attn", rank=16, seed=5)}
    expected = {name: peft_greedy(base, path, PROMPTS, GREEDY["max_new_tokens"]) for name, path in adapters.items()}
    expected[None] = peft_greedy(base, None, PROMPTS, GREEDY["max_new_tokens"])
    config = {"model": {"path": base, "device": "cpu", "dtype": "float32"}, "cache": {"max_total_tokens": 256},
              "parallel": {"tp_size": 2}, "lora": {"paths": {"all": adapters["all"]}, "max_rank": 16},
              "plugins": ["treadle.plugins.lora_backends.torch"]}
    with Engine(config) as engine:
        engine.load_lora_adapter("attn", adapters["attn"])  # at run time: every rank loads it
        names = ["all", "attn", None, "attn", "all", None]
        prompts = [PROMPTS[i % 2] for i in range(len(names))]
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
        assert [o.token_ids for o in outputs] == [expected[n][i % 2] for i, n in enumerate(names)]
        assert_kv_accounted(engine)
