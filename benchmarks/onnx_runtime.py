"""ONNX Runtime as a contender: the same weights, exported the way a user would ship BERT to it.

The checkpoint is loaded into transformers' BertModel (eager attention, the graph ONNX Runtime's
BERT fusions recognise), exported with torch.onnx's TorchScript exporter (opset 17, dynamic batch
and sequence axes), then run through onnxruntime.transformers' optimizer for BERT, which fuses the
embeddings + LayerNorm, each attention block, bias + GELU and the residual LayerNorms into
ONNX Runtime's own CPU kernels: what `optimum-cli export onnx --optimize O2` produces. The int8
model is that graph with dynamic quantisation (`quantize_dynamic`: int8 weights per output
channel, activations quantised per call), ONNX Runtime's standard CPU int8 recipe.

Files are cached in the given folder, keyed by the model's name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)
INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def available() -> bool:
    try:
        import onnx  # noqa: F401, PLC0415
        import onnxruntime  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


class _Outputs(torch.nn.Module):
    """BertModel with positional inputs and a tuple output, as the TorchScript exporter wants."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return out.last_hidden_state, out.pooler_output


def export(folder: Path, workdir: Path, name: str) -> dict[str, Path]:
    """{"fp32": fused fp32 graph, "int8": its dynamically quantised copy} for the checkpoint in `folder`."""
    import onnx  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415
    from onnxruntime.transformers.optimizer import optimize_model  # noqa: PLC0415

    workdir.mkdir(parents=True, exist_ok=True)
    paths = {"fp32": workdir / f"{name}.fused.onnx", "int8": workdir / f"{name}.fused.int8.onnx"}
    if all(p.is_file() for p in paths.values()):
        return paths
    model = transformers.BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    config = model.config
    raw = workdir / f"{name}.onnx"
    example = tuple(torch.ones(2, 16, dtype=torch.long) for _ in INPUTS)
    axes = {k: {0: "batch", 1: "sequence"} for k in (*INPUTS, "last_hidden_state")} | {"pooler_output": {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(_Outputs(model), example, str(raw), input_names=list(INPUTS),
                          output_names=["last_hidden_state", "pooler_output"], dynamic_axes=axes, opset_version=17,
                          dynamo=False)
    fused = optimize_model(str(raw), model_type="bert", num_heads=config.num_attention_heads,
                           hidden_size=config.hidden_size)
    counts = {k: v for k, v in fused.get_fused_operator_statistics().items() if v}
    logger.info("%s: ONNX Runtime fused %s", name, counts)
    if not counts.get("Attention"):
        raise RuntimeError(f"{name}: ONNX Runtime did not fuse the attention blocks ({counts}); the comparison "
                           "would understate it")
    fused.save_model_to_file(str(paths["fp32"]))
    # The fused operators (com.microsoft domain) carry no shape-inference types: say they are fp32.
    quantize_dynamic(str(paths["fp32"]), str(paths["int8"]), weight_type=QuantType.QInt8, per_channel=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    raw.unlink()
    return paths


@dataclass
class OrtModel:
    session: object

    def __call__(self, inputs: dict[str, torch.Tensor]) -> np.ndarray:
        """The last hidden state for torch inputs (on the CPU)."""
        feed = {k: inputs[k].cpu().numpy() for k in INPUTS}
        return self.session.run(["last_hidden_state"], feed)[0]


def load(path: Path, threads: int, profile_prefix: str | None = None) -> OrtModel:
    """An ONNX Runtime CPU session with every graph optimisation and `threads` threads (as torch uses),
    its threads not spinning between runs; with `profile_prefix`, ONNX Runtime's own per-node profiler on
    (its JSON trace written under that prefix when `session.end_profiling()` is called)."""
    import onnxruntime as ort  # noqa: PLC0415

    options = ort.SessionOptions()
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ONNX Runtime's pool threads busy-wait after a run by default; in an interleaved benchmark they
    # then hold the cores while the next contender runs (MiniLM 1x128: engine 18.7 ms -> 34.6 ms,
    # transformers 27.7 -> 41.9, ONNX Runtime's own time unchanged at 23.8). Off, as torch's OpenMP
    # threads go idle between calls.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return OrtModel(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
