"""Reward functions and the ways to provide one: built-in, a Python callable, a remote verifier."""
