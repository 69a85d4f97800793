"""The ``eagle3`` speculator: a target records its layers' inputs as HF computes them; a tiny random EAGLE-3 head
in the hub layout loads (safetensors or pytorch_model.bin), proposes what a plain-torch EAGLE-3 computes, and greedy
output through the Engine is the plain run's, with overlap on and off, after radix-cache hits and under retraction,
every KV slot back afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.layers.decoder import HiddenStateTap
from treadle.plugins.speculators.eagle3_model import aux_layer_ids, load_eagle3_head
from treadle.testing.eagle3_heads import make_eagle3_head
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.speculator_plugins import OverlappedVerifySteps

EAGLE_PLUGIN = "treadle.plugins.speculators.eagle3"  # until the installed package lists it as an entry point
PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6],
    [5, 17, 42, 8, 99, 3, 250, 11, 200, 12],
    [300, 301, 9],
    [400, 7, 7, 7, 9, 10, 11, 12, 13],
]
BUDGETS = (21, 6, 17, 30)
SHORT_PROMPTS = [[300, 301, 9], [400, 7]]
GREEDY = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in BUDGETS]
AUX = [-1, 0, 1]  # layer outputs: the inputs of layers 0 and 1 and the last hidden state of the 2-layer target


def target_config(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


@pytest.fixture(scope="module")
def eagle_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3"), target_config(tiny_llama_dir), 128, AUX)


LOOP_TOKENS = (8, 81, 471, 400, 197)  # what the tiny target's greedy outputs repeat


@pytest.fixture(scope="module")
def looping_eagle_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """The random head with its draft vocabulary mapped onto ``LOOP_TOKENS``, so that its drafts are kept now and
    then (a random head's hardly ever are)."""
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3-looping"), target_config(tiny_llama_dir), 128, AUX,
                            draft_targets=LOOP_TOKENS)


def engine_config(model_dir: str, eagle: str | None = None, k: int = 3, overlap: bool = True,
                  kv_tokens: int = 2048, **scheduler) -> dict:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": kv_tokens}, "plugins": [EAGLE_PLUGIN],
              "scheduler": {"disable_overlap": not overlap, **scheduler}}
    if eagle is not None:
        config["speculative"] = {"method": "eagle3", "num_tokens": k, "draft_model_path": eagle, "max_batch_size": 8}
    return config


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    with Engine(engine_config(tiny_llama_dir)) as engine:
        return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)


def test_a_target_records_its_layer_inputs_as_hf_computes_them(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[0]
    with Engine(engine_config(tiny_llama_dir)) as engine:
        runner = engine.scheduler.worker.runner
        tap = HiddenStateTap([0, 1, 2], runner.hf_config.hidden_size, 4, runner.dtype, runner.device)
        runner.model.capture_hidden_states(tap)
        engine.generate(input_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
        recorded = tap.output(len(prompt)).clone()
        final_norm = runner.model.model.norm
        runner.model.capture_hidden_states(None)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    width = recorded.shape[1] // 3
    torch.testing.assert_close(recorded[:, :width], states[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recorded[:, width:2 * width], states[1][0], rtol=1e-5, atol=1e-5)
    # HF's last entry is the final norm's output; the tap records the state before it.
    torch.testing.assert_close(final_norm(recorded[:, 2 * width:]), states[2][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bin_format", [False, True], ids=["safetensors", "bin"])
def test_the_hub_layout_loads(tiny_llama_dir, tmp_path, bin_format):
    folder = make_eagle3_head(tmp_path / "head", target_config(tiny_llama_dir), 128, AUX, bin_format=bin_format)
    head = load_eagle3_head(folder, torch.device("cpu"), torch.float32)
    assert head.draft_vocab_size == 128 and head.embed_tokens is None
    assert head.to_target_ids(torch.tensor([0, 1, 127])).tolist() == [0, 2, 254]
    assert aux_layer_ids(head.config, 2) == [0, 1, 2]
    assert aux_layer_ids(type("C", (), {})(), 32) == [2, 16, 29]  # the default: Llama-3.1-8B's
    with pytest.raises(ValueError, match="three distinct layers"):
        aux_layer_ids(type("C", (), {})(), 2)


def test_greedy_output_is_the_plain_runs(tiny_llama_dir, looping_eagle_dir, plain_outputs):
    """Verify steps overlapped (drafted on the device: eagle3_overlap.py) keep some drafts and give the plain tokens."""
    with Engine(engine_config(tiny_llama_dir, looping_eagle_dir, 3)) as engine:
        steps = OverlappedVerifySteps()
        engine.scheduler.add_observer(steps)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        assert all(o.spec_verify_steps > 0 for o in outputs)
        assert sum(o.spec_verify_steps for o in outputs) < sum(BUDGETS) - len(BUDGETS)  # drafts kept
        assert steps.overlapped >= steps.verify // 2 > 0, (steps.overlapped, steps.verify)
        assert_kv_accounted(engine, flush=False)
        # Again from half of each output, on the prefix cache the first run left (the head's KV comes with it).
        cuts = [len(o.token_ids) // 2 for o in plain_outputs]
        prompts = [p + o.token_ids[:cut] for p, o, cut in zip(PROMPTS, plain_outputs, cuts)]
        params = [SamplingParams(max_new_tokens=n - cut, temperature=0.0, ignore_eos=True)
                  for n, cut in zip(BUDGETS, cuts)]
        again = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in again] == [o.token_ids[cut:] for o, cut in zip(plain_outputs, cuts)]
        assert sum(o.cached_tokens for o in again) > 0
        assert_kv_accounted(engine)
        assert not engine.scheduler.worker.speculator.states


def test_retraction_in_a_small_pool_keeps_the_tokens(tiny_llama_dir, looping_eagle_dir, plain_outputs):
    with Engine(engine_config(tiny_llama_dir, looping_eagle_dir, 2, kv_tokens=48, new_token_ratio=0.0)) as engine:
        steps = OverlappedVerifySteps()
        engine.scheduler.add_observer(steps)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        assert engine.kv_stats()["retractions"] > 0 and steps.overlapped > 0
        assert_kv_accounted(engine)
        assert not engine.scheduler.worker.speculator.states


def test_sampling_requests_run_with_drafts(tiny_llama_dir, eagle_dir):
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True, seed=i) for i in range(3)]
    with Engine(engine_config(tiny_llama_dir, eagle_dir, 2)) as engine:
        outputs = engine.generate(input_ids=PROMPTS[:3], sampling_params=params)
        assert all(len(o.token_ids) == 12 for o in outputs)
        assert all(o.spec_verify_steps > 0 for o in outputs)
        assert_kv_accounted(engine)


# ---------------------------------------------------------------------- against a plain-torch EAGLE-3


class ReferenceEagle3:
    """EAGLE-3 drafting written out in plain torch and HF transformers, from the checkpoint's tensors: the target's
    layer inputs from HF, every pair recomputed from scratch for each proposal."""

    def __init__(self, target_dir: str, eagle_dir: str) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.w = load_file(str(Path(eagle_dir) / "model.safetensors"))
        self.config = LlamaConfig.from_dict(json.loads((Path(eagle_dir) / "config.json").read_text()))
        self.rotary = LlamaRotaryEmbedding(self.config)

    def drafts(self, sequence: list[int], n: int) -> list[int]:
        """The ``n`` drafts after ``sequence`` (its last token: the last one sampled)."""
        return self.walk(sequence, n)[0]

    def walk(self, sequence: list[int], n: int, path: tuple[int, ...] = ()) -> tuple[list[int], torch.Tensor]:
        """``(drafts, last logits)``: ``n`` steps after ``sequence``, each feeding the head's argmax (a target id)
        or, for the first ``len(path)`` steps, ``path``'s tokens instead; the logits are the last step's."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, config = self.w, self.config
        eps = config.rms_norm_eps
        pre_norm = []
        hook = self.target.model.norm.register_forward_hook(lambda module, args, out: pre_norm.append(args[0]))
        with torch.no_grad():
            states = self.target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        hook.remove()
        layer_inputs = torch.cat([states[0][0], states[1][0], pre_norm[0][0]], dim=-1)  # aux ids -1, 0, 1
        features = layer_inputs[:-1] @ w["fc.weight"].T  # pair q: feature of q, token q + 1
        embed = self.target.model.embed_tokens.weight
        tokens = list(sequence[1:])
        heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        out = []
        with torch.no_grad():
            for _ in range(n):
                x = torch.cat([_rms(embed[torch.tensor(tokens)], w["midlayer.input_layernorm.weight"], eps),
                               _rms(features, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
                count = x.shape[0]
                q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(1, count, heads, hd).transpose(1, 2)
                k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(1, count, kv_heads, hd).transpose(1, 2)
                v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(1, count, kv_heads, hd).transpose(1, 2)
                cos, sin = self.rotary(v, torch.arange(count)[None])
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                groups = heads // kv_heads
                attn = torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True)
                attn = attn.transpose(1, 2).reshape(count, heads * hd) @ w["midlayer.self_attn.o_proj.weight"].T
                summed = attn + features
                h = _rms(summed, w["midlayer.post_attention_layernorm.weight"], eps)
                mlp = (torch.nn.functional.silu(h @ w["midlayer.mlp.gate_proj.weight"].T)
                       * (h @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
                hidden = mlp + summed
                logits = _rms(hidden[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T
                draft = int(logits.argmax())
                draft += int(w["d2t"][draft])  # the tiny head's: draft id d is target id 2d
                if len(out) < len(path):
                    draft = path[len(out)]
                out.append(draft)
                # The next pair: the head's own output as the feature, the draft as the token.
                features = torch.cat([features, hidden[-1:]])
                tokens.append(draft)
        return out, logits


class RecordedProposals(list):
    """``(prompt, last token's position, that request's Drafts row)`` of every proposal; ``on_device`` counts those of
    overlapped verify batches (``propose_on_device``), whose positions are read once the run is over (an entry's
    ``kv_start`` is exact once the step before it is read)."""

    on_device = 0

    def __iter__(self):
        return ((prompt, entry.kv_start, row) for prompt, entry, row in super().__iter__())


def record_proposals(speculator) -> RecordedProposals:
    """Make ``speculator.propose`` (and ``propose_on_device``) record each request's proposals."""
    recorded = RecordedProposals()
    propose, propose_on_device = speculator.propose, speculator.propose_on_device

    def record(batch, drafts):
        for i, entry in enumerate(batch.entries):
            row = type(drafts)(drafts.token_ids[i], parents=None if drafts.parents is None else drafts.parents[i])
            recorded.append((tuple(entry.req.origin_input_ids), entry, row))
        return drafts

    def recording_propose_on_device(batch, num_drafts, positions, rows):
        recorded.on_device += len(batch.entries)
        return record(batch, propose_on_device(batch, num_drafts, positions, rows))

    speculator.propose = lambda batch, num_drafts: record(batch, propose(batch, num_drafts))
    speculator.propose_on_device = recording_propose_on_device
    return recorded


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_proposals_are_what_eagle3_computes(tiny_llama_dir, eagle_dir, looping_eagle_dir, plain_outputs, overlap):
    """With overlap the head keeps some drafts and most proposals are made on the device (overlapped verify)."""
    k, head = 3, looping_eagle_dir if overlap else eagle_dir
    config = engine_config(tiny_llama_dir, head, k, overlap)
    config["cache"]["disable_radix_cache"] = True  # a cached prefix brings a pair computed for another request
    with Engine(config) as engine:
        recorded = record_proposals(engine.scheduler.worker.speculator)
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    reference = ReferenceEagle3(tiny_llama_dir, head)
    full = {tuple(p): p + o.token_ids for p, o in zip(PROMPTS, plain_outputs)}
    # A row of a request that its previous step finished is discarded (its position, an upper bound, was not set).
    proposals = [(prompt, last, drafts.token_ids.tolist()) for prompt, last, drafts in recorded
                 if last < len(full[prompt]) - 1]
    assert len(proposals) > 20 and (recorded.on_device > len(proposals) // 2) == overlap
    for prompt, last, drafts in proposals[::2 if overlap else 3]:
        assert drafts == reference.drafts(full[prompt][:last + 1], len(drafts)), (prompt, last)


def test_the_conformance_kit_passes_it(tiny_llama_dir, eagle_dir):
    from treadle.plugins.speculators.eagle3 import build_eagle3_speculator
    from treadle.testing import check_speculator

    check_speculator(build_eagle3_speculator, model_dir=tiny_llama_dir,
                     overrides={"speculative": {"draft_model_path": eagle_dir}})
    check_speculator(build_eagle3_speculator, model_dir=tiny_llama_dir,
                     overrides={"speculative": {"draft_model_path": eagle_dir, "topk": 2}})


MEMORY = {
    "paged4": {"cache": {"kv_allocator": "paged", "page_size": 4}},
    "chunked-mixed": {"scheduler": {"chunked_prefill_size": 6, "enable_mixed_chunk": True}},
}


@pytest.mark.parametrize("memory", list(MEMORY))
def test_greedy_parity_with_pages_and_chunked_mixed_prefill(tiny_llama_dir, eagle_dir, plain_outputs, memory):
    config = engine_config(tiny_llama_dir, eagle_dir, 3)
    for section, values in MEMORY[memory].items():
        config[section].update(values)
    with Engine(config) as engine:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        assert_kv_accounted(engine)


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_other_families_record_their_hidden_states_for_the_head(tmp_path, family):
    from treadle.testing import models

    target = getattr(models, f"make_tiny_{family}")(tmp_path / family)
    head = make_eagle3_head(tmp_path / "head", target_config(target), 128, AUX)
    prompts, params = PROMPTS[:3], GREEDY[:3]
    with Engine(engine_config(target)) as engine:
        plain = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(engine_config(target, head, 3)) as engine:
        assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)] == plain
        assert_kv_accounted(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_trees_give_the_plain_greedy_and_seeded_tokens(tiny_llama_dir, eagle_dir, plain_outputs, overlap):
    """topk 2, 4 drafts: the head grows trees from its own output (scratch rows and slots of its own); greedy and
    seeded sampled output are the plain runs', every KV slot comes back."""
    seeded = [SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, seed=5 + n, ignore_eos=True)
              for n in BUDGETS]
    with Engine(engine_config(tiny_llama_dir, overlap=overlap)) as engine:
        expected = engine.generate(input_ids=PROMPTS, sampling_params=seeded)
    config = engine_config(tiny_llama_dir, eagle_dir, 4, overlap=overlap)
    config["speculative"]["topk"] = 2
    with Engine(config) as engine:
        assert engine.scheduler.worker.speculator.trees is not None
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        assert all(o.spec_verify_steps > 0 for o in outputs)
        sampled = engine.generate(input_ids=PROMPTS, sampling_params=seeded)
        assert [o.token_ids for o in sampled] == [o.token_ids for o in expected]
        assert_kv_accounted(engine)
        assert not engine.scheduler.worker.speculator.states


def test_tree_nodes_are_the_top_children_eagle3_computes(tiny_llama_dir, tmp_path):
    """In a tree (topk 2) each node's children, and the root's, are the likeliest tokens of a plain-torch EAGLE-3 fed
    the node's path (siblings share their parent's score, so the tree keeps a node's best children). The head's
    weights are large, so that what a node reads (its parent's hidden state, its ancestors' pairs) shows."""
    eagle_dir = make_eagle3_head(tmp_path, target_config(tiny_llama_dir), 128, AUX, seed=3, scale=1.0)
    config = engine_config(tiny_llama_dir, eagle_dir, 7)
    config["speculative"]["topk"] = 2
    config["cache"]["disable_radix_cache"] = True
    with Engine(config) as engine:
        recorded = record_proposals(engine.scheduler.worker.speculator)
        # Short prompts, so that the tree's own pairs weigh in each node's attention.
        outputs = engine.generate(input_ids=SHORT_PROMPTS, sampling_params=GREEDY[:2])
    reference = ReferenceEagle3(tiny_llama_dir, eagle_dir)
    full = {tuple(p): p + o.token_ids for p, o in zip(SHORT_PROMPTS, outputs)}
    assert len(recorded) > 4
    deep = 0
    for prompt, last, drafts in recorded:
        tokens, parents = drafts.token_ids.tolist(), drafts.parents.tolist()
        sequence = full[prompt][:last + 1]
        paths = {-1: ()}
        for j, (token, parent) in enumerate(zip(tokens, parents)):
            paths[j] = paths[parent] + (token,)
        for node, path in paths.items():
            children = sorted(t for t, p in zip(tokens, parents) if p == node)
            if children:
                top = reference.walk(sequence, len(path) + 1, path)[1].topk(len(children)).indices * 2
                assert children == sorted(top.tolist()), (prompt, last, path)
                deep += len(path) > 1
    assert deep > 0, "some trees must branch below their first level"
