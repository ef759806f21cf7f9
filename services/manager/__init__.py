"""The manager service: instance registry, scheduler and rollout-group assembler."""
