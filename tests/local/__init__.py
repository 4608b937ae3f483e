"""The tests of ``kclpy/local/``."""
