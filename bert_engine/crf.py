"""A linear-chain CRF over per-token emission scores, with optional constraints on transitions.

Log-likelihood (forward algorithm in log space), Viterbi and n-best decoding, and per-position
marginals (forward-backward). A mask selects the positions that carry a tag and may skip any of
them (only a word's first wordpiece is tagged; [CLS], [SEP] and padding are not): the selected
positions of a row form one chain. Which transitions a tag scheme allows, and all other task logic
(labels, entities, windows), lives with the NER task (plugins/tagging.py, plugins/ner.py).

Shape legend: B batch, T tokens, S selected positions per row (≤ T), L tags, K paths.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .heads import IGNORE_INDEX

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
                  begins: Tensor | None = None, ends: Tensor | None = None) -> Tensor:
        """p(tag at position t = l | emissions) as (B, T, L); rows of unselected positions are 0."""
        compact, valid, index, lengths, trans, start, end = self._prepare(emissions, mask, constrained, begins, ends)
        # In float64: in float32 the forward and backward sums drift apart by ~1e-5 over a sentence, and
        # exp(alpha + beta - log Z) came out as 1.000015 for a sure tag (a "probability" above 1).
        compact, trans, start, end = compact.double(), trans.double(), start.double(), end.double()
        B, S, L = compact.shape
        moves = self._moves(compact, trans)
        alphas = self._forward_alphas(compact, valid, start, moves)  # (B, S, L)
        betas = [end]
        ragged = not bool(valid.all())
        for s in range(S - 2, -1, -1):
            step = torch.logsumexp(moves[:, s] + betas[-1][:, None, :], dim=2)  # (B, L)
            betas.append(torch.where(valid[:, s + 1, None], step, end) if ragged else step)
        betas = torch.stack(betas[::-1], 1)  # (B, S, L)
        log_z = torch.logsumexp(alphas[:, -1] + end, dim=-1)  # (B,)
        probs = ((alphas + betas - log_z[:, None, None]).exp().clamp(max=1.0) * valid[..., None]).float()  # (B, S, L)
        # The compaction's index is a permutation, so scattering back touches each position once.
        out = emissions.new_zeros(emissions.shape, dtype=torch.float32)
        return out.scatter(1, index[..., None].expand(B, S, L), probs)  # (B, T, L)

    def decode(self, emissions: Tensor, mask: Tensor | None = None, *, nbest: int = 1, constrained: bool = True,
               begins: Tensor | None = None, ends: Tensor | None = None) -> list[list[tuple[list[int], float]]]:
        """The `nbest` highest-scoring tag sequences per row (Viterbi with K-best lists).

        Returns:
            per row, up to `nbest` (tags over the selected positions, score) pairs, best first.
            Paths that need a forbidden transition are left out; a row with no selected position
            has one empty path with score 0.
        """
        if nbest < 1:
            raise ValueError(f"nbest must be at least 1, got {nbest}")
        compact, valid, _, lengths, trans, start, end = self._prepare(emissions, mask, constrained, begins, ends)
        B, S, L = compact.shape
        K = nbest
        neg_inf = float("-inf")
        scores = compact.new_full((B, L, K), neg_inf)
        scores[:, :, 0] = start + compact[:, 0]  # (B, L, K): best K partial scores ending in each tag
        pointers = []  # per step s ≥ 1: (B, L, K) flat index prev_tag * K + prev_rank
        keep_index = (torch.arange(L, device=compact.device)[:, None] * K
                      + torch.arange(K, device=compact.device)[None, :]).expand(B, L, K)
        moves = self._moves(compact, trans).transpose(2, 3)[..., None]  # (B, S-1, L_to, L_from, 1)
        ragged = not bool(valid.all())
        for s in range(1, S):
            cand = (scores[:, None, :, :] + moves[:, s - 1]).reshape(B, L, L * K)  # (B, L_to, L_from * K)
            best, where = cand.topk(K, dim=-1)  # (B, L, K)
            if ragged:
                step_valid = valid[:, s, None, None]
                best, where = torch.where(step_valid, best, scores), torch.where(step_valid, where, keep_index)
            scores = best
            pointers.append(where)
        final = (scores + end[:, :, None]).reshape(B, L * K)
        best, where = final.topk(min(K, L * K), dim=-1)  # (B, K)
        back = torch.stack(pointers, 1).tolist() if pointers else [[] for _ in range(B)]  # (B, S-1, L, K), as lists
        results = []
        for b in range(B):
            n = int(lengths[b])
            if n == 0:
                results.append([([], 0.0)])
                continue
            paths = []
            for score, flat in zip(best[b].tolist(), where[b].tolist()):
                if score == neg_inf or (constrained and score < FORBIDDEN / 2):
                    continue
                tag, rank = divmod(flat, K)
                path = [tag]
                for s in range(S - 1, 0, -1):
                    tag, rank = divmod(back[b][s - 1][tag][rank], K)
                    path.append(tag)
                # Steps past the row's length point back to the same tag and rank, so the path's
                # tail repeats its last real tag: its first n entries are the row's path.
                paths.append((path[::-1][:n], score))
            results.append(paths)
        return results


def _per_row(scores: Tensor, flags: Tensor | None, B: int) -> Tensor:
    """(L,) start/end scores -> (B, L), zeroed for rows whose flag is False (mid-document windows)."""
    rows = scores[None].expand(B, -1)
    if flags is None:
        return rows
    return rows * flags.to(device=scores.device, dtype=torch.bool)[:, None]

