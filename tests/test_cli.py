"""`bert-engine` subcommands: JSON on stdout, clear errors with exit code 2."""

import json
import os
from pathlib import Path

import pytest
from conftest import reference_checkpoint

from bert_engine.cli import main


@pytest.fixture(scope="module")
def sentiment_checkpoint(tmp_path_factory):
    return reference_checkpoint(tmp_path_factory.mktemp("cli"), "BertForSequenceClassification",
                                id2label={0: "NEGATIVE", 1: "POSITIVE"})


def test_predict_prints_result_with_provenance(sentiment_checkpoint, capsys):
    assert main(["predict", "sentiment", "-i", "text=a gorgeous movie", "-o", "top_k=1",
                 "--model", str(sentiment_checkpoint)]) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["task"] == "sentiment" and len(output["result"]["labels"]) == 1
    assert output["provenance"]["model"] == str(sentiment_checkpoint)


def test_predict_file_streams_json_lines(sentiment_checkpoint, tmp_path, capsys):
    lines = tmp_path / "texts.txt"
    lines.write_text("a gorgeous movie\nterrible and dull\nfine\n")
    assert main(["predict", "sentiment", "--file", str(lines), "--model", str(sentiment_checkpoint)]) == 0
    captured = capsys.readouterr()
    answers = [json.loads(line) for line in captured.out.splitlines()]
    assert [a["line"] for a in answers] == [1, 2, 3] and all("label" in a["result"] for a in answers)
    assert "3 of 3 lines answered, 0 failed" in captured.err


def test_predict_file_takes_pairs_as_jsonl_or_tsv_and_fails_on_any_bad_line(tmp_path, capsys):
    context = "Moby-Dick was written by Herman Melville."
    jsonl = tmp_path / "questions.jsonl"
    jsonl.write_text("\n".join([json.dumps({"question": "Who wrote it?", "context": context}),
                                "not json", json.dumps({"question": "Who?", "contxt": context}),
                                json.dumps({"question": "What was written?", "context": context})]) + "\n")
    out = tmp_path / "answers.jsonl"
    assert main(["predict", "qa", "--file", str(jsonl), "--output", str(out)]) == 1
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["line"] for a in answers] == [1, 2, 3, 4]
    assert answers[0]["result"]["answer"] == "Herman Melville" and "result" in answers[3]
    assert answers[1]["error"].startswith("not JSON") and "unknown field(s) contxt" in answers[2]["error"]
    assert "2 of 4 lines answered, 2 failed" in capsys.readouterr().err
    tsv = tmp_path / "questions.tsv"
    tsv.write_text(f"question\tcontext\nWho wrote it?\t{context}\n")
    assert main(["predict", "qa", "--file", str(tsv)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["line"] == 2  # the header is line 1
    tsv.write_text("query\tcontext\nWho?\tx\n")
    assert main(["predict", "qa", "--file", str(tsv)]) == 2
    assert "questions.tsv:1: the header must name the task's fields (question, context) and no others: missing " \
        "question; column 'query' is not read" in capsys.readouterr().err


def test_predict_file_names_a_too_deep_line_and_reads_a_byte_order_mark(tmp_path, capsys):
    """A line of 100,000 nested brackets is that line's error, not a traceback; a UTF-8 BOM (Excel's
    export) before a TSV header is not part of the first field's name."""
    jsonl = tmp_path / "deep.jsonl"
    jsonl.write_text("[" * 100_000 + "\n" + json.dumps({"question": "Who wrote it?",
                                                      "context": "It was written by Herman Melville."}) + "\n")
    out = tmp_path / "answers.jsonl"
    assert main(["predict", "qa", "--file", str(jsonl), "--output", str(out)]) == 1
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert answers[0] == {"line": 1, "error": "JSON nested too deeply to be an input"} and "result" in answers[1]
    assert "Traceback" not in capsys.readouterr().err
    tsv = tmp_path / "excel.tsv"
    tsv.write_bytes("\ufeffquestion\tcontext\nWho wrote it?\tIt was written by Herman Melville.\n".encode())
    assert main(["predict", "qa", "--file", str(tsv)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["result"]["answer"] == "Herman Melville"


def test_predict_qa_with_two_fields(capsys):
    assert main(["predict", "qa", "-i", "question=Who wrote it?", "-i",
                 "context=Moby-Dick was written by Herman Melville.", "-o", "top_k=2"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    assert len(result["answers"]) == 2 and "null_gap" in result["no_answer"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predict", "nope", "-i", "text=x"], "no task named 'nope'"),
        (["predict", "sentiment", "-i", "txt=x"], "expected FIELD=TEXT with FIELD one of text, text_pair"),
        (["predict", "fill_mask", "-i", "text=no mask"], "has no [MASK] token"),
        (["info", "--model", "/does/not/exist"], "neither an existing folder nor a Hub id"),
        # the OS's errors read as the others do, the file first (it was "[Errno 2] No such file or directory: ...")
        (["train", "sentiment", "--train-file", "/does/not/exist.tsv"], "/does/not/exist.tsv: no such file or directory"),
        (["predict", "sentiment", "--file", __file__, "--output", "/does/not/x.jsonl"],
         "--output '/does/not/x.jsonl': there is no folder '/does/not' to write it in"),
        (["info", "--head", "foo"], "choose one of mlm, nsp, pretraining, sequence, span, token, or auto"),
    ],
)
def test_errors_are_one_clear_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_builtins_are_listed(capsys):
    assert main(["plugins"]) == 0
    import plugins

    listed = json.loads(capsys.readouterr().out)
    names = [p["name"] for p in listed["plugins"]]
    builtins = [module.rsplit(".", 1)[-1] for module in plugins.BUILTIN]  # the tab order plugins/ declares
    assert names[:len(builtins)] == builtins
    # what predict's -i and -o take, per task
    assert listed["tasks"]["qa"]["fields"] == ["question", "context"] and "no_answer" in listed["tasks"]["qa"]["options"]
    assert listed["tasks"]["sentiment"]["optional_fields"] == ["text_pair"]
    assert "text-classification" in listed["tasks"]["sentiment"]["aliases"]


def test_a_result_holding_nan_is_an_error_not_invalid_json(tmp_path, capsys):
    """Finite weights can still overflow: a LayerNorm scale of 3e38 turns the embeddings into inf/NaN.
    NaN is not JSON, so nothing is printed and the error says why."""
    from safetensors.torch import load_file, save_file

    folder = reference_checkpoint(tmp_path / "overflows", "BertModel")
    state = load_file(folder / "model.safetensors")
    name = next(k for k in state if k.endswith("embeddings.LayerNorm.weight"))
    state[name] *= 3e38
    save_file(state, folder / "model.safetensors")
    assert main(["encode", "--model", str(folder), "hello world"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "the result holds NaN or infinity" in captured.err


@pytest.mark.parametrize("command", [[], ["train"], ["predict"], ["pretrain"], ["plugin", "check"]])
def test_help_loads_no_torch(command):
    """`--help` stays light: no torch, Gradio or Hub client imported (0.12 s instead of 2 s on a 2-core
    EPYC; timings are not asserted, what gets imported is)."""
    import subprocess
    import sys

    probe = ("import sys\nfrom bert_engine.cli import main\ntry:\n    main(sys.argv[1:] + ['--help'])\n"
             "except SystemExit:\n    pass\nprint(sorted(m for m in ('torch', 'gradio', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]


def test_a_bad_line_in_a_batched_file_gets_its_own_error(sentiment_checkpoint, tmp_path, capsys):
    lines = tmp_path / "texts.txt"
    lines.write_bytes(b"a gorgeous movie\nbad \xff byte\nterrible and dull\n")  # (a blank line is skipped, not bad)
    assert main(["predict", "sentiment", "--file", str(lines), "--model", str(sentiment_checkpoint)]) == 1
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert ["result" in a for a in answers] == [True, False, True] and "not UTF-8" in answers[1]["error"]


def test_predict_file_under_torchrun_gives_the_single_process_output(sentiment_checkpoint, tmp_path):
    """Two gloo processes share the lines (whole batches each) and the first writes them in order:
    the file equals one process's, to the last digit."""
    import os
    import socket
    import subprocess
    import sys

    lines = tmp_path / "texts.txt"
    lines.write_bytes("".join(f"review {i}: {'great' if i % 3 else 'dull'} film{' really' * (i % 7)}\n"
                              for i in range(75)).encode() + b"bad \xff\n")  # 76 lines: 3 batches of 32, one bad line
    single, shared = tmp_path / "single.jsonl", tmp_path / "shared.jsonl"
    command = ["-m", "bert_engine", "predict", "sentiment", "--file", str(lines), "--model", str(sentiment_checkpoint)]
    # One kernel for every process: a kernel choice timed while the machine is busy (a test run beside it) is timed
    # again at the next loads and may differ between the processes, and with it the last digits
    pinned = {**os.environ, "BERT_ENGINE_KERNELS": "packed"}
    one_thread = {**pinned, "OMP_NUM_THREADS": "1"}  # as torchrun sets for each process: the same arithmetic
    assert subprocess.run([sys.executable, *command, "--output", str(single)], capture_output=True,
                          env=one_thread).returncode == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(port), *command, "--output", str(shared)],
                          capture_output=True, text=True, timeout=300, env=pinned)
    assert done.returncode != 0 and "75 of 76 lines answered, 1 failed" in done.stderr, done.stderr[-2000:]
    assert shared.read_text() == single.read_text() and len(single.read_text().splitlines()) == 76


def test_info_loads_a_task_model_with_its_task_head(capsys):
    """`bert-engine info --model plugins/starter/ner` was refused: the adapter's head is NER's (a CRF over
    token logits), which no --head kind builds (`--head token` was refused too). A folder whose manifest
    names a registered task now loads with that task's head; --task says it for any folder."""
    from pathlib import Path

    starter = Path(__file__).resolve().parents[1] / "plugins" / "starter" / "ner"
    assert main(["info", "--model", str(starter)]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["task"] == "ner" and found["head"] == "token" and found["config"]["num_hidden_layers"] == 6
    assert main(["info", "--task", "ner", "--model", str(starter)]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == found["parameters"]
    assert main(["info", "--task", "ner", "--head", "token", "--model", str(starter)]) == 2
    assert "--task 'ner' loads that task's own head; leave out --head 'token'" in capsys.readouterr().err
    assert main(["info", "--task", "no_such_task"]) == 2
    assert "no task named 'no_such_task'" in capsys.readouterr().err


def test_info_on_an_adapter_folder_without_a_head_says_which_task_and_how_to_load_it(tmp_path, capsys, caplog):
    """An adapter folder whose manifest names no registered task, without --head: the refusal says how to
    load it (--head takes head kinds: sequence, token, ...; not task names)."""
    import shutil
    from pathlib import Path

    starter = Path(__file__).resolve().parents[1] / "plugins" / "starter" / "ner"
    copy = tmp_path / "adapter"
    copy.mkdir()
    shutil.copy(starter / "adapter_config.json", copy)
    (copy / "manifest.json").write_text(json.dumps({"task": "ner; rm -rf /"}))  # not a task name: not repeated
    assert main(["info", "--model", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "pass --head (one of mlm, nsp, pretraining, sequence, span, token; in Python, load(folder, head))" in err
    assert "rm -rf" not in err and "`bert-engine predict TASK --model FOLDER`" in err
    (copy / "manifest.json").write_text(json.dumps({"task": "parsing"}))  # a task no plugin registers
    assert main(["info", "--model", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "its manifest.json names task 'parsing', which no installed plugin registers" in caplog.text
    assert f"`bert-engine predict parsing --model {copy}` (its manifest says task 'parsing')" in err


def test_bad_lines_leave_the_rest_of_their_batch_batched(sentiment_checkpoint, tmp_path, capsys, monkeypatch):
    """A bad line in a batch of 32 (over the character limit) gets its own error; the others still share
    predict_many's passes, and answer as one text at a time does; blank lines are skipped (not inputs), their
    numbers left out, and nothing goes one by one."""
    from bert_engine.runtime import inference

    texts = [f"review {i}: {'great' if i % 3 else 'dull'} film" for i in range(32)]
    texts[5], texts[20] = "   ", "x" * (inference.MAX_INPUT_CHARS + 1)
    texts[9] = texts[11] = texts[13] = texts[15] = " "  # more blank lines than the retries: still one batch
    lines = tmp_path / "texts.txt"
    lines.write_text("\n".join(texts) + "\n")
    alone = []
    original = inference.Predictor.predict
    monkeypatch.setattr(inference.Predictor, "predict", lambda self, inputs, **o: alone.append(inputs) or original(self, inputs, **o))
    assert main(["predict", "sentiment", "--file", str(lines), "--model", str(sentiment_checkpoint)]) == 1
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["line"] for a in answers] == [n for n in range(1, 33) if n not in (6, 10, 12, 14, 16)]
    by_line = {a["line"]: a for a in answers}
    assert [n for n, a in by_line.items() if "error" in a] == [21] and "characters" in by_line[21]["error"]
    assert alone == []  # nothing went one by one
    answers = [by_line.get(n, {}) for n in range(1, 33)]  # (indexed by line again, for the comparison below)
    monkeypatch.setattr(inference.Predictor, "predict", original)
    assert main(["predict", "sentiment", "--input", f"text={texts[7]}", "--model", str(sentiment_checkpoint)]) == 0
    alone_result = json.loads(capsys.readouterr().out)["result"]  # within float rounding: a batch's padded shape
    assert alone_result["label"] == answers[7]["result"]["label"]  # takes other matmul blockings than one text
    assert alone_result["logits"] == pytest.approx(answers[7]["result"]["logits"], abs=1e-4)


def test_input_files_are_checked_before_reading_and_bad_bytes_fail_their_line_only(sentiment_checkpoint, tmp_path,
                                                                                    capsys, monkeypatch):
    """/dev/zero (no size to check, no end) and a folder are refused before any reading; a file over
    BERT_ENGINE_MAX_FILE_MB is refused from its size; a line with a byte that is not UTF-8 gets its own error
    and the others are answered; `eval` names the line of a bad byte."""
    import os

    args = ["--model", str(sentiment_checkpoint)]
    if os.path.exists("/dev/zero"):
        assert main(["predict", "sentiment", "--file", "/dev/zero", *args]) == 2
        assert "/dev/zero: not a regular file" in capsys.readouterr().err
        assert main(["eval", "sentiment", "--data", "/dev/zero", *args]) == 2
        assert "/dev/zero: not a regular file" in capsys.readouterr().err
    assert main(["predict", "sentiment", "--file", str(tmp_path), *args]) == 2
    assert "is a folder" in capsys.readouterr().err
    big = tmp_path / "big.txt"
    big.write_bytes(b"fine\n" * 300_000)  # 1.5 MB
    monkeypatch.setenv("BERT_ENGINE_MAX_FILE_MB", "1")
    assert main(["predict", "sentiment", "--file", str(big), *args]) == 2
    assert "big.txt: 1.5 MB, over the limit of 1 MB (BERT_ENGINE_MAX_FILE_MB)" in capsys.readouterr().err
    monkeypatch.setenv("BERT_ENGINE_MAX_FILE_MB", "0")  # (a small file said "0 MB; the limit is 0 MB")
    small = tmp_path / "small.txt"
    small.write_text("fine\n")
    assert main(["predict", "sentiment", "--file", str(small), *args]) == 2
    assert "small.txt: 5 bytes, over the limit of 0 MB (BERT_ENGINE_MAX_FILE_MB)" in capsys.readouterr().err
    monkeypatch.delenv("BERT_ENGINE_MAX_FILE_MB")
    mixed = tmp_path / "mixed.txt"
    mixed.write_bytes(b"a gorgeous movie\nbad \xff byte\nterrible and dull\n")
    for name in ("mixed.txt", "mixed.jsonl"):
        path = tmp_path / name
        path.write_bytes(mixed.read_bytes() if name.endswith(".txt")
                         else b'"a gorgeous movie"\n"bad \xff byte"\n\n"terrible and dull"\n')
        assert main(["predict", "sentiment", "--file", str(path), *args]) == 1
        captured = capsys.readouterr()
        answers = [json.loads(line) for line in captured.out.splitlines()]
        assert "not UTF-8 text (byte 0xff at character" in answers[1]["error"]
        assert "result" in answers[0] and "result" in answers[-1]
        if name.endswith(".jsonl"):  # a blank line is no input: skipped (the summary counts it)
            assert [a["line"] for a in answers] == [1, 2, 4]
            assert "2 of 3 lines answered, 1 failed, 1 blank line skipped" in captured.err
    tsv = tmp_path / "dev.tsv"
    tsv.write_bytes(b"sentence\tlabel\na fine film\t1\nbad \xff\t0\n")
    assert main(["eval", "sentiment", "--data", str(tsv), *args]) == 2
    assert "dev.tsv:3: not UTF-8 text (byte 0xff)" in capsys.readouterr().err


def test_eval_still_reads_a_folder_of_texts(tmp_path, capsys):
    """fill-mask's reader takes a folder of plain text: the input-file checks let a folder through for eval."""
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text(("The old man walked to the market every morning and bought bread. " * 20 + "\n\n") * 3)
    assert main(["eval", "fill_mask", "--data", str(books), "--split", "all", "--limit", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["examples"] == 2
    # ... but not for a task that reads a file, and a folder's files count against BERT_ENGINE_MAX_FILE_MB
    assert main(["eval", "sentiment", "--data", str(books)]) == 2
    assert "is a folder; task 'sentiment' reads its data from a file" in capsys.readouterr().err
    with open(books / "sparse.txt", "wb") as handle:  # 3 GB declared, nothing written
        handle.truncate(3_000_000_000)
    assert main(["eval", "fill_mask", "--data", str(books), "--split", "all"]) == 2
    assert "its files hold more than 1,024 MB" in capsys.readouterr().err


def test_lines_end_at_newlines_only_and_keep_their_numbers(sentiment_checkpoint, tmp_path, capsys):
    """A raw U+2028 inside a JSON string, a form feed inside a text line and a blank TSV row: each line is one
    input with its own number (str.splitlines split the first two; csv skipped the blank row silently). A blank
    line is no input: skipped, keeping the others' numbers, and said in the summary (it failed the run)."""
    args = ["--model", str(sentiment_checkpoint)]
    cases = {"a.jsonl": ('{"text": "good film\u2028really"}\n"awful"\n', [1, 2], 0),
             "b.txt": ("good\x0cfilm\r\nbad film\n  \nawful\n", [1, 2, 4], 1),
             "c.tsv": ("text\nfine film\n\nbad film\n", [2, 4], 1),
             "d.txt": ("good film\rbad film\r\rawful\r", [1, 2, 4], 1)}  # bare CRs: an old Mac's line ends
    for name, (content, lines, blank) in cases.items():
        path = tmp_path / name
        path.write_text(content, encoding="utf-8", newline="")
        assert main(["predict", "sentiment", "--file", str(path), *args]) == 0, name
        captured = capsys.readouterr()  # (once: out and err together)
        answers = [json.loads(line) for line in captured.out.splitlines()]
        assert all("result" in a for a in answers) and [a["line"] for a in answers] == lines, (name, answers)
        assert (f"{len(lines)} of {len(lines)} lines answered, 0 failed, 1 blank line skipped" in captured.err) == \
            bool(blank), captured.err


def test_pack_does_not_replace_a_pack_of_another_task(tmp_path, capsys):
    import shutil

    from plugins.starter import STARTER_ROOT

    target = tmp_path / "ner-pack"
    shutil.copytree(STARTER_ROOT / "ner", target)
    before = sorted(p.name for p in target.iterdir())
    assert main(["pack", "sentiment", "--run", str(STARTER_ROOT / "sentiment"), "--to", str(target)]) == 2
    assert "holds a pack of task 'ner', not 'sentiment'" in capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == before


@pytest.mark.parametrize("argv, message", [
    (["eval", "sentiment", "--data", "x.tsv", "--limit", "-3"], "argument --limit: must be at least 1, got -3"),
    (["pack", "sentiment", "--run", "r", "--to", "t", "--eval-limit", "abc"],
     "argument --eval-limit: expected a whole number, got 'abc'"),
])
def test_counts_are_whole_numbers_of_one_or_more(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_eval_names_a_label_the_model_does_not_have(tmp_path, capsys):
    data = tmp_path / "bad.tsv"
    data.write_text("sentence\tlabel\ngood film\t7\n")
    assert main(["eval", "sentiment", "--data", str(data), "--split", "train"]) == 2  # was an IndexError traceback
    assert "example 1 has label 7, but the head's labels are ['NEGATIVE', 'POSITIVE']" in capsys.readouterr().err


def test_verbose_is_taken_before_or_after_the_subcommand():
    """`bert-engine -v info` and `bert-engine info -v` both log at INFO (a fresh-clone check typed the
    second and got a usage error); without it, neither does."""
    from bert_engine.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["-v", "info"]).verbose and parser.parse_args(["info", "--kernels", "-v"]).verbose
    assert parser.parse_args(["plugin", "check", "sentiment", "--verbose"]).verbose
    assert not parser.parse_args(["info"]).verbose and not parser.parse_args(["predict", "sentiment"]).verbose


def test_a_checkpoint_of_another_task_is_the_users_choice_not_a_plugin_bug(capsys):
    """NER's head refuses a sentiment model's labels with CheckpointError: the user picked the wrong model
    (exit 2, one line), not a bug in the NER plugin (exit 1) as it was reported before."""
    from plugins.starter import STARTER_ROOT

    assert main(["predict", "ner", "-i", "text=Angela Merkel", "--model", str(STARTER_ROOT / "sentiment")]) == 2
    err = capsys.readouterr().err
    assert "cannot be read as entity tags: tag 'NEGATIVE'" in err and "pick a token-classification (NER) checkpoint" in err
    assert "bug in plugin" not in err and len(err.strip().splitlines()) == 1


def test_the_cli_takes_the_task_names_pipeline_takes(capsys):
    text = "text=The council met on Monday. It approved the budget after a long debate. Schools get more money."
    assert main(["predict", "summarization", "-i", text]) == 0
    assert json.loads(capsys.readouterr().out)["task"] == "summary"
    assert main(["predict", "nosuch", "-i", "text=x"]) == 2
    assert "known: " in capsys.readouterr().err


def test_predict_arguments_that_would_be_dropped_are_refused_naming_them(tmp_path, capsys, caplog):
    """-i given twice kept the last, -i beside a file's own field was overridden by every line, --output without
    --file was ignored, --output naming a folder failed with a bare OSError, --revision on a folder was dropped."""
    lines = tmp_path / "lines.txt"
    lines.write_text("good\nbad\n")
    for argv, message in ((["-i", "text=a", "-i", "text=b"], "--input text= is given twice"),
                          (["--file", str(lines), "-i", "text=hi"], f"--input text= and the lines of {lines} both give text"),
                          (["--file", str(lines), "--output", str(tmp_path)], f"--output '{tmp_path}' is a folder"),
                          (["-i", "text=a", "--output", str(tmp_path / "x.jsonl")], "without --file the answer goes to stdout"),
                          (["--file", str(lines), "--output", str(tmp_path / "." / "lines.txt")],
                           "is the file --file reads"),
                          (["--file", str(lines), "--output", str(tmp_path / "hard-link.txt")], "is the file --file reads"),
                          (["--file", str(lines), "--output", ""], "--output is empty")):
        if "hard-link" in " ".join(argv):
            os.link(lines, tmp_path / "hard-link.txt")
        assert main(["predict", "sentiment", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert lines.read_text() == "good\nbad\n"  # (not replaced by its answers)
    context = "Moby-Dick was written by Herman Melville."
    contexts = tmp_path / "contexts.jsonl"
    contexts.write_text(json.dumps({"context": context}) + "\n")  # -i gives the field the lines leave out
    assert main(["predict", "qa", "--file", str(contexts), "-i", "question=Who wrote it?"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["result"]["answer"] == "Herman Melville"
    from plugins.starter import STARTER_ROOT

    with caplog.at_level("WARNING"):
        assert main(["predict", "sentiment", "-i", "text=good", "--model", str(STARTER_ROOT / "sentiment"),
                     "--revision", "v2"]) == 0
    assert "revision 'v2' applies to Hub ids only and is ignored" in caplog.text


def test_encode_refuses_an_empty_text_and_marks_one_it_cut(tmp_path, capsys, caplog):
    folder = reference_checkpoint(tmp_path / "tiny", "BertModel")
    assert main(["encode", "--model", str(folder), "fine", "  "]) == 2
    assert "text 2 is empty" in capsys.readouterr().err
    with caplog.at_level("WARNING"):
        assert main(["encode", "--model", str(folder), "word " * 1000, "short"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [r["truncated"] for r in results] == [True, False] and "text 1 is longer than the model's" in caplog.text


def test_a_bad_share_cpus_setting_is_a_setting_error_at_load_not_a_plugin_bug(monkeypatch, capsys):
    """BERT_ENGINE_SHARE_CPUS is read at each forward chunk; a bad value failed there, inside the task's
    forward, reported as a bug in the plugin (exit 1). It is checked when the model loads."""
    monkeypatch.setenv("BERT_ENGINE_SHARE_CPUS", "bogus")
    assert main(["predict", "sentiment", "-i", "text=hi"]) == 2
    err = capsys.readouterr().err
    assert "BERT_ENGINE_SHARE_CPUS must be" in err and "got 'bogus'" in err and "bug in plugin" not in err


def test_a_bad_setting_is_named_before_any_work_whatever_the_command_reads(monkeypatch, capsys):
    """docs/settings.md: "at start" settings are read and checked when a command starts. The CLI ignored
    BERT_ENGINE_TIMEOUT=abc (exit 0; only app.py checked), and BERT_ENGINE_PRECISION=fp8 was refused without
    naming the variable it came from."""
    monkeypatch.setenv("BERT_ENGINE_TIMEOUT", "abc")
    assert main(["plugins"]) == 2
    assert "BERT_ENGINE_TIMEOUT must be a number, got 'abc'" in capsys.readouterr().err
    monkeypatch.delenv("BERT_ENGINE_TIMEOUT")
    monkeypatch.setenv("BERT_ENGINE_PRECISION", "fp8")
    assert main(["predict", "sentiment", "-i", "text=hi"]) == 2
    assert "BERT_ENGINE_PRECISION: precision 'fp8' is not one of auto, fp32" in capsys.readouterr().err
    assert main(["predict", "sentiment", "-i", "text=hi", "--precision", "fp32"]) == 0  # the flag wins


def test_a_tsv_field_past_csvs_limit_is_read_and_another_format_is_named(sentiment_checkpoint, tmp_path, capsys):
    """A TSV line's fields are its text between tabs, up to the input limit (Python's csv reader stopped at 131,072
    characters with a traceback); `eval` on a file of another format says so in one line, exit 2."""
    tsv = tmp_path / "long.tsv"
    tsv.write_text("text\n" + "a fine film " * 17_000 + "\nshort\n")  # 204,000 characters
    assert main(["predict", "sentiment", "--file", str(tsv), "--model", str(sentiment_checkpoint)]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["line"] for line in captured.out.splitlines()] == [2, 3]
    assert "2 of 2 lines answered" in captured.err
    squad_like = tmp_path / "dev.json"
    squad_like.write_text(json.dumps({"data": [{"title": "x" * 200_000}]}) + "\n")
    assert main(["eval", "sentiment", "--data", str(squad_like), "--model", str(sentiment_checkpoint)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dev.json:1: expected a header line naming the columns 'sentence' and 'label'" in err[0]


def test_a_tsv_line_with_more_fields_than_its_header_fails_alone(sentiment_checkpoint, tmp_path, capsys):
    """A tab inside a text made a field the header does not name: what followed it was dropped, unread, and the
    line answered; now that line fails, naming the counts, and the others are answered."""
    tsv = tmp_path / "tabs.tsv"
    tsv.write_text("text\ngreat\tawful awful terrible\nfine\n")
    assert main(["predict", "sentiment", "--file", str(tsv), "--model", str(sentiment_checkpoint)]) == 1
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [line["line"] for line in lines] == [2, 3] and "result" in lines[1]
    assert "2 tab-separated fields where the header names 1" in lines[0]["error"]


def test_a_json_file_holding_an_array_is_read_whole(tmp_path, capsys):
    """A pretty-printed JSON array was read line by line as JSON Lines ("not JSON" on most lines, one answered):
    a .json document is an array of inputs (objects or texts, numbered by their place) or one object; a .json
    of JSON Lines still reads line by line."""
    pretty = tmp_path / "pretty.json"
    pretty.write_text('[\n {"text": "great"},\n "fine film",\n {"txt": "x"}\n]\n')
    assert main(["predict", "sentiment", "--file", str(pretty)]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["line"] for line in lines] == [1, 2, 3] and "result" in lines[0] and "result" in lines[1]
    assert lines[2]["error"] == "unknown field(s) txt; the task's: text, text_pair"
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"text": "great"}, indent=2))
    assert main(["predict", "sentiment", "--file", str(one)]) == 0
    assert [json.loads(line)["line"] for line in capsys.readouterr().out.splitlines()] == [1]
    broken = tmp_path / "broken.json"
    broken.write_text('[\n {"text": "great"},\n]\n')  # a trailing comma: one error for the file
    assert main(["predict", "sentiment", "--file", str(broken)]) == 2
    assert "broken.json: not a JSON array (Expecting value" in capsys.readouterr().err
    jsonl = tmp_path / "lines.json"
    jsonl.write_text('{"text": "great"}\n{"text": "bad"}\n')
    assert main(["predict", "sentiment", "--file", str(jsonl)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_a_tsv_header_naming_a_column_the_task_does_not_read_is_refused(tmp_path, capsys):
    """A misspelt optional field ("text_pari") was dropped unread and every line answered without it, while
    JSON Lines refuses an unknown field: the header is refused once, naming the column and the task's fields."""
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("text\ttext_pari\nA man plays.\tSomeone plays.\n")
    assert main(["predict", "sentiment", "--file", str(tsv)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pairs.tsv:1: the header must name the task's fields (text; optional: text_pair) and " \
        "no others: column 'text_pari' is not read (did you mean 'text_pair'?)" in err[0], err
    tsv.write_text("txt\nA man plays.\n")  # a misspelt field: missing, and the column it may have meant
    assert main(["predict", "sentiment", "--file", str(tsv)]) == 2
    assert "no others: missing text; column 'txt' is not read (did you mean 'text'?)" in capsys.readouterr().err


def test_predict_reads_standard_input_and_refuses_a_file_of_no_inputs(sentiment_checkpoint, tmp_path, capsys,
                                                                      monkeypatch):
    """`--file -` reads standard input (plain text unless --format says), within BERT_ENGINE_MAX_FILE_MB; a file
    holding nothing but blank lines was "0 of 0 lines answered", exit 0, which a script took for success."""
    import io

    model = ["--model", str(sentiment_checkpoint)]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a gorgeous movie\n\nterrible\n")))
    assert main(["predict", "sentiment", "--file", "-", *model]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["line"] for line in captured.out.splitlines()] == [1, 3]
    assert "2 of 2 lines answered, 0 failed, 1 blank line skipped" in captured.err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"text": "great"}\n{"txt": "bad"}\n')))
    assert main(["predict", "sentiment", "--file", "-", "--format", "jsonl", *model]) == 1
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "result" in answers[0] and "unknown field(s) txt" in answers[1]["error"]
    monkeypatch.setenv("BERT_ENGINE_MAX_FILE_MB", "1")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * 1_000_001)))
    assert main(["predict", "sentiment", "--file", "-", *model]) == 2
    assert "standard input: over the limit of 1 MB (BERT_ENGINE_MAX_FILE_MB)" in capsys.readouterr().err
    blank = tmp_path / "blank.txt"
    for text, said in (("", "the file is empty"), ("\n  \n", "2 blank lines")):
        blank.write_text(text)
        assert main(["predict", "sentiment", "--file", str(blank), *model]) == 2
        assert f"blank.txt: no inputs ({said})" in capsys.readouterr().err
    assert main(["predict", "sentiment", "--format", "tsv", "-i", "text=fine", *model]) == 2
    assert "--format says how --file is written; give --file" in capsys.readouterr().err


def test_encode_refuses_text_no_task_would_read(capsys):
    """`encode` answered a zero-width space with the vector of [CLS] [SEP]; every task refuses such text."""
    assert main(["encode", "fine", "\u200b\u200b"]) == 2
    assert "text 2 has no readable text, only control or invisible characters (U+200B)" in capsys.readouterr().err


def test_encode_runs_where_bert_engine_device_says_as_predict_does(monkeypatch, capsys):
    # it ignored the setting (exit 0 on the CPU) where predict and eval refused a device the machine lacks
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has the device; the refusal needs a CPU build of torch")
    monkeypatch.setenv("BERT_ENGINE_DEVICE", "cuda")
    assert main(["encode", "fine"]) == 2
    assert "BERT_ENGINE_DEVICE: device 'cuda': " in capsys.readouterr().err


def test_predict_into_a_reader_that_leaves_early_is_no_error(tmp_path):
    """`bert-engine predict --file ... | head -1` ended in "error: [Errno 32] Broken pipe", exit 1."""
    import subprocess
    import sys

    data = tmp_path / "many.txt"
    data.write_text("a fine film\n" * 2000)
    done = subprocess.run(f"{sys.executable} -m bert_engine predict sentiment --file {data} | head -1",
                          shell=True, capture_output=True, text=True, timeout=300,
                          executable="/bin/bash", env={**__import__("os").environ, "PYTHONUNBUFFERED": "1"})
    assert done.stdout.strip() and "error" not in done.stderr.lower() and "Traceback" not in done.stderr, done.stderr


def test_eval_refuses_a_split_that_names_none(tmp_path, capsys):
    """`eval sentiment --split bogus` answered on the file and reported "split": "bogus" (an SST-2 or CoNLL file
    is one split; the name only says which); a typo is now refused naming the names, as summary's and fill-mask's
    readers did already."""
    data = tmp_path / "dev.tsv"
    data.write_text("sentence\tlabel\na fine film\t1\n")
    assert main(["eval", "sentiment", "--data", str(data), "--split", "bogus"]) == 2
    assert "split 'bogus' is not one of train, dev, validation, test, all" in capsys.readouterr().err
    conll = Path(__file__).parent / "fixtures" / "conll_tiny.txt"
    assert main(["eval", "ner", "--data", str(conll), "--split", "tset+lower", "--limit", "2"]) == 2
    assert "split 'tset+lower' is not one of train, dev, validation, test, all, each with '+lower'" in \
        capsys.readouterr().err


def test_encode_reads_a_task_models_folder_through_its_encoder(capsys):
    """`encode --model plugins/starter/sentiment` was refused ("needs a head"): a folder whose manifest names a
    task loads with that task's head, and its encoder (the adapter's) gives the vectors."""
    starter = Path(__file__).resolve().parents[1] / "plugins" / "starter" / "sentiment"
    assert main(["encode", "--model", str(starter), "a fine film"]) == 0
    tuned = json.loads(capsys.readouterr().out)["results"][0]["mean_embedding"]
    assert main(["encode", "a fine film"]) == 0
    base = json.loads(capsys.readouterr().out)["results"][0]["mean_embedding"]
    assert len(tuned) == len(base) == 384 and tuned != base  # the adapter's encoder, not the bare backbone


def test_a_plain_text_file_for_a_task_of_two_fields_is_refused_once(tmp_path, capsys):
    """Plain text gives each line's first field only: a QA file of questions failed every line alike ("input
    'context' is missing"), exit 1; refused up front now, saying how to give the rest, unless -i gives it."""
    questions = tmp_path / "questions.txt"
    questions.write_text("Who wrote it?\nWhen?\n")
    assert main(["predict", "qa", "--file", str(questions)]) == 2
    assert "questions.txt: plain text gives each line's question; task 'qa' also needs context: give -i " \
        "context=TEXT for every line, or write the file as .jsonl or .tsv (--format)" in capsys.readouterr().err
    assert main(["predict", "qa", "--file", str(questions), "-i", "context=Moby-Dick was written by Melville."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_plugin_check_refuses_a_case_timeout_that_is_no_time(value, capsys):
    # 0 and nan had every case time out, and the cancellations then reached other threads (an outside test)
    with pytest.raises(SystemExit) as exit_:
        main(["plugin", "check", "sentiment", "--case-timeout", value])
    assert exit_.value.code == 2 and "--case-timeout" in capsys.readouterr().err


def test_train_names_a_folder_given_for_a_tasks_data_file(tmp_path, capsys):
    # "[Errno 21] Is a directory", exit 1, where --help says a file, folder or pattern (a folder: pretraining's)
    (tmp_path / "sst2").mkdir()
    assert main(["train", "sentiment", "--model", str(reference_checkpoint(tmp_path / "m", "BertForSequenceClassification")),
                 "--train-file", str(tmp_path / "sst2"), "--max-steps", "1", "--output-dir", str(tmp_path / "run")]) == 2
    assert f"{tmp_path / 'sst2'}: is a folder; task 'sentiment' reads its data from a file" in capsys.readouterr().err


def test_on_a_terminal_the_answers_are_whole_lines_not_glued_to_the_progress_bar(sentiment_checkpoint, tmp_path):
    """stdout and stderr on one terminal: tqdm's bar (no newline of its own) and the JSON Lines shared lines."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import subprocess
    import sys
    import termios

    data = tmp_path / "many.txt"
    data.write_text("".join(f"a fine film, take {i}\n" for i in range(100)))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a width, or tqdm draws nothing
    process = subprocess.Popen([sys.executable, "-m", "bert_engine", "predict", "sentiment", "--file", str(data),
                                "--model", str(sentiment_checkpoint)], stdin=subprocess.DEVNULL, stdout=follower,
                               stderr=follower, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert process.wait(timeout=300) == 0
    text = seen.decode("utf-8", "replace")
    assert re.search(r"\d+%\|", text), text[:500]  # the bar was drawn...
    lines = [line.strip(" ") for line in re.split(r"[\r\n]+", text)]
    answers = [line for line in lines if line.startswith('{"line"')]
    assert len(answers) == 100 and all(json.loads(line)["result"]["label"] for line in answers)  # ...and no answer cut
    assert not [line for line in lines if "%|" in line and "{" in line], "an answer shares a line with the bar"


def test_a_file_of_many_short_lines_is_read_line_by_line_not_held_as_rows(tmp_path):
    """20 MB of two-byte lines held 4 GB as a list of rows before one was answered (session 57's audit): the rows
    are built as they are read, twice (a count, then the answers), and the answers of one process are not kept."""
    import tracemalloc

    from bert_engine.cli import BLANK, _batches, _read_rows
    from bert_engine.tasks.registry import load_registry

    task = load_registry(entry_points=False).task("sentiment")
    lines = 100_000
    for kind, line in (("text", "a"), ("jsonl", '{"text": "a"}'), ("tsv", "a")):
        data = tmp_path / f"many.{kind}"
        data.write_text(("text\n" if kind == "tsv" else "") + (line + "\n") * lines + "\n")
        tracemalloc.start()
        rows = _read_rows(str(data), task, kind)
        counted = sum(1 for _, row in rows if row is not BLANK)
        batches = sum(1 for _ in _batches(rows, 0, 1))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert counted == lines and batches == -(-lines // 32)
        assert peak < 3 * data.stat().st_size + 4_000_000, (kind, peak)  # the text, not a row object per line


def test_a_binary_file_a_non_utf8_json_array_and_header_are_refused_once(tmp_path, capsys):
    """Each was answered "line" by line before: 17 errors for 4 KB of random bytes, "not JSON" on an array's good
    entries beside one bad byte, a TSV header echoed as escaped bytes (session 57's fresh-clone trial)."""
    import random

    noise = bytes(random.Random(0).randrange(1, 256) for _ in range(4000))  # no NUL byte
    latin1 = "Café crème, déjà vu, naïve façade.\n".encode("latin-1") * 20  # a few bad bytes a line: answered per line
    (tmp_path / "latin1.txt").write_bytes(latin1)
    assert main(["predict", "sentiment", "--file", str(tmp_path / "latin1.txt")]) == 1
    assert "not UTF-8 text (byte 0xe9" in capsys.readouterr().out
    cases = ((b"x\x00y" + bytes(range(256)) * 8, "bin.txt", "not a text file (a NUL byte at byte 1)"),
             (noise, "noise.bin", "noise.bin: not UTF-8 text ("),
             ("hi\n".encode("utf-16"), "utf16.txt", "this one is UTF-16 text: save it as UTF-8"),
             (b'[{"text": "great"},\n {"text": "caf\xe9"},\n {"text": "awful"}]\n', "mixed.json",
              "not UTF-8 text (byte 0xe9 on line 2); a JSON array must be UTF-8"),
             (b"\xe9\xff\tz\nabc\n", "bad.tsv", "bad.tsv:1: the header naming the task's fields is not UTF-8 text"))
    for data, name, message in cases:
        (tmp_path / name).write_bytes(data)
        assert main(["predict", "sentiment", "--file", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_version_is_printed_without_loading_torch():
    import subprocess
    import sys

    from bert_engine.version import __version__

    done = subprocess.run([sys.executable, "-c", "import sys\nfrom bert_engine.cli import main\ntry:\n    main(['--version'])"
                           "\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["bert-engine", __version__, "False"], done.stdout + done.stderr


def test_output_dash_is_stdout_and_a_failed_write_names_the_output_file(sentiment_checkpoint, tmp_path, capsys):
    lines = tmp_path / "lines.txt"
    lines.write_text("good\nbad\n")
    assert main(["predict", "sentiment", "--file", str(lines), "--output", "-", "--model", str(sentiment_checkpoint)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2 and not (Path.cwd() / "-").exists()
    if Path("/dev/full").exists():  # writes fail there with "No space left on device", which named no file
        assert main(["predict", "sentiment", "--file", str(lines), "--output", "/dev/full",
                     "--model", str(sentiment_checkpoint)]) == 1
        assert "error: /dev/full: no space left on device" in capsys.readouterr().err


def test_a_progress_bar_in_a_log_file_is_a_line_now_and_then_and_redrawn_on_a_terminal(tmp_path):
    """tqdm redraws its bar every 0.1 s: in a log file (`train ... 2> train.log`) each redraw stayed, "\\r"-joined,
    megabytes of one line over a long run (session 57's list). There it writes at most every 30 s."""
    import os
    import time

    from bert_engine.progress import FILE_INTERVAL_S, progress_bar

    with open(tmp_path / "train.log", "w", encoding="utf-8") as log:
        bar = progress_bar(total=40, file=log, desc="train")
        for step in range(40):
            time.sleep(0.03)  # 1.2 s of work: twelve redraws at tqdm's own 0.1 s
            bar.update(1)
            if step % 2 == 0:
                bar.set_postfix(loss=1.0 / (step + 1))  # (the training loop's: each was a redraw of its own)
        bar.close()
    written = (tmp_path / "train.log").read_text(encoding="utf-8")
    lines = written.splitlines()
    assert "\r" not in written and len(lines) <= 3 and "40/40" in lines[-1], written  # the start and the end, lines
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        bar = progress_bar(range(3), file=terminal)
        assert bar.mininterval < FILE_INTERVAL_S  # tqdm's own redraws on a terminal
        bar.close()
    os.close(leader)


def test_input_file_gives_a_field_the_text_of_a_file(tmp_path, capsys, monkeypatch):
    """A document past the shell's argument limit (about 128 KB) had no way in but a JSON Lines file: --input-file
    FIELD=PATH reads one field's text from a file (or standard input), checked and refused as --file's are."""
    import io

    article = tmp_path / "article.txt"
    article.write_text("Moby-Dick was written by Herman Melville.\nIt was published in 1851.\n", encoding="utf-8")
    assert main(["predict", "qa", "-i", "question=Who wrote it?", "--input-file", f"context={article}"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["answer"] == "Herman Melville"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Paris is the capital of France.")))
    assert main(["predict", "qa", "-i", "question=What is the capital of France?", "--input-file", "context=-"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["answer"] == "Paris"
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "utf16.txt").write_bytes("hello".encode("utf-16"))
    for given, message in ((f"text={tmp_path / 'latin1.txt'}", "not UTF-8 text (byte 0xe9 at byte 3)"),
                           (f"text={tmp_path / 'utf16.txt'}", "not a text file (a NUL byte"),
                           (f"text={tmp_path / 'nope.txt'}", "nope.txt: no such file"),
                           (f"text={tmp_path}", "is a folder"),
                           ("text=", "expected FIELD=PATH"), (f"txt={article}", "expected FIELD=PATH with FIELD one of text")):
        assert main(["predict", "sentiment", "--input-file", given]) == 2, given
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (given, err)
    assert main(["predict", "sentiment", "-i", "text=hi", "--input-file", f"text={article}"]) == 2
    assert "gives a field already given" in capsys.readouterr().err
    assert main(["predict", "qa", "--input-file", "question=-", "--input-file", "context=-"]) == 2  # (it said "the
    assert "standard input can be read once" in capsys.readouterr().err                            # context is empty")


def test_eval_on_a_file_without_the_split_says_split_all_reads_it(capsys):
    """`eval summary --data tests/fixtures/bbc_tiny.jsonl` said only "no 'test' examples" (the fixture's articles
    hash to other splits); the way to read it was not said (session 58's fresh-clone trial)."""
    fixture = Path(__file__).parent / "fixtures" / "bbc_tiny.jsonl"
    assert main(["eval", "summary", "--data", str(fixture)]) == 2
    assert "holds 3 examples of other splits: --split all reads every one" in capsys.readouterr().err
