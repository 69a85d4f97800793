"""Scheduling: the scheduler and its parts (admission, decode, request lifecycle, KV bookkeeping, output processing),
and the step observers that follow its steps."""
