"""The scheduler process: sole owner of request state, the waiting queue, KV blocks and the prefix cache."""
