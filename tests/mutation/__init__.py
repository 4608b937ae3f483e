"""A mutation check of the guard functions (``python -m tests.mutation``); not run by the
suite."""
