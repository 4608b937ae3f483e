"""Leases: one DynamoDB item per shard, in the Java KCL 2.x schema, one owner at a time."""
