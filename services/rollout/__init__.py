"""The rollout service: one inference engine instance in the elastic pool."""
