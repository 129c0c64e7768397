"""Small example models in plain torch, shipped for the demo, the tests and the benchmarks."""
