"""The image processor a vision-language model gets is its own checkpoint's: never another model's limits, even
where transformers shares a processor class's default ``size`` dict between instances."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, Qwen2VLImageProcessor

from treadle.bench.vl import QWEN2_5_VL_7B, write_model
from treadle.core.multimodal.processor import MultimodalProcessor, load_image_processor
from treadle.testing.multimodal import random_image

TINY_LIMITS = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}  # the tests' tiny model's processor's


@pytest.fixture
def polluted_default(monkeypatch) -> dict:
    """The processor class's shared default ``size`` holding the tiny model's limits, as transformers 5.17 leaves it
    after ``Qwen2VLImageProcessor(min_pixels=..., max_pixels=...)``; and, as there, a processor made without a
    ``size`` writing its ``min_pixels``/``max_pixels`` into that shared dict."""
    default = dict(TINY_LIMITS)
    cls = type(Qwen2VLImageProcessor())
    original = cls.__init__

    def init_sharing_the_default(self, **kwargs) -> None:
        original(self, **{**kwargs, "size": kwargs.get("size") or cls.size})

    monkeypatch.setattr(cls, "size", default)
    monkeypatch.setattr(cls, "__init__", init_sharing_the_default)
    return default


def test_the_benchmark_model_scales_a_1024x768_image_to_its_own_limits(tmp_path, polluted_default):
    folder = write_model(tmp_path / "qwen2.5-vl-7b")
    processor = MultimodalProcessor.for_model(str(folder), AutoConfig.from_pretrained(folder))
    _, inputs = processor.process([QWEN2_5_VL_7B["image_token_id"]], [random_image(1024, 768)])
    assert inputs.items[0].grid_thw == (1, 54, 74)
    assert inputs.items[0].num_tokens == 999  # 756x1036 pixels: 54x74 patches, merged 2x2 (54 with the tiny limits)


def test_a_checkpoint_naming_pixel_limits_keeps_them_to_itself(tmp_path, polluted_default):
    """A published Qwen2.5-VL checkpoint names ``min_pixels``/``max_pixels`` and no ``size``: it gets its limits and
    the class's shared default is left as it was."""
    settings = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056,
                "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    processor = load_image_processor(str(tmp_path))
    assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (3136, 12845056)
    assert polluted_default == TINY_LIMITS
