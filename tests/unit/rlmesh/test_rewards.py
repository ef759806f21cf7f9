"""Rewards: a user's function gets the arguments it names (sync, async, batched), built-ins score
as documented, and the guard turns a raise, a hang or a NaN into the failure reward, counts it,
and stops the job past the configured error rate."""

import asyncio
import math
import time

import pytest

from rlmesh.rewards.base import RewardItem, RewardResult, as_result
from rlmesh.rewards.builtin import IncrementReward
from rlmesh.rewards.guard import GuardedReward, RewardErrorRateExceeded
from rlmesh.rewards.python import PythonReward, RewardLoadError, load_callable


def items(*pairs: tuple[str, str]) -> list[RewardItem]:
    return [
        RewardItem(f"s{i}", "p=", completion, {"answer": answer}, [1] * (len(completion) + 1))
        for i, (completion, answer) in enumerate(pairs)
    ]


def test_a_function_gets_the_arguments_it_names():
    def by_answer(completion, answer):
        return float(completion == answer)

    def everything(**kwargs):
        return {"reward": 0.5, "components": {"n": float(len(kwargs))}}

    async def later(completion, metadata):
        await asyncio.sleep(0)
        return len(completion) / 10

    async def run():
        assert [r.reward for r in await PythonReward(by_answer, False, "f").score(items(("12", "12"), ("1", "2")))] == [
            1.0,
            0.0,
        ]
        result = (await PythonReward(everything, False, "f").score(items(("1", "2"))))[0]
        assert result.components == {"n": 5.0}  # prompt, completion, metadata, completion_token_ids, answer
        assert (await PythonReward(later, False, "f").score(items(("123", "1"))))[0].reward == pytest.approx(0.3)

    asyncio.run(run())


def test_a_batched_function_takes_lists():
    calls = []

    def batch(completions=None, completion=None, answer=None):
        calls.append(len(completion))
        return [float(c == a) for c, a in zip(completion, answer)]

    results = asyncio.run(PythonReward(batch, True, "f").score(items(("1", "1"), ("2", "3"), ("4", "4"))))
    assert [r.reward for r in results] == [1.0, 0.0, 1.0] and calls == [3]


def test_return_values_are_checked():
    assert as_result(1).reward == 1.0 and as_result({"reward": 0.2, "components": {"a": 1}}).components == {"a": 1.0}
    for bad, message in (
        (float("nan"), "reward is nan"),
        ({"score": 1}, "needs a 'reward' key"),
        ("1", "must be a number"),
        ({"reward": 1, "extra": 2}, "unknown keys"),
    ):
        with pytest.raises((TypeError, ValueError), match=message):
            as_result(bad)


def test_functions_load_from_a_module_or_a_file(tmp_path):
    (tmp_path / "user_scores.py").write_text("def score(completion):\n    return 1.0\nvalue = 3\n")
    assert load_callable("user_scores:score", [str(tmp_path)])("x") == 1.0
    assert load_callable(f"{tmp_path / 'user_scores.py'}:score")("x") == 1.0
    for spec, message in (
        ("user_scores:absent", "has no attribute 'absent'"),
        ("user_scores:value", "not callable"),
        ("no_such_module_here:f", "cannot import module"),
        (f"{tmp_path}/missing.py:f", "does not exist"),
    ):
        with pytest.raises(RewardLoadError, match=message):
            load_callable(spec, [str(tmp_path)])
    with pytest.raises(RewardLoadError, match="no value for parameter 'solution'"):
        asyncio.run(PythonReward(lambda solution: 1.0, False, "f").score(items(("1", "1"))))


def test_the_increment_reward_gives_partial_credit_and_exact():
    results = asyncio.run(IncrementReward().score(items(("2345", "2345"), ("2344", "2345"))))
    assert [(r.reward, r.components["exact"]) for r in results] == [(1.0, 1.0), (0.75, 0.0)]


def guarded(function, batched=False, timeout=0.5, max_error_rate=0.5, window=8) -> GuardedReward:
    return GuardedReward("t", PythonReward(function, batched, "f"), timeout, -1.0, max_error_rate, window)


def test_a_raise_a_hang_or_a_nan_gives_the_failure_reward_and_is_counted():
    def flaky(completion):
        if completion == "raise":
            raise RuntimeError("verifier crashed")
        if completion == "hang":
            time.sleep(5)
        if completion == "nan":
            return math.nan
        return 1.0

    async def flaky_async(completion):
        if completion == "hang":
            await asyncio.sleep(5)
        return 1.0

    reward = guarded(flaky, max_error_rate=1.0)
    results = asyncio.run(reward.score(items(("raise", ""), ("hang", ""), ("nan", ""), ("ok", ""))))
    assert [r.reward for r in results] == [-1.0, -1.0, -1.0, 1.0]
    assert "verifier crashed" in results[0].error and "timed out" in results[1].error and "nan" in results[2].error
    assert (reward.counters.scored, reward.counters.failed, reward.counters.timed_out) == (4, 3, 1)
    assert [
        r.reward for r in asyncio.run(guarded(flaky_async, max_error_rate=1.0).score(items(("hang", ""), ("ok", ""))))
    ] == [-1.0, 1.0]


def test_a_batched_call_that_fails_fails_its_samples_only():
    def broken(completion):
        raise ValueError("bad batch")

    results = asyncio.run(guarded(broken, batched=True, max_error_rate=1.0).score(items(("1", "1"), ("2", "2"))))
    assert all(r.failed and r.reward == -1.0 and "bad batch" in r.error for r in results)


def test_wrong_token_rewards_fail_the_sample():
    def per_token(completion_token_ids):
        return {"reward": 1.0, "token_rewards": [0.0]}

    result = asyncio.run(guarded(per_token, max_error_rate=1.0).score(items(("12", "12"))))[0]
    assert result.failed and "1 token rewards for 3 tokens" in result.error


def test_past_the_error_rate_the_job_stops_with_the_reason():
    def always(completion):
        raise KeyError("answer")

    reward = guarded(always, max_error_rate=0.25, window=8)
    with pytest.raises(
        RewardErrorRateExceeded,
        match=r"task 't': 3 of the last 3 samples failed .*limit reward.max_error_rate = 25%.*KeyError",
    ):
        asyncio.run(reward.score(items(("1", "1"), ("2", "2"), ("3", "3"))))


def test_a_few_early_failures_do_not_stop_a_job():
    def sometimes(completion):
        if completion == "bad":
            raise RuntimeError("x")
        return 1.0

    reward = guarded(sometimes, max_error_rate=0.25, window=8)
    asyncio.run(reward.score(items(("bad", ""), ("ok", ""))))
    asyncio.run(reward.score(items(*[("ok", "")] * 6)))
    assert reward.counters.failed == 1
    assert isinstance(RewardResult(0.0).components, dict)
