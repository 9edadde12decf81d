"""The CRF against brute-force enumeration of every tag sequence, and the tag-scheme constraints."""

import itertools
import math

import pytest
import torch

from bert_engine.crf import CRF, FORBIDDEN
from plugins.tagging import allowed_transitions, detect_scheme, parse_tag

BIO = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def _random_crf(num_tags, seed, tags=None, scheme=None):
    torch.manual_seed(seed)
    crf = CRF(num_tags)
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_()
    if tags is not None:
        crf.set_constraints(*allowed_transitions(tags, scheme))
    return crf


def _brute(crf, emissions, mask, constrained, begins, ends):
    """Every tag sequence over each row's selected positions: (log Z, sorted (score, path), marginals)."""
    trans, start, end = (p.detach() for p in crf.potentials(constrained))
    B, T, L = emissions.shape
    out = []
    for b in range(B):
        positions = [t for t in range(T) if mask[b, t]]
        scored = []
        for path in itertools.product(range(L), repeat=len(positions)):
            score = sum(float(emissions[b, t, tag]) for t, tag in zip(positions, path))
            score += sum(float(trans[i, j]) for i, j in zip(path, path[1:]))
            if path:
                score += float(start[path[0]]) * bool(begins[b]) + float(end[path[-1]]) * bool(ends[b])
            scored.append((score, list(path)))
        log_z = math.log(sum(math.exp(s) for s, _ in scored))
        marg = torch.zeros(T, L)
        for s, path in scored:
            for t, tag in zip(positions, path):
                marg[t, tag] += math.exp(s - log_z)
        out.append((log_z, sorted(scored, key=lambda item: -item[0]), marg))
    return out


CASES = [
    # (tags or number of tags, scheme, mask rows)
    (3, None, [[1, 1, 1, 1], [1, 0, 1, 0], [0, 1, 1, 0]]),
    (4, None, [[0, 1, 0, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]),
    (BIO, "BIO", [[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]]),
    (BIO, "IOB1", [[1, 1, 1, 1], [0, 0, 1, 1]]),
    (["O", "B-X", "I-X", "E-X", "S-X"], "BIOES", [[1, 1, 1, 0, 1], [0, 1, 1, 0, 0]]),
]


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("flags", ["all", "mid"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_crf_matches_brute_force(case, flags, constrained):
    tags, scheme, rows = CASES[case]
    L = len(tags) if isinstance(tags, list) else tags
    crf = _random_crf(L, seed=case, tags=tags if scheme else None, scheme=scheme)
    mask = torch.tensor(rows, dtype=torch.bool)
    B, T = mask.shape
    emissions = torch.randn(B, T, L, generator=torch.Generator().manual_seed(10 + case)) * 2
    begins = torch.ones(B, dtype=torch.bool) if flags == "all" else torch.tensor([b % 2 == 0 for b in range(B)])
    ends = torch.ones(B, dtype=torch.bool) if flags == "all" else torch.tensor([b % 2 == 1 for b in range(B)])
    kwargs = dict(constrained=constrained, begins=begins, ends=ends)
    brute = _brute(crf, emissions, mask, constrained, begins, ends)

    with torch.no_grad():
        log_z = crf.log_partition(emissions, mask, **kwargs)
        marginals = crf.marginals(emissions, mask, **kwargs)
        decoded = crf.decode(emissions, mask, nbest=4, **kwargs)
    for b, (z, ranked, marg) in enumerate(brute):
        if not mask[b].any():
            assert float(log_z[b]) == 0.0 and decoded[b] == [([], 0.0)]
            assert marginals[b].abs().sum() == 0
            continue
        assert float(log_z[b]) == pytest.approx(z, abs=1e-3, rel=1e-5)
        torch.testing.assert_close(marginals[b], marg, atol=1e-5, rtol=1e-4)
        if constrained:
            ranked = [(s, p) for s, p in ranked if s > FORBIDDEN / 2]
        expected = ranked[:4]
        assert [p for p, _ in decoded[b]] == [p for _, p in expected]
        assert [s for _, s in decoded[b]] == pytest.approx([s for s, _ in expected], abs=1e-3)
        # The log-likelihood of each path is its score minus log Z.
        tag_rows = torch.full((T,), -100)
        tag_rows[mask[b]] = torch.tensor(expected[0][1])
        ll = crf.log_likelihood(emissions[b:b + 1], tag_rows[None], mask[b:b + 1], constrained=constrained,
                                begins=begins[b:b + 1], ends=ends[b:b + 1])
        assert ll.item() == pytest.approx(expected[0][0] - z, abs=1e-3)


def test_labels_minus_100_are_skipped_like_masked_positions():
    crf = _random_crf(3, seed=5)
    emissions = torch.randn(1, 5, 3)
    tags = torch.tensor([[-100, 2, -100, 0, 1]])
    via_labels = crf.log_likelihood(emissions, tags)
    via_mask = crf.log_likelihood(emissions, tags.clamp(min=0), tags != -100)
    assert torch.allclose(via_labels, via_mask)
    assert float(via_labels) < 0


def test_log_likelihood_gradient_is_finite_with_constraints():
    crf = _random_crf(len(BIO), seed=2, tags=BIO, scheme="BIO")
    emissions = torch.randn(2, 6, len(BIO), requires_grad=True)
    tags = torch.tensor([[0, 1, 2, 0, 3, 4], [-100, 0, 0, 1, -100, -100]])
    loss = -crf.log_likelihood(emissions, tags, constrained=True).sum()
    loss.backward()
    assert torch.isfinite(emissions.grad).all() and torch.isfinite(crf.transitions.grad).all()


def test_training_the_crf_raises_the_gold_likelihood():
    torch.manual_seed(0)
    crf = CRF(3)
    emissions = torch.randn(4, 7, 3)
    tags = torch.randint(0, 3, (4, 7))
    optimizer = torch.optim.SGD(crf.parameters(), lr=0.5)
    before = crf.log_likelihood(emissions, tags).sum().item()
    for _ in range(30):
        optimizer.zero_grad()
        (-crf.log_likelihood(emissions, tags).sum()).backward()
        optimizer.step()
    assert crf.log_likelihood(emissions, tags).sum().item() > before + 1


@pytest.mark.parametrize("scheme, bad, good", [
    ("BIO", [("O", "I-PER"), ("B-LOC", "I-PER"), ("I-LOC", "I-PER")], [("B-PER", "I-PER"), ("I-PER", "I-PER"), ("I-PER", "B-PER"), ("O", "B-LOC")]),
    ("IOB1", [("O", "B-PER"), ("I-LOC", "B-PER")], [("O", "I-PER"), ("I-PER", "B-PER"), ("I-LOC", "I-PER")]),
])
def test_bio_and_iob1_transition_rules(scheme, bad, good):
    allowed, start, end = allowed_transitions(BIO, scheme)
    index = {t: i for i, t in enumerate(BIO)}
    for a, b in bad:
        assert not allowed[index[a], index[b]], (a, b)
    for a, b in good:
        assert allowed[index[a], index[b]], (a, b)
    first_forbidden = "I-" if scheme == "BIO" else "B-"
    assert [t for t in BIO if not start[index[t]]] == [t for t in BIO if t.startswith(first_forbidden)]
    assert end.all()


def test_bioes_transition_rules():
    tags = ["O", "B-X", "I-X", "E-X", "S-X", "B-Y", "E-Y"]
    allowed, start, end = allowed_transitions(tags, "BIOES")
    index = {t: i for i, t in enumerate(tags)}
    assert allowed[index["B-X"], index["E-X"]] and allowed[index["I-X"], index["I-X"]]
    assert not allowed[index["B-X"], index["O"]] and not allowed[index["B-X"], index["E-Y"]]
    assert allowed[index["E-X"], index["B-Y"]] and allowed[index["S-X"], index["S-X"]]
    assert not allowed[index["O"], index["E-X"]]
    assert [t for t in tags if start[index[t]]] == ["O", "B-X", "S-X", "B-Y"]
    assert [t for t in tags if end[index[t]]] == ["O", "E-X", "S-X", "E-Y"]


def test_tag_errors_name_the_tag():
    with pytest.raises(ValueError, match="'PER'"):
        parse_tag("PER")
    with pytest.raises(ValueError, match="E-X"):
        allowed_transitions(["O", "B-X", "E-X"], "BIO")
    with pytest.raises(ValueError, match="'XYZ'"):
        allowed_transitions(BIO, "XYZ")
    assert detect_scheme(BIO) == "BIO" and detect_scheme(["O", "S-X"]) == "BIOES"


def test_emission_width_must_match():
    with pytest.raises(ValueError, match="5 tags, the CRF has 3"):
        CRF(3).decode(torch.zeros(1, 2, 5))


def test_marginals_are_probabilities_even_for_sure_tags():
    """Peaked emissions over long rows: every marginal stays within [0, 1] and rows sum to 1 (float32
    sums once gave 1.000015 for a sure tag)."""
    torch.manual_seed(0)
    crf = CRF(9)
    emissions = torch.randn(8, 120, 9) * 15
    marginals = crf.marginals(emissions, torch.ones(8, 120, dtype=torch.bool), constrained=False)
    assert float(marginals.max()) <= 1.0 and float(marginals.min()) >= 0.0
    torch.testing.assert_close(marginals.sum(-1), torch.ones(8, 120), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 15.0])
def test_the_scaled_recursion_matches_the_log_space_one(scale):
    """marginals' probability-space pass (numpy) against the log-space torch pass it falls back to, on ragged
    rows, mid-document windows, constraints and peaked emissions; log Z against log_partition."""
    crf = _random_crf(len(BIO), seed=3, tags=BIO, scheme="BIO")
    generator = torch.Generator().manual_seed(4)
    emissions = torch.randn(6, 30, len(BIO), generator=generator) * scale
    mask = torch.rand(6, 30, generator=generator) > 0.3
    mask[5] = False  # a row with nothing selected
    begins, ends = torch.tensor([1, 0, 1, 0, 1, 1], dtype=torch.bool), torch.tensor([1, 1, 0, 0, 1, 0], dtype=torch.bool)
    for constrained in (False, True):
        kwargs = dict(constrained=constrained, begins=begins, ends=ends)
        marginals, log_z = crf.marginals(emissions, mask, with_log_z=True, **kwargs)
        compact, valid, index, _, trans, start, end = crf._prepare(emissions, mask, constrained, begins, ends)
        reference, _ = crf._log_space_marginals(compact, valid, trans, start, end)
        expected = torch.zeros_like(marginals).scatter(1, index[..., None].expand(*reference.shape), reference)
        torch.testing.assert_close(marginals, expected, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(log_z, crf.log_partition(emissions, mask, **kwargs), atol=1e-3, rtol=1e-6)
        assert float(log_z[5]) == 0.0 and marginals[5].abs().sum() == 0


def test_marginals_fall_back_to_log_space_where_every_path_underflows():
    """Scores 2,000 apart: in probability space the one step's mass rounds to 0, so the log-space pass answers."""
    crf = CRF(2)
    with torch.no_grad():
        crf.transitions.copy_(torch.tensor([[0.0, -2000.0], [-2000.0, 0.0]]))
    emissions = torch.tensor([[[0.0, -2000.0], [-3000.0, 0.0]]])
    marginals, log_z = crf.marginals(emissions, with_log_z=True, constrained=False)
    # Two best paths tie at -2000 (0 -> 1 and 1 -> 1): position 0 is even, position 1 is tag 1.
    torch.testing.assert_close(marginals[0], torch.tensor([[0.5, 0.5], [0.0, 1.0]]))
    assert float(log_z[0]) == pytest.approx(-2000 + math.log(2), abs=1e-3)


def test_decoding_with_marginals_at_once_answers_as_the_two_calls_do():
    """The NER postprocess's one call (the inputs compacted once) gives decode's paths and marginals' values."""
    torch.manual_seed(5)
    crf = CRF(5)
    with torch.no_grad():
        crf.transitions.normal_()
        crf.start_transitions.normal_()
    emissions = torch.randn(3, 9, 5)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, ::2] = False
    kwargs = dict(constrained=False, begins=torch.tensor([True, False, True]), ends=torch.tensor([True, True, False]))
    paths, marginals, log_z = crf.decode_with_marginals(emissions, mask, nbest=3, **kwargs)
    assert paths == crf.decode(emissions, mask, nbest=3, **kwargs)
    want, want_log_z = crf.marginals(emissions, mask, with_log_z=True, **kwargs)
    assert torch.equal(marginals, want) and torch.equal(log_z, want_log_z)
    with pytest.raises(ValueError, match="nbest must be at least 1"):
        crf.decode_with_marginals(emissions, mask, nbest=0)


def test_the_c_recursions_answer_as_the_numpy_ones(monkeypatch):
    """crf_decode.c (bert_engine's C library, where it builds): the same n-best paths and scores to the bit,
    ties included (whole-number scores), and the same marginals and log Z, on ragged rows, constrained or
    not; numpy's code is the reference."""
    from bert_engine import crf as crf_module
    from bert_engine.runtime import native

    lib = native.library()
    if lib is None:
        pytest.skip(f"bert_engine's C library cannot run here: {native.unavailable()}")
    torch.manual_seed(11)
    crf = CRF(6)
    with torch.no_grad():
        crf.transitions.copy_(torch.randint(-2, 3, (6, 6)).float())
        crf.start_transitions.normal_()
    crf.set_constraints(*(torch.rand(6, 6) > 0.2, torch.ones(6, dtype=torch.bool), torch.rand(6) > 0.3))
    for emissions in (torch.randint(-3, 4, (4, 11, 6)).float(), torch.randn(4, 11, 6) * 4):
        mask = torch.ones(4, 11, dtype=torch.bool)
        mask[1, 7:] = False
        mask[2, 1:] = False
        mask[3] = False
        for constrained in (True, False):
            kwargs = dict(nbest=5, constrained=constrained, begins=torch.tensor([True, False, True, True]))
            monkeypatch.setattr(crf_module, "NATIVE", lib)
            native_answer = crf.decode_with_marginals(emissions, mask, **kwargs)
            monkeypatch.setattr(crf_module, "NATIVE", None)
            numpy_answer = crf.decode_with_marginals(emissions, mask, **kwargs)
            assert native_answer[0] == numpy_answer[0]
            torch.testing.assert_close(native_answer[1], numpy_answer[1], atol=1e-6, rtol=0)
            torch.testing.assert_close(native_answer[2], numpy_answer[2], atol=1e-9, rtol=1e-12)


def test_the_requests_decode_in_numpy_is_the_general_paths_to_the_bit_and_sees_new_weights(monkeypatch):
    """decode_with_marginals on the CPU with the C library (NER's postprocess) runs per row in numpy: the same
    paths, marginals and log Z, bit for bit, as the torch-compacted path over the same C recursions, on ragged
    masks, windows inside a document and n-best lists; its cached potentials follow weights changed in place."""
    from bert_engine import crf as crf_module
    from bert_engine.runtime import native

    lib = native.library()
    if lib is None:
        pytest.skip(f"bert_engine's C library cannot run here: {native.unavailable()}")
    monkeypatch.setattr(crf_module, "NATIVE", lib)
    general = crf_module._native_decode_with_marginals
    torch.manual_seed(3)
    crf = CRF(7)
    with torch.no_grad():
        crf.transitions.normal_()
        crf.start_transitions.normal_()
        crf.end_transitions.normal_()
    crf.set_constraints(torch.rand(7, 7) > 0.25, torch.rand(7) > 0.2, torch.rand(7) > 0.2)

    def both(emissions, mask, **kwargs):
        fast = crf.decode_with_marginals(emissions, mask, **kwargs)
        monkeypatch.setattr(crf_module, "_native_decode_with_marginals", lambda *args: None)
        slow = crf.decode_with_marginals(emissions, mask, **kwargs)
        monkeypatch.setattr(crf_module, "_native_decode_with_marginals", general)
        return fast, slow

    mask = torch.rand(5, 13) > 0.3
    mask[1, 6:] = False
    mask[3] = False
    mask[4, 0] = False
    for emissions in (torch.randn(5, 13, 7) * 3, torch.randint(-2, 3, (5, 13, 7)).float()):
        for kwargs in (dict(nbest=1, constrained=True), dict(nbest=4, constrained=False),
                       dict(nbest=3, constrained=True, begins=torch.tensor([True, False, True, True, False]),
                            ends=torch.tensor([False, True, True, True, True]))):
            (paths, marginals, log_z), (want_paths, want_marginals, want_log_z) = both(emissions, mask, **kwargs)
            assert paths == want_paths
            assert torch.equal(marginals, want_marginals) and torch.equal(log_z, want_log_z)
    emissions = torch.randn(2, 6, 7)
    before = both(emissions, None)[0]
    with torch.no_grad():
        crf.transitions.mul_(-2.0)
    after, want = both(emissions, None)
    assert after[0] == want[0] and torch.equal(after[1], want[1]) and torch.equal(after[2], want[2])
    assert not torch.equal(after[1], before[1])  # the new weights were read, not the kept ones


def test_a_crf_built_under_inference_mode_decodes_as_one_built_outside():
    """NER's decoder for another tag scheme (or for a model on the GPU) is built in the request's inference_mode:
    its tensors have no version counter, which the kept numpy potentials once read (a RuntimeError for any
    `scheme=` but the head's own, and for every NER request on CUDA)."""
    torch.manual_seed(6)
    outside = CRF(5)
    with torch.no_grad():
        outside.transitions.normal_()
        outside.end_transitions.normal_()
    emissions, mask = torch.randn(2, 7, 5), torch.ones(2, 7, dtype=torch.bool)
    want = outside.decode_with_marginals(emissions, mask, nbest=2)
    with torch.inference_mode():
        inside = CRF(5)
        inside.load_state_dict(outside.state_dict())
        for _ in range(2):  # the second call must not reuse anything kept from the first
            paths, marginals, log_z = inside.decode_with_marginals(emissions, mask, nbest=2)
            assert paths == want[0] and torch.equal(marginals, want[1]) and torch.equal(log_z, want[2])
