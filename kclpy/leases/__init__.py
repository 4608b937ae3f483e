"""Leases: one DynamoDB item per shard, in the Java KCL 2.x schema, owned by one worker at a time."""
