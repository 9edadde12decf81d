"""Sharing one machine between visitors: who is asking, how much each may have in flight, and whose
forward pass runs next.

A public Space serves many visitors from one CPU or GPU. The per-request limits (inference.py: text
length, tokens over all windows; cancel.py: the time limit) bound what one request costs, but one
visitor sending many of the costliest requests allowed would still take the machine from the rest.
Two rules keep the others' share:

- **In flight.** A visitor (a browser session) may have `max_in_flight()` requests (BERT_ENGINE_MAX_IN_FLIGHT) running at once;
  `max_waiting()` more (BERT_ENGINE_MAX_WAITING) wait, without using the CPU, for one of them to finish, and
  any beyond those are refused at once with a message. A client that resends every refusal at once would
  otherwise turn its share into a flood of refusals, each a trip through the server.
- **Least recent compute first.** Every forward pass goes through one `ComputeGate`, in chunks of
  about `chunk_flops()` of work (BERT_ENGINE_CHUNK_GFLOP). When the gate frees, the waiting chunk whose visitor has used the
  least compute recently (FLOPs, decaying with a half-life of `HALF_LIFE_S`) goes next (an address's
  sessions are one visitor there; among them, the session with least compute goes first). A visitor
  asking for a sentence waits for at most one chunk of a visitor summarising a book; the book's
  chunks run when nobody lighter waits. Without a visitor (the CLI, Python), each request counts
  as its own visitor, which is plain least-attained-service scheduling.

The visitor of the running code is a context variable (`VISITOR`), set by the playground from
Gradio's request; cancel.call_with_timeout carries it into the thread that runs the request.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from .. import settings
from .cancel import cancelled_for, wait_or_gone


def chunk_flops() -> float:
    """The work of one forward chunk (FLOPs, padding included): BERT_ENGINE_CHUNK_GFLOP, read now."""
    return settings.get("BERT_ENGINE_CHUNK_GFLOP") * 1e9


def max_in_flight() -> int:
    """Requests one visitor may have running at once: BERT_ENGINE_MAX_IN_FLIGHT, read now."""
    return settings.get("BERT_ENGINE_MAX_IN_FLIGHT")


def max_in_flight_per_group() -> int:
    """Requests one address may have running at once, over all its sessions: BERT_ENGINE_MAX_IN_FLIGHT_PER_IP."""
    return settings.get("BERT_ENGINE_MAX_IN_FLIGHT_PER_IP")


def max_waiting() -> int:
    """Requests one visitor (and one address) may have waiting for a free place beyond its in-flight cap:
    BERT_ENGINE_MAX_WAITING, read now."""
    return settings.get("BERT_ENGINE_MAX_WAITING")


HALF_LIFE_S = 30.0  # a visitor's recent compute halves every 30 s
SHARED_S = 2.0  # another account used the gate this recently: the machine is shared, chunks are short
SHARED_CHUNK_SHARE = 8  # ... an eighth of BERT_ENGINE_CHUNK_GFLOP (a row at least), so others wait less
STUCK_GRACE_S = 2.0  # a cancelled holder stuck in native code this long no longer blocks the gate

VISITOR: ContextVar[str | None] = ContextVar("bert_engine_visitor", default=None)
# Where the visitor connects from (the client's address): sessions opened from one address share one
# share of the gate and one in-flight cap, so opening a new session per request multiplies nothing.
GROUP: ContextVar[str | None] = ContextVar("bert_engine_visitor_group", default=None)
# A visitor for one call only (a request with no session: a direct HTTP call, a relayed MCP call): nothing is kept
# for it after the call (a last input, a model choice), since no later request of its can read it, and keeping it
# would push out the sessions' own (session 58's re-audit: 270 such calls evicted a visitor's last input).
ONE_CALL_PREFIXES = ("call:", "mcp-call:")


def one_call(visitor: str | None) -> bool:
    """Whether `visitor` stands for one call only (ONE_CALL_PREFIXES)."""
    return isinstance(visitor, str) and visitor.startswith(ONE_CALL_PREFIXES)


class Waited:
    """Seconds the current request spent waiting for the gate (set by the caller that wants to know:
    a request cut off while it waited for others is the machine's load, not its task's fault)."""

    def __init__(self) -> None:
        self._done = 0.0
        self._since: float | None = None  # waiting now, since then

    @property
    def seconds(self) -> float:
        """Time waited so far, including a wait still going on (read from another thread)."""
        since = self._since
        return self._done + (time.monotonic() - since if since is not None else 0.0)

    def start(self) -> None:
        self._since = time.monotonic()

    def stop(self) -> None:
        if self._since is not None:
            self._done += time.monotonic() - self._since
            self._since = None


WAITED: ContextVar[Waited | None] = ContextVar("bert_engine_waited", default=None)


class TooManyRequests(Exception):  # noqa: N818 - the HTTP name says what it is
    """A visitor asked for more than max_in_flight() requests at once."""


class InFlight:
    """How many requests each visitor has running; `admit` holds one beyond the limit in a short waiting
    line, and refuses one beyond that."""

    def __init__(self, limit: int | None = None, group_limit: int | None = None, waiting: int | None = None) -> None:
        self._limit = limit  # None: the setting, read when a request is admitted
        self._group_limit = group_limit
        self._waiting_limit = waiting
        self._running: dict[str, int] = {}
        self._groups: dict[str, int] = {}
        self._waiting: dict[str, int] = {}  # visitors' and groups' requests waiting for a place (keys v:, g:)
        self._cond = threading.Condition()
        self.admitted = 0  # requests admitted so far: one admitted during another's run overlapped it

    def _full(self, visitor: str, group: str | None, limit: int, group_limit: int) -> str | None:
        """Why the visitor may not start another request now (None: it may)."""
        if self._running.get(visitor, 0) >= limit:
            return f"you already have {limit} requests running"
        if group is not None and self._groups.get(group, 0) >= group_limit:
            return f"{group_limit} requests from your address are already running (over all its sessions)"
        return None

    @contextmanager
    def admit(self, visitor: str | None, group: str | None = None, wait_s: float = 0.0) -> Iterator[None]:
        """Count the request while it runs. When the visitor already has `limit` running, or its group
        (address) `group_limit` over all its sessions, the request waits up to `wait_s` seconds for one
        of them to finish, if fewer than `waiting` of the visitor's and of the group's already wait;
        otherwise (or when the wait runs out) raises TooManyRequests before anything runs. A request
        without a visitor is not counted."""
        limit = max_in_flight() if self._limit is None else self._limit
        group_limit = max_in_flight_per_group() if self._group_limit is None else self._group_limit
        line = max_waiting() if self._waiting_limit is None else self._waiting_limit
        if visitor is None or limit <= 0:
            yield
            return
        group = group if group_limit > 0 else None
        lines = [f"v:{visitor}"] + ([f"g:{group}"] if group is not None else [])
        with self._cond:
            full = self._full(visitor, group, limit, group_limit)
            if full is not None and wait_s > 0 and all(self._waiting.get(k, 0) < line for k in lines):
                for key in lines:
                    self._waiting[key] = self._waiting.get(key, 0) + 1
                deadline = time.monotonic() + wait_s
                try:
                    while full is not None and time.monotonic() < deadline:
                        wait_or_gone(self._cond, deadline - time.monotonic())  # sender gone: stop waiting
                        full = self._full(visitor, group, limit, group_limit)
                finally:
                    for key in lines:
                        _decrement(self._waiting, key)
                if full is not None:
                    raise TooManyRequests(f"{full} and none finished within {wait_s:g} s; wait for their answers "
                                          "before sending more")
            if full is not None:
                raise TooManyRequests(f"{full}; wait for their answers before sending more")
            self._running[visitor] = self._running.get(visitor, 0) + 1
            if group is not None:
                self._groups[group] = self._groups.get(group, 0) + 1
            self.admitted += 1
        try:
            yield
        finally:
            with self._cond:
                _decrement(self._running, visitor)
                if group is not None:
                    _decrement(self._groups, group)
                self._cond.notify_all()

    def total(self) -> int:
        """Requests running now, every visitor's."""
        with self._cond:
            return sum(self._running.values())

    def running(self, visitor: str) -> int:
        with self._cond:
            return self._running.get(visitor, 0)

    def waiting(self, visitor: str) -> int:
        """The visitor's requests waiting for a place now."""
        with self._cond:
            return self._waiting.get(f"v:{visitor}", 0)


def _decrement(counts: dict[str, int], key: str) -> None:
    if counts[key] > 1:
        counts[key] -= 1
    else:
        del counts[key]


class _Waiter:
    __slots__ = ("key", "member", "seq")

    def __init__(self, key: object, member: object, seq: int) -> None:
        self.key, self.member, self.seq = key, member, seq


class Turn:
    """A turn at the gate being used: `hand_back(cost)` charges the work done so far, lets whoever used
    least lately go first, and returns when this key's turn comes again (a row too long for one turn
    hands it back between the encoder's layers: runtime/inference.py)."""

    def __init__(self, gate: ComputeGate, key: object, member: object = None) -> None:
        self.gate, self.key, self.member, self.charged = gate, key, member, 0.0
        self.behind = False  # set when the turn starts: lighter visitors share the machine (see `threads`)

    def threads(self) -> int:
        """Intra-op threads for this turn's work: all of them, or half while lighter visitors share the machine
        (their tokenising, decoding and the server's own work run beside it, on the other cores)."""
        total = torch.get_num_threads()
        return max(1, total // 2) if self.behind and total > 1 else total

    def hand_back(self, cost: float) -> None:
        self.gate._release(self.key, cost, self.member)
        self.charged += cost
        self.gate._acquire(self.key, self.member)


def _accounts(key: object | None) -> tuple[object, object]:
    """(the account a turn is charged to, the member of it that asks): an explicit `key` is its own account;
    else the address (GROUP) with the session (VISITOR) as its member, else the session, else this one call."""
    if key is not None:
        return key, None
    group, visitor = GROUP.get(), VISITOR.get()
    if group is not None:
        return group, ("member", group, visitor) if visitor is not None else None
    return (visitor if visitor is not None else object()), None


class ComputeGate:
    """`slots` forward chunks at a time; the next slot goes to the waiter whose account (its address) has the
    least recent compute, then, within an address, whose session has (ties: first come): sessions behind one
    address (an office, a phone carrier) share the address's one share, but a short request of one does not
    wait behind another's long one. Waiting polls, so a request's cancellation reaches it."""

    def __init__(self, slots: int = 1, half_life_s: float = HALF_LIFE_S) -> None:
        self.slots = slots
        self.decay = math.log(2) / half_life_s
        self._cond = threading.Condition()
        self._holders: list[threading.Thread] = []
        self._waiting: list[_Waiter] = []
        self._usage: dict[object, tuple[float, float]] = {}  # account or member -> (FLOPs, when)
        self._seen: dict[tuple[object, object], float] = {}  # (account, member) -> when it last used the gate
        self._seq = 0

    def usage(self, key: object, now: float | None = None) -> float:
        """The key's recent compute (FLOPs, as charged), decayed to now."""
        if key is None:
            return 0.0
        tokens, when = self._usage.get(key, (0.0, 0.0))
        now = time.monotonic() if now is None else now
        return tokens * math.exp(-self.decay * (now - when))

    def chunk_budget(self, key: object | None = None) -> float:
        """The FLOPs `key`'s next chunk may hold the machine for: chunk_flops() while nobody else is around,
        an eighth of it while another account waits or used the gate in the last SHARED_S seconds. A
        chunk cannot be interrupted, so a light visitor arriving behind a heavy one waits for at most
        one short chunk (12.5 GFLOP: one 512-token MiniLM row, 77 ms on the 2-core AVX-512 EPYC by
        benchmarks.encoder, against ~0.6 s for 100 GFLOP); alone, a long request keeps big, efficient chunks."""
        return chunk_flops() / SHARED_CHUNK_SHARE if self._others_around(*_accounts(key)) else chunk_flops()

    @contextmanager
    def turn(self, cost: float, key: object | None = None) -> Iterator[Turn]:
        """Wait for a slot, run the block, then charge `cost` (its FLOPs: BertConfig.forward_flops) to
        `key` (default: the current GROUP, else VISITOR, else a key for this one call). The block gets
        the Turn, which it may hand back and take again mid-work (`Turn.hand_back`)."""
        key, member = _accounts(key)
        turn = Turn(self, key, member)
        self._acquire(key, member)
        turn.behind = self.behind_others(key, member)
        try:
            yield turn
        finally:
            self._release(key, max(0.0, cost - turn.charged), member)

    def behind_others(self, key: object, member: object = None) -> bool:
        """Whether a visitor with less recent compute than `key` (and, within its address, than `member`)
        waits, or used the gate in the last SHARED_S seconds: `key` is the heavier one on a shared machine."""
        return self._others_around(key, member, lighter=True)

    def _rank(self, key: object, member: object, now: float) -> tuple[float, float]:
        return self.usage(key, now), self.usage(member, now)

    def _others_around(self, key: object, member: object = None, lighter: bool = False) -> bool:
        """Whether another account, or another session of the same address, waits at the gate or used it in
        the last SHARED_S seconds (`lighter`: one with less recent compute than this one)."""
        now = time.monotonic()
        with self._cond:
            mine = self._rank(key, member, now) if lighter else (math.inf, math.inf)
            others = {(w.key, w.member) for w in self._waiting} | {
                pair for pair, when in self._seen.items() if now - when < SHARED_S}
            return any(pair != (key, member) and self._rank(*pair, now) < mine for pair in others)

    def _acquire(self, key: object, member: object = None) -> None:
        waited = WAITED.get()
        with self._cond:
            self._seq += 1
            waiter = _Waiter(key, member, self._seq)
            self._waiting.append(waiter)
            if waited is not None:
                waited.start()
            try:
                while not self._my_turn(waiter):
                    self._cond.wait(0.05)
            finally:
                self._waiting.remove(waiter)
                if waited is not None:
                    waited.stop()
            self._holders.append(threading.current_thread())

    def _release(self, key: object, cost: float, member: object = None) -> None:
        with self._cond:
            me = threading.current_thread()
            if me in self._holders:
                self._holders.remove(me)
            now = time.monotonic()
            for charged in (key, member) if member is not None else (key,):
                self._usage[charged] = (self.usage(charged, now) + cost, now)
            self._seen[(key, member)] = now
            if len(self._usage) > 4096:  # forget the visitors whose compute has decayed away
                self._usage = {k: v for k, v in self._usage.items() if self.usage(k, now) > 1.0}
            if len(self._seen) > 4096:
                self._seen = {k: when for k, when in self._seen.items() if now - when < SHARED_S}
            self._cond.notify_all()

    def _my_turn(self, waiter: _Waiter) -> bool:
        self._holders = [t for t in self._holders if t.is_alive() and (cancelled_for(t) or 0.0) < STUCK_GRACE_S]
        if len(self._holders) >= self.slots:
            return False
        now = time.monotonic()
        best = min(self._waiting, key=lambda w: (*self._rank(w.key, w.member, now), w.seq))
        return best is waiter


GATE = ComputeGate(slots=1)  # one forward chunk at a time per process: each already uses every core


@contextmanager
def visitor_scope(visitor: str | None, group: str | None = None) -> Iterator[None]:
    """Run the block as `visitor` (None: anonymous) from `group` (its address; None: unknown)."""
    token, group_token = VISITOR.set(visitor), GROUP.set(group)
    try:
        yield
    finally:
        GROUP.reset(group_token)
        VISITOR.reset(token)
