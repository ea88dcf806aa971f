"""Benchmarks behind `mini-infer bench` and the chapters' speed cells: offline
throughput, prefix caching, speculation, serving, and static batching as the baseline."""
