"""`bert-engine ...`: thin command-line wrappers over the library. Prints JSON for scripts."""

from __future__ import annotations

import argparse
import contextlib
import csv
import difflib
import json
import logging
import math
import os
import shlex
import stat
import sys
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import settings

if TYPE_CHECKING:  # each command imports what it needs when it runs: `--help` loads no torch
    from .training.train_config import TrainConfig

logger = logging.getLogger(__name__)
PRECISIONS = "auto, fp32, bf16, fp16, int8"  # checked by runtime/precision.py (its table) when a command runs

PRECISION_HELP = ("auto: fp32 on CPU, bf16/fp16 on GPU; bf16 on a CPU with AVX512-BF16 or AMX; int8: dynamic "
                  "quantisation of the encoder's linear layers (CPU); see benchmarks/README.md for the speed and "
                  "accuracy of each")


def _task(name: str):
    """The registered task `name` or alias (as `pipeline()` takes them: "summarization", "question-answering");
    ValueError (exit code 2) naming the known ones otherwise."""
    from .serving.pipeline import find_task
    from .tasks.registry import load_registry

    try:
        return find_task(load_registry(), name)
    except KeyError as err:
        raise ValueError(str(err.args[0])) from None


def _info_task(args: argparse.Namespace):
    """The task whose head `info` loads: --task, else (no --head) the task a local folder's manifest.json
    names when it is a registered task's (a starter or packed model: its head is the task's, e.g. NER's CRF,
    which no --head kind builds); None: load --head as given."""
    if args.task is not None:
        if args.head not in (None, "auto"):
            raise ValueError(f"--task {args.task!r} loads that task's own head; leave out --head {args.head!r}")
        return _task(args.task)
    return _folder_task(args.model) if args.head in (None, "auto") else None


def _folder_task(model: str | None):
    """The registered task a local model folder's manifest.json names (a starter or packed model), or the task a
    training run's train_config.json names (the run's folder, or its best/ or last/), or None: no such folder or
    record, or a task no installed plugin registers (logged: loading as asked may not fit)."""
    from .checkpoints.loader import recorded_task

    folder = Path(str(model)).expanduser()
    named = recorded_task(folder) if model is not None and folder.is_dir() else None
    if named is None:
        return None
    try:
        return _task(named)
    except ValueError:
        logger.warning("%s: its manifest.json names task %r, which no installed plugin registers", folder, named)
        return None


def _info(args: argparse.Namespace) -> dict:
    from .checkpoints.hub import default_backbone
    from .checkpoints.loader import load
    from .runtime.inference import _staged_head

    task = _info_task(args)
    if task is not None and args.model is None:
        args.model = task.spec.default_checkpoint or default_backbone()
    head = _staged_head(task.spec.build_head) if task is not None else args.head
    loaded = load(args.model, head, revision=args.revision)
    model, tokenizer, config = loaded.model, loaded.tokenizer, loaded.model.config
    info = {
        "checkpoint": str(loaded.checkpoint.folder), "commit": loaded.checkpoint.commit,
        "task": task.spec.name if task is not None else None,
        "model": type(model).__name__, "head": getattr(model, "head_name", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": config.to_dict(), "tokenizer_vocab_size": tokenizer.vocab_size,
    }
    if args.kernels:  # timed on this machine's first ask, then read from the cache
        from .runtime import native
        from .runtime.fast import choose_kernels, fused_label, int8_fused_label, int8_kernel, kernel_label
        from .runtime.precision import kernel_cache

        choice = choose_kernels(model.eval(), kernel_cache())
        info["kernels"] = {name: {**c, "runs": kernel_label(c)} for name, c in choice.items()}
        layers = [(c.pop("layer_rows"), c.pop("layer_timed", {})) for c in info["kernels"].values() if "layer_rows" in c]
        if layers:  # the four projections share them (AVX-512): shown once
            info["layer_timings"] = {"rows_ms": layers[0][0], **layers[0][1]}
        info["fused_layers"] = fused_label(choice) if native.unavailable() is None else "not used: no tiled kernel here"
        # why bert_engine's own kernel is not a candidate, or the vector width it runs at
        info["tiled_kernel"] = native.unavailable() or f"available ({'AVX-512' if native.isa() == 512 else 'AVX2'})"
        info["int8_kernel"] = int8 = int8_kernel()  # what --precision int8 runs its projections' matmuls with
        info["int8_fused_layers"] = int8_fused_label(kernel=int8)
    return info


def _encode(args: argparse.Namespace) -> dict:
    import torch

    from .checkpoints.loader import load
    from .model import mean_pool
    from .runtime.inference import readable

    empty = [i for i, text in enumerate(args.text) if not text.strip()]
    if empty:
        raise ValueError(f"text {empty[0] + 1} is empty; give each text some words to encode")
    unreadable = [i for i, text in enumerate(args.text) if not readable(text)]
    if unreadable:  # (as every task refuses it: a vector of [CLS] [SEP] alone is no text's)
        text = args.text[unreadable[0]].strip()
        raise ValueError(f"text {unreadable[0] + 1} has no readable text, only control or invisible characters "
                         f"({', '.join(f'U+{ord(c):04X}' for c in dict.fromkeys(text[:200]))[:120]}); type some words")
    from .model import encoder_of
    from .runtime.inference import _staged_head
    from .runtime.precision import pick_device

    device = pick_device()  # BERT_ENGINE_DEVICE's, else CUDA, MPS or the CPU: as predict and eval run
    task = _folder_task(args.model)  # a task's model folder (a starter's adapter): its task's head, its encoder used
    loaded = load(args.model, _staged_head(task.spec.build_head) if task is not None else None, revision=args.revision,
                  device=device)
    model, tokenizer = encoder_of(loaded.model), loaded.tokenizer
    batch = tokenizer(args.text).to(device)
    room = tokenizer.model_max_length - 2  # ([CLS] and [SEP] around the text's pieces)
    cut = [len(pieces.offsets) > room for pieces in tokenizer.pieces(args.text)]
    for i in (i for i, c in enumerate(cut) if c):  # the vector stands for the first `room` pieces only
        logger.warning("text %d is longer than the model's %d tokens: it is encoded up to there (\"truncated\": true)",
                       i + 1, tokenizer.model_max_length)
    with torch.inference_mode():
        out = model(**batch.model_inputs())
    mean = mean_pool(out.last_hidden_state, batch.attention_mask).float().cpu()  # mean over real tokens
    return {"results": [
        {"text": text, "tokens": tokenizer.convert_ids_to_tokens(batch.input_ids[i, : int(batch.attention_mask[i].sum())]),
         "truncated": cut[i], "mean_embedding": [round(v, 6) for v in mean[i].tolist()]}
        for i, text in enumerate(args.text)
    ]}


def _push(args: argparse.Namespace) -> dict:
    """Stage a run's model with a generated card, check it loads, and upload it (or, with --dry-run,
    leave the staged folder for a look)."""
    import tempfile

    from .checkpoints.hub import check_push_target, check_repo_id, upload_folder
    from .shipping.publish import check_license, read_source, stage

    check_repo_id(args.repo)  # a dry run stages for the same repository
    check_license(args.license)
    if not args.dry_run:
        check_push_target(args.repo, args.token)
    source = read_source(args.run_dir, args.task)
    task = _task(source.task)
    if args.dry_run:
        into = Path(args.dry_run)
        if into.exists():
            raise ValueError(f"--dry-run {str(into)!r} exists; give a new folder")
        files = stage(source, task, args.repo, into, license=args.license)
        return {"repo": args.repo, "task": task.spec.name, "staged": str(into), "files": files, "uploaded": False}
    with tempfile.TemporaryDirectory(prefix="bert-engine-push-") as tmp:
        into = Path(tmp) / "repo"
        stage(source, task, args.repo, into, license=args.license)
        done = upload_folder(into, args.repo, token=args.token, private=args.private, revision=args.revision,
                             message=args.message or f"Upload {task.spec.name} model with bert-engine push",
                             endpoint=args.endpoint)
    return {"repo": done.repo_id, "task": task.spec.name, "commit": done.commit, "url": done.url,
            "files": list(done.files), "uploaded": True}


def _plugins(args: argparse.Namespace) -> dict:
    from .tasks.registry import load_registry

    registry = load_registry()
    if registry.failures:  # a plugin that failed to load is a failure of this command too
        args.exit_code = 1
    # what `predict` takes per task: its -i fields and its -o options (learnt from error messages before)
    usage = {name: {"title": task.spec.title, "aliases": list(task.spec.aliases), "fields": list(task.spec.input_fields),
                    "optional_fields": list(task.spec.optional_fields), "options": sorted(task.spec.options)}
             for name, task in registry.tasks.items()}
    if not args.smoke:
        return {**registry.to_json(), "tasks": usage}
    from .runtime.cancel import call_with_timeout, raised_by_call
    from .runtime.inference import Predictor

    smoke = {}
    for name, task in registry.tasks.items():
        if not task.spec.examples:
            smoke[name] = "no examples to run"
            continue
        try:
            predictor = Predictor.load(task)
            call_with_timeout(predictor.predict, args.timeout, dict(task.spec.examples[0]), what=f"task {name!r}")
            smoke[name] = "ok"
        except BaseException as err:  # any failure of a task's code is reported, and the next task runs
            if isinstance(err, KeyboardInterrupt) and not raised_by_call(err):
                raise
            smoke[name] = registry.record_exception(name, err).message
            args.exit_code = 1
    return {**registry.to_json(), "tasks": usage, "smoke": smoke}


def _plugin_check(args: argparse.Namespace) -> dict:
    from .tasks.conformance import check_plugin

    report = check_plugin(args.name, data=args.data, split=args.split, case_timeout_s=args.case_timeout)
    if not report["ok"]:
        args.exit_code = 1
    return report


class TaskFailed(Exception):
    """A task's own code failed, or answered what JSON cannot hold: one line naming the plugin, exit 1."""


def failed_task_message(task, err: BaseException) -> str:
    """What failed where, for an exception a task's code raised (`request_stage` noted by the Predictor)."""
    stage = getattr(err, "request_stage", None) or "request"
    text = " ".join(str(err).split())[:300]
    return (f"task {task.spec.name} failed in {stage} ({type(err).__name__}{': ' + text if text else ''}); "
            f"this is a bug in plugin {task.plugin}, not in your input")


@contextlib.contextmanager
def _task_code(task):
    """Turns a failure of the task's own code (an exception its preprocess, head or postprocess raised, which
    the Predictor marks with `request_stage`) into TaskFailed; bad input stays the InputError it is."""
    from .files import CheckpointError
    from .hookspecs import InputError

    try:
        yield
    except (InputError, CheckpointError):  # bad input; a head that says the checkpoint is not for its task
        raise
    except (Exception, SystemExit) as err:
        if not _tasks_own(err):
            raise
        raise TaskFailed(failed_task_message(task, err)) from None


def _tasks_own(err: BaseException) -> bool:
    """Whether the task's own code raised `err` (the Predictor marks where: preprocess, build_head, ...)."""
    return getattr(err, "request_stage", None) is not None


_STDOUT: list = []  # the process's stdout while a command runs (main sends everything else to stderr)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed, or not a real stream
        return False


def _answers_out():
    """Where a command's answers go: the real stdout, whatever a plugin's code printed meanwhile."""
    return _STDOUT[-1] if _STDOUT else sys.stdout


@contextlib.contextmanager
def _stdout_for_answers():
    """While a command runs, whatever else is written to stdout goes to stderr: print() from a plugin, and
    writes straight to file descriptor 1 (a subprocess it starts, a C library). Yields the stream the
    command's answers go to. Where stdout is not descriptor 1 (captured, embedded) only print() moves."""
    stream = sys.stdout
    try:
        on_fd_1 = stream.fileno() == 1
    except (AttributeError, OSError, ValueError):
        on_fd_1 = False
    answers = stream
    if on_fd_1:  # descriptor 1 itself goes to stderr; the answers keep a duplicate of the real one
        stream.flush()
        saved = os.dup(1)
        answers = open(saved, "w", encoding=stream.encoding or "utf-8", errors=stream.errors, closefd=False)
        sys.stderr.flush()
        os.dup2(2, 1)
    _STDOUT.append(answers)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield answers
    finally:
        _STDOUT.pop()
        if on_fd_1:
            answers.flush()
            stream.flush()  # what code holding the old stdout object wrote: still to stderr
            os.dup2(saved, 1)
            answers.close()
            os.close(saved)


def _predict(args: argparse.Namespace) -> dict:
    task = _task(args.task)
    with _task_code(task):
        return _predict_task(args, task)


def _predict_task(args: argparse.Namespace, task) -> dict:
    from .runtime.inference import Predictor, check_json_result

    fields = task.spec.input_fields + task.spec.optional_fields
    inputs = {}
    for item in args.input:
        field, sep, value = item.partition("=")
        if not sep or field not in fields:
            raise ValueError(f"--input {item!r}: expected FIELD=TEXT with FIELD one of {', '.join(fields)}")
        if field in inputs:
            raise ValueError(f"--input {field}= is given twice; give each field once")
        inputs[field] = value
    for item in args.input_file:  # a field's text from a file: an article too long for the shell's arguments
        field, sep, file = item.partition("=")
        if not sep or field not in fields or not file:
            raise ValueError(f"--input-file {item!r}: expected FIELD=PATH with FIELD one of {', '.join(fields)}")
        if field in inputs:
            raise ValueError(f"--input-file {field}= gives a field already given; give each field once")
        if file == "-" and (args.file == "-" or sum(i.partition("=")[2] == "-" for i in args.input_file) > 1):
            raise ValueError("standard input can be read once: give one --input-file (or --file) as -, the others "
                             "as files")
        inputs[field] = _file_text(file)
    options = _parse_options(args.option)
    if args.output == "-":  # as --file -: standard output, where the answers go anyway
        args.output = None
    if args.output is not None:
        if not args.file:
            raise ValueError("--output writes the answers of --file's lines; without --file the answer goes to stdout")
        if not args.output.strip():
            raise ValueError("--output is empty; give the path of a file to write (or leave it out for stdout)")
        if Path(args.output).is_dir():
            raise ValueError(f"--output {args.output!r} is a folder; give the path of a file to write")
        if not Path(args.output).parent.is_dir():  # said before the model loads and the file is read
            raise ValueError(f"--output {args.output!r}: there is no folder {str(Path(args.output).parent)!r} to "
                             "write it in")
        if args.file != "-" and Path(args.output).exists() and Path(args.file).exists() and \
                os.path.samefile(args.output, args.file):  # (the same path, a link, or a hard link to it)
            raise ValueError(f"--output {args.output!r} is the file --file reads; writing the answers there would "
                             "replace the inputs: give another path")
    if args.format and not args.file:
        raise ValueError("--format says how --file is written; give --file")
    kind = (args.format or _format_of(args.file)) if args.file else None
    needed = [f for f in task.spec.input_fields[1:] if f not in inputs]
    if kind == "text" and needed:  # every line would fail alike: refused once, before the file is read
        raise ValueError(f"{_file_name(args.file)}: plain text gives each line's {task.spec.input_fields[0]}; "
                         f"task {task.spec.name!r} also needs {', '.join(needed)}: give "
                         f"{' '.join(f'-i {f}=TEXT' for f in needed)} for every line, or write the file as .jsonl "
                         "or .tsv (--format)")
    rows = _read_rows(args.file, task, kind) if args.file else None  # a bad file fails before the model loads
    blank = count = 0
    if rows is not None:  # (a blank line is no input: skipped, said in the summary; it failed the run)
        given: set[str] = set()
        for _, row in rows:  # one pass that keeps nothing: the rows are read again as they are answered
            blank += row is BLANK
            count += row is not BLANK
            if inputs and isinstance(row, dict):
                given.update(row)
        if not count:  # "0 of 0 lines answered" and exit 0 read as success to a script
            raise ValueError(f"{_file_name(args.file)}: no inputs ("
                             + (f"{blank} blank line{'s' if blank != 1 else ''})" if blank
                                else "nothing was given)" if args.file == "-" else "the file is empty)"))
        # -i with --file: a field every line leaves out (QA's question for many contexts)
        clash = sorted(given & set(inputs))
        if clash:
            raise ValueError(f"--input {clash[0]}= and the lines of {args.file} both give {clash[0]}; with --file, -i "
                             "gives a field the lines leave out (say QA's question for a file of contexts)")
    predictor = Predictor.load(task, args.model, revision=args.revision, precision=_precision(args))
    if rows is None:
        output = predictor.predict(inputs, **options)
        check_json_result(task.spec.name, output["result"])  # what a script reads must be JSON
        return output
    failed = _predict_rows(task, predictor, rows, count, inputs, predictor.check_options(options), args.output)
    if failed:
        args.exit_code = 1
    if os.environ.get("RANK", "0") != "0":  # under torchrun the first process reports
        return None
    info = predictor.provenance()
    skipped = f", {blank} blank line{'s' if blank != 1 else ''} skipped" if blank else ""
    print(f"bert-engine predict: {count - failed} of {count} lines answered, {failed} failed{skipped}, by "
          f"{info['model']} ({info['device']}, {info['dtype']})" + (f"; results in {args.output}" if args.output else ""),
          file=sys.stderr)
    return None


BLANK = "(a blank line)"  # _read_rows' mark for a line holding only whitespace: skipped, and counted in the summary


FORMATS = ("text", "jsonl", "json", "tsv")  # predict --format; without it, a file's suffix says (stdin: text)


def _format_of(file: str) -> str:
    """The format a --file's name says: .jsonl, .json, .tsv, else plain text (also for "-", standard input)."""
    suffix = Path(file).suffix if file != "-" else ""
    return {".jsonl": "jsonl", ".json": "json", ".tsv": "tsv"}.get(suffix, "text")


def _file_name(file: str) -> str:
    return "standard input" if file == "-" else file


def _file_bytes(file: str) -> bytes:
    """A --file's bytes: a file checked first (check_data_file), or standard input ("-") read up to
    BERT_ENGINE_MAX_FILE_MB and refused past it (a pipe declares no size: what is read is counted)."""
    if file != "-":
        check_data_file(Path(file))
        return Path(file).read_bytes()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process reads the file; one stream cannot be read twice
        raise ValueError("--file -: standard input cannot be shared by torchrun's processes; give a file")
    limit = settings.get("BERT_ENGINE_MAX_FILE_MB") * 1_000_000
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"standard input: over the limit of {limit // 1_000_000:,} MB (BERT_ENGINE_MAX_FILE_MB)")
    return data


def _file_text(file: str) -> str:
    """A file's whole text (or standard input's, "-"), for --input-file: checked and read as --file is, and refused
    if it is not UTF-8 text, naming the byte."""
    data = _file_bytes(file)
    if (nul := data.find(b"\x00")) >= 0:
        raise ValueError(f"{_file_name(file)}: not a text file (a NUL byte at byte {nul:,}): give UTF-8 text")
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (Excel's, Notepad's) is not text
    except UnicodeDecodeError as err:
        raise ValueError(f"{_file_name(file)}: not UTF-8 text (byte 0x{data[err.start]:02x} at byte {err.start:,}); "
                         "save it as UTF-8") from None


def _read_rows(file: str, task, kind: str) -> Iterable[tuple[int, dict | str]]:
    """(line number, inputs or an error message) per input of a file ("-": standard input) of format `kind`
    (FORMATS): JSON Lines (an object keyed by the task's fields, or a string for its first field), a JSON array
    of those, TSV with a header naming the fields, or plain text with one input per line for the first field.
    A file of lines is read line by line each time the answer is iterated (its text held once, the rows built as
    they are read: 20 MB of two-byte lines held 4 GB as a list of rows), a JSON document as one list; what is
    wrong with the file as a whole (a bad header, not JSON) is raised here, before anything is iterated."""
    spec = task.spec
    fields, first = spec.input_fields + spec.optional_fields, spec.input_fields[0]
    path = _file_name(file)
    # A byte that is not UTF-8 fails its own line (below), not the file: the rest is answered. A NUL byte is in no
    # text file: a binary file (or UTF-16 text) is refused once, not as one bad "line" after another.
    data = _file_bytes(file)
    if (nul := data.find(b"\x00", 0, 65_536)) >= 0:
        utf16 = data[:2] in (b"\xff\xfe", b"\xfe\xff")
        raise ValueError(f"{path}: not a text file (a NUL byte at byte {nul:,}): give UTF-8 text, one input per line, "
                         "or a .jsonl, .json or .tsv file" + ("; this one is UTF-16 text: save it as UTF-8" if utf16 else ""))
    text = data.decode("utf-8-sig", errors="surrogateescape")  # a byte-order mark (Excel's) is not text
    del data
    # A binary file without a NUL byte: most of its bytes are not UTF-8 (a Latin-1 text's accented letters are a few
    # per cent); refused once, where its "lines" were each answered "not UTF-8" before
    head = text[:4096]
    if len(head) >= 64 and (bad := sum("\udc80" <= c <= "\udcff" for c in head)) > 0.25 * len(head):
        raise ValueError(f"{path}: not UTF-8 text ({bad:,} of its first {len(head):,} characters are bytes UTF-8 does "
                         "not read: a binary file, or text in another encoding): give UTF-8 text, one input per line, "
                         "or a .jsonl, .json or .tsv file")
    try:
        whole = _json_document(text) if kind == "json" else None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if whole is not None:
        # A JSON document: an array of inputs (objects keyed by the fields, or texts), each numbered by its place
        # (1, 2, ...), or one object (a pretty-printed array was read line by line: "not JSON" on most lines)
        items = whole if isinstance(whole, list) else [whole]
        return [(number, _json_input(value, fields, first)) for number, value in enumerate(items, 1)]
    if kind in ("jsonl", "json"):
        return _LazyRows(text, lambda line: _jsonl_row(line, fields, first))
    if kind == "tsv":
        # Tab-separated, no quoting: a line's fields are its text between tabs (csv's reader refused fields past
        # 131,072 characters with a traceback, far below the 1,000,000 an input may have)
        first_line = next(_lines(text), None)
        if first_line is not None and (bad := not_utf8(first_line)):
            raise ValueError(f"{path}:1: the header naming the task's fields is {bad}; save the file as UTF-8")
        header = first_line.split("\t") if first_line is not None else []
        # A column the task does not read was dropped unread (a misspelt optional field, "text_pari", answered
        # without it); JSON Lines refuses such a field per line, a header refuses it once, naming the field it
        # may have meant ("txt" for a missing "text" was reported as the missing field alone).
        missing = [f for f in spec.input_fields if f not in header]
        unknown = [name for name in header if name not in fields]
        if missing or unknown:
            said = [f"missing {', '.join(missing)}"] if missing else []
            for name in unknown:
                near = difflib.get_close_matches(name, [f for f in fields if f not in header], n=1, cutoff=0.6)
                shown = repr(name[:40]) + ("..." if len(name) > 40 else "")  # a binary file's "column": a glimpse
                said.append(f"column {shown} is not read" + (f" (did you mean {near[0]!r}?)" if near else ""))
            if len(said) > 4:
                said[4:] = [f"and {len(said) - 4} more columns"]
            raise ValueError(f"{path}:1: the header must name the task's fields ({', '.join(spec.input_fields)}"
                             + (f"; optional: {', '.join(spec.optional_fields)}" if spec.optional_fields else "")
                             + f") and no others: {'; '.join(said)}")
        return _LazyRows(text, lambda line: _tsv_row(line, header, fields), skip=1)
    return _LazyRows(text, lambda line: not_utf8(line) or ({first: line} if line.strip() else BLANK))


def _lines(text: str) -> Iterator[str]:
    """`text`'s lines, one at a time. Lines end at "\\n" (or "\\r\\n") only: str.splitlines also splits at U+2028,
    form feeds and the like, which JSON and text hold inside a line (a JSON Lines line with a raw U+2028 became two
    bad lines, numbers drifted); the newline that ends the last line starts no line of its own. A file with no "\n"
    but a "\r" (an old Mac's line endings) has its lines end at "\r" (it was one long line)."""
    start, end = 0, len(text)
    newline = "\n" if "\n" in text or "\r" not in text else "\r"
    while start < end:
        stop = text.find(newline, start)
        stop = end if stop < 0 else stop
        yield text[start:stop].removesuffix("\r")
        start = stop + 1


class _LazyRows:
    """A file's (line number, row) pairs, built from its text each time they are iterated."""

    def __init__(self, text: str, row, skip: int = 0) -> None:
        self.text, self.row, self.skip = text, row, skip

    def __iter__(self) -> Iterator[tuple[int, dict | str]]:
        for number, line in enumerate(_lines(self.text), 1):
            if number > self.skip:
                yield number, self.row(line)


def _jsonl_row(line: str, fields, first: str) -> dict | str:
    if bad := not_utf8(line):
        return bad
    if not line.strip():
        return BLANK
    try:
        value = json.loads(line)
    except ValueError as err:
        return f"not JSON ({err})"
    except RecursionError:
        return "JSON nested too deeply to be an input"
    return _json_input(value, fields, first)


def _tsv_row(line: str, header: list[str], fields) -> dict | str:
    """One row per line (no quoting): its number is its line's."""
    if (bad := not_utf8(line)) or not line.strip():
        return bad or BLANK
    values = line.split("\t")
    if len(values) > len(header):  # a tab inside a text: what follows it would be dropped, unread
        return (f"{len(values)} tab-separated fields where the header names {len(header)}; a tab inside a text must "
                "be written as a space")
    row = dict(zip(header, values))
    return {f: row[f] for f in fields if row.get(f) is not None}


def _json_document(text: str) -> Any:
    """A .json file's text as one JSON array or object (None: it is not one, e.g. JSON Lines, or undecodable)."""
    start = text.lstrip()[:1]
    if start == "[" and (bad := next((i for i, c in enumerate(text) if "\udc80" <= c <= "\udcff"), None)) is not None:
        # an array cannot be read line by line: one error for the file, not "not JSON" on the lines around the byte
        raise ValueError(f"not UTF-8 text (byte 0x{ord(text[bad]) - 0xDC00:02x} on line {text.count(chr(10), 0, bad) + 1}"
                         "); a JSON array must be UTF-8: save it as UTF-8")
    if start not in ("[", "{") or not_utf8(text[:1_000_000]):
        return None
    try:
        value = json.loads(text)
    except ValueError as err:
        if start == "[":  # an array that does not parse (a trailing comma): one error, not "not JSON" per line
            raise ValueError(f"not a JSON array ({err}); give a valid array, or one JSON object per line") from None
        return None
    except RecursionError:
        return None
    return value if isinstance(value, (list, dict)) else None


def _json_input(value: Any, fields: tuple[str, ...], first: str) -> dict | str:
    """One input of a JSON file: an object keyed by the task's fields (a text: its first field's), or the error."""
    if isinstance(value, str):
        value = {first: value}
    if not isinstance(value, dict):
        return f"expected a text or an object keyed by {', '.join(fields)}, got {type(value).__name__}"
    unknown = sorted(map(str, set(value) - set(fields)))
    return f"unknown field(s) {', '.join(unknown)}; the task's: {', '.join(fields)}" if unknown else value


def not_utf8(line: str) -> str:
    """The error for a line read with errors="surrogateescape" that held bytes that are not UTF-8 ("": none)."""
    bad = next((i for i, c in enumerate(line) if "\udc80" <= c <= "\udcff"), None)
    return "" if bad is None else f"not UTF-8 text (byte 0x{ord(line[bad]) - 0xDC00:02x} at character {bad + 1})"


def check_data_file(path: Path, *, folder_ok: bool = False) -> None:
    """Refuse, before reading, what is not a regular file (a device such as /dev/zero, a pipe, a folder unless
    `folder_ok`: some tasks read a folder of texts) or is larger than BERT_ENGINE_MAX_FILE_MB, from the size
    the file system declares.

    Raises:
        ValueError: naming the file and the reason.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror or err})") from None
    limit = settings.get("BERT_ENGINE_MAX_FILE_MB")
    if stat.S_ISDIR(info.st_mode):
        if not folder_ok:
            raise ValueError(f"{path}: is a folder; give a file")
        total = 0  # a folder's files, all of them: what its reader may read
        for entry in path.rglob("*"):
            try:
                mode, size = (found := entry.stat()).st_mode, found.st_size
            except OSError as err:
                raise ValueError(f"{entry}: cannot be read ({err.strerror or err})") from None
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise ValueError(f"{entry}: not a regular file (a device or a pipe has no size to check)")
            total += size
            if total > limit * 1_000_000:
                raise ValueError(f"{path}: its files hold more than {limit:,} MB (BERT_ENGINE_MAX_FILE_MB)")
        return
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file (a device or a pipe has no size to check)")
    if info.st_size > limit * 1_000_000:
        size = f"{info.st_size:,} bytes" if info.st_size < 1_000_000 else f"{info.st_size / 1e6:,.1f} MB"
        raise ValueError(f"{path}: {size}, over the limit of {limit:,} MB (BERT_ENGINE_MAX_FILE_MB)")


def _predict_rows(task, predictor, rows, count: int, fixed: dict, options: dict, output: str | None) -> int:
    """Answer every row (`count` of them, blank lines left out), in order, as JSON Lines ({"line", "result"} or
    {"line", "error"}) on stdout or into `output`, with a progress bar on stderr. Under torchrun each process answers
    every WORLD_SIZE-th batch of 32 lines and the first writes them all, in order. Returns how many lines failed."""
    from .runtime.distributed import gather_objects, init_distributed, process_group

    dist_info = init_distributed("cpu" if predictor.device.type == "cpu" else None)
    with process_group(dist_info):
        try:
            answers, failed = _answer_rows(task, predictor, rows, count, fixed, options, dist_info.rank, dist_info.world,
                                           output if dist_info.world == 1 else None, progress=dist_info.is_main)
        except OSError as err:  # writing the answers (a full disk): the file is named, as a read error names its own
            if output and err.filename is None and not isinstance(err, BrokenPipeError):
                err.filename = output
            raise
        if dist_info.world == 1:
            return failed
        every = sorted((a for part in gather_objects(answers, dist_info) for a in part), key=lambda a: a["line"])
        if dist_info.is_main:
            with open(output, "w", encoding="utf-8") if output else contextlib.nullcontext(_answers_out()) as out:
                out.writelines(json.dumps(a, ensure_ascii=False, allow_nan=False) + "\n" for a in every)
        return sum("error" in a for a in every)


def _batches(rows: Iterable[tuple[int, dict | str]], rank: int, world: int) -> Iterator[list[tuple[int, dict | str]]]:
    """Every `world`-th batch of 32 rows from batch `rank`, blank lines left out, built as the rows are read."""
    batch: list[tuple[int, dict | str]] = []
    index = 0
    for number, row in rows:
        if row is BLANK:
            continue
        batch.append((number, row))
        if len(batch) == 32:
            if index % world == rank:
                yield batch
            batch, index = [], index + 1
    if batch and index % world == rank:
        yield batch


def _answer_rows(task, predictor, rows, count: int, fixed: dict, options: dict, rank: int, world: int,
                 output: str | None, *, progress: bool) -> tuple[list[dict], int]:
    """This process's share of the rows (every `world`-th batch of 32 lines from batch `rank`: the same
    batches as one process makes, so the answers are the same to the last digit): one-field tasks
    share batched passes (a batch with a bad line is answered line by line, so each line gets its own
    answer). With `world` 1 the answers stream to stdout or `output` and are not kept (a long file's answers
    need not fit in memory); under torchrun they are returned for the first process to write. Returns them
    and how many failed."""
    from .hookspecs import InputError
    from .progress import progress_bar
    from .runtime.inference import ResultNotJSON, can_batch, check_json_result

    spec, answered, failed = task.spec, [], 0
    batches = _batches(rows, rank, world)
    stream = world == 1
    # Answers and the bar on one terminal: each answer is written with the bar cleared and then redrawn below it,
    # not glued to the bar's line (a file or a pipe gets plain lines)
    beside_bar = stream and output is None and progress and _is_terminal(_answers_out()) and _is_terminal(sys.stderr)
    with (open(output, "w", encoding="utf-8") if output else contextlib.nullcontext(_answers_out())) as out, \
            progress_bar(total=count, file=sys.stderr, unit="line", desc=spec.name, disable=not progress) as bar:
        for lines in batches:
            chunk = [(n, {**fixed, **row} if isinstance(row, dict) else row) for n, row in lines]
            answers: list = [None] * len(chunk)
            good = [k for k, (_, row) in enumerate(chunk) if isinstance(row, dict)]
            if good and can_batch(spec, [chunk[k][1] for k in good]):
                _answer_batch(spec, predictor, chunk, good, answers, options)
            for k, (number, row) in enumerate(chunk):
                if answers[k] is None:
                    try:
                        if not isinstance(row, dict):
                            raise InputError(row)
                        answers[k] = {"result": predictor.predict(row, **options)["result"]}
                    except InputError as err:
                        answers[k] = {"error": str(err)}
                    except (Exception, SystemExit) as err:  # the task's own code failed on this line
                        if not _tasks_own(err):
                            raise
                        answers[k] = {"error": failed_task_message(task, err)}
                if "result" in answers[k]:
                    try:
                        check_json_result(spec.name, answers[k]["result"])
                    except ResultNotJSON as err:  # the plugin's fault, on this line: said there, the rest go on
                        answers[k] = {"error": failed_task_message(task, err)}
                answer = {"line": number, **answers[k]}
                failed += "error" in answer
                if not stream:
                    answered.append(answer)
                else:
                    if beside_bar and k == 0:
                        bar.clear()  # the bar's line emptied, the batch's answers written, the bar drawn below them
                    out.write(json.dumps(answer, ensure_ascii=False, allow_nan=False) + "\n")
            if stream:
                out.flush()
            bar.update(min(len(chunk) * world, count - bar.n))
            if beside_bar:
                bar.refresh()
    return answered, failed


# A batch whose predict_many names a bad line drops that line and runs again, at most this many times; then
# (or when the error names no line) the rest of the batch is answered line by line.
BATCH_RETRIES = 3


def _answer_batch(spec, predictor, chunk: list, good: list[int], answers: list, options: dict) -> None:
    """Fill `answers[k]` for the rows `good` of `chunk` through predict_many: a row whose inputs fail the
    predictor's checks gets its error, one that predict_many names by its position is left out, and the
    others are answered together. Rows left None are answered one by one by the caller."""
    from .hookspecs import InputError

    for k in good:
        try:
            predictor.check_inputs(chunk[k][1], {})
        except InputError as err:
            answers[k] = {"error": str(err)}
    field = spec.input_fields[0]
    # an empty line cannot join a batch (predict_in_batches refuses it): left to the caller from the start, so
    # five blank lines do not use up the retries
    pending = [k for k in good if answers[k] is None and isinstance(chunk[k][1].get(field), str)
               and chunk[k][1][field].strip()]
    for _ in range(BATCH_RETRIES + 1):
        if not pending:
            return
        try:
            texts = [chunk[k][1][field] for k in pending]
            for k, result in zip(pending, spec.predict_many(predictor, texts, **options)):
                answers[k] = {"result": result}
            return
        except InputError as err:
            if err.position is None or not 0 <= err.position < len(pending):
                return  # about no one line (an option): each line gets the error on its own
            pending.pop(err.position)  # left to the caller: alone, it gets the error a line of its own gets
        except (Exception, SystemExit) as err:  # the task's own code failed: each line says so on its own
            if not _tasks_own(err):
                raise
            return


def _training_config(args: argparse.Namespace, **fixed) -> TrainConfig:
    import dataclasses

    from .training.train_config import TrainConfig

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    if "options" in given:  # -o NAME=VALUE pairs, in order; a later one wins
        given["options"] = dict(given["options"])
    given.update(fixed)
    return TrainConfig.from_file(args.config, **given) if args.config else TrainConfig(**given)


def _run_training(job_factory, cfg, command: str, kind: str = "train") -> dict:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from .runtime.distributed import init_distributed, process_group
    from .training.loop import check_run_folder, train

    check_run_folder(Path(cfg.output_dir), cfg, kind)  # before the model loads: a refusal comes at once
    dist_info = init_distributed(cfg.device)
    with process_group(dist_info), logging_redirect_tqdm():  # log lines above the progress bar, not glued to it
        job = job_factory(cfg)
        return train(job, cfg, dist_info=dist_info, command=command)


def _train(args: argparse.Namespace) -> dict:
    from .training.jobs import TaskJob

    task = _task(args.task)
    cfg = _training_config(args, task=args.task)
    return _run_training(lambda c: TaskJob(task, c), cfg, args.typed)


def _pretrain(args: argparse.Namespace) -> dict:
    from .training.jobs import PretrainJob

    return _run_training(PretrainJob, _training_config(args), args.typed, "pretrain")


def _distill(args: argparse.Namespace) -> dict:
    from .training.distill import DistillJob

    task = _task(args.task)
    return _run_training(lambda c: DistillJob(task, c), _training_config(args, task=args.task), args.typed, "distill")


def _eval(args: argparse.Namespace) -> dict:
    from .runtime.inference import Predictor
    from .training.jobs import check_targets, evaluate_task, resolve_model_name

    task = _task(args.task)
    spec = task.spec
    if spec.read_data is None:
        raise ValueError(f"task {spec.name!r} declares no data reader; it cannot be evaluated from a file")
    check_data_file(Path(args.data), folder_ok=True)  # a task's reader may take a folder of texts
    try:
        examples = list(islice(spec.read_data(args.data, args.split), args.limit))
    except IsADirectoryError:
        raise ValueError(f"{args.data}: is a folder; task {spec.name!r} reads its data from a file") from None
    except csv.Error as err:  # a task's reader meeting another format (a JSON file read as TSV), or a huge field
        raise ValueError(f"{args.data}: not task {spec.name!r}'s data format ({err})") from None
    except UnicodeDecodeError as err:
        if Path(args.data).is_dir():
            raise ValueError(f"{args.data}: a file in it is not UTF-8 text ({err.reason})") from None
        data = Path(args.data).read_bytes()  # within BERT_ENGINE_MAX_FILE_MB: checked above
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise ValueError(f"{args.data}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x})") from None
        raise
    if not examples:
        hint = ""
        if args.split != "all":  # a file of one split only (a fixture, a held-out file): say how to read it whole
            try:
                whole = sum(1 for _ in spec.read_data(args.data, "all"))
            except Exception:  # noqa: BLE001 - a reader without "all": no hint
                whole = 0
            hint = (f" (it holds {whole:,} example{'s' if whole != 1 else ''} of other splits: --split all reads "
                    "every one)") if whole else ""
        raise ValueError(f"{args.data}: no {args.split!r} examples for task {spec.name!r}{hint}")
    model = args.model or spec.default_checkpoint
    predictor = Predictor.load(task, resolve_model_name(model) if model in (None, "default") else model,
                               revision=args.revision, precision=_precision(args))
    options = _parse_options(args.option)
    head = getattr(predictor.model, "head", None)
    check_targets(spec, getattr(head, "labels", None), examples, args.data)  # an unknown label: named, not a crash
    metrics = evaluate_task(spec, predictor, examples, progress=True, **options)
    return {"task": spec.name, "data": args.data, "split": args.split, "examples": len(examples),
            "metrics": metrics, "model": predictor.provenance()}


def _pack(args: argparse.Namespace) -> dict:
    from .shipping.pack import pack

    return pack(_task(args.task), args.run_dir, args.to, checkpoint=args.checkpoint, eval_data=args.eval_data,
                eval_splits=args.eval_split, eval_limit=args.eval_limit, command_line=args.command_line,
                adapter_dtype=args.adapter_dtype, adapter_rank=args.adapter_rank,
                options=_parse_options(args.option))


def _parse_options(items: list[str]) -> dict:
    try:
        return dict(_one_option(item) for item in items)
    except argparse.ArgumentTypeError as err:
        raise ValueError(str(err)) from None


def _one_option(item: str) -> tuple[str, object]:
    """NAME=VALUE, the value read as JSON (numbers, true, lists) or else kept as a bare word."""
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--option {item!r}: expected NAME=VALUE")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value  # a bare word, e.g. long_input=windows


def _add_training_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field (--batch-size for batch_size), help from the field's metadata."""
    import dataclasses
    import typing

    from .training.train_config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    parser.add_argument("--config", default=None, help="a JSON or YAML file of these settings; flags override it")
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        text = f.metadata.get("help", "")
        if "(default" not in text:  # a help that names its default in words keeps only those
            text = f"{text} (default: {f.default})"
        if typing.get_origin(kind) is dict:
            parser.add_argument("-o", "--option", dest=f.name, action="append", type=_one_option,
                                default=argparse.SUPPRESS, help=f.metadata.get("help", ""))
        elif base is bool:
            parser.add_argument(flag, dest=f.name, action="store_true", default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(flag, dest=f.name, type=base, default=argparse.SUPPRESS, help=text)


def _seconds(text: str) -> float:
    """argparse type: a time limit in seconds, a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def _at_least_one(text: str) -> int:
    """argparse type: a whole number of 1 or more (a count of examples, a rank)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bert-engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    from .version import __version__  # noqa: PLC0415 - a constant; --help stays free of torch

    parser.add_argument("--version", action="version", version=f"bert-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: the offline MiniLM)")
    common.add_argument("--revision", default=None, help="Hub branch, tag or commit")
    info = sub.add_parser("info", parents=[common], help="load a checkpoint and describe it")
    info.add_argument("--head", default=None, help="head to load (mlm, sequence, token, span, auto, ...)")
    info.add_argument("--task", default=None, help="load the model with this task's own head (e.g. ner: its CRF); "
                      "a folder whose manifest.json names a task loads with it when --head is not given")
    info.add_argument("--kernels", action="store_true", help="also the matmul kernel BERT_ENGINE_KERNELS=auto gives each "
                      "projection on this machine (oneDNN packed, MKL plain or bert_engine's tiled AVX2 kernel; for short "
                      "and long inputs; shown whatever BERT_ENGINE_KERNELS is set to) and their timings, and whose "
                      "int8 matmuls --precision int8 runs (BERT_ENGINE_INT8_KERNEL)")
    info.set_defaults(run=_info)
    encode = sub.add_parser("encode", parents=[common], help="tokenise and encode texts; mean-pooled vectors")
    encode.add_argument("text", nargs="+")
    encode.set_defaults(run=_encode)
    predict = sub.add_parser("predict", help="run a task and print its result with provenance as JSON")
    predict.add_argument("task", help="task name, e.g. sentiment (`bert-engine plugins` lists each task's fields "
                                      "and options)")
    predict.add_argument("--input", "-i", action="append", default=[], metavar="FIELD=TEXT",
                         help="an input field, e.g. -i text='great movie' (repeat for several fields); with --file, a "
                              "field the lines leave out, the same for every line")
    predict.add_argument("--input-file", action="append", default=[], metavar="FIELD=PATH",
                         help="an input field's text read from a file (- for standard input), e.g. --input-file "
                              "text=article.txt for a document too long for the command line; as -i otherwise")
    predict.add_argument("--file", help="many inputs: .jsonl (objects keyed by the task's fields), .json (an array "
                                        "of them, numbered 1, 2, ... in the answers), .tsv (a header naming them, and no "
                                        "other columns) or plain text (one input per line for the first field); "
                                        "- reads standard input (plain text unless --format says); "
                                        "answers stream as JSON Lines, exit code 1 if any line failed")
    predict.add_argument("--format", choices=FORMATS, default=None,
                         help="how --file is written (default: its suffix says; plain text for another suffix or -)")
    predict.add_argument("--output", help="with --file: write the JSON Lines here instead of stdout; under "
                                          "torchrun the processes share the lines and the first writes them, in order")
    predict.add_argument("--option", "-o", action="append", default=[], metavar="NAME=VALUE",
                         help="a task option, JSON-parsed when possible, e.g. -o top_k=2")
    predict.add_argument("--model", default=None, help="checkpoint folder or Hub id (default: the task's)")
    predict.add_argument("--revision", default=None)
    predict.add_argument("--precision", default=None, help=f"{PRECISIONS} (default: BERT_ENGINE_PRECISION, else auto); "
                         + PRECISION_HELP)
    predict.set_defaults(run=_predict)
    train = sub.add_parser("train", help="fine-tune a registered task (built-in or plugin); works under torchrun",
                           description="Fine-tune TASK's head on a checkpoint, optionally with LoRA adapters.")
    train.add_argument("task", help="task name, e.g. sentiment, ner, qa, summary, fill_mask")
    from .training.train_config import DISTILL_ONLY, NOT_FOR_DISTILL, PRETRAIN_ONLY  # noqa: PLC0415 - a light module

    _add_training_flags(train, skip=("task", *PRETRAIN_ONLY, *DISTILL_ONLY))
    train.set_defaults(run=_train)
    pretrain = sub.add_parser("pretrain", help="masked-LM pretraining (+ next-sentence or sentence-order) on raw text; "
                                               "works under torchrun",
                              description="Pretrain BERT, RoBERTa, ALBERT or DistilBERT on text documents (a file or "
                                          "folder; blank lines separate documents), from a size preset or from a "
                                          "checkpoint, with the family's objective: MLM + NSP (BERT), MLM + SOP "
                                          "(ALBERT), MLM only (RoBERTa, DistilBERT).")
    _add_training_flags(pretrain, skip=("task", *DISTILL_ONLY))
    pretrain.set_defaults(run=_pretrain)
    distill = sub.add_parser("distill", help="distil a fine-tuned task model into a smaller student (DistilBERT-style)",
                             description="Train a student with fewer layers (from every other teacher layer) on "
                                         "TASK's data with the teacher's soft targets, the task loss and a "
                                         "hidden-state cosine loss; saves a plain checkpoint of the teacher's family.")
    distill.add_argument("task", help="task name, e.g. sentiment, ner, qa")
    _add_training_flags(distill, skip=("task", *PRETRAIN_ONLY, *NOT_FOR_DISTILL))
    distill.set_defaults(run=_distill)
    evaluate = sub.add_parser("eval", help="score a checkpoint on a task's data with the task's standard metrics")
    evaluate.add_argument("task", help="task name")
    evaluate.add_argument("--data", required=True, help="data file in the task's format (e.g. eng.testb, dev-v1.1.json)")
    evaluate.add_argument("--split", default="test", help="split of the file, for files holding several (default: test)")
    evaluate.add_argument("--limit", type=_at_least_one, default=None, help="evaluate only the first N examples")
    evaluate.add_argument("--model", default=None, help="checkpoint folder, adapter folder or Hub id (default: the task's)")
    evaluate.add_argument("--revision", default=None)
    evaluate.add_argument("--precision", default=None, help=f"{PRECISIONS} (default: BERT_ENGINE_PRECISION, else "
                          "auto); " + PRECISION_HELP)
    evaluate.add_argument("--option", "-o", action="append", default=[], metavar="NAME=VALUE", help="a task option")
    evaluate.set_defaults(run=_eval)
    pack = sub.add_parser("pack", help="copy a LoRA run's best adapter + head into a starter folder, "
                                       "evaluate it and write manifest.json")
    pack.add_argument("task")
    pack.add_argument("--run", dest="run_dir", required=True, help="the training output_dir (its best/ is packed, or --checkpoint last), or a packed folder to pack "
                      "again with its training record (re-evaluated, options re-tuned)")
    pack.add_argument("--checkpoint", choices=("best", "last"), default="best",
                      help="which of the run's checkpoints to pack: best/ (its own evaluations' best, the default) or "
                           "last/ (the end of the schedule, e.g. where those evaluations are a small noisy slice)")
    pack.add_argument("--to", required=True, help="destination folder, e.g. plugins/starter/sentiment")
    pack.add_argument("--eval-data", action="append", default=[], help="data to report metrics on (repeatable)")
    pack.add_argument("--eval-split", action="append", default=[],
                      help="the split of the data (default: test); once for all --eval-data, or once per --eval-data, "
                           "in the same order (e.g. Gutenberg's test split, then all of WikiText-2's test file)")
    pack.add_argument("--eval-limit", type=_at_least_one, default=None, help="evaluate on only the first N examples")
    pack.add_argument("--command-line", default="", help="the training command, recorded in the manifest (default: "
                      "the bert-engine command lines the run's run.json lists)")
    pack.add_argument("--adapter-dtype", choices=("fp32", "fp16"), default="fp32",
                      help="store the adapter's tensors in this precision (fp16: half the size; evaluated as stored)")
    pack.add_argument("--adapter-rank", type=_at_least_one, default=None, metavar="K",
                      help="store the adapter at a lower rank K: each LoRA delta cut to its best rank-K approximation "
                           "(truncated SVD; evaluated as stored, the trained rank and the energy kept in the manifest)")
    pack.add_argument("--option", "-o", action="append", default=[], metavar="NAME=VALUE",
                      help="a task option tuned for this model: evaluated with and stored in the manifest, so the "
                           "tab and the API use it by default (repeatable)")
    pack.set_defaults(run=_pack)
    push = sub.add_parser("push", help="upload a trained model or adapter to the Hub with a generated model card")
    push.add_argument("--run", dest="run_dir", required=True,
                      help="a training output folder (its best/ is pushed), a packed folder or a model folder")
    push.add_argument("--repo", required=True, help="the Hub repository, owner/name (created if missing)")
    push.add_argument("--task", default=None, help="the task, where the folder does not record it")
    push.add_argument("--token", default=None, help="a Hub token with write access (default: HF_TOKEN or the login)")
    push.add_argument("--private", action="store_true", help="create the repository private")
    push.add_argument("--revision", default=None, help="the branch to commit to (default: main)")
    push.add_argument("--message", default=None, help="the commit message")
    push.add_argument("--license", default="apache-2.0", help="the licence in the card (default apache-2.0, the "
                                                              "MiniLM base model's)")
    push.add_argument("--endpoint", default=None, help="the Hub URL (default: HF_ENDPOINT or huggingface.co)")
    push.add_argument("--dry-run", metavar="FOLDER", default=None,
                      help="stage into FOLDER (card included, load-checked) and upload nothing")
    push.set_defaults(run=_push)
    plugins = sub.add_parser("plugins", help="loaded task plugins (name, version, tasks), each task's input fields "
                                             "and options, and failures, as JSON")
    plugins.add_argument("--smoke", action="store_true",
                         help="also load each task's default model and run its first example; failures and hangs "
                              "are listed (stage 'request') and the exit code is 1")
    plugins.add_argument("--timeout", type=float, default=120.0, help="seconds per task for --smoke (default 120)")
    plugins.set_defaults(run=_plugins)
    plugin = sub.add_parser("plugin", help="plugin tools")
    plugin_sub = plugin.add_subparsers(dest="plugin_command", required=True)
    check = plugin_sub.add_parser("check", help="load one plugin alone and run the conformance kit on its tasks")
    check.add_argument("name", help="plugin name (a built-in module or an entry-point name)")
    check.add_argument("--data", help="a few examples in the task's read_data format: also check training "
                                      "(read_data -> training batch -> loss with a gradient -> metric)")
    check.add_argument("--split", default=None, help="the split of --data to read (default: train)")
    check.add_argument("--case-timeout", type=_seconds, default=60.0,
                       help="seconds each case (prediction, tab event, training check) may take (default 60)")
    check.set_defaults(run=_plugin_check)
    _verbose_anywhere(parser)
    return parser


def _verbose_anywhere(parser: argparse.ArgumentParser) -> None:
    """-v after a subcommand too (`bert-engine info --kernels -v`), not only before it; where it is not
    given, the top-level value stands (SUPPRESS: a subcommand leaves it unset)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if "-v" not in child._option_string_actions:
                    child.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                       help="log at INFO level")
                _verbose_anywhere(child)


def _precision(args) -> str:
    """A command's --precision, else BERT_ENGINE_PRECISION's, checked as the app checks it, so that a refusal names
    the variable (it was "precision 'fp8' is not one of ..." with nothing pointing at the environment)."""
    if args.precision:
        return args.precision
    from .runtime.precision import setting_precision  # noqa: PLC0415 - torch loads with it, after parsing

    return setting_precision()


def _said(err: BaseException) -> str:
    """An error as one line: the OS's ("[Errno 2] No such file or directory: 'nope.tsv'") as the file, then why in
    the words the other errors use ("nope.tsv: no such file or directory")."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror and not isinstance(err, BrokenPipeError):
        return f"{err.filename}: {err.strerror[:1].lower()}{err.strerror[1:]}"
    return str(err)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # --help and usage errors end here, before torch loads
    args.typed = shlex.join(["bert-engine", *(sys.argv[1:] if argv is None else argv)])  # recorded by training
    from .checkpoints.hub import HubError, default_backbone
    from .checkpoints.loading import CheckpointError

    try:
        settings.check_all()  # a BERT_ENGINE_* value of the wrong type: one line naming it, before any work
    except ValueError as err:
        print(f"bert-engine {args.command}: error: {err}", file=sys.stderr)
        return 2
    verbose = args.verbose or args.command in ("train", "pretrain")  # training reports its progress
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "model", "unset") is None and (args.command == "encode"
                                                     or (args.command == "info" and args.task is None)):
        args.model = default_backbone()
    # While the command runs, whatever code prints (a plugin's print, a library's banner, a subprocess) goes to
    # stderr: stdout carries the command's JSON alone, which scripts parse.
    try:
        with _stdout_for_answers():
            result = args.run(args)
    except (HubError, CheckpointError, ValueError, TypeError, FileNotFoundError) as err:  # the input's fault
        print(f"bert-engine {args.command}: error: {_said(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `bert-engine predict --file ... | head`: the reader left early; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor is the flush at exit
        return getattr(args, "exit_code", 0)
    except (TaskFailed, OSError) as err:  # a plugin's bug, or the machine's (a read-only folder, a full disk)
        print(f"bert-engine {args.command}: error: {_said(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what the command saved on the way out it has logged already
        print(f"bert-engine {args.command}: interrupted", file=sys.stderr)
        return 130
    if os.environ.get("RANK", "0") != "0" or result is None:  # torchrun: the first process reports; None:
        return getattr(args, "exit_code", 0)                      # the command wrote its own output
    try:
        text = json.dumps(result, indent=2, ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN is not JSON: a reader would choke on what we print
        print(f"bert-engine {args.command}: error: the result holds NaN or infinity (the model overflowed at this "
              "precision, or its weights are broken); nothing printed", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `bert-engine ... | head`: the reader left; that is not an error
        sys.stdout = open(os.devnull, "w")
    return getattr(args, "exit_code", 0)


if __name__ == "__main__":
    sys.exit(main())
