"""The tests of ``kclpy/spark/``."""
