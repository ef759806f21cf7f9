"""Environments a multi-turn task runs its episodes in: a Python class, a service in any language, an agent's command."""
