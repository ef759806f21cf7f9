"""The user's reward for the nines'-complement task: credit per correct digit, and a named
component for exact answers. rlmesh loads it by name from job.toml (`reward:score`)."""


def score(completion: str, answer: str) -> dict:
    length = max(len(completion), len(answer))
    correct = sum(1 for got, want in zip(completion, answer) if got == want)
    exact = float(completion == answer)
    return {
        "reward": correct / length if length else 1.0,
        "components": {"exact": exact, "length_ok": float(len(completion) == len(answer))},
    }
