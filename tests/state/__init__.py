"""The tests of ``kclpy/state/``."""
