"""Multi-turn episodes: driving each one as a session at the manager, in rank 0 or a process of its own.

- `agents`: An episode driven by a black-box agent.
- `driver`: The episode driver.
- `environment_threads`: Sync environment calls on threads.
- `process`: The episode driver in a process of its own (`episode_driver = "process"`), started by rank 0.
- `steps`: An episode driven step by step.
- `verifiers_environment`: An episode of a verifiers environment (`environment.verifiers`).
"""
