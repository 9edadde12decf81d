"""Why a model answered as it did: token attributions for a shown prediction.

A task declares what can be explained (TaskSpec.explain: the predicted label's probability, an
entity's, an answer's start and end); `explain` attributes each of those numbers to the input's
tokens, with one of two methods:

- Integrated Gradients (Sundararajan et al. 2017): the gradient of the score with respect to the
  word embeddings, averaged along the straight path from a baseline to the input, times the input
  minus the baseline. The path integral is taken by Gauss-Legendre quadrature with `steps` nodes
  (exact for polynomials of degree 2 x steps - 1, so far fewer steps than a Riemann sum need). The
  attributions sum to score(input) - score(baseline) up to the quadrature's error, which the result
  reports for every target (`completeness_gap`).
- gradient x input: the gradient at the input times the input minus the baseline: one forward and
  backward pass, fast, without that guarantee (its gap is reported too).

The baseline: every text token's word embedding replaced by the padding token's, so the model reads
a blank text of the same length; the special tokens ([CLS], [SEP], [PAD]) and [MASK], the positions
and the segments stay as they are, and their attributions are 0.

Cost: each step is a forward and one backward pass per target (about 1 + 2 x targets forwards),
run in chunks that take turns at the fairness gate like every forward. One explanation may cost at
most EXPLAIN_BUDGET times the work of the longest prediction a request may cause (BERT_ENGINE_MAX_TOKENS
tokens through this model, at most BERT_ENGINE_MAX_GFLOP); more is refused before anything runs, naming the
cost and the limit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..checkpoints.loader import load
from ..hookspecs import ExplainTarget, InputError, takes_context
from ..model import encoder_of
from .fairness import chunk_flops
from .inference import Predictor, max_request_flops, max_request_tokens, request_stage, row_flops
from .precision import prepare_for_inference

logger = logging.getLogger(__name__)

METHODS = {"integrated_gradients": "Integrated Gradients", "gradient_x_input": "gradient x input"}
DEFAULT_STEPS = 32
MAX_STEPS = 256
MAX_TARGETS = 16  # explained per request; a result with more (many entities) explains the first 16
# An explanation may cost this many of the longest predictions a request may cause. Autograd on the plain fp32
# copy runs at 160-260 GFLOP/s counted on a quiet 2-core Ice Lake Xeon (sentiment, 2,000 tokens, 4-16 steps), so
# the most this admits (3,400 GFLOP with MiniLM) takes 13-21 s there; at 4 (6,800 GFLOP) a hostile-visitor audit
# on a busy machine saw admitted explanations run into the 120 s request limit and be cut off, every time.
EXPLAIN_BUDGET = 2
BASELINE = ("every text token's word embedding replaced by the padding token's; special tokens, [MASK], "
            "positions and segments kept")
_COPY_LOCK = threading.Lock()


def checked_method(task: str, method: Any, steps: Any) -> int:
    """The steps an explanation by `method` takes (1 for gradient x input), after checking both; a caller
    checks them before the inputs, so one error does not hide another.

    Raises:
        InputError: an unknown method, or steps not an integer in [1, MAX_STEPS].
    """
    if method not in METHODS:
        raise InputError(f"{task}: method {method!r} is not one of {', '.join(METHODS)}")
    if isinstance(steps, float) and steps.is_integer():
        steps = int(steps)  # a slider's value
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
        raise InputError(f"{task}: steps must be an integer in [1, {MAX_STEPS}], got {steps!r:.40}")  # (1e308 as an integer: 309 digits)
    return steps if method == "integrated_gradients" else 1


def gauss_legendre(steps: int) -> tuple[np.ndarray, np.ndarray]:
    """`steps` nodes in (0, 1) and weights summing to 1: the integral over [0, 1] of f is about sum(w * f(a))."""
    nodes, weights = np.polynomial.legendre.leggauss(steps)
    return (nodes + 1) / 2, weights / 2


def request_flop_limit(predictor: Predictor) -> float:
    """The most work one explanation may cause: EXPLAIN_BUDGET x the most one prediction may cause, the FLOPs of
    max_request_tokens() tokens through the model in windows of its longest input, at most max_request_flops()."""
    encoder = encoder_of(predictor.model)
    window = max(1, min(int(predictor.tokenizer.model_max_length), int(encoder.config.max_tokens)))
    return EXPLAIN_BUDGET * min(row_flops(encoder, window) * max_request_tokens() / window, max_request_flops())


def gradient_model(predictor: Predictor) -> tuple[nn.Module, str]:
    """The model as autograd can run it, and what it is: the served model itself, unless its kernels have
    no backward (oneDNN-packed, tiled or int8 linears, torch.compile'd layers) or it computes in bf16 / fp16
    (a GPU's default: its gradients summed over the path steps miss the score by several per cent): then an
    fp32 copy of the same checkpoint with plain kernels, loaded once and kept on the predictor."""
    model = predictor.model
    if not _needs_copy(model):
        return model, "the served model"
    with _COPY_LOCK:
        copy = getattr(predictor, "_gradient_copy", None)
        if copy is None:
            if predictor.source is None:
                raise InputError(f"{predictor.task.spec.name}: this model's kernels have no gradients and it was "
                                 "not loaded from a checkpoint, so no copy with plain kernels can be made to explain it")
            name, device, load_kwargs = predictor.source
            logger.info("loading an fp32 copy of %s with plain kernels, for explanations", predictor.model_id)
            loaded = load(name, predictor.task.spec.build_head, device=device, dtype=torch.float32, **load_kwargs)
            copy = prepare_for_inference(loaded.model, "fp32", pack=False)
            predictor._gradient_copy = copy
    half = _half_precision(model)
    if half is not None:
        return copy, f"an fp32 copy (the served model computes in {half}, too coarse for attributions that add up)"
    served = "int8" if predictor.precision == "int8" else "packed or tiled fp32"
    return copy, f"an fp32 copy with plain kernels (the served {served} kernels have no gradients)"


def _half_precision(model: nn.Module) -> str | None:
    """"bfloat16" or "float16" where the model's floating-point weights are in that dtype, else None."""
    for param in model.parameters():
        if param.dtype in (torch.bfloat16, torch.float16):
            return str(param.dtype).removeprefix("torch.")
    return None


def _needs_copy(model: nn.Module) -> bool:
    from .fast import Int8Linear, PackedLinear, TiledLinear  # noqa: PLC0415 - fast.py loads oneDNN helpers

    return _half_precision(model) is not None or any(
        isinstance(m, (Int8Linear, PackedLinear, TiledLinear)) or hasattr(m, "_orig_mod") for m in model.modules())


def explain(predictor: Predictor, inputs: Mapping[str, Any], *, method: str = "integrated_gradients",
            steps: int = DEFAULT_STEPS, targets: Sequence[str] | None = None, **options: Any) -> dict[str, Any]:
    """The prediction for `inputs` and the attribution of each explained number to the input's tokens.

    Args:
        predictor: a Predictor (or anything with `get()` returning one, or a `pipeline()`) of a task that
            declares `explain`.
        method: "integrated_gradients" or "gradient_x_input".
        steps: Integrated Gradients' quadrature nodes (1..MAX_STEPS); gradient x input takes one.
        targets: names of the task's targets to explain (default: all, up to MAX_TARGETS).
        options: the task's options, as for predict.
    Returns:
        {"task", "method", "steps", "baseline", "explained_on", "seconds", "flops", "rows": [{"row",
        "tokens": [{"token", "field", "start", "end"}]}], "targets": [{"name", "what", "row", "score",
        "baseline_score", "attributions", "sum", "completeness_gap"}], "left_out", "result", "provenance"}.
    Raises:
        InputError: the task declares no explanation, a bad method, step count or target name, or an
            explanation costing more than request_flop_limit (naming both).
    """
    predictor = getattr(predictor, "predictor", predictor)  # a pipeline(): the Predictor it runs
    if not callable(getattr(predictor, "get", None)):
        raise TypeError(f"explain needs a pipeline() or a Predictor, got {type(predictor).__name__}")
    predictor = predictor.get()
    spec = predictor.task.spec
    if spec.explain is None:
        raise InputError(f"{spec.name}: this task does not say what to explain (its TaskSpec has no `explain`)")
    steps = checked_method(spec.name, method, steps)
    checked = predictor.check_inputs(inputs, options)
    start = time.perf_counter()
    with request_stage("preprocess"):
        batch = spec.preprocess(dict(inputs), predictor.tokenizer, **checked)  # a copy: the caller's stays
    result = predictor.run(batch, checked)
    with request_stage("explain"):
        extra = {"context": predictor.context()} if takes_context(spec.explain) else {}
        found = list(spec.explain(result, batch, **checked, **extra) or ())
        chosen = _choose(spec.name, found, targets, len(batch))
    fields = [f for f in (*spec.input_fields, *spec.optional_fields) if inputs.get(f) is not None]
    rows = sorted({t.row for t in chosen})
    out: dict[str, Any] = {"task": spec.name, "method": method, "steps": steps, "baseline": BASELINE,
                           "rows": [], "targets": [], "left_out": len(found) - len(chosen), "result": result}
    if not chosen:
        out.update(explained_on=None, seconds=round(time.perf_counter() - start, 3), flops=0,
                   provenance=predictor.provenance())
        return out
    encoder = encoder_of(predictor.model)
    lengths = {r: int(batch.attention_mask[r].sum()) for r in rows}
    cost = sum(row_flops(encoder, lengths[r]) * (steps * (1 + 2 * sum(t.row == r for t in chosen)) + 2) for r in rows)
    limit = request_flop_limit(predictor)
    if cost > limit:
        raise InputError(f"{spec.name}: explaining {len(chosen)} number(s) over {sum(lengths.values()):,} tokens with "
                         f"{steps} step(s) costs {cost / 1e9:,.1f} GFLOP; the limit is {limit / 1e9:,.1f} GFLOP ({EXPLAIN_BUDGET:g} x "
                         "the most one prediction may cost: BERT_ENGINE_MAX_TOKENS, BERT_ENGINE_MAX_GFLOP). Use fewer "
                         "steps, gradient_x_input, fewer targets, or a shorter input")
    model, explained_on = gradient_model(predictor)
    with request_stage("explain"):
        for r in rows:
            ours = [t for t in chosen if t.row == r]
            attributions, scores, baselines = _attribute(predictor, model, batch, r, lengths[r], ours, method, steps)
            out["rows"].append({"row": r, "tokens": _tokens(predictor.tokenizer, batch, r, lengths[r], fields, inputs)})
            for target, values, score, base in zip(ours, attributions, scores, baselines):
                total = float(values.sum())
                out["targets"].append({
                    "name": target.name, "what": target.what, "row": r, "score": _round(score),
                    "baseline_score": _round(base), "attributions": [_round(v) for v in values.tolist()],
                    "sum": _round(total), "completeness_gap": _round(total - (score - base))})
    out.update(explained_on=explained_on, seconds=round(time.perf_counter() - start, 3), flops=int(cost),
               provenance=predictor.provenance())
    return out


def _choose(task: str, found: list[Any], names: Sequence[str] | None, rows: int) -> list[ExplainTarget]:
    for target in found:
        if not isinstance(target, ExplainTarget) or not callable(target.score) or not isinstance(target.name, str):
            raise TypeError(f"{task}: explain must return ExplainTarget records, got {type(target).__name__}")
        if not isinstance(target.row, int) or not 0 <= target.row < rows:
            raise TypeError(f"{task}: ExplainTarget {target.name!r} names row {target.row!r}; the batch has {rows}")
    if names:
        if isinstance(names, str):
            names = [names]
        known = [t.name for t in found]
        missing = [n for n in names if n not in known]
        if missing:
            raise InputError(f"{task}: nothing named {missing[0]!r} to explain; this answer has: "
                             f"{', '.join(known) or 'nothing'}")
        found = [t for t in found if t.name in set(names)]
    return found[:MAX_TARGETS]


def _attribute(predictor: Predictor, model: nn.Module, batch, r: int, n: int, targets: list[ExplainTarget],
               method: str, steps: int) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """Attributions (one (n,) tensor per target) for row `r`'s first `n` tokens, and each target's score
    at the input and at the baseline."""
    device = next(model.parameters()).device
    encoder = encoder_of(model)
    table = encoder.embeddings.word_embeddings
    ids = batch.input_ids[r:r + 1, :n].to(device)
    segments = batch.token_type_ids[r:r + 1, :n].to(device)
    tokenizer = predictor.tokenizer
    kept = {tokenizer.token_id(name) for name in ("cls_token", "sep_token", "pad_token", "mask_token")}
    varied = ~torch.isin(ids[0], torch.tensor(sorted(kept), device=device))  # (n,) the text's own tokens
    with torch.no_grad():
        # the table's weights read directly, not the module called: outside the lock, another explanation's hook
        # on this table (run() below) answered the call with that visitor's embeddings
        x = torch.nn.functional.embedding(ids, table.weight)[0].detach()  # (n, E)
        blank = table.weight[tokenizer.pad_token_id].detach() if tokenizer.pad_token_id is not None else 0.0
        base = torch.where(varied[:, None], blank, x)
    delta = x - base  # 0 at the kept tokens
    extra = dict(batch.meta.get("model_kwargs", {}))
    per_row = row_flops(encoder_of(predictor.model), n)
    gate = predictor.gate

    def run(embeddings: torch.Tensor):
        """The model over rows of `embeddings` in place of the word embeddings; call it holding the model's
        lock (the hook lives only inside the call, so no other request's forward ever meets it)."""
        rows = embeddings.shape[0]
        handle = table.register_forward_hook(lambda _module, _args, _output: embeddings)
        try:  # one unpadded row: every token attended to, a mask of ones (heads read it: docs/plugins.md)
            return model(input_ids=ids.expand(rows, -1), attention_mask=torch.ones_like(ids).expand(rows, -1),
                         token_type_ids=segments.expand(rows, -1), **extra)
        finally:
            handle.remove()

    def turn(cost: float):
        return gate.turn(cost) if gate is not None else contextlib.nullcontext()

    with turn(2 * per_row), predictor._lock, torch.no_grad():  # the scores at the input and the baseline
        ends = run(torch.stack([x, base]))
        values = [_scores(t, ends, 2) for t in targets]
    scores, baselines = [float(v[0]) for v in values], [float(v[1]) for v in values]
    if method == "integrated_gradients":
        alphas, weights = gauss_legendre(steps)
    else:
        alphas, weights = np.ones(1), np.ones(1)
    sums = [torch.zeros_like(x, dtype=torch.float32) for _ in targets]
    per_step = per_row * (1 + 2 * len(targets))
    i = 0
    while i < len(alphas):
        budget = gate.chunk_budget() if gate is not None else chunk_flops()  # shorter while others wait
        chunk = max(1, min(32, int(budget // max(per_step, 1.0))))
        a = torch.tensor(alphas[i:i + chunk], dtype=x.dtype, device=device)[:, None, None]
        w = torch.tensor(weights[i:i + chunk], dtype=torch.float32, device=device)[:, None, None]
        with turn(per_step * a.shape[0]), predictor._lock, torch.enable_grad():
            path = (base + a * delta).requires_grad_(True)  # (c, n, E)
            output = run(path)
            for k, target in enumerate(targets):
                value = _scores(target, output, a.shape[0])
                if not value.requires_grad:
                    raise TypeError(f"ExplainTarget {target.name!r}: its score does not depend on the output it is "
                                    "handed (no gradient reaches the input); compute it from that output")
                (grad,) = torch.autograd.grad(value.sum(), path, retain_graph=k < len(targets) - 1)
                sums[k] += (w * grad.float()).sum(0)
        i += chunk
    return [(s * delta.float()).sum(-1).cpu() for s in sums], scores, baselines


def _scores(target: ExplainTarget, output: Any, rows: int) -> torch.Tensor:
    value = target.score(output)
    if not isinstance(value, torch.Tensor) or value.shape != (rows,):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"ExplainTarget {target.name!r}: score must give one value per row, shape ({rows},), got {shape}")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"ExplainTarget {target.name!r}: score is not finite")
    return value.float()


def _tokens(tokenizer, batch, r: int, n: int, fields: list[str], inputs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Row `r`'s tokens, each with the input field it comes from and its character span there (None for specials)."""
    tokens = tokenizer.convert_ids_to_tokens(batch.input_ids[r, :n].tolist())
    out = []
    sequences, offsets = batch.sequence_ids[r], batch.offsets[r]
    for t, token in enumerate(tokens):
        sequence = sequences[t] if t < len(sequences) else None
        field = fields[sequence] if sequence is not None and sequence < len(fields) and t < len(offsets) else None
        start, end = offsets[t] if field is not None else (None, None)
        out.append({"token": token, "field": field, "start": start, "end": end})
    return out


def _round(value: float) -> float:
    return 0.0 if not math.isfinite(value) else round(float(value), 6)
