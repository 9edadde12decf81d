"""The summary task's default (hybrid mode) with another library's encoder, for benchmarks.workloads.

No transformers or optimum pipeline does extractive summarisation, so a user who wants the starter's
summaries from transformers or ONNX Runtime writes the glue: split the sentences, pack them into BertSum
windows, score every token with the scorer's weights, embed each sentence alone for the centroid, choose.
`SummaryReference` is that glue, taken from plugins/summary.py itself (its preprocess and postprocess, the
same options the engine's Predictor merges from the model's manifest) around an encoder of the peer's: the
same algorithm and weights, so the answers can be compared sentence by sentence, and the time differs by the
encoders and what each computes: the peers run `ROWS` rows at a time, each chunk padded to its own longest row, as
their pipelines pad a batch; the engine runs the real tokens alone. The sentence splitting, tokenising and choosing
are the engine's code on every side (the same cost), so the ratio is the encoders' and their padding's.

Used in process (transformers 5, the suite's) and in the peers' venv (transformers 4.57, optimum's
ORTModelForFeatureExtraction exported from the same folder): it needs only torch, safetensors and the repo.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROWS = 32  # rows per forward, as the engine's Predictor (max_rows) and the pipelines' batch_size
DOCUMENTS = 8  # documents per call in a file's run (plugins.summary.evaluate's batch)


def chunks(inputs: dict, rows: int = ROWS):
    """(start, inputs of `rows` rows cut to their own longest row): a padded batch as a pipeline batches it."""
    names = ("input_ids", "attention_mask", "token_type_ids")
    for i in range(0, len(inputs["input_ids"]), rows):
        width = int(inputs["attention_mask"][i:i + rows].sum(1).max())
        yield i, {k: inputs[k][i:i + rows, :width] for k in names}


def _stitched(parts: list[tuple[int, torch.Tensor]], inputs: dict) -> torch.Tensor:
    """The chunks' hidden states back in one (B, T, H) tensor, zeros past each chunk's width."""
    batch, length = inputs["input_ids"].shape
    out = torch.zeros(batch, length, parts[0][1].shape[-1])
    for start, states in parts:
        out[start:start + len(states), :states.shape[1]] = states
    return out


def torch_encoder(model, rows: int = ROWS) -> Callable[[dict], torch.Tensor]:
    """Model inputs -> last hidden states (B, T, H) through a transformers BertModel, `rows` rows at a time."""
    def encode(inputs: dict) -> torch.Tensor:
        with torch.inference_mode():
            return _stitched([(i, model(**{k: v.to(model.device) for k, v in part.items()}).last_hidden_state.float().cpu())
                              for i, part in chunks(inputs, rows)], inputs)
    return encode


def ort_encoder(model, rows: int = ROWS) -> Callable[[dict], torch.Tensor]:
    """The same through optimum's ORTModelForFeatureExtraction (ONNX Runtime)."""
    def encode(inputs: dict) -> torch.Tensor:
        return _stitched([(i, torch.as_tensor(model(**part).last_hidden_state).float())
                          for i, part in chunks(inputs, rows)], inputs)
    return encode


class SummaryReference:
    """plugins/summary.py's prediction for a list of documents, with `encode` as the encoder and the scorer
    read from the merged model folder (`head.scorer.*` in its model.safetensors)."""

    def __init__(self, folder: str | Path, encode: Callable[[dict], torch.Tensor], options: dict[str, Any]) -> None:
        from safetensors import safe_open  # noqa: PLC0415

        from bert_engine.hookspecs import TaskContext  # noqa: PLC0415
        from bert_engine.tokenizer import Tokenizer  # noqa: PLC0415

        with safe_open(str(Path(folder) / "model.safetensors"), "pt") as weights:
            self.weight = weights.get_tensor("head.scorer.weight").float()[0]  # (H,)
            self.bias = weights.get_tensor("head.scorer.bias").float()[0]
            trained = weights.get_tensor("head.is_trained").float()
        self.head = SimpleNamespace(is_trained=trained)
        self.encode, self.options = encode, dict(options)
        self.tokenizer = Tokenizer.from_pretrained(folder)
        self.context = TaskContext(self.tokenizer, lambda inputs: SimpleNamespace(last_hidden_state=encode(inputs)))

    def __call__(self, texts: list[str]) -> list[dict]:
        from plugins import summary  # noqa: PLC0415

        batch = summary.preprocess({"text": texts}, self.tokenizer, **self.options)
        scores = self.encode(batch.model_inputs()) @ self.weight + self.bias  # (B, T): the scorer on every token
        result = summary.postprocess(summary.SummaryOutput(scores, self.head), batch, context=self.context,
                                     **self.options)
        return result if isinstance(result, list) else [result]

    def many(self, texts: list[str], documents: int = DOCUMENTS) -> list[dict]:
        """Results for a file of documents, `documents` per call, in input order."""
        return [r for i in range(0, len(texts), documents) for r in self(texts[i:i + documents])]
