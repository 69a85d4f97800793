"""Every built-in model family on the torch_native backend agrees with HF transformers (float32, CPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from treadle.core.config import ModelConfig
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.memory.pools import KVCache, ReqToTokenPool
from treadle.core.loading.model_loader import load_model
from treadle.core.registry import build_registry
from treadle.testing.models import (
    make_tiny_llama,
    make_tiny_mistral,
    make_tiny_mixtral,
    make_tiny_qwen2,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
)

PLUGINS = [
    "treadle.plugins.attention.torch_native",
    "treadle.plugins.models.llama",
    "treadle.plugins.models.mistral",
    "treadle.plugins.models.qwen2",
    "treadle.plugins.models.qwen3",
    "treadle.plugins.models.mixtral",
    "treadle.plugins.models.qwen3_moe",
]


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugin_modules=PLUGINS, load_entry_points=False)


class Harness:
    """A hand-built model runner: ReqToTokenPool, KVCache, scattered slots, torch_native backend."""

    def __init__(self, model, hf_config, registry, page_size: int = 1, kv_size: int = 1024) -> None:
        self.model = model
        num_kv_heads = hf_config.num_key_value_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        self.pool = ReqToTokenPool(8, 256, "cpu")
        self.kv_cache = KVCache(
            kv_size, page_size, hf_config.num_hidden_layers, num_kv_heads, head_dim, torch.float32, "cpu"
        )
        runner = SimpleNamespace(
            device=torch.device("cpu"), dtype=torch.float32, num_heads=hf_config.num_attention_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, req_to_token_pool=self.pool,
            kv_cache=self.kv_cache, sliding_window=getattr(hf_config, "sliding_window", None), context_len=256,
        )
        self.backend = registry.get("attention", "torch_native")(runner)
        # Slots in a shuffled order so attention must follow req_to_token, never assume contiguity.
        order = torch.randperm(kv_size, generator=torch.Generator().manual_seed(1)) + page_size
        self.free_slots = order.tolist()
        self.seq_lens: dict[int, int] = {}

    def extend(self, requests: list[tuple[int, list[int]]], all_logits: bool = False) -> torch.Tensor:
        """Run new tokens for ``(req_pool_idx, token_ids)`` after whatever each request has cached."""
        prefix_lens = [self.seq_lens.get(idx, 0) for idx, _ in requests]
        new_lens = [len(ids) for _, ids in requests]
        positions, out_cache_loc, logits_rows, start = [], [], [], 0
        for (idx, ids), prefix in zip(requests, prefix_lens):
            slots = [self.free_slots.pop() for _ in ids]
            self.pool.req_to_token[idx, prefix : prefix + len(ids)] = torch.tensor(slots, dtype=torch.int32)
            positions += range(prefix, prefix + len(ids))
            out_cache_loc += slots
            logits_rows += range(start, start + len(ids)) if all_logits else [start + len(ids) - 1]
            start += len(ids)
            self.seq_lens[idx] = prefix + len(ids)
        seq_lens = torch.tensor([self.seq_lens[idx] for idx, _ in requests])
        batch = self._batch(
            ForwardMode.EXTEND, [idx for idx, _ in requests], [t for _, ids in requests for t in ids],
            positions, out_cache_loc, seq_lens, logits_rows,
            extend_seq_lens=torch.tensor(new_lens), extend_prefix_lens=torch.tensor(prefix_lens),
            extend_start_loc=torch.tensor([sum(new_lens[:i]) for i in range(len(new_lens))]),
            extend_seq_lens_cpu=new_lens, extend_prefix_lens_cpu=prefix_lens,
        )
        return self._run(batch)

    def decode(self, requests: list[tuple[int, int]]) -> torch.Tensor:
        """One new token per ``(req_pool_idx, token_id)``."""
        positions, out_cache_loc = [], []
        for idx, _ in requests:
            slot = self.free_slots.pop()
            position = self.seq_lens[idx]
            self.pool.req_to_token[idx, position] = slot
            positions.append(position)
            out_cache_loc.append(slot)
            self.seq_lens[idx] = position + 1
        seq_lens = torch.tensor([self.seq_lens[idx] for idx, _ in requests])
        batch = self._batch(
            ForwardMode.DECODE, [idx for idx, _ in requests], [t for _, t in requests],
            positions, out_cache_loc, seq_lens, list(range(len(requests))),
        )
        return self._run(batch)

    def _batch(self, mode, req_indices, input_ids, positions, out_cache_loc, seq_lens, logits_rows, **extend):
        return ForwardBatch(
            forward_mode=mode, batch_size=len(req_indices), input_ids=torch.tensor(input_ids),
            positions=torch.tensor(positions), req_pool_indices=torch.tensor(req_indices),
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), out_cache_loc=torch.tensor(out_cache_loc),
            seq_lens_sum=int(seq_lens.sum()), logits_indices=torch.tensor(logits_rows),
            req_to_token_pool=self.pool, kv_cache=self.kv_cache, attn_backend=self.backend, **extend,
        )

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.init_forward_metadata(batch)
        with torch.no_grad():
            return self.model(batch.input_ids, batch.positions, batch)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill all prompts in one batch, then decode them together."""
        logits = self.extend(list(enumerate(prompts)))
        outputs = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(max_new_tokens - 1):
            logits = self.decode([(i, out[-1]) for i, out in enumerate(outputs)])
            for out, token in zip(outputs, logits.argmax(-1).tolist()):
                out.append(token)
        return outputs


def _load(path: str, registry) -> tuple:
    model, hf_config, _ = load_model(ModelConfig(path=path, device="cpu", dtype="float32"), registry)
    return model, hf_config


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0]


def _hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None  # always generate exactly max_new_tokens
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


LLAMA_VARIANTS = {
    "plain": {},
    "tied-bias-headdim": {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True, "head_dim": 32},
    "llama3-rope": {
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },
    },
}


@pytest.mark.parametrize("variant", list(LLAMA_VARIANTS))
def test_llama_prefill_logits_match_hf(tmp_path, registry, variant):
    path = make_tiny_llama(tmp_path / variant, **LLAMA_VARIANTS[variant])
    model, hf_config = _load(path, registry)
    hf_model = _hf(path)
    prompts = _prompts(hf_config.vocab_size, [23, 9])
    logits = Harness(model, hf_config, registry).extend(list(enumerate(prompts)), all_logits=True)
    expected = torch.cat([_hf_logits(hf_model, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_mistral_sliding_window_prefill_matches_hf(tmp_path, registry):
    path = make_tiny_mistral(tmp_path / "mistral", sliding_window=6)
    model, hf_config = _load(path, registry)
    hf_model = _hf(path)
    prompt = _prompts(hf_config.vocab_size, [25])[0]
    logits = Harness(model, hf_config, registry).extend([(0, prompt)], all_logits=True)
    torch.testing.assert_close(logits, _hf_logits(hf_model, prompt), atol=1e-4, rtol=1e-4)
    # The window must matter here, otherwise this test would pass for full attention too.
    full = _hf(make_tiny_mistral(tmp_path / "mistral-full", sliding_window=None))
    assert not torch.allclose(_hf_logits(full, prompt)[-1], logits[-1], atol=1e-3)


@pytest.mark.parametrize(
    ("family", "page_size"), [("llama", 1), ("mistral", 4)], ids=["llama-page1", "mistral-window5-page4"]
)
def test_greedy_decode_matches_hf_generate(tmp_path, registry, family, page_size):
    if family == "llama":
        path = make_tiny_llama(tmp_path / family)
    else:
        path = make_tiny_mistral(tmp_path / family, sliding_window=5)
    model, hf_config = _load(path, registry)
    hf_model = _hf(path)
    prompts = _prompts(hf_config.vocab_size, [7, 12], seed=3)
    ours = Harness(model, hf_config, registry, page_size=page_size).greedy(prompts, max_new_tokens=16)
    assert ours == [_hf_greedy(hf_model, p, 16) for p in prompts]


def test_extend_and_decode_after_cached_prefix_equal_full_prefill(tmp_path, registry):
    path = make_tiny_mistral(tmp_path / "mistral", sliding_window=7)
    model, hf_config = _load(path, registry)
    prompt = _prompts(hf_config.vocab_size, [20], seed=5)[0]
    harness = Harness(model, hf_config, registry)

    full = harness.extend([(0, prompt)], all_logits=True)
    harness.extend([(1, prompt[:11])])  # the cached prefix
    rest = harness.extend([(1, prompt[11:-1])], all_logits=True)
    last = harness.decode([(1, prompt[-1])])

    torch.testing.assert_close(rest, full[11:-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=1e-5)


def test_mixed_batch_of_prefix_extend_and_fresh_prefill_matches_separate_runs(tmp_path, registry):
    path = make_tiny_llama(tmp_path / "llama")
    model, hf_config = _load(path, registry)
    long_prompt, short_prompt = _prompts(hf_config.vocab_size, [15, 6], seed=7)
    harness = Harness(model, hf_config, registry)
    alone = [harness.extend([(0, long_prompt)])[0], harness.extend([(1, short_prompt)])[0]]

    harness.extend([(2, long_prompt[:10])])
    together = harness.extend([(2, long_prompt[10:]), (3, short_prompt)])

    torch.testing.assert_close(together, torch.stack(alone), atol=1e-5, rtol=1e-5)


def test_unexpected_checkpoint_tensor_is_named(tmp_path, registry):
    model, _ = _load(make_tiny_llama(tmp_path / "llama"), registry)
    with pytest.raises(ValueError, match="unexpected tensors .*model.layers.0.extra.weight"):
        model.load_weights([("model.layers.0.extra.weight", torch.zeros(2))])


FAMILIES = {
    "qwen2": (make_tiny_qwen2, {}),
    "qwen2-sliding-layer1": (make_tiny_qwen2, {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "qwen3": (make_tiny_qwen3, {}),
    "qwen3-bias-sliding": (make_tiny_qwen3, {"attention_bias": True, "use_sliding_window": True, "sliding_window": 6,
                                             "max_window_layers": 0}),
    "mixtral": (make_tiny_mixtral, {}),
    "mixtral-top1-window": (make_tiny_mixtral, {"num_experts_per_tok": 1, "sliding_window": 6}),
    "qwen3-moe": (make_tiny_qwen3_moe, {}),
    "qwen3-moe-renorm-every-2nd": (make_tiny_qwen3_moe, {"norm_topk_prob": True, "decoder_sparse_step": 2,
                                                         "mlp_only_layers": []}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_prefill_logits_match_hf(tmp_path, registry, family):
    make, overrides = FAMILIES[family]
    path = make(tmp_path / family, **overrides)
    model, hf_config = _load(path, registry)
    assert type(model).__name__ == hf_config.architectures[0]
    prompts = _prompts(hf_config.vocab_size, [23, 9])
    logits = Harness(model, hf_config, registry).extend(list(enumerate(prompts)), all_logits=True)
    expected = torch.cat([_hf_logits(_hf(path), p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("family", "page_size"), [(f, 4 if i % 2 else 1) for i, f in enumerate(FAMILIES)])
def test_family_greedy_decode_matches_hf_generate(tmp_path, registry, family, page_size):
    make, overrides = FAMILIES[family]
    path = make(tmp_path / family, **overrides)
    model, hf_config = _load(path, registry)
    hf_model = _hf(path)
    prompts = _prompts(hf_config.vocab_size, [7, 12], seed=3)
    ours = Harness(model, hf_config, registry, page_size=page_size).greedy(prompts, max_new_tokens=12)
    assert ours == [_hf_greedy(hf_model, p, 12) for p in prompts]


def test_qwen2_sliding_window_layers_change_the_output(tmp_path):
    prompt = _prompts(512, [20])[0]
    windowed = _hf(make_tiny_qwen2(tmp_path / "w", **FAMILIES["qwen2-sliding-layer1"][1]))
    full = _hf(make_tiny_qwen2(tmp_path / "full"))
    assert windowed.config.layer_types == ["full_attention", "sliding_attention"]
    assert not torch.allclose(_hf_logits(windowed, prompt)[-1], _hf_logits(full, prompt)[-1], atol=1e-3)


def _mixtral_state(path: str) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in _hf(path).state_dict().items()}


def test_mixtral_loads_fused_and_per_expert_checkpoint_names_alike(tmp_path, registry):
    path = make_tiny_mixtral(tmp_path / "mixtral")
    reference, _ = _load(path, registry)
    state = _mixtral_state(path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers 5's in-memory layout
    fused, _ = _load(path, registry)
    fused.load_weights(iter(state.items()))
    qwen_moe_names = {"gate_proj": slice(0, 96), "up_proj": slice(96, 192)}
    per_expert = {n: t for n, t in state.items() if ".experts." not in n}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        for expert in range(4):
            for shard, rows in qwen_moe_names.items():
                per_expert[f"{prefix}.{expert}.{shard}.weight"] = state[f"{prefix}.gate_up_proj"][expert, rows]
            per_expert[f"{prefix}.{expert}.down_proj.weight"] = state[f"{prefix}.down_proj"][expert]
    renamed, _ = _load(path, registry)
    renamed.load_weights(iter(per_expert.items()))
    for name, param in reference.named_parameters():
        torch.testing.assert_close(dict(fused.named_parameters())[name], param, atol=0, rtol=0)
        torch.testing.assert_close(dict(renamed.named_parameters())[name], param, atol=0, rtol=0)


def test_mixtral_missing_expert_tensor_is_named(tmp_path, registry):
    path = make_tiny_mixtral(tmp_path / "mixtral")
    model, _ = _load(path, registry)
    state = {n: t for n, t in _mixtral_state(path).items() if "layers.1.mlp.experts.down_proj" not in n}
    with pytest.raises(ValueError, match=r"missing .*model\.layers\.1\.mlp\.experts\.0\.w2\.weight"):
        model.load_weights(iter(state.items()))


@pytest.mark.parametrize(
    ("make", "overrides", "message"),
    [
        (make_tiny_qwen2, {"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        (make_tiny_qwen2, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 64}}, "unsupported rope type 'yarn'"),
        (make_tiny_mixtral, {"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size"),
    ],
    ids=["activation", "rope-type", "shared-experts"],
)
def test_unsupported_config_feature_fails_at_load_naming_it(tmp_path, registry, make, overrides, message):
    path = make(tmp_path / "model")
    config_file = tmp_path / "model" / "config.json"
    config = json.loads(config_file.read_text())
    config.update(overrides)
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        _load(path, registry)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from treadle.core.loading.default_model import default_model

    return default_model()  # converted once into the cache (~30 s the first time)


def test_smollm2_answers_capital_of_france(smollm2_dir, registry):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    model, hf_config = _load(smollm2_dir, registry)
    tokens = Harness(model, hf_config, registry).greedy([prompt], max_new_tokens=9)[0]
    eos = hf_config.eos_token_id
    assert eos in tokens, tokenizer.decode(tokens)
    assert tokenizer.decode(tokens[: tokens.index(eos)]) == "The capital of France is Paris."


def test_decoder_layers_that_run_the_next_layers_norm_give_the_same_logits(tmp_path, registry, monkeypatch):
    """On a GPU, a one-token decode's o_proj and down_proj kernels add the residual and run the norm after them
    (the post-attention norm, and the next layer's input norm, which that layer then skips). Emulated here with the
    same torch ops, the layer stack must give the unfused logits exactly: each norm runs once, on the right sum."""
    from treadle.layers.linear import RowParallelLinear

    path = make_tiny_llama(tmp_path / "llama", num_hidden_layers=3)
    model, hf_config = _load(path, registry)
    layers = model.model.layers
    assert model.model._next_norms == [layers[1].input_layernorm, layers[2].input_layernorm, None]
    prompts = _prompts(hf_config.vocab_size, [7, 12], seed=3)
    expected = Harness(model, hf_config, registry).greedy(prompts, max_new_tokens=6)
    calls = []

    def fused(self, x, residual, norm):
        calls.append(norm)
        return norm(self(x), residual)

    monkeypatch.setattr(RowParallelLinear, "forward_add_rmsnorm", fused)
    assert Harness(model, hf_config, registry).greedy(prompts, max_new_tokens=6) == expected
    assert any(norm is layers[1].input_layernorm for norm in calls)  # the down_proj of layer 0 ran layer 1's norm


def test_a_decoder_layer_subclass_with_its_own_forward_is_run_through_it(tmp_path, registry):
    from treadle.layers.decoder import DecoderLayer
    from treadle.plugins.models.llama import LlamaModel

    class Custom(DecoderLayer):
        def forward(self, hidden_states, residual, cos, sin, forward_batch):
            return super().forward(hidden_states, residual, cos, sin, forward_batch)

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(make_tiny_llama(tmp_path / "llama", num_hidden_layers=3))
    model = LlamaModel(config, lambda config, layer_id: (Custom if layer_id == 1 else DecoderLayer)(config, layer_id))
    # Layer 1 runs as a module (its own forward, with its own input norm), so layer 0 leaves that norm to it.
    assert model._next_norms == [None, False, None]
