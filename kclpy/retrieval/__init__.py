"""Retrieval: iterators, GetRecords with backoff and prefetch, parse, KPL de-aggregation."""
