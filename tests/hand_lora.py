"""A hand-rolled LoRA for the per-request output deltas (``LinearBase.add_output_delta``), shared by the CPU, Triton
interpreter and GPU tests (imported by name, see conftest.py).

:class:`HandLora` holds random adapters for every projection of a Llama checkpoint (``q/k/v/o/gate/up/down``, HF
names), registers them on a model built from the shared layers as output deltas that add ``x A_i^T B_i^T`` for
each token's adapter ``i``, and writes checkpoint copies with ``B_i A_i`` merged into the weights: the reference.
:class:`HandSteps` runs extend and decode steps on a ModelRunner with a batch context built by hand.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from treadle.core.execution.batch_context import NO_ADAPTER, BatchContext, BatchContextLayout
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.layers.linear import LinearBase

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
READS = BatchContextLayout(adapter_ids=True)


class HandLora:
    """``adapters`` random rank-``rank`` adapters for every projection of the checkpoint in ``model_dir``: for the
    HF weight ``W`` [out, in] of ``name``, ``A[name]`` [adapters, rank, in] and ``B[name]`` [adapters, out, rank]."""

    def __init__(self, model_dir: str, adapters: int = 2, rank: int = 4, scale: float = 0.3, seed: int = 7) -> None:
        self.model_dir = model_dir
        self.weights = load_file(str(Path(model_dir) / "model.safetensors"))
        generator = torch.Generator().manual_seed(seed)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for name, weight in sorted(self.weights.items()):
            if name.removesuffix(".weight").rpartition(".")[2] in PROJECTIONS:
                out_features, in_features = weight.shape
                self.a[name.removesuffix(".weight")] = scale * torch.randn(adapters, rank, in_features,
                                                                           generator=generator)
                self.b[name.removesuffix(".weight")] = scale * torch.randn(adapters, out_features, rank,
                                                                           generator=generator)

    def merged_checkpoint(self, adapter: int, out_dir: str | Path) -> str:
        """A copy of the checkpoint with adapter ``adapter`` merged into every projection (``W + B A``)."""
        out = Path(out_dir)
        shutil.copytree(self.model_dir, out)
        merged = dict(self.weights)
        for name in self.a:
            merged[f"{name}.weight"] = self.weights[f"{name}.weight"] + self.b[name][adapter] @ self.a[name][adapter]
        save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
        return str(out)

    def register(self, model: torch.nn.Module) -> list:
        """One output delta on every linear layer of ``model`` (stacked layers: one piece per shard, in order);
        returns the functions that remove them."""
        removers = []
        for module_name, layer in model.named_modules():
            if not isinstance(layer, LinearBase):
                continue
            parent = module_name.rpartition(".")[0]
            shard_ids = getattr(layer, "shard_ids", None) or (module_name.rpartition(".")[2],)
            names = [f"{parent}.{shard}" if parent else shard for shard in shard_ids]
            weight = layer.weight
            pieces = [(self.a[n].to(weight.device, weight.dtype), self.b[n].to(weight.device, weight.dtype))
                      for n in names]
            removers.append(layer.add_output_delta(_lora_delta(pieces), READS))
        return removers


def _lora_delta(pieces: list[tuple[torch.Tensor, torch.Tensor]]):
    def delta(x: torch.Tensor, context: BatchContext | None) -> torch.Tensor | None:
        if context is None or context.adapter_ids is None:
            return None
        ids = context.adapter_ids
        chosen = ids.clamp(min=0)
        outputs = []
        for a, b in pieces:
            down = torch.einsum("ti,tri->tr", x, a.index_select(0, chosen))
            outputs.append(torch.einsum("tr,tor->to", down, b.index_select(0, chosen)))
        # Tokens without an adapter (and graph padding) add nothing; multiplying keeps the step free of branches.
        return torch.cat(outputs, dim=-1) * (ids != NO_ADAPTER).unsqueeze(-1).to(x.dtype)

    return delta


class HandSteps:
    """Forward steps on a ModelRunner built by hand: request row ``r`` keeps its K/V in slots
    ``1 + r * SLOTS`` onwards (slot 0 is padding); ``adapters`` maps a row to its adapter (absent: none)."""

    SLOTS = 64

    def __init__(self, runner, adapters: dict[int, int] | None = None) -> None:
        self.runner = runner
        self.adapters = adapters
        self.lens: dict[int, int] = {}

    def extend(self, prompts: dict[int, list[int]]) -> torch.Tensor:
        """Every token's logits of ``prompts`` (request row -> new token ids), after what each row holds."""
        rows = list(prompts)
        prefix = [self.lens.get(row, 0) for row in rows]
        new = [len(prompts[row]) for row in rows]
        token_rows = [row for row in rows for _ in prompts[row]]
        positions = [p for row, start in zip(rows, prefix) for p in range(start, start + len(prompts[row]))]
        batch = self._batch(ForwardMode.EXTEND, rows, token_rows, [t for row in rows for t in prompts[row]],
                            positions, list(range(sum(new))), extend_seq_lens=self._tensor(new),
                            extend_prefix_lens=self._tensor(prefix),
                            extend_start_loc=self._tensor([sum(new[:i]) for i in range(len(new))]),
                            extend_seq_lens_cpu=new, extend_prefix_lens_cpu=prefix)
        return self._run(batch)

    def decode(self, tokens: dict[int, int]) -> torch.Tensor:
        """One new token per request row; the logits of each."""
        rows = list(tokens)
        positions = [self.lens[row] for row in rows]
        return self._run(self._batch(ForwardMode.DECODE, rows, rows, list(tokens.values()), positions,
                                     list(range(len(rows)))))

    def _batch(self, mode: ForwardMode, rows: list[int], token_rows: list[int], input_ids: list[int],
               positions: list[int], logits_rows: list[int], **extend) -> ForwardBatch:
        runner = self.runner
        slots = [1 + row * self.SLOTS + position for row, position in zip(token_rows, positions)]
        for row, position, slot in zip(token_rows, positions, slots):
            runner.req_to_token_pool.req_to_token[row, position] = slot
            self.lens[row] = max(self.lens.get(row, 0), position + 1)
        seq_lens = torch.tensor([self.lens[row] for row in rows])
        batch = ForwardBatch(
            forward_mode=mode, batch_size=len(rows), input_ids=self._tensor(input_ids),
            positions=self._tensor(positions), req_pool_indices=self._tensor(rows), seq_lens=seq_lens.to(runner.device),
            seq_lens_cpu=seq_lens, out_cache_loc=self._tensor(slots), seq_lens_sum=int(seq_lens.sum()),
            logits_indices=self._tensor(logits_rows), req_to_token_pool=runner.req_to_token_pool,
            kv_cache=runner.kv_cache, attn_backend=runner.attn_backend, **extend)
        if self.adapters is not None:
            adapter_ids = self._tensor([self.adapters.get(row, NO_ADAPTER) for row in rows])
            batch.batch_context = BatchContext.for_batch(batch, adapter_ids)
        return batch

    def _run(self, batch: ForwardBatch) -> torch.Tensor:
        return self.runner.forward(batch).float().cpu().clone()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.runner.device)


def model_config(model_dir: str, **overrides) -> dict:
    """ModelRunner overrides for ``model_dir`` on the CPU with the torch_native backend."""
    return {"model.path": model_dir, "model.device": "cpu", "model.dtype": "float32",
            "attention.backend": "torch_native", "cache.max_total_tokens": 1024, **overrides}

