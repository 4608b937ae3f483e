"""``python -m kclpy`` is ``kclpy-worker``."""

from kclpy.cli import main

main()
