"""Fidelity evaluation of modular KV reuse on a document-QA set shipped with the project
(``python -m perf.fidelity``, ``promptcache eval``). See ``docs/fidelity.md``."""
