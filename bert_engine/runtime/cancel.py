"""Time limits that really stop a request: the call runs in its own thread, and when its time is up
the caller answers at once while the thread is cancelled.

Cancelling raises `Cancelled` inside the request's thread (CPython's PyThreadState_SetAsyncExc),
again every half second until the thread ends, so Python code stops at its next bytecode: a task's
loop, a chunked forward pass between chunks, a `with` block that then releases its lock. It is a
BaseException, so a task's `except Exception` cannot swallow it. A thread inside one native call
(a matmul, a sleep, a read) stops when that call returns; `ModelLock` keeps such a thread from
holding its model: once it has been cancelled for `grace_s`, the waiters take a fresh lock.

Python cannot kill a thread. A loop that catches BaseException (`except:`) and goes round again takes
each cancellation inside its `try` and runs on; so does one endless native call. The caller hears of such
a thread through `on_stuck` once it has outlived STUCK_AFTER_S of cancellations, and through `on_stopped`
if it ever ends: the app then refuses the task's further requests, so one stuck thread cannot become many.

A request is stopped the same way before its time limit when the one who sent it is gone: the caller sets
the event in CALLER_GONE (the playground does when Gradio cancels the visitor's event, or the visitor's
connection closes), and call_with_timeout, seeing it within GONE_POLL_S, cancels the thread and raises
RequestCancelled. Without this a cancelled request ran on to its end or its time limit, holding the CPU
and its visitor's in-flight place.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

logger = logging.getLogger(__name__)

REINJECT_EVERY_S = 0.5   # a task that catches BaseException gets the cancellation again
GIVE_UP_AFTER_S = 60.0   # then the thread is left alone (logged); its model lock was abandoned long before
STUCK_AFTER_S = 10.0     # a cancelled thread still running this long is reported stuck (on_stuck)
WATCH_STUCK_EVERY_S = 5.0  # how often a stuck thread, no longer cancelled, is looked at to report its end
GONE_POLL_S = 0.1        # how often a waiting caller looks whether the request's sender is gone (CALLER_GONE)

# Set by whoever serves a request when its sender cancels it or goes away (None: nobody says so)
CALLER_GONE: ContextVar[threading.Event | None] = ContextVar("bert_engine_caller_gone", default=None)


class Cancelled(BaseException):
    """Raised inside a request's thread when its time limit has passed."""


class PredictionTimeout(RuntimeError):
    """A prediction did not finish in time (a hung plugin, an overloaded machine)."""


class RequestCancelled(RuntimeError):
    """The request's sender cancelled it or went away (CALLER_GONE was set), so it was stopped."""


def wait_or_gone(event: threading.Event | threading.Condition, timeout_s: float | None) -> bool:
    """`event.wait(timeout_s)` in steps of GONE_POLL_S, or RequestCancelled as soon as this request's
    CALLER_GONE is set; returns what the wait returned (a Condition must be held by the caller)."""
    gone = CALLER_GONE.get()
    if gone is None:
        return event.wait(timeout_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if gone.is_set():
            raise RequestCancelled("the request was cancelled by its sender")
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return event.wait(0)
        if event.wait(GONE_POLL_S if left is None else min(GONE_POLL_S, left)):
            return True


_cancelled_at: dict[int, float] = {}  # thread ident -> monotonic time its cancellation began
_cancelled_guard = threading.Lock()
# The request threads call_with_timeout started that have not yet finished their Python code; a cancellation is
# injected only into one of these, under _cancelled_guard. An ident is the OS thread's: once a thread ends, the
# next thread may get the same one, and "is it alive?" then "raise in that ident" let a cancellation meant for
# an ended request land in an unrelated thread (fsspec's I/O thread in `plugin check --case-timeout 0`).
_running: set[threading.Thread] = set()


def cancelled_for(thread: threading.Thread) -> float | None:
    """Seconds since `thread` was cancelled (None: it was not, or it has ended)."""
    with _cancelled_guard:
        start = _cancelled_at.get(thread.ident) if thread.ident is not None else None
    return None if start is None else time.monotonic() - start


def _inject(thread: threading.Thread) -> None:
    # Under _cancelled_guard the thread cannot leave _running; under threading's own lock its ident cannot pass
    # to another thread (a thread leaves threading's table under that lock before its OS thread ends, and a new
    # one enters it under it). The second check covers a thread that ended without leaving _running (a
    # cancellation arriving in its last bytecodes).
    active = getattr(threading, "_active", None)
    registry_lock = getattr(threading, "_active_limbo_lock", None) or contextlib.nullcontext()
    with _cancelled_guard, registry_lock:
        ident = thread.ident
        if thread not in _running or ident is None:
            return
        if active.get(ident) is not thread if active is not None else not thread.is_alive():
            return
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(Cancelled))


def _leave_running(thread: threading.Thread) -> None:
    """Take `thread` (the current one, at the end of its work) out of _running, so that no cancellation is
    injected after it; one injected just before arrives here, and is taken here too."""
    while True:
        try:
            with _cancelled_guard:
                _running.discard(thread)
            return
        except Cancelled:  # injected before the discard: no other can follow it, so the next round ends
            continue


def cancel(thread: threading.Thread, what: str = "a request", *, on_stuck: Callable[[], None] | None = None,
           on_stopped: Callable[[], None] | None = None, why: str = "its time limit") -> threading.Thread:
    """Raise Cancelled in `thread` now and every REINJECT_EVERY_S until it ends; returns the watcher thread.
    `on_stuck()` is called (from the watcher) once the thread has outlived STUCK_AFTER_S of cancellations,
    and then `on_stopped()` when it ends, however late."""
    start = time.monotonic()
    with _cancelled_guard:
        _cancelled_at[thread.ident] = start
    stuck = False

    def report_stuck() -> None:
        nonlocal stuck
        if not stuck and on_stuck is not None and thread.is_alive() and time.monotonic() - start >= STUCK_AFTER_S:
            stuck = True
            logger.error("%s still runs %.0f s after it was cancelled (a loop that catches BaseException, or "
                         "a native call that does not return)", what, time.monotonic() - start)
            on_stuck()

    def watch() -> None:
        try:
            while thread.is_alive() and time.monotonic() - start < GIVE_UP_AFTER_S:
                _inject(thread)
                thread.join(REINJECT_EVERY_S)
                report_stuck()
            if thread.is_alive():
                logger.error("%s still runs %.0f s after it was cancelled (inside a native call?); "
                             "it no longer holds its model", what, GIVE_UP_AFTER_S)
            else:
                logger.info("%s stopped %.2f s after %s", what, time.monotonic() - start, why)
        finally:
            with _cancelled_guard:
                _cancelled_at.pop(thread.ident, None)
        if stuck:
            while thread.is_alive():
                thread.join(WATCH_STUCK_EVERY_S)
            logger.warning("%s, stuck since it was cancelled, ended %.0f s later", what, time.monotonic() - start)
            if on_stopped is not None:
                on_stopped()

    watcher = threading.Thread(target=watch, name="bert-engine-cancel", daemon=True)
    watcher.start()
    return watcher


def call_with_timeout(function: Callable[..., Any], timeout_s: float | None, *args: Any,
                      what: str = "the prediction", on_stuck: Callable[[], None] | None = None,
                      on_stopped: Callable[[], None] | None = None, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, or PredictionTimeout after `timeout_s` seconds (None: no limit),
    with the call cancelled (see the module docstring; `on_stuck`, `on_stopped`: as `cancel` takes them);
    RequestCancelled, the call cancelled as well, once this request's CALLER_GONE is set.
    Any exception of the call, BaseExceptions such as SystemExit or a native library's panic included,
    is raised here in the caller."""
    if timeout_s is None and CALLER_GONE.get() is None:
        return function(*args, **kwargs)
    box: dict[str, Any] = {}
    done = threading.Event()
    context = contextvars.copy_context()  # the caller's context variables (fairness.VISITOR) go along

    def target() -> None:
        try:
            try:
                box["value"] = context.run(function, *args, **kwargs)
            except BaseException as err:  # handed to the caller below
                box["error"] = err
            finally:
                done.set()
        except Cancelled:  # arrived during the clean-up above: nothing is waiting for this thread any more
            done.set()
        finally:
            _leave_running(thread)

    thread = threading.Thread(target=target, name="bert-engine-request", daemon=True)
    with _cancelled_guard:
        _running.add(thread)
    try:
        thread.start()
    except BaseException:
        with _cancelled_guard:
            _running.discard(thread)
        raise
    try:
        finished = wait_or_gone(done, timeout_s)
    except RequestCancelled:
        cancel(thread, what, on_stuck=on_stuck, on_stopped=on_stopped, why="its sender cancelled it")
        raise RequestCancelled(f"{what} was cancelled by its sender and stopped") from None
    except BaseException:  # the caller itself was interrupted (a real Ctrl-C): stop the call as well
        cancel(thread, what, on_stuck=on_stuck, on_stopped=on_stopped)
        raise
    if not finished:
        cancel(thread, what, on_stuck=on_stuck, on_stopped=on_stopped)
        raise PredictionTimeout(f"{what} did not finish within {timeout_s:g} s and was cut off")
    if "error" in box:
        error = box.pop("error")
        with contextlib.suppress(AttributeError, TypeError):  # an exception type without a __dict__
            error.raised_by_call = True  # tells a KeyboardInterrupt the call raised from a real Ctrl-C
        try:
            raise error
        finally:
            del error  # this frame is in the traceback: no cycle that would keep the call's frames alive
    return box.pop("value")


def raised_by_call(err: BaseException) -> bool:
    """Whether `err` came out of the function call_with_timeout ran (not from waiting for it)."""
    return bool(getattr(err, "raised_by_call", False))


class ModelLock:
    """One forward pass at a time on a model, which a cancelled request cannot keep.

    Waiters poll, so their own cancellation reaches them while they wait; when the holder has been
    cancelled for `grace_s` (stuck in a call Python cannot interrupt) or ended without releasing,
    the lock is replaced and the waiters go on; the stuck holder's late release is ignored.
    """

    def __init__(self, grace_s: float = 2.0) -> None:
        self.grace_s = grace_s
        self._guard = threading.Lock()
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None
        self._held = threading.local()

    def __enter__(self) -> ModelLock:
        while True:
            lock = self._lock
            if lock.acquire(timeout=0.05):
                with self._guard:
                    if lock is self._lock:
                        self._owner, self._held.lock = threading.current_thread(), lock
                        return self
                lock.release()  # replaced while we waited: take the new one
                continue
            self._maybe_abandon(lock)

    def __exit__(self, *exc: object) -> None:
        lock = self._held.__dict__.pop("lock", None)
        if lock is None:
            return
        with self._guard:
            if lock is self._lock:
                self._owner = None
        lock.release()

    def _maybe_abandon(self, lock: threading.Lock) -> None:
        owner = self._owner
        if owner is None:
            return
        stuck = cancelled_for(owner)
        if owner.is_alive() and (stuck is None or stuck < self.grace_s):
            return
        with self._guard:
            if self._lock is lock and self._owner is owner:
                logger.warning("a cancelled request (%s) still holds its model after %.1f s; the next requests "
                               "go on without it", owner.name, stuck or 0.0)
                self._lock, self._owner = threading.Lock(), None
