"""LoRA adapters: many fine-tunes of one base model served in one batch."""
