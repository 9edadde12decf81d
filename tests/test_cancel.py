"""runtime/cancel.py: a time limit's cancellation lands in the request it was meant for and nowhere else."""

import threading
import time

import pytest

from bert_engine.runtime import cancel
from bert_engine.runtime.cancel import Cancelled, PredictionTimeout, call_with_timeout


def _bystander():
    """A thread of someone else's (fsspec's I/O loop, say) and what reached it."""
    caught, stop = [], threading.Event()

    def run():
        try:
            while not stop.wait(0.01):  # wakes every 10 ms: where an exception raised in it would land
                continue
        except BaseException as err:  # noqa: BLE001 - recorded for the assertion
            caught.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, stop, caught


def test_a_cancellation_reaches_only_a_running_request_not_a_thread_that_took_its_id():
    """An outside test saw `Cancelled` raised in fsspec's thread after `plugin check --case-timeout 0`: the
    cancelled request had ended and its thread id passed to a new thread between "is it alive?" and the
    raise. A request thread is now cancelled only while it is registered and threading's table still holds it
    under that id; a thread of its id that is another's is left alone."""
    bystander, stop, caught = _bystander()
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    ended._ident = bystander.ident  # what the OS does when it hands the ended request's id to a new thread
    ended.is_alive = lambda: True  # and "is it alive?" answered before it ended
    with cancel._cancelled_guard:
        cancel._running.add(ended)  # as if it had ended without leaving (a cancellation in its last bytecodes)
    try:
        cancel._inject(ended)
        time.sleep(0.1)
        assert bystander.is_alive() and caught == []
        cancel._inject(bystander)  # not a request thread of call_with_timeout's: never cancelled
        time.sleep(0.1)
        assert bystander.is_alive() and caught == []
    finally:
        with cancel._cancelled_guard:
            cancel._running.discard(ended)
        stop.set()
        bystander.join(5)


def test_requests_that_end_at_their_limit_cancel_nothing_else():
    """Many requests ending right at their time limit (the race of the outside test, over and over) beside a
    bystander thread: each is cut off or answers, the bystander never hears of it, and no request thread stays
    registered."""
    bystander, stop, caught = _bystander()
    answered = cut = 0
    try:
        for i in range(200):
            try:
                call_with_timeout(time.sleep, 0.001 * (i % 3), 0.001 * (i % 3))
                answered += 1
            except PredictionTimeout:
                cut += 1
        deadline = time.monotonic() + 5
        while cancel._running and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.6)  # past a watcher's next round of cancellations
        assert caught == [] and bystander.is_alive() and answered + cut == 200
        assert not cancel._running
    finally:
        stop.set()
        bystander.join(5)


def test_a_request_past_its_limit_is_still_stopped():
    stopped = threading.Event()

    def endless():
        try:
            while True:
                time.sleep(0.01)
        except Cancelled:
            stopped.set()
            raise

    with pytest.raises(PredictionTimeout, match="did not finish within 0.2 s"):
        call_with_timeout(endless, 0.2)
    assert stopped.wait(5)


def _counting(stop_after_s: float = 30.0):
    """A request's Python loop and how far it got: its count stops growing once the loop is stopped."""
    state = {"count": 0, "stopped": None}

    def work():
        end = time.monotonic() + stop_after_s
        try:
            while time.monotonic() < end:
                state["count"] += 1
                time.sleep(0.001)
        except BaseException as err:  # noqa: BLE001 - recorded, then raised on as it came
            state["stopped"] = type(err).__name__
            raise
        return "finished"

    return work, state


@pytest.mark.parametrize("timeout_s", [60.0, None])
def test_a_request_whose_sender_is_gone_stops_before_its_time_limit(timeout_s):
    """A visitor who cancels or leaves: the caller sets CALLER_GONE and the request stops at once (it ran on to
    its end or its 120 s limit, holding the CPU). Without a time limit too: the request then runs in a thread."""
    work, state = _counting()
    gone = threading.Event()
    threading.Timer(0.3, gone.set).start()
    token = cancel.CALLER_GONE.set(gone)
    start = time.monotonic()
    try:
        with pytest.raises(cancel.RequestCancelled, match="task 'x' was cancelled by its sender and stopped"):
            call_with_timeout(work, timeout_s, what="task 'x'")
    finally:
        cancel.CALLER_GONE.reset(token)
    assert time.monotonic() - start < 2.0
    deadline = time.monotonic() + 5
    while state["stopped"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state["stopped"] == "Cancelled"  # the request's own thread was stopped, not just abandoned
    count = state["count"]
    time.sleep(0.3)
    assert state["count"] == count


def test_a_request_whose_sender_stays_runs_to_its_answer():
    work, state = _counting(stop_after_s=0.3)
    token = cancel.CALLER_GONE.set(threading.Event())  # served by the playground, never set
    try:
        assert call_with_timeout(work, 30.0) == "finished"
        with pytest.raises(PredictionTimeout, match="within 0.2 s"):
            call_with_timeout(_counting(stop_after_s=5)[0], 0.2)
    finally:
        cancel.CALLER_GONE.reset(token)
    assert state["stopped"] is None


def test_wait_or_gone_waits_like_a_plain_wait_until_the_sender_goes():
    event = threading.Event()
    assert cancel.wait_or_gone(event, 0.05) is False  # no CALLER_GONE: a plain wait
    gone = threading.Event()
    token = cancel.CALLER_GONE.set(gone)
    try:
        start = time.monotonic()
        assert cancel.wait_or_gone(event, 0.2) is False and time.monotonic() - start >= 0.2
        threading.Timer(0.1, event.set).start()
        assert cancel.wait_or_gone(event, 5) is True
        event.clear()
        threading.Timer(0.2, gone.set).start()
        start = time.monotonic()
        with pytest.raises(cancel.RequestCancelled):
            cancel.wait_or_gone(event, None)
        assert time.monotonic() - start < 1.0
    finally:
        cancel.CALLER_GONE.reset(token)
