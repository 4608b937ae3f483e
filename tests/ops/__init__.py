"""The tests of ``kclpy/ops/``."""
