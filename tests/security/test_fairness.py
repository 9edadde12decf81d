"""One visitor cannot take the machine from the others: a visitor's requests in flight are capped, the
next forward chunk goes to whoever used least compute lately, and no visitor sees another's input.
The throughput figure under attack is benchmarks/load_test.py --attacker (see docs/reliability.md)."""

import threading
import time

import pytest
import torch

from bert_engine.runtime.fairness import ComputeGate, InFlight, TooManyRequests, visitor_scope
from bert_engine.runtime.inference import forward_in_chunks, row_flops


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _hold(gate: ComputeGate, key: str, tokens: int = 1) -> tuple[threading.Thread, threading.Event]:
    """A thread holding a turn at `gate` (as `key`) until the returned event is set; returns once it holds."""
    release = threading.Event()

    def hold():
        with gate.turn(tokens, key=key):
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    _wait_until(lambda: gate._holders)
    return thread, release


def test_the_next_chunk_goes_to_the_visitor_with_least_recent_compute():
    gate = ComputeGate(slots=1)
    with gate.turn(50_000, key="heavy"):  # the heavy visitor has just used a lot
        pass
    order = []

    def waiter(key):
        with gate.turn(10, key=key):
            order.append(key)

    holder, release = _hold(gate, "heavy", 4096)
    threads = [holder]
    for key in ("heavy", "light"):  # the heavy visitor's next chunk was queued first
        threads.append(threading.Thread(target=waiter, args=(key,)))
        threads[-1].start()
        queued = len(threads) - 1
        _wait_until(lambda queued=queued: len(gate._waiting) == queued)
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == ["light", "heavy"]
    assert gate.usage("heavy") > 50_000 > gate.usage("light") > 0


def test_sessions_behind_one_address_share_its_share_but_a_light_one_goes_first_within_it():
    """Two sessions from one address (an office's NAT): the address is charged as one account against other
    addresses, but among its own waiters the session with less recent compute goes first, and the heavy one's
    chunks are short while the other is around (a visitor's short request waited 1-3 s behind a heavy session
    of its own address, 0.17 s behind one of another address)."""
    import bert_engine.runtime.fairness as fairness

    gate = ComputeGate(slots=1)
    # each turn charges its cost when it ends: the recent use each account and session starts with
    with visitor_scope("heavy-session", "ip:1"), gate.turn(50_000):
        pass
    with visitor_scope("other-address", "ip:2"), gate.turn(60_000):  # another address, heavier still
        pass
    order = []

    def waiter(session, address):
        with visitor_scope(session, address), gate.turn(10):
            order.append(session)

    holder, release = _hold(gate, "someone", 1)
    threads = [holder]
    for session, address in (("heavy-session", "ip:1"), ("other-address", "ip:2"), ("light-session", "ip:1")):
        threads.append(threading.Thread(target=waiter, args=(session, address)))
        threads[-1].start()
        queued = len(threads) - 1
        _wait_until(lambda queued=queued: len(gate._waiting) == queued)
    with visitor_scope("heavy-session", "ip:1"):  # a session of its own address waits: the heavy one's chunks shrink
        assert gate.chunk_budget() == fairness.chunk_flops() / fairness.SHARED_CHUNK_SHARE
    release.set()
    for thread in threads:
        thread.join(10)
    assert order == ["light-session", "heavy-session", "other-address"]  # the address first, then within it
    assert gate.usage("ip:1") == pytest.approx(50_020, rel=0.01)  # one account for the address


def test_a_cancelled_holder_stuck_in_native_code_does_not_block_the_gate(monkeypatch):
    import bert_engine.runtime.fairness as fairness

    gate = ComputeGate(slots=1)
    thread, stuck = _hold(gate, "a")
    monkeypatch.setattr(fairness, "cancelled_for", lambda t: 5.0 if t is thread else None)  # cut off 5 s ago
    start = time.monotonic()
    with gate.turn(1, key="b"):
        waited = time.monotonic() - start
    stuck.set()
    thread.join(10)
    assert waited < 1.0


def test_a_visitor_may_have_only_so_many_requests_in_flight():
    in_flight = InFlight(limit=2)
    with in_flight.admit("a"), in_flight.admit("a"):
        with pytest.raises(TooManyRequests, match="you already have 2 requests running"):
            with in_flight.admit("a"):
                pass
        with in_flight.admit("b"):  # another visitor is not affected
            assert in_flight.running("b") == 1
        assert in_flight.running("a") == 2
    assert in_flight.running("a") == 0
    with in_flight.admit(None), in_flight.admit(None), in_flight.admit(None):  # no visitor: not counted
        pass


def test_a_request_beyond_the_cap_waits_idle_for_a_place_and_one_beyond_the_line_is_refused_at_once():
    """A client that resends each refusal at once turns its share into a flood of refusals (issue 36: the
    attacker sending 4 at once); the third and fourth wait, without the CPU, and start when a place frees."""
    in_flight = InFlight(limit=2, group_limit=8, waiting=2)
    first_done, second_done = threading.Event(), threading.Event()
    started, refused = [], []

    def third(name, release):
        with in_flight.admit("a", "ip:1", wait_s=60):
            started.append(name)
            release.wait(30)

    with in_flight.admit("a", "ip:1"):
        second = in_flight.admit("a", "ip:1")
        second.__enter__()
        waiters = [threading.Thread(target=third, args=(n, e)) for n, e in (("c", first_done), ("d", second_done))]
        for thread in waiters:
            thread.start()
        deadline = time.monotonic() + 10
        while in_flight.waiting("a") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert in_flight.waiting("a") == 2 and started == []  # both wait; neither runs beside the two
        began = time.monotonic()
        with pytest.raises(TooManyRequests, match="you already have 2 requests running"):
            with in_flight.admit("a", "ip:1", wait_s=60):  # the line is full: refused, not held 60 s
                refused.append("e")
        assert time.monotonic() - began < 30 and refused == []
        second.__exit__(None, None, None)  # a place frees: exactly one waiter starts
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 1 and in_flight.running("a") == 2 and in_flight.waiting("a") == 1
    first_done.set(), second_done.set()
    for thread in waiters:
        thread.join(10)
    assert sorted(started) == ["c", "d"] and in_flight.running("a") == 0 and in_flight.waiting("a") == 0


def test_a_wait_for_a_place_ends_with_a_refusal_when_none_frees():
    in_flight = InFlight(limit=1, group_limit=8, waiting=2)
    with in_flight.admit("a", "ip:1"):
        with pytest.raises(TooManyRequests, match=r"you already have 1 requests running and none finished within 0.2 s"):
            with in_flight.admit("a", "ip:1", wait_s=0.2):
                raise AssertionError("admitted while the first still ran")
        assert in_flight.waiting("a") == 0 and in_flight.running("a") == 1
    no_line = InFlight(limit=1, group_limit=8, waiting=0)  # BERT_ENGINE_MAX_WAITING=0: refused at once
    with no_line.admit("a"), pytest.raises(TooManyRequests, match="you already have 1 requests running;"):
        with no_line.admit("a", wait_s=60):
            raise AssertionError("admitted beyond the cap")


def test_a_request_waiting_for_a_place_leaves_the_line_when_its_sender_is_gone():
    """A visitor who cancels a request that waits for a place (or closes the page) frees its place in the
    line at once: it held it for up to its whole time limit."""
    from bert_engine.runtime.cancel import CALLER_GONE, RequestCancelled

    in_flight = InFlight(limit=1, group_limit=8, waiting=1)
    gone = threading.Event()
    with in_flight.admit("a", "ip:1"):
        threading.Timer(0.3, gone.set).start()
        token = CALLER_GONE.set(gone)
        began = time.monotonic()
        try:
            with pytest.raises(RequestCancelled), in_flight.admit("a", "ip:1", wait_s=60):
                raise AssertionError("admitted while the first still ran")
        finally:
            CALLER_GONE.reset(token)
        assert time.monotonic() - began < 2 and in_flight.waiting("a") == 0 and in_flight.running("a") == 1
    assert in_flight.running("a") == 0


def test_an_address_has_one_waiting_line_over_all_its_sessions():
    """Rotating sessions does not lengthen the line either: an address's sessions share it."""
    in_flight = InFlight(limit=2, group_limit=1, waiting=1)
    release = threading.Event()

    def wait_in_line():
        with in_flight.admit("s2", "ip:1", wait_s=60):
            release.wait(30)

    with in_flight.admit("s1", "ip:1"):
        waiter = threading.Thread(target=wait_in_line)
        waiter.start()
        deadline = time.monotonic() + 10
        while in_flight.waiting("s2") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(TooManyRequests, match="1 requests from your address are already running"):
            with in_flight.admit("s3", "ip:1", wait_s=60):
                raise AssertionError("a second session of the address joined its full line")
    release.set()
    waiter.join(10)
    assert in_flight.total() == 0


def test_rotating_sessions_from_one_address_multiplies_nothing():
    """Per address as well as per session: a new session per request gets no more in flight than the
    address's cap, and the gate charges the address's sessions to one account (issue 36)."""
    from bert_engine.runtime.fairness import visitor_scope

    in_flight = InFlight(limit=2, group_limit=3)
    with in_flight.admit("s1", "ip:1"), in_flight.admit("s2", "ip:1"), in_flight.admit("s3", "ip:1"):
        with pytest.raises(TooManyRequests, match="3 requests from your address are already running"):
            with in_flight.admit("s4", "ip:1"):
                raise AssertionError("a fourth request from the address was admitted")
        with in_flight.admit("s5", "ip:2"):  # another address is not affected
            assert in_flight.running("s5") == 1 and in_flight.total() == 4
    with in_flight.admit("s4", "ip:1"):  # freed again
        assert in_flight.running("s4") == 1 and in_flight.total() == 1
    gate = ComputeGate(slots=1)
    ran = []
    for session in ("s1", "s2", "s3"):
        with visitor_scope(session, "ip:1"), gate.turn(1000):
            ran.append(session)
    with visitor_scope("s9", None), gate.turn(10):  # an address the server does not know: the session's own
        ran.append("s9")
    assert ran == ["s1", "s2", "s3", "s9"]
    assert gate.usage("ip:1") == pytest.approx(3000, rel=0.01) and gate.usage("s1") == 0
    assert gate.usage("s9") == pytest.approx(10, rel=0.01)


def test_forward_chunks_are_bounded_in_work_and_equal_one_pass(tiny_config):
    from bert_engine import BertModel

    model = BertModel(tiny_config).eval()
    ids = torch.randint(5, tiny_config.vocab_size, (12, 64))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    seen = []
    gate = ComputeGate(slots=1)
    original = gate.turn

    def counting(tokens, key=None):
        seen.append(tokens)
        return original(tokens, key)

    gate.turn = counting
    with torch.inference_mode():
        whole = model(**inputs).last_hidden_state
        row = row_flops(model, 64)
        chunked = forward_in_chunks(model, inputs, 32, max_flops=4 * row, gate=gate).last_hidden_state
    assert seen == [4 * row] * 3  # 4 rows of 64 tokens per chunk, charged their FLOPs
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_a_deep_model_gets_fewer_rows_per_chunk_and_is_charged_for_every_layer(tiny_config):
    """Work, not tokens: the same rows through an ALBERT applying 40 shared layers cost 20 times a
    2-layer model's, so its chunks are smaller and the gate charges it accordingly (issue 36 #2)."""
    import dataclasses

    from bert_engine import BertModel

    shallow = dataclasses.replace(tiny_config, num_hidden_layers=2)
    deep = dataclasses.replace(tiny_config, model_type="albert", num_hidden_layers=40, embedding_size=16)
    ids = torch.randint(5, tiny_config.vocab_size, (8, 32))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    budget = 8 * row_flops(BertModel(shallow), 32)  # the shallow model's 8 rows in one chunk
    charged = {}
    for name, config in (("shallow", shallow), ("deep", deep)):
        gate, calls = ComputeGate(slots=1), []
        original = gate.turn
        gate.turn = lambda cost, key=None, calls=calls, original=original: (calls.append(cost), original(cost, key))[1]
        with torch.inference_mode():
            forward_in_chunks(BertModel(config).eval(), inputs, 32, max_flops=budget, gate=gate)
        charged[name] = calls
    assert len(charged["shallow"]) == 1 and len(charged["deep"]) == 8  # one row per chunk for the deep one
    assert sum(charged["deep"]) == pytest.approx(20 * sum(charged["shallow"]), rel=0.01)


def test_each_visitor_sees_only_their_own_last_input(tmp_path):
    """The serving layer keeps each visitor's last input (the Predictor remembers nobody) and serves
    its forwards through the gate; a Predictor on its own does neither."""
    from conftest import reference_checkpoint

    from bert_engine.runtime.fairness import GATE
    from bert_engine.runtime.inference import Predictor
    from bert_engine.serving.predictors import LazyPredictor
    from bert_engine.tasks.registry import load_registry

    folder = reference_checkpoint(tmp_path / "sst", "BertForSequenceClassification", id2label={0: "NEG", 1: "POS"})
    task = load_registry(entry_points=False).task("sentiment")
    assert Predictor.load(task, str(folder)).gate is None and not hasattr(Predictor, "last")
    predictor = LazyPredictor(task, str(folder))
    assert predictor.get().gate is GATE
    with visitor_scope("alice"):
        predictor.predict({"text": "alice's private diary entry"})
    with visitor_scope("bob"):
        predictor.predict({"text": "bob's note"})
        tokens, _ = predictor.attention()
        assert "diary" not in tokens and "note" in tokens
    with visitor_scope("alice"):
        assert "diary" in predictor.attention()[0]
    with visitor_scope("carol"), pytest.raises(Exception, match="no input yet"):
        predictor.attention()


def test_time_waiting_at_the_gate_is_counted_while_it_goes_on():
    """A request cut off while it waits for other visitors' work is the machine's load, not its task's
    fault: the app reads the time waited (also mid-wait) before blaming the plugin."""
    from bert_engine.runtime.fairness import WAITED, Waited

    gate = ComputeGate(slots=1)
    holder, release = _hold(gate, "busy")
    waited, served = Waited(), threading.Event()

    def wait_for_turn():
        WAITED.set(waited)
        with gate.turn(1, key="late"):
            served.set()  # the turn came, after the holder let go

    waiter = threading.Thread(target=wait_for_turn)
    waiter.start()
    _wait_until(lambda: waited.seconds > 0.3)  # still waiting: counted live
    assert not served.is_set()
    release.set()
    holder.join(10)
    waiter.join(10)
    assert served.is_set() and 0.3 < waited.seconds < 10


def test_chunks_are_short_while_the_machine_is_shared(tiny_config, monkeypatch):
    """A chunk cannot be interrupted: while another visitor waits or used the gate in the last seconds, a
    heavy request's chunks hold an eighth of BERT_ENGINE_CHUNK_GFLOP, so the other waits for at most a
    short one; alone, it keeps full chunks (the load test's light visitor behind long requests)."""
    from bert_engine import BertModel
    from bert_engine.runtime import fairness

    model = BertModel(tiny_config).eval()
    ids = torch.randint(5, tiny_config.vocab_size, (16, 64))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    row = row_flops(model, 64)
    monkeypatch.setenv("BERT_ENGINE_CHUNK_GFLOP", str(16 * row / 1e9))  # 16 rows per chunk when alone

    def chunks(gate):
        costs, original = [], gate.turn
        gate.turn = lambda cost, key=None: (costs.append(cost), original(cost, key))[1]
        with torch.inference_mode(), visitor_scope("heavy"):
            forward_in_chunks(model, inputs, 32, gate=gate)
        return len(costs)

    alone = ComputeGate(slots=1)
    assert chunks(alone) == 1 and alone.chunk_budget("heavy") == fairness.chunk_flops()
    shared = ComputeGate(slots=1)
    with shared.turn(10, key="light"):  # another visitor is being served
        assert shared._holders == [threading.current_thread()]
    assert shared.chunk_budget("heavy") == fairness.chunk_flops() / fairness.SHARED_CHUNK_SHARE
    assert chunks(shared) == 8  # 2 rows per chunk
    monkeypatch.setattr(fairness, "SHARED_S", 0.0)  # long ago: alone again
    assert chunks(shared) == 1


def test_a_row_that_is_more_than_a_turn_hands_the_turn_back_between_layers(tiny_config):
    """One row of a deep model (the review's ALBERT: 256 shared layers, ~2 TFLOP per 512-token row) cannot
    be split into rows: it hands its turn (and its model's lock) back between layers, charging what it
    did, so a light visitor waits for a few layers, not the whole row; the output is unchanged."""
    import dataclasses

    from bert_engine import BertModel

    deep = dataclasses.replace(tiny_config, model_type="albert", num_hidden_layers=40, embedding_size=16)
    model = BertModel(deep).eval()
    ids = torch.randint(5, tiny_config.vocab_size, (1, 32))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    per_row = row_flops(model, 32)
    gate, turns, charges = ComputeGate(slots=1), [], []
    acquire, release = gate._acquire, gate._release
    gate._acquire = lambda key, member=None: (turns.append(key), acquire(key, member))[1]
    gate._release = lambda key, cost, member=None: (charges.append(cost), release(key, cost, member))[1]
    with torch.inference_mode(), visitor_scope("heavy"):
        whole = model(**inputs).last_hidden_state
        chunked = forward_in_chunks(model, inputs, 32, max_flops=per_row / 4, gate=gate).last_hidden_state
    assert turns == ["heavy"] * 4  # handed back after layers 10, 20 and 30
    assert len(charges) == 4 and sum(charges) == pytest.approx(per_row, rel=1e-6)  # in parts, the whole row in all
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
