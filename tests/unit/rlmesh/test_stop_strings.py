"""Stop strings: the matcher, checking only the last tokens' text after each token, stops at the very
token with which the whole text first contains a stop string; the text shown ends before it, and a
stream holds back an ending that may still become one. The torch engine stops there, its tokens as
sampled; the synthetic engine, whose tokens are no text, refuses them."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmesh.chat.stop_strings import StopMatcher, cut_at_stop, stop_problem, tokenizer_decoder, without_partial_stop
from rlmesh.errors import InvalidArgument
from rlmesh.models.tokenizer import load_tokenizer
from services.rollout.engine import EngineRequest, Finish, Sampling
from services.rollout.synthetic_engine import SyntheticConfig, SyntheticEngine
from services.rollout.torch.engine import TorchEngine
from tests.support.engines import engine_output

# Tokens of one to three characters over a small alphabet, so stop strings span several tokens.
VOCABULARY = ["a", "b", "c", " ", "ab", "ba", "c ", " a", "abc", "bca", "\n", "a\n"]


def decode(token_ids: list[int]) -> str:
    return "".join(VOCABULARY[t] for t in token_ids)


@given(
    st.lists(st.integers(0, len(VOCABULARY) - 1), max_size=40),
    st.lists(st.text("abc \n", min_size=1, max_size=5), min_size=1, max_size=4),
    st.integers(0, 10),
)
def test_the_matcher_stops_at_the_first_token_whose_text_contains_a_stop_string(tokens, stops, continued):
    matcher = StopMatcher(decode, stops)
    earlier, response = tokens[:continued], tokens[continued:]
    found = next((i for i in range(len(response)) if matcher.reached(earlier, response[: i + 1])), None)
    expected = next(
        (i for i in range(len(response)) if any(s in decode(earlier + response[: i + 1]) for s in stops)), None
    )
    if expected is not None and any(s in decode(earlier) for s in stops):
        return  # the continued tokens already held one: an engine would have stopped before them
    assert found == expected


def test_the_text_shown_ends_before_the_stop_string_and_a_stream_holds_back_its_start():
    assert cut_at_stop("Action: look\nObservation: x", ["Observation:", "\n\n"]) == "Action: look\n"
    assert cut_at_stop("no stop here", ["Observation:"]) == "no stop here"
    assert without_partial_stop("Action: look\nObserv", ["Observation:"]) == "Action: look\n"
    assert without_partial_stop("Action: look\nObservation: x", ["Observation:"]) == "Action: look\n"
    assert without_partial_stop("done.", ["Observation:"]) == "done."
    assert (
        stop_problem(["a"] * 5) and stop_problem([""]) and stop_problem(["x" * 257]) and not stop_problem(["\n", "END"])
    )


async def test_the_torch_engine_stops_at_the_token_that_completes_a_stop_string(model_dir):
    engine = TorchEngine(model_dir, max_batch_size=4, seed=1)
    await engine.start()
    try:
        text_of = tokenizer_decoder(str(model_dir))
        prompt = load_tokenizer(model_dir).encode("98765432=").ids
        free, _, _, _ = await engine_output(
            engine, EngineRequest("free", prompt, Sampling(temperature=0, max_tokens=12))
        )
        text = text_of(free)
        stop = text[2:4]
        assert len(stop) == 2, text
        tokens, logprobs, _, finish = await engine_output(
            engine, EngineRequest("stop", prompt, Sampling(temperature=0, max_tokens=12, stop=(stop,)))
        )
        end = next(i for i in range(len(free)) if stop in text_of(free[: i + 1]))
        assert tokens == free[: end + 1] and len(logprobs) == len(tokens) and finish is Finish.STOP
        # A turn continued elsewhere: its earlier tokens count towards the text.
        rest, _, _, finish = await engine_output(
            engine,
            EngineRequest(
                "continued",
                prompt,
                Sampling(temperature=0, max_tokens=12, stop=(stop,)),
                continued_token_ids=free[:end],
            ),
        )
        assert rest == free[end : end + 1] and finish is Finish.STOP
    finally:
        await engine.stop()


async def test_the_synthetic_engine_refuses_stop_strings():
    engine = SyntheticEngine(SyntheticConfig(length="fixed", mean_tokens=4))
    await engine.start()
    try:
        with pytest.raises(InvalidArgument, match="stop strings"):
            await engine_output(engine, EngineRequest("s", [1, 2], Sampling(max_tokens=4, stop=("x",))))
    finally:
        await engine.stop()
