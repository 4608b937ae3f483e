"""Retrieval: shard iterators, GetRecords with backoff and prefetch, response parse, KPL de-aggregation."""
