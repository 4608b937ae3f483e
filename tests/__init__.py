"""kclpy's test suite, laid out like the package it tests (docs/design.md, "Tests").

A package so that every test module is imported by its full name (``tests.leases.test_table``):
two folders may then each hold a ``test_<name>.py`` of the same name."""
