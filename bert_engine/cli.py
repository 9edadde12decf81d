"""`bert-engine ...`: thin command-line wrappers over the library. Prints JSON for scripts."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from .hub import HubError, default_backbone
from .loading import CheckpointError, load


def _info(args: argparse.Namespace) -> dict:
    model, tokenizer = load(args.model, args.head, revision=args.revision)
    config = model.config
    return {
        "checkpoint": str(model.checkpoint.folder), "commit": model.checkpoint.commit,
        "model": type(model).__name__, "head": getattr(model, "head_name", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": config.to_dict(), "tokenizer_vocab_size": tokenizer.vocab_size,
    }


def _encode(args: argparse.Namespace) -> dict:
    model, tokenizer = load(args.model, revision=args.revision)
    batch = tokenizer(args.text)
    with torch.inference_mode():
        out = model(**batch.model_inputs())
    mask = batch.attention_mask.unsqueeze(-1).to(out.last_hidden_state.dtype)
    mean = (out.last_hidden_state * mask).sum(1) / mask.sum(1)  # mean over real tokens
    return {"results": [
        {"text": text, "tokens": tokenizer.convert_ids_to_tokens(batch.input_ids[i, : int(batch.attention_mask[i].sum())]),
         "mean_embedding": [round(v, 6) for v in mean[i].tolist()]}
        for i, text in enumerate(args.text)
    ]}


def _plugins(args: argparse.Namespace) -> dict:
    from .registry import load_registry

    return load_registry().to_json()


def _plugin_check(args: argparse.Namespace) -> dict:
    from .conformance import check_plugin

    report = check_plugin(args.name)
    if not report["ok"]:
        args.exit_code = 1
    return report


def _predict(args: argparse.Namespace) -> dict:
    from .hookspecs import InputError
    from .inference import Predictor
    from .registry import load_registry

    registry = load_registry()
    try:
        task = registry.task(args.task)
    except KeyError as err:
        raise ValueError(str(err.args[0])) from None
    fields = task.spec.input_fields + task.spec.optional_fields
    inputs = {}
    for item in args.input:
        field, sep, value = item.partition("=")
        if not sep or field not in fields:
            raise ValueError(f"--input {item!r}: expected FIELD=TEXT with FIELD one of {', '.join(fields)}")
        inputs[field] = value
    options = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option {item!r}: expected NAME=VALUE")
        try:
            options[name] = json.loads(value)
        except ValueError:
            options[name] = value  # a bare word, e.g. long_input=windows
    predictor = Predictor.load(task, args.model, revision=args.revision)
    texts = Path(args.file).read_text(encoding="utf-8").splitlines() if args.file else [None]
    if args.file and task.spec.predict_many is not None and not inputs:
        results = task.spec.predict_many(predictor, texts, progress=True, **options)
        return {"results": results, "provenance": predictor.provenance()}
    results = []
    for text in texts:
        row = dict(inputs, **({task.spec.input_fields[0]: text} if text is not None else {}))
        try:
            results.append(predictor.predict(row, **options))
        except InputError as err:
            if args.file is None:
                raise
            results.append({"task": task.spec.name, "error": str(err)})
    return results[0] if args.file is None else {"results": results}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bert-engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: the offline MiniLM)")
    common.add_argument("--revision", default=None, help="Hub branch, tag or commit")
    info = sub.add_parser("info", parents=[common], help="load a checkpoint and describe it")
    info.add_argument("--head", default=None, help="head to load (mlm, sequence, token, span, auto, ...)")
    info.set_defaults(run=_info)
    encode = sub.add_parser("encode", parents=[common], help="tokenise and encode texts; mean-pooled vectors")
    encode.add_argument("text", nargs="+")
    encode.set_defaults(run=_encode)
    predict = sub.add_parser("predict", help="run a task and print its result with provenance as JSON")
    predict.add_argument("task", help="task name, e.g. sentiment")
    predict.add_argument("--input", "-i", action="append", default=[], metavar="FIELD=TEXT",
                         help="an input field, e.g. -i text='great movie' (repeat for several fields)")
    predict.add_argument("--file", help="one input per line for the task's first field (batch)")
    predict.add_argument("--option", "-o", action="append", default=[], metavar="NAME=VALUE",
                         help="a task option, JSON-parsed when possible, e.g. -o top_k=2")
    predict.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: the task's)")
    predict.add_argument("--revision", default=None)
    predict.set_defaults(run=_predict)
    plugins = sub.add_parser("plugins", help="loaded task plugins (name, version, tasks) and failures, as JSON")
    plugins.set_defaults(run=_plugins)
    plugin = sub.add_parser("plugin", help="plugin tools")
    plugin_sub = plugin.add_subparsers(dest="plugin_command", required=True)
    check = plugin_sub.add_parser("check", help="load one plugin alone and run the conformance kit on its tasks")
    check.add_argument("name", help="plugin name (a built-in module or an entry-point name)")
    check.set_defaults(run=_plugin_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "model", "unset") is None and args.command in ("info", "encode"):
        args.model = default_backbone()
    try:
        result = args.run(args)
    except (HubError, CheckpointError, ValueError, TypeError) as err:
        print(f"bert-engine {args.command}: error: {err}", file=sys.stderr)
        return 2
    try:
        json.dump(result, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `bert-engine ... | head`: the reader left; that is not an error
        sys.stdout = open(os.devnull, "w")
    return getattr(args, "exit_code", 0)


if __name__ == "__main__":
    sys.exit(main())
