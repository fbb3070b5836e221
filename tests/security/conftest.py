"""Security suite: attacks from inside a sandbox that must fail (issue 15)."""
