"""Tests of no single module: the whole system (fleets, chaos, the simulator, the
benchmarks' harnesses, Java interop, hostile input through the worker) and the project
itself (its rules, docs, release and supply chain)."""
