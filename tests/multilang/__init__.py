"""The tests of ``kclpy/multilang/``."""
