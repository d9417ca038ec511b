"""The eviction runtime: `cache` (an evicting KV cache), `capture` (its attention function) and
`engine` (prefill, batched decode and teacher-forced replay under one eviction cadence)."""
