"""The tests of ``kclpy/retrieval/``."""
