"""The tests of ``kclpy/recovery/``."""
