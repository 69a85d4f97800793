"""Built-in treadle plugins: speculators (what proposes the drafts a speculative worker verifies)."""
