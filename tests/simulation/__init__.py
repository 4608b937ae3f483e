"""A seeded fleet simulator in virtual time: see ``history.py`` for what a history is and
checks, ``scheduler.py`` for how kclpy's threads run deterministically, ``aws.py`` for
the in-memory endpoints and faults, and ``__main__.py`` for the soak and replay command."""
