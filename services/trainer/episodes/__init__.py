"""Multi-turn episodes: driving each one as a session at the manager, in rank 0 or a process of its own.

- `agents`: an episode driven by the user's agent command against the session's gateway URL.
- `driver`: the episode driver: runs a batch's episodes concurrently and counts their failures.
- `environment_threads`: sync environment calls on threads, a hung call's thread written off.
- `process`: the episode driver in a process of its own (`episode_driver = "process"`), started by rank 0.
- `spec`: how a task's episodes run (`EpisodeSpec`), shared by the driver and every kind of episode.
- `steps`: an episode driven step by step: reset, then the model's turn and the environment's step.
- `verifiers_environment`: an episode of a verifiers environment (`environment.verifiers`).
"""
