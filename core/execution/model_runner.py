"""ModelRunner: loads the model, sizes and owns the KV memory, builds the attention backend, runs eager forwards.

The model worker (core/execution/worker.py) owns a runner, and the CUDA graphs that replay its forwards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from treadle.core.config import ServerConfig
from treadle.core.distributed.parallel import get_tp_rank, get_tp_size, tp_head_counts, tp_min_int
from treadle.core.embedding.checkpoint import read_checkpoint_embedding, resolve_embedding
from treadle.core.execution.attention import build_attention_backend, model_sliding_windows
from treadle.core.execution.batch_context import using_batch_context
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.model_protocol import ModelTraits
from treadle.core.lora.manager import LoRAManager
from treadle.core.memory.allocator import KVAllocator
from treadle.core.memory.pools import KV_DTYPES, KVCache, ReqToTokenPool
from treadle.core.registry import Registry
from treadle.core.resolved_config import ResolvedConfig, RuntimeFacts, describe_resolution, resolve_config

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV pools, the KV allocator and the attention backend of one GPU (or the CPU).

    Attention backends see it through an :class:`~treadle.core.execution.attention_context.AttentionContext`
    (``AttentionContext.of(runner)``). Under tensor parallelism the head counts and the KV cache are this
    rank's share (``tp_rank`` of ``tp_size``). ``forward`` runs eagerly; whether CUDA graphs may replay its
    steps is ``uses_decode_graphs`` / ``piecewise_graph_tokens``, and the worker captures them.
    """

    def __init__(self, config: ServerConfig, registry: Registry, offline: bool = False) -> None:
        from treadle.core.loading.model_loader import load_model

        self.model, self.hf_config, self.model_dir = load_model(config.model, registry)
        self.model_traits = ModelTraits.of(self.model)  # its optional members (model_protocol.py), read once
        first_param = next(self.model.parameters())
        self.device: torch.device = first_param.device
        # FP8 weights and their float32 scales keep their dtype; the model dtype is that of the rest.
        self.dtype: torch.dtype = next(
            (p.dtype for p in self.model.parameters() if not getattr(p, "keep_dtype", False)), first_param.dtype
        )

        hf = self.hf_config
        self.num_layers: int = hf.num_hidden_layers
        # This rank's share of the heads (all of them at tp 1); KV heads replicate past their count.
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_heads, self.num_kv_heads = tp_head_counts(
            hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads, self.tp_size
        )
        self.head_dim: int = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.vocab_size: int = hf.vocab_size
        # What the layers were built with (a config's sliding_window may be switched off for some or all).
        self.layer_sliding_windows = model_sliding_windows(self.model) or (getattr(hf, "sliding_window", None) or None,)
        shared = set(self.layer_sliding_windows)
        self.sliding_window: int | None = shared.pop() if len(shared) == 1 else None
        self.kv_dtype: torch.dtype = KV_DTYPES.get(config.cache.kv_dtype, self.dtype)
        # LoRA slots take device memory (before the KV pool is sized) and register the layers' deltas (before the
        # worker captures CUDA graphs); without a lora section nothing of it exists.
        self.lora: LoRAManager | None = (LoRAManager(config.lora, self.model, registry, self.device, self.dtype)
                                         if config.lora.requested else None)

        # Every "auto" is resolved here, once, into the frozen config the runtime reads; the user's is untouched.
        self.embedding = resolve_embedding(config.model, read_checkpoint_embedding(self.model_dir, hf))
        resolved = resolve_config(config, self._runtime_facts(offline), agree_min=tp_min_int)
        self.context_len: int = resolved.model.context_length
        self.page_size: int = resolved.cache.page_size
        self.max_total_tokens: int = resolved.cache.max_total_tokens
        self.max_running_requests: int = resolved.scheduler.max_running_requests
        self.kv_cache = KVCache(
            self.max_total_tokens, self.page_size, self.num_layers, self.num_kv_heads,
            self.head_dim, self.kv_dtype, self.device,
        )
        self._use_checkpoint_kv_scales()
        # One spare row so a retracted request can be re-admitted while others still hold theirs.
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + 1, self.context_len + self.page_size, self.device
        )
        allocator_factory = registry.get("kv_allocators", resolved.cache.kv_allocator)
        self.allocator: KVAllocator = allocator_factory(self.max_total_tokens, self.page_size, "cpu")
        self.config: ResolvedConfig = resolved
        self.attn_backend, backend_name = build_attention_backend(registry, resolved.attention.backend, self)
        self.config = resolved = resolved.with_attention_backend(backend_name)
        logger.info(
            "model %s loaded%s; %s",
            self.model_dir, f" (tensor-parallel rank {self.tp_rank} of {self.tp_size})" if self.tp_size > 1 else "",
            describe_resolution(config, resolved),
        )

    def _runtime_facts(self, offline: bool) -> RuntimeFacts:
        """What the ``auto`` choices depend on, read off the loaded model and its device."""
        on_cuda = self.device.type == "cuda"
        total = free = 0
        if on_cuda:
            # Loading may have freed memory into torch's cache (16-bit weights quantized at load to FP8):
            # handed back, it counts as free for the pool.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
        kv_name = next((name for name, dtype in KV_DTYPES.items() if dtype == self.kv_dtype),
                       str(self.kv_dtype).removeprefix("torch."))
        return RuntimeFacts(
            device="cuda" if on_cuda else "cpu",
            dtype=str(self.dtype).removeprefix("torch."),  # type: ignore[arg-type]
            context_length=getattr(self.hf_config, "max_position_embeddings", 4096),
            kv_bytes_per_token=KVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                                       self.kv_dtype),
            kv_dtype=kv_name,
            device_total_bytes=total,
            device_free_bytes=free,
            tp_size=self.tp_size,
            offline=offline,
            prefers_mixed_chunks=self.model_traits.prefers_mixed_chunks,
            launch_bound_prefill=self.model_traits.launch_bound_prefill,
            lora_max_rank=self.lora.max_rank if self.lora is not None else 0,
            lora_backend=self.lora.backend_name if self.lora is not None else "",
            embedding=self.embedding,
        )

    def _use_checkpoint_kv_scales(self) -> None:
        # A model that found per-layer KV-cache scales in its checkpoint lists them in `kv_cache_scales`.
        scales = self.model_traits.kv_cache_scales
        if not scales:
            return
        if not self.kv_cache.is_fp8:
            logger.info("the checkpoint's KV-cache scales are unused: cache.kv_dtype is auto")
            return
        for layer_id, layer_scales in scales.items():
            self.kv_cache.k_scales[layer_id] = layer_scales.get("k", 1.0)
            self.kv_cache.v_scales[layer_id] = layer_scales.get("v", 1.0)

    @property
    def uses_decode_graphs(self) -> bool:
        """Whether decode steps can replay CUDA graphs here: on CUDA, with a backend that supports them
        (``runtime.disable_cuda_graph`` is the worker's to apply)."""
        return self.device.type == "cuda" and bool(getattr(self.attn_backend, "supports_cuda_graph", False))

    @property
    def piecewise_graph_tokens(self) -> int:
        """The largest prefill step that can replay piecewise CUDA graphs (0: prefills run eagerly): on CUDA,
        ``runtime.piecewise_cuda_graph_max_tokens`` resolved above 0, and a model with
        ``forward_hidden``/``compute_logits``."""
        max_tokens = self.config.runtime.piecewise_cuda_graph_max_tokens
        if self.device.type != "cuda" or max_tokens == 0:
            return 0
        return max_tokens if self.model_traits.splits_forward else 0

    def _warm_up_prefill(self, tokens: int = 16,
                         forward: Callable[[ForwardBatch], torch.Tensor] | None = None) -> None:
        """One prefill of ``tokens`` dummy tokens through the real attention backend, its K/V written to the padding
        slot, so that first-use costs land in start-up, not on the first request: FlashInfer loads (or JIT-builds)
        its prefill module at first use, which took the first request of a fresh H100 server 17 s once no decode
        graph of ``flashinfer_triton`` went through FlashInfer any more. ``forward``: the worker's (through its
        graphs); default the eager one."""
        device = self.device
        lens = torch.tensor([tokens], dtype=torch.int64)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        padding = torch.zeros(tokens, dtype=torch.int64, device=device)
        (forward or self.forward)(ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=padding,
            positions=torch.arange(tokens, device=device), req_pool_indices=zero, seq_lens=lens.to(device),
            seq_lens_cpu=lens, out_cache_loc=padding, seq_lens_sum=tokens, logits_indices=zero + tokens - 1,
            req_to_token_pool=self.req_to_token_pool, kv_cache=self.kv_cache, attn_backend=self.attn_backend,
            extend_seq_lens=lens.to(device), extend_prefix_lens=zero, extend_start_loc=zero,
            extend_seq_lens_cpu=[tokens], extend_prefix_lens_cpu=[0],
        ))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32 or the model's dtype, as the model returns them) for ``forward_batch.logits_indices``,
        computed eagerly (``ModelWorker.forward`` replays CUDA graphs where it captured them), with the batch's
        context current for the layers (batch_context.py)."""
        with using_batch_context(forward_batch.batch_context):
            self.attn_backend.init_forward_metadata(forward_batch)
            return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.inference_mode()
    def forward_hidden_states(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Every row's final hidden state (after the final norm), computed eagerly: what an embedding model
        (``model.task: embed``) pools."""
        model = self.model
        with using_batch_context(forward_batch.batch_context):
            self.attn_backend.init_forward_metadata(forward_batch)
            hidden = model.forward_hidden(forward_batch.input_ids, forward_batch.positions, forward_batch)
            return model.compute_hidden_states(hidden, forward_batch)
