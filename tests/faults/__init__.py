"""Fault suites: real processes (redis-server included) killed and restarted mid-stream."""
