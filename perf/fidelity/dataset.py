"""The document-QA sets and the PML they are read through.

Two sets: ``data/`` (shipped; free to tune on) and ``heldout/`` (issue 21: written once, never used
to choose a policy, k or threshold). Two layouts:

* ``bundle`` (the shipped set's original): each bundle of documents is one schema, a system
  message holding them as modules in bundle order; a question's prompt imports its whole bundle
  (the documents it needs plus distractors). For a cross-document question a second schema lays
  the bundle out identically but wraps the two documents it needs in a scaffold, so the prompt is
  the same token for token and only the pair's states differ (encoded jointly).
* ``library``: one schema holds every document (in ``library`` order); a question imports the
  documents it needs and one distractor (:func:`distractor`), in schema order — so the schema
  leaves gaps between them that compact placement closes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

DATA_DIR = Path(__file__).parent / "data"
HELDOUT_DIR = Path(__file__).parent / "heldout"
SETS = {"shipped": DATA_DIR, "heldout": HELDOUT_DIR}

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
    library: tuple[str, ...] = ()
    """Document order of the library schema (default: the bundles one after another)."""
    name: str = "shipped"

    def bundle_of(self, question: Question) -> int:
        """Index of the bundle holding all of the question's documents."""
        for index, bundle in enumerate(self.bundles):
            if set(question.docs) <= set(bundle):
                return index
        raise ValueError(f"question {question.id}: documents {question.docs} are not in one bundle")


def load(data_dir: Path | str = DATA_DIR) -> Dataset:
    """Read ``documents.json`` and ``questions.json`` (``data_dir`` or a set's name, :data:`SETS`)
    and check that they fit together."""
    name = str(data_dir) if str(data_dir) in SETS else Path(data_dir).name
    data_dir = SETS.get(str(data_dir), Path(data_dir))
    docs_file = json.loads((data_dir / "documents.json").read_text(encoding="utf-8"))
    questions_file = json.loads((data_dir / "questions.json").read_text(encoding="utf-8"))
    documents = {d["id"]: Document(d["id"], d["title"], d["text"]) for d in docs_file["documents"]}
    bundles = tuple(tuple(b) for b in docs_file["bundles"])
    questions = tuple(Question(q["id"], q["kind"], tuple(q["docs"]), q["question"], tuple(q["answers"]))
                      for q in questions_file["questions"])
    library = tuple(docs_file.get("library") or [d for b in bundles for d in b])
    if sorted(library) != sorted(documents):
        raise ValueError("the library order must list every document once")
    dataset = Dataset(documents, bundles, questions, library, "shipped" if data_dir == DATA_DIR else name)
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


def library_name(dataset: Dataset) -> str:
    return f"fidelity-{dataset.name}-library"


def library_schema(dataset: Dataset) -> str:
    """PML schema holding every document, in library order."""
    parts = "".join(_module(dataset.documents[d]) for d in dataset.library)
    return f'<schema name="{library_name(dataset)}"><system>{escape(SYSTEM)}{parts}</system></schema>'


def distractor(dataset: Dataset, question: Question) -> str:
    """The document a library-layout prompt imports besides the question's own: a third of the
    library after the question's first document (the next one not needed), a fixed rule."""
    n = len(dataset.library)
    at = dataset.library.index(question.docs[0]) + n // 3 + 1
    while dataset.library[at % n] in question.docs:
        at += 1
    return dataset.library[at % n]


def imported(dataset: Dataset, question: Question, layout: str = "bundle") -> tuple[str, ...]:
    """The documents a question's prompt imports, in the order it lists them (schema order)."""
    if layout == "library":
        chosen = {*question.docs, distractor(dataset, question)}
        return tuple(d for d in dataset.library if d in chosen)
    return dataset.bundles[dataset.bundle_of(question)]


def prompt(dataset: Dataset, question: Question, scaffold: bool = False, layout: str = "bundle",
           placement: str = "schema") -> str:
    """PML prompt importing the question's bundle (through the scaffold schema if ``scaffold``), or
    with ``layout="library"`` its documents and a distractor from the library schema;
    ``placement`` as in PML (``schema`` or ``compact``)."""
    imports = "".join(f"<{d}/>" for d in imported(dataset, question, layout))
    if layout == "library":
        name = library_name(dataset)
    else:
        name = schema_name(dataset.bundle_of(question), question.docs if scaffold else ())
    return (f'<prompt schema="{name}" placement="{placement}">{imports}<user>{escape(question.question)}</user>'
            '<assistant/></prompt>')
