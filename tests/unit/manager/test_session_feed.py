"""The manager's feed of opening sessions: every watcher gets each publication in order, one too far
behind misses what overflows its queue without holding up the others, and a watcher that left gets
nothing more."""

from services.manager.session_feed import SessionFeed


async def test_each_watcher_gets_every_publication_in_order():
    feed: SessionFeed[str] = SessionFeed(queue_size=8)
    with feed.watch() as first, feed.watch() as second:
        assert len(feed) == 2
        for name in ("a", "b", "c"):
            feed.publish(name)
        assert [first.get_nowait() for _ in range(3)] == ["a", "b", "c"]
        assert [second.get_nowait() for _ in range(3)] == ["a", "b", "c"]
    assert len(feed) == 0


async def test_a_watcher_too_far_behind_misses_the_overflow_and_the_others_do_not():
    feed: SessionFeed[int] = SessionFeed(queue_size=2)
    with feed.watch() as slow, feed.watch() as keeping_up:
        for n in range(4):
            feed.publish(n)
            assert keeping_up.get_nowait() == n
        assert [slow.get_nowait() for _ in range(slow.qsize())] == [0, 1]


def test_a_watcher_that_left_gets_nothing_more():
    feed: SessionFeed[str] = SessionFeed()
    with feed.watch() as gone:
        pass
    feed.publish("late")
    assert gone.empty() and not feed
