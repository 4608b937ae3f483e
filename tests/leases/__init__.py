"""The tests of ``kclpy/leases/``."""
