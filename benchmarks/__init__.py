"""Benchmarks of llm-pool: scenarios, a harness, committed results (see docs/performance.md)."""
