"""The starter pack's quality floors: each task's packed model scored on a small fixed slice of real
data it was not trained on (tests/fixtures/regression/, cut by scripts/cut_regression_slices.py),
with the same evaluation as `bert-engine eval`. A pack that scores below a floor (or, for a figure that must
stay low, over a ceiling) fails here, so a worse model cannot land silently. Each floor sits a few points under the figure the committed pack
measured on that slice (the `measured` column); after packing a better model, raise both."""

from pathlib import Path

import pytest

from bert_engine.runtime.inference import Predictor
from bert_engine.tasks.evaluation import evaluate_task, read_examples
from bert_engine.tasks.registry import load_registry
from plugins.starter import STARTER_ROOT

SLICES = Path(__file__).parent / "fixtures" / "regression"

# task (+ a variant): (slice, split, metric, measured on the committed pack, floor[, evaluation options])
FLOORS = {
    "sentiment": ("sst2_dev_every4th.tsv", "all", "accuracy", 0.908, 0.88),
    "ner": ("conll_testb_first250.txt", "all", "f1", 91.8, 89.0),
    # the same text typed in lower case: the casing model must still read words (a model trained
    # without casing_dropout measured 85.3 here)
    "ner+lower": ("conll_testb_first250.txt", "all+lower", "f1", 91.7, 89.0),
    "qa": ("squad_v2_dev_second_half.json", "dev", "best_f1", 69.1, 65.5),  # answers and the null score together
    # the shipped default's "no answer" decision (the answerability verifier at its "eager" threshold), as a user gets it
    "qa+default": ("squad_v2_dev_second_half.json", "dev", "f1", 47.0, 46.0),
    "summary": ("bbc_test_first16.jsonl", "all", "rouge2", 60.1, 57.0),  # hybrid mode (auto)
    "fill_mask": ("wikitext2_test_first3.txt", "all", "top1", 0.533, 0.51, {"words": 0}),  # every masked token
    # what a visitor sees: 1,000 whole words, each behind one [MASK] (fill_mask_words), content words only (552;
    # 300 words, 169 of them content, moved by more than one pack differs from the next). The pack before it: 0.112
    "fill_mask+words": ("wikitext2_test_first3.txt", "all", "content_top1", 0.129, 0.115,
                        {"words": 1000}),
}


# ... and figures that must stay low: (slice, split, metric, measured on the committed pack, ceiling)
CEILINGS = {
    # the shipped "no answer" decision on whole scientific papers (every question answerable): the share refused.
    # The verifier once read the question's missing words over the whole document and refused 3 of these 20.
    "qa+long": ("covid_qa_first_papers.json", "dev", "no_answer_rate", 0.0, 10.0),
}


@pytest.fixture(scope="module")
def registry():
    return load_registry(entry_points=False)


@pytest.mark.parametrize("task", sorted(FLOORS))
def test_the_starter_model_stays_above_its_floor(registry, task):
    name, split, metric, measured, floor, *options = FLOORS[task]
    task = task.split("+")[0]
    if not (STARTER_ROOT / task / "manifest.json").is_file():
        pytest.skip(f"no {task} starter model packed")
    assert floor < measured
    spec = registry.task(task).spec
    examples = read_examples(spec, str(SLICES / name), split, None)
    metrics = evaluate_task(spec, Predictor.load(registry.task(task)), examples, **(options[0] if options else {}))
    assert metrics[metric] >= floor, (f"{task}: {metric} {metrics[metric]:.4g} on {name} is under its floor {floor} "
                                      f"(the committed pack measured {measured})")


@pytest.mark.parametrize("task", sorted(CEILINGS))
def test_the_starter_model_stays_under_its_ceiling(registry, task):
    name, split, metric, measured, ceiling = CEILINGS[task]
    task = task.split("+")[0]
    if not (STARTER_ROOT / task / "manifest.json").is_file():
        pytest.skip(f"no {task} starter model packed")
    assert measured < ceiling
    spec = registry.task(task).spec
    metrics = evaluate_task(spec, Predictor.load(registry.task(task)), read_examples(spec, str(SLICES / name), split, None))
    assert metrics[metric] <= ceiling, (f"{task}: {metric} {metrics[metric]:.4g} on {name} is over its ceiling {ceiling} "
                                        f"(the committed pack measured {measured})")
