"""The document-QA set (``data/``) and the PML it is read through.

Each bundle of three documents is one schema: a system message holding the documents as
modules, in bundle order. A question's prompt imports its bundle's three documents (the ones
it needs plus distractors) and asks the question as the user. For a cross-document question
a second schema lays the bundle out identically but wraps the two documents the question
needs in a scaffold, so the prompt is the same token for token and only the pair's states
differ (encoded jointly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

DATA_DIR = Path(__file__).parent / "data"

SYSTEM = "Answer the question using the documents below. Reply with only the answer, in a few words."


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    id: str
    kind: str
    """``single`` (one document answers it) or ``cross`` (needs both of ``docs``)."""
    docs: tuple[str, ...]
    question: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Dataset:
    documents: dict[str, Document]
    bundles: tuple[tuple[str, ...], ...]
    questions: tuple[Question, ...]

    def bundle_of(self, question: Question) -> int:
        """Index of the bundle holding all of the question's documents."""
        for index, bundle in enumerate(self.bundles):
            if set(question.docs) <= set(bundle):
                return index
        raise ValueError(f"question {question.id}: documents {question.docs} are not in one bundle")


def load(data_dir: Path = DATA_DIR) -> Dataset:
    """Read ``documents.json`` and ``questions.json`` and check that they fit together."""
    docs_file = json.loads((data_dir / "documents.json").read_text(encoding="utf-8"))
    questions_file = json.loads((data_dir / "questions.json").read_text(encoding="utf-8"))
    documents = {d["id"]: Document(d["id"], d["title"], d["text"]) for d in docs_file["documents"]}
    bundles = tuple(tuple(b) for b in docs_file["bundles"])
    questions = tuple(Question(q["id"], q["kind"], tuple(q["docs"]), q["question"], tuple(q["answers"]))
                      for q in questions_file["questions"])
    dataset = Dataset(documents, bundles, questions)
    for question in questions:
        expected = 1 if question.kind == "single" else 2
        if question.kind not in ("single", "cross") or len(question.docs) != expected:
            raise ValueError(f"question {question.id}: kind {question.kind!r} with {len(question.docs)} documents")
        dataset.bundle_of(question)
    return dataset


def schema_name(bundle: int, scaffold: tuple[str, ...] = ()) -> str:
    return f"fidelity-b{bundle}" + (f"-{'-'.join(scaffold)}" if scaffold else "")


def _module(document: Document) -> str:
    return (f'<module name="{document.id}" xml:space="preserve">\n\nDocument: {escape(document.title)}\n'
            f'{escape(document.text)}</module>')


def bundle_schema(dataset: Dataset, bundle: int, scaffold: tuple[str, ...] = ()) -> str:
    """PML schema of a bundle; ``scaffold`` (two adjacent documents of it) are encoded jointly."""
    ids = dataset.bundles[bundle]
    parts: list[str] = []
    i = 0
    while i < len(ids):
        if scaffold and ids[i] == scaffold[0]:
            if tuple(ids[i:i + len(scaffold)]) != tuple(scaffold):
                raise ValueError(f"scaffold {scaffold} is not a run of bundle {bundle}'s documents {ids}")
            members = "".join(_module(dataset.documents[d]) for d in scaffold)
            parts.append(f'<scaffold name="needed">{members}</scaffold>')
            i += len(scaffold)
        else:
            parts.append(_module(dataset.documents[ids[i]]))
            i += 1
    return f'<schema name="{schema_name(bundle, scaffold)}"><system>{escape(SYSTEM)}{"".join(parts)}</system></schema>'


def prompt(dataset: Dataset, question: Question, scaffold: bool = False) -> str:
    """PML prompt importing the question's bundle (through the scaffold schema if ``scaffold``)."""
    bundle = dataset.bundle_of(question)
    imports = "".join(f"<{d}/>" for d in dataset.bundles[bundle])
    name = schema_name(bundle, question.docs if scaffold else ())
    return f'<prompt schema="{name}">{imports}<user>{escape(question.question)}</user><assistant/></prompt>'
