"""Benchmarks: workloads and measurements run through the real client and server."""
