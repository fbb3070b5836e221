"""Hostile-input suites: real replica and router processes on loopback, bounded in count and time."""
