"""A gateway process's view of a session read from the manager's record (after the gateway was
started again): a finished last turn joins the recorded conversation at the stream's end (unless
it ran through /v1/completions), a turn still running is the one asked for next, and a closed
session's next turn is past its last. A session's turns go one at a time, and no lock outlives
its last user."""

import asyncio

import pytest
from transformers import AutoTokenizer

from rlmesh.common.v1 import common_pb2
from rlmesh.manager.v1 import manager_pb2
from rlmesh.models.tokenizer import IM_END_TOKEN, build_text_tokenizer, save_chat_tokenizer
from services.manager.domain.conversations import COMPLETIONS_KEY, LoggedMessage, conversation_to_proto, message_key
from services.manager.gateway.app import Gateway
from services.manager.gateway.sessions import GatewaySessions

ENVIRONMENT, MODEL = manager_pb2.SEGMENT_SOURCE_ENVIRONMENT, manager_pb2.SEGMENT_SOURCE_MODEL
USER = LoggedMessage(message_key({"role": "user", "content": "Count."}))


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(build_text_tokenizer(), folder, model_max_length=512)
    return GatewaySessions(
        manager=None, tokenizer=AutoTokenizer.from_pretrained(str(folder)), turn_timeout=5, rpc_timeout=5
    )


def record(
    segments, turns: int, status=manager_pb2.SESSION_STATUS_OPEN, conversation=(USER,)
) -> manager_pb2.GetSessionResponse:
    return manager_pb2.GetSessionResponse(
        session=manager_pb2.SessionTrajectory(session_id="b/p/0", segments=segments, status=status, turns=turns),
        key="k",
        sampling=common_pb2.SamplingParams(max_tokens=9),
        conversation=conversation_to_proto(conversation),
    )


def test_a_finished_turn_joins_the_recorded_conversation_where_the_stream_ends(sessions):
    stop = sessions.tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    answer = sessions.tokenizer.encode("five", add_special_tokens=False) + [stop]
    view = sessions._view_of(
        record(
            [
                manager_pb2.Segment(source=ENVIRONMENT, token_ids=[5, 6, 7]),
                manager_pb2.Segment(
                    source=MODEL, token_ids=answer, turn=0, finish_reason=common_pb2.FINISH_REASON_STOP
                ),
            ],
            turns=1,
        )
    )
    assert view.next_turn == 1 and view.stream == [5, 6, 7, *answer] and view.sampling.max_tokens == 9
    first, model = view.conversation
    assert first == USER
    assert model.key == message_key({"role": "assistant", "content": "five"})
    assert model.end == 3 + len(answer) and model.stop_text == IM_END_TOKEN


def test_a_turn_run_through_completions_is_no_chat_turn_of_the_recorded_conversation(sessions):
    stop = sessions.tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    mark = LoggedMessage(COMPLETIONS_KEY)
    view = sessions._view_of(
        record(
            [
                manager_pb2.Segment(source=ENVIRONMENT, token_ids=[5, 6, 7]),
                manager_pb2.Segment(
                    source=MODEL, token_ids=[8, stop], turn=0, finish_reason=common_pb2.FINISH_REASON_STOP
                ),
            ],
            turns=1,
            conversation=(mark,),
        )
    )
    assert view.next_turn == 1 and view.conversation == [mark]


def test_a_turn_still_running_is_the_one_asked_for_again(sessions):
    view = sessions._view_of(record([manager_pb2.Segment(source=ENVIRONMENT, token_ids=[5, 6, 7], turn=0)], turns=1))
    assert view.next_turn == 0 and view.conversation == [USER]


def test_a_closed_session_asks_for_the_turn_after_its_last(sessions):
    view = sessions._view_of(
        record(
            [manager_pb2.Segment(source=ENVIRONMENT, token_ids=[5, 6, 7], turn=0)],
            turns=1,
            status=manager_pb2.SESSION_STATUS_TRUNCATED_CONTEXT,
        )
    )
    assert view.next_turn == 1 and view.conversation == [USER]


async def test_a_sessions_turns_go_one_at_a_time_and_no_lock_outlives_them(sessions):
    gateway = Gateway(sessions, sessions.tokenizer, "tiny")
    order = []

    async def turn(name: str) -> None:
        unlock = await gateway.hold("b/p/0")
        order.append(f"{name} in")
        await asyncio.sleep(0.01)
        order.append(f"{name} out")
        unlock()

    await asyncio.gather(turn("first"), turn("second"), turn("third"))
    assert order == ["first in", "first out", "second in", "second out", "third in", "third out"]
    assert not gateway._locks
