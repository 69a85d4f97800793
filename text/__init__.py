"""Text handling around the engine: tokenizer glue, incremental detokenizing, tool-call and reasoning parsing."""
