"""A linear-chain CRF over per-token emission scores, with optional constraints on transitions.

Log-likelihood (forward algorithm in log space), Viterbi and n-best decoding, and per-position
marginals (forward-backward). A mask selects the positions that carry a tag and may skip any of
them (only a word's first wordpiece is tagged; [CLS], [SEP] and padding are not): the selected
positions of a row form one chain. Which transitions a tag scheme allows, and all other task logic
(labels, entities, windows), lives with the NER task (plugins/tagging.py, plugins/ner.py).

Shape legend: B batch, T tokens, S selected positions per row (≤ T), L tags, K paths.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .heads import IGNORE_INDEX

# bert_engine's C library (runtime/native.py sets it when it loads; None until then, or where it cannot be
# built): the n-best Viterbi and forward-backward below run there a row at a time (crf_decode.c), the same
# answers as the numpy code without its ~35 us of dispatch a step. The numpy code stays the reference.
NATIVE: Any = None

# Forbidden transitions score FORBIDDEN instead of -inf: log-sum-exp over a row of -inf has a NaN
# gradient, and a finite penalty this large still gives such paths a probability of exactly 0.0.
FORBIDDEN = -1e4


class CRF(nn.Module):
    """Linear-chain conditional random field with learnable transitions and optional constraints.

    Every method takes emissions (B, T, L) and a mask (B, T) of the positions that carry tags (any
    pattern). `begins` / `ends` (B,) bool say whether a row's first / last selected position is the
    true start / end of the sequence; where False (a window in the middle of a document) no start /
    end score or constraint applies. `constrained` adds FORBIDDEN to transitions the scheme forbids.
    """

    def __init__(self, num_tags: int) -> None:
        super().__init__()
        if num_tags < 1:
            raise ValueError(f"a CRF needs at least one tag, got num_tags={num_tags}")
        self.num_tags = num_tags
        # Zero-initialised: an untrained CRF adds nothing but its constraints to the emissions.
        self.transitions = nn.Parameter(torch.zeros(num_tags, num_tags))  # [from, to]
        self.start_transitions = nn.Parameter(torch.zeros(num_tags))
        self.end_transitions = nn.Parameter(torch.zeros(num_tags))
        self.register_buffer("allowed", torch.ones(num_tags, num_tags, dtype=torch.bool), persistent=False)
        self.register_buffer("allowed_start", torch.ones(num_tags, dtype=torch.bool), persistent=False)
        self.register_buffer("allowed_end", torch.ones(num_tags, dtype=torch.bool), persistent=False)

    def set_constraints(self, allowed: Tensor, allowed_start: Tensor, allowed_end: Tensor) -> None:
        """Install the allowed-transition masks from `allowed_transitions`."""
        L = self.num_tags
        if allowed.shape != (L, L) or allowed_start.shape != (L,) or allowed_end.shape != (L,):
            raise ValueError(f"constraint shapes {tuple(allowed.shape)}, {tuple(allowed_start.shape)}, "
                             f"{tuple(allowed_end.shape)} do not fit {L} tags")
        self.allowed.copy_(allowed)
        self.allowed_start.copy_(allowed_start)
        self.allowed_end.copy_(allowed_end)

    def potentials(self, constrained: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Transition (L, L), start (L,) and end (L,) scores in fp32, with the constraints if asked."""
        trans, start, end = self.transitions.float(), self.start_transitions.float(), self.end_transitions.float()
        if constrained:
            trans = trans + (~self.allowed) * FORBIDDEN
            start = start + (~self.allowed_start) * FORBIDDEN
            end = end + (~self.allowed_end) * FORBIDDEN
        return trans, start, end

    def numpy_potentials(self, constrained: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`potentials(constrained)` as float32 numpy arrays (contiguous, read-only), kept until a parameter or
        constraint changes (in place, or replaced): a request's decode reads them without three torch ops each."""
        tensors = (self.transitions, self.start_transitions, self.end_transitions, self.allowed, self.allowed_start,
                   self.allowed_end)
        # A CRF built under torch.inference_mode (ner's decoder for another scheme, or for a model on the GPU) has
        # tensors without a version counter: nothing can tell that they changed, so nothing is kept
        versions = None if any(t.is_inference() for t in tensors) else tuple((t._version, t.data_ptr()) for t in tensors)
        kept = self.__dict__.get("_numpy_potentials")
        if (versions is not None and kept is not None and kept[0] == constrained and kept[2] == versions
                and all(a is b for a, b in zip(kept[1], tensors))):
            return kept[3]
        with torch.no_grad():
            arrays = tuple(np.ascontiguousarray(t.detach().float().cpu().numpy()) for t in self.potentials(constrained))
        for array in arrays:
            array.flags.writeable = False
        if versions is not None:
            self.__dict__["_numpy_potentials"] = (constrained, tensors, versions, arrays)
        return arrays

    # -- the pieces every method shares ----------------------------------------------------------------

    def _prepare(self, emissions: Tensor, mask: Tensor | None, constrained: bool, begins, ends):
        B, T, L = emissions.shape
        if L != self.num_tags:
            raise ValueError(f"emissions have {L} tags, the CRF has {self.num_tags}")
        mask = torch.ones(B, T, dtype=torch.bool, device=emissions.device) if mask is None else mask.bool()
        lengths = mask.sum(1)  # (B,)
        S = max(int(lengths.max()), 1) if B else 1
        # Selected positions first, in their order: a stable sort on "not selected".
        index = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :S]  # (B, S)
        steps = torch.arange(S, device=emissions.device)
        valid = steps[None, :] < lengths[:, None]  # (B, S)
        compact = emissions.float().gather(1, index[..., None].expand(B, S, L))  # (B, S, L)
        trans, start, end = self.potentials(constrained)
        start = _per_row(start, begins, B)  # (B, L)
        end = _per_row(end, ends, B)  # (B, L)
        return compact, valid, index, lengths, trans, start, end

    @staticmethod
    def _moves(compact: Tensor, trans: Tensor) -> Tensor:
        """(B, S-1, L_from, L_to): the transition plus the next step's emission, for every step at once. The
        per-step work of the recursions is a few tiny tensors, where op dispatch, not arithmetic, is the cost
        (a visitor's sentence pays it per step), so what does not depend on the previous step is done here."""
        return trans[None, None] + compact[:, 1:, None, :]

    def _forward_alphas(self, compact, valid, start, moves) -> Tensor:
        """alpha[:, s, l]: log-sum of the scores of all partial paths ending in tag l at step s."""
        alphas = [start + compact[:, 0]]  # (B, L)
        ragged = not bool(valid.all())  # rows of different lengths: finished rows keep their last alpha
        for s in range(1, compact.shape[1]):
            step = torch.logsumexp(alphas[-1][:, :, None] + moves[:, s - 1], dim=1)  # (B, L)
            alphas.append(torch.where(valid[:, s, None], step, alphas[-1]) if ragged else step)
        return torch.stack(alphas, 1)  # (B, S, L)

    # -- public API ------------------------------------------------------------------------------------

    def log_partition(self, emissions: Tensor, mask: Tensor | None = None, *, constrained: bool = False,
                      begins: Tensor | None = None, ends: Tensor | None = None) -> Tensor:
        """log Z per row (B,); 0 for a row with no selected position."""
        compact, valid, _, lengths, trans, start, end = self._prepare(emissions, mask, constrained, begins, ends)
        last = self._forward_alphas(compact, valid, start, self._moves(compact, trans))[:, -1]  # (B, L)
        return torch.where(lengths > 0, torch.logsumexp(last + end, dim=-1), torch.zeros_like(lengths, dtype=last.dtype))

    def path_score(self, emissions: Tensor, tags: Tensor, mask: Tensor | None = None, *, constrained: bool = False,
                   begins: Tensor | None = None, ends: Tensor | None = None) -> Tensor:
        """Unnormalised score (B,) of the tag sequence `tags` (B, T) over the selected positions."""
        compact, valid, index, lengths, trans, start, end = self._prepare(emissions, mask, constrained, begins, ends)
        gold = tags.gather(1, index).clamp(min=0)  # (B, S)
        emit = compact.gather(2, gold[..., None]).squeeze(-1)  # (B, S)
        score = (emit * valid).sum(1)
        score = score + (trans[gold[:, :-1], gold[:, 1:]] * valid[:, 1:]).sum(1)
        last = gold.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)  # (B,)
        edges = start.gather(1, gold[:, :1]).squeeze(1) + end.gather(1, last[:, None]).squeeze(1)
        return torch.where(lengths > 0, score + edges, torch.zeros_like(score))

    def log_likelihood(self, emissions: Tensor, tags: Tensor, mask: Tensor | None = None, *,
                       constrained: bool = False, begins: Tensor | None = None,
                       ends: Tensor | None = None) -> Tensor:
        """log p(tags | emissions) per row (B,). Positions whose tag is -100 are skipped like masked ones."""
        keep = tags != IGNORE_INDEX
        mask = keep if mask is None else mask.bool() & keep
        kwargs = dict(constrained=constrained, begins=begins, ends=ends)
        return self.path_score(emissions, tags, mask, **kwargs) - self.log_partition(emissions, mask, **kwargs)

    def marginals(self, emissions: Tensor, mask: Tensor | None = None, *, constrained: bool = True,
                  begins: Tensor | None = None, ends: Tensor | None = None,
                  with_log_z: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """p(tag at position t = l | emissions) as (B, T, L); rows of unselected positions are 0. With
        `with_log_z`, also log Z per row (B,), as log_partition gives it (0 for a row with nothing selected),
        from the same pass. Not differentiable: training uses log_likelihood."""
        prepared = self._prepare(emissions, mask, constrained, begins, ends)
        return self._marginals(emissions, prepared, with_log_z)

    def decode_with_marginals(self, emissions: Tensor, mask: Tensor | None = None, *, nbest: int = 1,
                              constrained: bool = True, begins: Tensor | None = None, ends: Tensor | None = None
                              ) -> tuple[list[list[tuple[list[int], float]]], Tensor, Tensor]:
        """`decode`'s paths, `marginals` and log Z (with_log_z) in one call, the inputs compacted once (a
        third of the CRF's time on a visitor's sentence). On the CPU with crf_decode.c, in numpy a row at a
        time (`_native_decode_with_marginals`): the same answers to the bit without a dozen small torch ops."""
        if nbest < 1:
            raise ValueError(f"nbest must be at least 1, got {nbest}")
        if NATIVE is not None and emissions.device.type == "cpu" and emissions.shape[-1] == self.num_tags:
            answer = _native_decode_with_marginals(NATIVE, self, emissions, mask, nbest, constrained, begins, ends)
            if answer is not None:
                return answer
        prepared = self._prepare(emissions, mask, constrained, begins, ends)
        marginals, log_z = self._marginals(emissions, prepared, True)
        return self._decode(prepared, nbest, constrained), marginals, log_z

    def _marginals(self, emissions: Tensor, prepared: tuple, with_log_z: bool) -> Tensor | tuple[Tensor, Tensor]:
        compact, valid, index, lengths, trans, start, end = prepared
        B, S, L = compact.shape
        found = _scaled_forward_backward(compact, valid, trans, start, end)
        probs, log_z = found if found is not None else self._log_space_marginals(compact, valid, trans, start, end)
        # The compaction's index is a permutation, so scattering back touches each position once.
        out = emissions.new_zeros(emissions.shape, dtype=torch.float32).scatter(
            1, index[..., None].expand(B, S, L), probs.to(emissions.device))
        if not with_log_z:
            return out
        log_z = log_z.to(device=emissions.device, dtype=torch.float32)
        return out, torch.where(lengths > 0, log_z, torch.zeros_like(log_z))

    def _log_space_marginals(self, compact, valid, trans, start, end) -> tuple[Tensor, Tensor]:
        """Forward-backward in log space with torch ops (B, S, L), log Z (B,): the fallback where the scaled
        recursion cannot represent a step (see _scaled_forward_backward)."""
        # In float64: in float32 the forward and backward sums drift apart by ~1e-5 over a sentence, and
        # exp(alpha + beta - log Z) came out as 1.000015 for a sure tag (a "probability" above 1).
        compact, trans, start, end = compact.double(), trans.double(), start.double(), end.double()
        S = compact.shape[1]
        moves = self._moves(compact, trans)
        alphas = self._forward_alphas(compact, valid, start, moves)  # (B, S, L)
        betas = [end]
        ragged = not bool(valid.all())
        for s in range(S - 2, -1, -1):
            step = torch.logsumexp(moves[:, s] + betas[-1][:, None, :], dim=2)  # (B, L)
            betas.append(torch.where(valid[:, s + 1, None], step, end) if ragged else step)
        betas = torch.stack(betas[::-1], 1)  # (B, S, L)
        log_z = torch.logsumexp(alphas[:, -1] + end, dim=-1)  # (B,)
        probs = ((alphas + betas - log_z[:, None, None]).exp().clamp(max=1.0) * valid[..., None]).float()
        return probs, log_z

    def decode(self, emissions: Tensor, mask: Tensor | None = None, *, nbest: int = 1, constrained: bool = True,
               begins: Tensor | None = None, ends: Tensor | None = None) -> list[list[tuple[list[int], float]]]:
        """The `nbest` highest-scoring tag sequences per row (Viterbi with K-best lists).

        Returns:
            per row, up to `nbest` (tags over the selected positions, score) pairs, best first.
            Paths that need a forbidden transition are left out; a row with no selected position
            has one empty path with score 0.
        """
        return self._decode(self._prepare(emissions, mask, constrained, begins, ends), nbest, constrained)

    @staticmethod
    def _decode(prepared: tuple, nbest: int, constrained: bool) -> list[list[tuple[list[int], float]]]:
        if nbest < 1:
            raise ValueError(f"nbest must be at least 1, got {nbest}")
        compact, valid, _, lengths, trans, start, end = prepared
        paths = _viterbi_nbest(compact, valid, trans, start, end, nbest)
        results = []
        for n, row in zip(lengths.tolist(), paths):
            if n == 0:
                results.append([([], 0.0)])
                continue
            results.append([(path[:n], score) for path, score in row
                            if not (constrained and score < FORBIDDEN / 2)])
        return results


def _per_row(scores: Tensor, flags: Tensor | None, B: int) -> Tensor:
    """(L,) start/end scores -> (B, L), zeroed for rows whose flag is False (mid-document windows)."""
    rows = scores[None].expand(B, -1)
    if flags is None:
        return rows
    return rows * flags.to(device=scores.device, dtype=torch.bool)[:, None]


def _scaled_forward_backward(compact: Tensor, valid: Tensor, trans: Tensor, start: Tensor,
                             end: Tensor) -> tuple[Tensor, Tensor] | None:
    """Marginals (B, S, L) and log Z (B,) by forward-backward in probability space, each step's vector
    rescaled to sum 1 (the scales summed in log space), in numpy float64 on the CPU.

    A request's CRF is a few dozen steps over 9 tags, where torch's per-op dispatch, not arithmetic, is
    the cost: a step here is one small matrix product and a rescale (about 5 µs in numpy, against about
    12 µs for one torch.logsumexp alone). With log Z from the same pass, a 12-word sentence's marginals and
    log Z take 0.36 ms instead of 0.87 ms on a 2-core AVX-512 EPYC (benchmarks/README.md, "A visitor's
    request"). A step past a row's end multiplies by the identity, so finished rows keep
    their last vector, as the log-space recursion's `where` does. Each step's transition matrix is taken
    relative to its largest entry, and each marginal is alpha x beta renormalised over the tags, so
    nothing overflows. None where a rescale meets a zero or non-finite sum (every path through a step
    underflowing: scores hundreds apart): the caller falls back to the log-space recursion."""
    em = compact.detach().double().cpu().numpy()  # (B, S, L)
    ok = valid.cpu().numpy()  # (B, S)
    tr = trans.detach().double().cpu().numpy()  # (L, L)
    st, en = start.detach().double().cpu().numpy(), end.detach().double().cpu().numpy()  # (B, L)
    if NATIVE is not None:
        return _native_forward_backward(NATIVE, em, ok, tr, st, en)
    B, S, L = em.shape
    moves = tr[None, None] + em[:, 1:, None, :]  # (B, S-1, L_from, L_to)
    shift = moves.max(axis=(2, 3)) if S > 1 else np.zeros((B, 0))  # (B, S-1)
    steps = np.exp(moves - shift[..., None, None])
    past = ~ok[:, 1:]  # (B, S-1): the step into a position past the row's end
    steps[past] = np.eye(L)
    shift[past] = 0.0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        first = st + em[:, 0]
        top = first.max(1)
        vector = np.exp(first - top[:, None])[:, None, :]  # (B, 1, L): rows as row vectors
        alphas, sums = np.empty((B, S, L)), np.empty((B, S))
        for s in range(S):  # a zero or non-finite sum poisons every later step: checked once, after
            if s:
                vector = vector @ steps[:, s - 1]
            total = vector.sum(2)
            vector = vector / total[..., None]
            sums[:, s] = total[:, 0]
            alphas[:, s] = vector[:, 0]
        top_end = en.max(1)
        last = np.exp(en - top_end[:, None])  # (B, L)
        log_z = top + shift.sum(1) + np.log(sums).sum(1) + np.log((vector[:, 0] * last).sum(1)) + top_end
        vector = last[:, :, None]  # (B, L, 1): columns
        betas = np.empty((B, S, L))
        for s in range(S - 1, -1, -1):
            if s < S - 1:
                vector = steps[:, s] @ vector
            total = vector.sum(1)
            vector = vector / total[:, None]
            betas[:, s] = vector[:, :, 0]
        joint = alphas * betas
        total = joint.sum(2, keepdims=True)
        if not (np.isfinite(log_z).all() and np.isfinite(betas).all() and (total[ok] > 0).all()):
            return None
        probs = np.where(ok[..., None], joint / np.where(total > 0, total, 1.0), 0.0)
    return torch.from_numpy(probs).float(), torch.from_numpy(log_z)


def _viterbi_nbest(compact: Tensor, valid: Tensor, trans: Tensor, start: Tensor, end: Tensor,
                   nbest: int) -> list[list[tuple[list[int], float]]]:
    """Per row, the `nbest` best (path over all S steps, score) pairs, best first, by Viterbi with K-best
    lists, in numpy on the CPU (a request's decode is a dozen steps over 9 tags: torch's per-op dispatch
    cost more than the arithmetic). Steps past a row's end keep its lists and point back to the same tag
    and rank, so a path's first `length` entries are the row's path. Paths scoring -inf (fewer than
    `nbest` exist) are left out."""
    em = compact.detach().float().cpu().numpy()  # (B, S, L)
    ok = valid.cpu().numpy()  # (B, S)
    if NATIVE is not None:
        return _native_viterbi(NATIVE, em, ok, trans, start, end, nbest)
    B, S, L = em.shape
    K = nbest
    # (B, S-1, L_to, L_from): the transition plus the next step's emission, for every step at once
    moves = (trans.detach().float().cpu().numpy().T[None, None] + em[:, 1:, :, None])[..., None]
    scores = np.full((B, L, K), -np.inf, dtype=np.float32)  # best K partial scores ending in each tag
    scores[:, :, 0] = start.detach().float().cpu().numpy() + em[:, 0]
    keep = np.broadcast_to(np.arange(L * K).reshape(1, L, K), (B, L, K))  # "the same tag and rank"
    pointers = np.empty((B, max(S - 1, 0), L, K), dtype=np.int64)  # flat index prev_tag * K + prev_rank
    rows = np.arange(B)[:, None, None]
    tags = np.arange(L)[None, :, None]
    ragged = not bool(ok.all())  # a visitor's one row is never ragged: its steps skip the two np.where
    with np.errstate(invalid="ignore"):
        for s in range(1, S):
            cand = (scores[:, None, :, :] + moves[:, s - 1]).reshape(B, L, L * K)  # (B, L_to, L_from * K)
            where = np.argsort(-cand, axis=-1, kind="stable")[..., :K]  # ties: the lower index first
            best = cand[rows, tags, where]
            if ragged:
                step_valid = ok[:, s, None, None]
                scores = np.where(step_valid, best, scores)
                pointers[:, s - 1] = np.where(step_valid, where, keep)
            else:
                scores = best
                pointers[:, s - 1] = where
        final = (scores + end.detach().float().cpu().numpy()[:, :, None]).reshape(B, L * K)
        order = np.argsort(-final, axis=-1, kind="stable")[:, :K]
    back = pointers.tolist()
    out = []
    for b in range(B):
        paths = []
        for flat in order[b].tolist():
            score = float(final[b, flat])
            if score == float("-inf"):
                continue
            tag, rank = divmod(flat, K)
            path = [tag]
            for s in range(S - 1, 0, -1):
                tag, rank = divmod(back[b][s - 1][tag][rank], K)
                path.append(tag)
            paths.append((path[::-1], score))
        out.append(paths)
    return out


def _pointer(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def _viterbi_row(lib: Any, row: np.ndarray, trans: np.ndarray, start: np.ndarray, end: np.ndarray,
                 nbest: int) -> list[tuple[list[int], float]]:
    """One row's (n, L) float32 n-best paths and scores through crf_decode.c (contiguous float32 inputs)."""
    n, L = row.shape
    paths, scores = np.empty((nbest, n), dtype=np.int64), np.empty(nbest, dtype=np.float32)
    found = lib.crf_viterbi_nbest(_pointer(row), n, L, _pointer(trans), _pointer(start), _pointer(end), nbest,
                                  _pointer(paths), _pointer(scores))
    if found < 0:
        raise MemoryError("the CRF's n-best Viterbi could not allocate its lists")
    return [(paths[k].tolist(), float(scores[k])) for k in range(found)]


def _forward_backward_row(lib: Any, row: np.ndarray, trans: np.ndarray, start: np.ndarray,
                          end: np.ndarray) -> tuple[np.ndarray, float] | None:
    """One row's (n, L) float64 marginals and log Z through crf_decode.c (contiguous float64 inputs); None where
    the scaled recursion cannot represent a step."""
    n, L = row.shape
    part, z = np.empty((n, L)), ctypes.c_double()
    status = lib.crf_forward_backward(_pointer(row), n, L, _pointer(trans), _pointer(start), _pointer(end),
                                      _pointer(part), ctypes.byref(z))
    if status < 0:
        raise MemoryError("the CRF's forward-backward could not allocate its steps")
    return None if status else (part, z.value)


def _native_viterbi(lib: Any, em: np.ndarray, ok: np.ndarray, trans: Tensor, start: Tensor, end: Tensor,
                    nbest: int) -> list[list[tuple[list[int], float]]]:
    """_viterbi_nbest's answer through crf_decode.c, a row at a time over its own steps (a path covers the
    row's length; decode keeps that much of the numpy one's too)."""
    tr = np.ascontiguousarray(trans.detach().float().cpu().numpy())
    st = np.ascontiguousarray(start.detach().float().cpu().numpy())
    en = np.ascontiguousarray(end.detach().float().cpu().numpy())
    out = []
    for b, n in enumerate(ok.sum(1).tolist()):
        if n == 0:
            out.append([])
            continue
        out.append(_viterbi_row(lib, np.ascontiguousarray(em[b, :n]), tr, st[b], en[b], nbest))
    return out


def _native_decode_with_marginals(lib: Any, crf: CRF, emissions: Tensor, mask: Tensor | None, nbest: int,
                                  constrained: bool, begins: Tensor | None,
                                  ends: Tensor | None) -> tuple[list, Tensor, Tensor] | None:
    """CRF.decode_with_marginals through crf_decode.c with numpy around it, a row at a time: each row's selected
    positions are taken out, the C n-best Viterbi (float32) and forward-backward (float64) run on them as the
    general path feeds them, and the marginals go back to their positions. The same paths, marginals and log Z
    as that path, bit for bit (tested). None where a row's scaled recursion cannot represent a step: the
    general path then runs, with its log-space fallback."""
    B, T, L = emissions.shape
    em = emissions.detach().float().cpu().numpy()  # (B, T, L)
    selected = np.ones((B, T), dtype=bool) if mask is None else mask.detach().cpu().numpy().astype(bool)
    first = None if begins is None else begins.detach().cpu().numpy().astype(bool)
    last = None if ends is None else ends.detach().cpu().numpy().astype(bool)
    trans, start, end = crf.numpy_potentials(constrained)
    trans64 = trans.astype(np.float64)
    probs, log_z = np.zeros((B, T, L), dtype=np.float32), np.zeros(B, dtype=np.float32)
    paths: list[list[tuple[list[int], float]]] = []
    for b in range(B):
        positions = np.flatnonzero(selected[b])
        n = int(positions.size)
        if n == 0:
            paths.append([([], 0.0)])
            continue
        row = em[b, positions]  # (n, L), a contiguous copy
        # a window inside a document gets no start / end scores: the scores times False, as _per_row does
        st = start if first is None else start * np.float32(first[b])
        en = end if last is None else end * np.float32(last[b])
        paths.append([(path, score) for path, score in _viterbi_row(lib, row, trans, st, en, nbest)
                      if not (constrained and score < FORBIDDEN / 2)])
        found = _forward_backward_row(lib, row.astype(np.float64), trans64, st.astype(np.float64),
                                      en.astype(np.float64))
        if found is None:
            return None
        probs[b, positions], log_z[b] = found
    return paths, torch.from_numpy(probs), torch.from_numpy(log_z)


def _native_forward_backward(lib: Any, em: np.ndarray, ok: np.ndarray, tr: np.ndarray, st: np.ndarray,
                             en: np.ndarray) -> tuple[Tensor, Tensor] | None:
    """_scaled_forward_backward's answer through crf_decode.c, a row at a time; None as there."""
    B, S, L = em.shape
    probs, log_z = np.zeros((B, S, L)), np.zeros(B)
    tr = np.ascontiguousarray(tr)
    for b, n in enumerate(ok.sum(1).tolist()):
        if n == 0:
            continue
        found = _forward_backward_row(lib, np.ascontiguousarray(em[b, :n]), tr, np.ascontiguousarray(st[b]),
                                      np.ascontiguousarray(en[b]))
        if found is None:
            return None
        probs[b, :n], log_z[b] = found
    return torch.from_numpy(probs).float(), torch.from_numpy(log_z)
