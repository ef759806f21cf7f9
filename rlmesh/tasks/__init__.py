"""Verifiable tasks that generate their own data and score responses."""
