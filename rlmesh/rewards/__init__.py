"""Reward functions and the ways to provide one: built-in, a Python callable, a remote verifier.

- `base`: what every reward function takes and returns, and the interface they share.
- `builtin`: the rewards shipped with rlmesh, chosen by `reward.builtin`.
- `guard`: wraps a reward so a raise, hang or non-finite value costs its samples, not the run.
- `math`: the `math` built-in reward: the final answer checked by math-verify (GSM8K `#### N` too).
- `python`: a reward written as a Python function in the user's file (`module:function`, `file.py:function`).
- `remote`: a reward computed by a verifier behind `RewardService`, with deadlines, retries and batching.
"""
