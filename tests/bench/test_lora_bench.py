"""``treadle bench lora``'s CPU-checkable parts: the PEFT adapters it writes load into PEFT as written, and its
tables mark each ratio against its target."""

from __future__ import annotations

import pytest
import torch

from treadle.bench.lora import format_engine_table, format_kernel_table, format_sweep_table
from treadle.bench.lora_gemv import format_gemv_table
from treadle.bench.lora_engine import TARGET_MODULES, write_adapters
from treadle.bench.shapes import TINY


def test_written_adapters_load_into_peft_on_all_seven_projections(tmp_path) -> None:
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    paths = write_adapters(tmp_path, TINY, count=2, rank=4)
    assert sorted(paths) == ["adapter00", "adapter01"]
    config = LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")})
    model = peft.PeftModel.from_pretrained(LlamaForCausalLM(config), paths["adapter01"])
    written = load_file(f"{paths['adapter01']}/adapter_model.safetensors")
    loaded = {name: module for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert {name.rpartition(".")[2] for name in loaded} == set(TARGET_MODULES)
    assert len(loaded) == len(TARGET_MODULES) * TINY["num_hidden_layers"]
    for name, module in loaded.items():
        assert module.r["default"] == 4 and module.scaling["default"] == 2.0
        # PEFT put the file's values in place (a wrong tensor name would leave its random initialisation)
        a = written[f"{name}.lora_A.weight"]
        assert torch.equal(module.lora_A["default"].weight.to(a.dtype), a)


def test_tables_mark_each_ratio_against_its_target() -> None:
    kernels = format_kernel_table([{"case": "bs=1 decode, one adapter", "backend": "triton", "rank": 16,
                                    "base_ms": 4.0, "lora_ms": 0.3, "base_plus_lora_ms": 4.2, "ratio": 1.05}])
    assert "bs=1 decode, one adapter" in kernels and "1.050" in kernels
    dense = format_kernel_table([{"case": "4096-token prefill", "backend": "triton", "rank": 16, "base_ms": 80.0,
                                  "lora_ms": 12.0, "base_plus_lora_ms": 92.0, "ratio": 1.15,
                                  "forms": {"dense": {"lora_ms": 8.0, "ratio": 1.104},
                                            "no_dense": {"lora_ms": 14.0, "ratio": 1.171}}}])
    assert dense.splitlines()[1].split()[-2:] == ["ratio", "no-dense"]
    assert dense.splitlines()[2].split()[-3:] == ["1.150", "1.104", "1.171"]  # default, dense on, dense off
    result = {"spread_over_adapters": 16, "offline_ratio": 0.9, "bs1_step_ratio": 1.2, "bs32_step_ratio": 1.1,
              "base": {"offline_output_tok_s": 1000.0, "bs1_step_ms": 5.0, "bs32_step_ms": 8.0},
              "lora": {"offline_output_tok_s": 900.0, "bs1_step_ms": 6.0, "bs32_step_ms": 8.8}}
    lines = format_engine_table(result).splitlines()
    offline, bs1, bs32 = (next(line for line in lines if line.startswith(prefix))
                          for prefix in ("offline", "bs=1", "bs=32"))
    assert offline.endswith(">= 0.85 ok") and bs1.endswith("<= 1.10 MISSED") and bs32.endswith("<= 1.25 ok")
    assert format_engine_table({"skipped": "no lora config"}) == "end to end: skipped: no lora config"


def test_sweep_table_compares_each_choice_with_the_default_of_its_case() -> None:
    rows = [{"case": "bs=1, 1 adapter", "choice": "default", "base_ms": 5.0, "lora_ms": 0.9, "ratio": 1.18},
            {"case": "bs=1, 1 adapter", "choice": "shrink_tile=16384", "base_ms": 5.0, "lora_ms": 0.4, "ratio": 1.08}]
    lines = format_sweep_table(rows).splitlines()
    row = lines[3]
    assert "shrink_tile=16384" in row and row.endswith("1.080     -0.100")
    assert lines[-1].split() == ["bs=1,", "1", "adapter", "shrink_tile=16384", "1.080"]


def test_gemv_table_puts_the_unfused_and_split_ratios_side_by_side() -> None:
    rows = [{"case": "bs=1, 1 adapter", "base_ms": 4.0, "unfused_ms": 4.6, "unfused_ratio": 1.15, "split_ms": 4.3,
             "split_ratio": 1.075, "split_all_ms": 4.2, "split_all_ratio": 1.05,
             "small_batch": {"16-bit 6144 x 4096": "1 row: triton 4/2048/8/4 gemv"}},
            {"case": "bs=32, 32 adapters, cuBLAS", "base_ms": 8.0, "unfused_ms": 10.4, "unfused_ratio": 1.3,
             "split_ms": 10.0, "split_ratio": 1.25, "split_all_ms": 10.0, "split_all_ratio": 1.25}]
    lines = format_gemv_table(rows).splitlines()
    assert lines[1].split()[3:] == ["unfused", "ms", "ratio", "split", "ms", "ratio", "split_all", "ms", "ratio"]
    assert lines[2].split()[-7:] == ["4.000", "4.600", "1.150", "4.300", "1.075", "4.200", "1.050"]
    assert lines[3].split()[:4] == ["bs=32,", "32", "adapters,", "cuBLAS"] and lines[3].endswith("1.250")
    assert lines[4].strip() == "16-bit 6144 x 4096: 1 row: triton 4/2048/8/4 gemv"
