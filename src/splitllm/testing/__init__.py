"""The harness that tests and benchmarks launch servers, clients and the WAN proxy with."""
