"""Analysis tools: FLOPs, memory, benchmarks, the oracle check. The trainer never imports them."""
