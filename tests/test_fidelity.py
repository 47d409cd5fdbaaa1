"""The fidelity evaluation: scoring, the shipped data set, and an end-to-end run on a slice."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from perf.fidelity import dataset as ds  # noqa: E402
from perf.fidelity.scoring import contains_answer, exact_match, first_token_kl, normalize, token_f1  # noqa: E402


@pytest.mark.parametrize("text, expected", [
    ("The Silt River.", "silt river"),
    ("It employs 1,350 people!", "it employs 1350 people"),
    ("It weighs 1.2 kilograms.", "it weighs 1.2 kilograms"),
    ("  An  OWL, holding a quill ", "owl holding quill"),
    ("The Heron's Year", "heron s year"),
])
def test_normalize(text, expected):
    assert normalize(text) == expected


def test_exact_match_and_f1():
    assert exact_match("The Silt River.", ["the Silt River", "Silt"]) == 1.0
    assert exact_match("Silt River, in Eastvale", ["the Silt River"]) == 0.0
    assert token_f1("Old Hollis", ["Old Hollis"]) == 1.0
    assert token_f1("It is called Old Hollis", ["Old Hollis"]) == pytest.approx(2 * (2 / 5) * 1 / (2 / 5 + 1))
    assert token_f1("nothing here", ["Old Hollis"]) == 0.0
    assert token_f1("red blue", ["Pilot", "red blue green"]) == pytest.approx(0.8)
    assert token_f1("", [""]) == 1.0


def test_contains_answer_matches_whole_words():
    assert contains_answer("Marrowick was founded in 1642 by wool traders.", ["1642"]) == 1.0
    assert contains_answer("It has 16420 people", ["1642"]) == 0.0
    assert contains_answer("It employs 1350 people", ["1,350"]) == 1.0
    assert contains_answer("The answer is Pilot.", ["Rowan Keel"]) == 0.0


def test_first_token_kl():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert first_token_kl(a, a) == pytest.approx(0.0, abs=1e-12)
    assert first_token_kl(a, a + 5.0) == pytest.approx(0.0, abs=1e-12)
    assert first_token_kl(a, torch.tensor([3.0, 2.0, 1.0])) > 0.5


def test_data_set_sizes_and_answers_are_in_the_documents():
    data = ds.load()
    assert len(data.documents) >= 20
    kinds = [q.kind for q in data.questions]
    assert kinds.count("single") >= 100 and kinds.count("cross") >= 30
    assert len({q.id for q in data.questions}) == len(data.questions)
    for question in data.questions:
        answering = data.documents[question.docs[-1]].text
        assert any(contains_answer(answering, [a]) for a in question.answers), question.id
        if question.kind == "cross":
            bundle = data.bundles[data.bundle_of(question)]
            assert bundle.index(question.docs[1]) == bundle.index(question.docs[0]) + 1, question.id


def test_scaffold_prompts_read_the_same_tokens():
    from pckernels.integration.embedded import load_tokenizer
    from pckernels.pml import parse_prompt, parse_schema

    tokenizer = load_tokenizer()
    data = ds.load()
    schemas = {}
    for question in data.questions:
        if question.kind != "cross":
            continue
        bundle = data.bundle_of(question)
        for scaffold in ((), question.docs):
            schema = parse_schema(ds.bundle_schema(data, bundle, scaffold), tokenizer)
            schemas[schema.name] = schema
        plain = parse_prompt(ds.prompt(data, question), schemas)
        joint = parse_prompt(ds.prompt(data, question, scaffold=True), schemas)
        assert plain.token_ids == joint.token_ids and plain.position_ids == joint.position_ids
        assert joint.scaffolds and not plain.scaffolds


def test_held_out_set_sizes_and_answers_are_in_the_documents():
    data = ds.load("heldout")
    assert data.name == "heldout" and len(data.documents) == 16
    kinds = [q.kind for q in data.questions]
    assert kinds.count("single") == 48 and kinds.count("cross") == 16
    assert sorted(data.library) == sorted(data.documents)
    shipped = ds.load()
    assert not set(data.documents) & set(shipped.documents)
    for question in data.questions:
        assert any(contains_answer(data.documents[question.docs[-1]].text, [a]) for a in question.answers), question.id


@pytest.mark.parametrize("name", ["shipped", "heldout"])
def test_library_prompts_import_the_documents_and_one_distractor_in_schema_order(name):
    from pckernels.integration.embedded import load_tokenizer
    from pckernels.pml import parse_prompt, parse_schema

    data = ds.load(name)
    schema = parse_schema(ds.library_schema(data), load_tokenizer())
    for question in data.questions:
        docs = ds.imported(data, question, "library")
        assert len(docs) == len(question.docs) + 1 and set(question.docs) < set(docs)
        assert list(docs) == sorted(docs, key=data.library.index)
        plain = parse_prompt(ds.prompt(data, question, layout="library"), schema)
        packed = parse_prompt(ds.prompt(data, question, layout="library", placement="compact"), schema)
        assert plain.token_ids == packed.token_ids and plain.modules == packed.modules
        assert packed.position_ids == tuple(range(len(packed.token_ids)))
    assert len({ds.distractor(data, q) for q in data.questions}) > len(data.documents) // 2


def test_conditions_by_name():
    from perf.fidelity.runner import parse_condition

    assert parse_condition("compact").placement == "compact"
    assert parse_condition("independent").placement == "schema"
    c = parse_condition("compact+epic@4")
    assert (c.kind, c.placement, c.policy, c.share) == ("recompute", "compact", "epic", 4.0)
    assert parse_condition("deviation@0.1").placement == "schema"
    with pytest.raises(ValueError, match="unknown condition"):
        parse_condition("compact+sometimes@3")


def test_limit_spreads_questions_over_the_set():
    from perf.fidelity.runner import select_questions

    data = ds.load()
    chosen = select_questions(data, 4)
    assert [q.kind for q in chosen].count("single") == 4 and [q.kind for q in chosen].count("cross") == 4
    assert len({data.bundle_of(q) for q in chosen}) >= 4


def test_paired_changes_count_lost_and_gained_answers():
    from perf.fidelity.runner import paired_changes

    def rec(question, kind, condition, contains):
        return {"question": question, "kind": kind, "condition": condition, "contains": contains}

    records = [rec("s1", "single", "baseline", 1.0), rec("s1", "single", "independent", 0.0),
               rec("s2", "single", "baseline", 0.0), rec("s2", "single", "independent", 1.0),
               rec("s3", "single", "baseline", 1.0), rec("s3", "single", "independent", 1.0),
               rec("c1", "cross", "baseline", 1.0), rec("c1", "cross", "scaffold", 0.0),
               rec("c1", "cross", "independent", 0.0)]
    changes = paired_changes(records)
    assert changes["single"]["independent"] == {"lost": 1, "gained": 1}
    assert changes["single"]["baseline"] == {"lost": 0, "gained": 0}
    assert changes["cross"]["scaffold"] == {"lost": 1, "gained": 0}
    assert changes["all"]["independent"] == {"lost": 2, "gained": 1}


@pytest.mark.slow
def test_evaluation_runs_end_to_end(tmp_path):
    from perf.fidelity import runner

    args = argparse.Namespace(limit=1, shares=[0.5, 1.0], policies=["first", "deviation"], max_new_tokens=4,
                              model="smollm2", threads=2, machine="test")
    report = runner.evaluate(args)
    paths = runner.write(report, tmp_path)
    assert all(p.is_file() and p.stat().st_size for p in paths)
    assert json.loads(paths[0].read_text())["settings"]["questions"] == 2
    summary = report["summary"]
    assert set(summary["cross"]) == {"baseline", "prefix", "independent", "scaffold", "first@0.5", "first@1",
                                     "deviation@0.5"}
    assert "scaffold" not in summary["single"]
    assert summary["all"]["prefix"]["agree"] == 100.0
    # The prompts' schema positions are contiguous, so recomputing every stale token is baseline.
    assert summary["all"]["first@1"]["kl"] < 1e-3
    assert summary["all"]["independent"]["computed_tokens"] < summary["all"]["baseline"]["computed_tokens"] / 10
    assert "| independent |" in paths[1].read_text()
