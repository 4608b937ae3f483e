"""Test helpers shared by every test module: local streams and tables, fault injection."""
