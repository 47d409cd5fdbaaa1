"""How big each experiment is: the quick and full CPU settings and a tiny one for tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

EXPERIMENTS = ("ttft", "workloads", "hit_ratio", "amortisation", "memory", "decode", "concurrency", "llamacpp")


@dataclass
class SuiteConfig:
    """Sizes in tokens; ``repeats`` interleaved rounds per measurement (median and spread)."""

    name: str = "full"
    repeats: int = 5
    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 6144, 8064])
    """TTFT vs prompt length: document module sizes (the prompt adds a short question)."""
    ttft_repeats: int | None = None
    """Rounds for TTFT vs length (default ``repeats``): its ratios to the floor are a few percent,
    so they need more rounds than the workloads' ratios of several times."""
    doc_qa_tokens: int = 4096
    rag_docs: int = 12
    rag_doc_tokens: int = 384
    rag_k: int = 5
    template_system_tokens: int = 1024
    code_files: int = 8
    code_file_tokens: int = 384
    queries: int = 6
    """Queries per workload stream (the first one is reported apart: nothing is reusable yet)."""
    check_tokens: int = 16
    """Tokens generated per query when comparing outputs (timed runs generate one)."""
    hit_ratio_tokens: int = 4096
    hit_ratios: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 0.9, 1.0])
    amortisation_tokens: list[int] = field(default_factory=lambda: [512, 2048, 8000])
    decode_context_tokens: int = 2048
    decode_tokens: int = 64
    prefix_block_size: int = 256
    concurrency_streams: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    concurrency_requests: int = 2
    """Requests each concurrent client sends, back to back."""
    concurrency_tokens: int = 32
    peer_contexts: list[int] = field(default_factory=lambda: [4096, 8064])
    """Document sizes of the llama.cpp comparison (the prompt adds a chat template and a question)."""
    peer_threads: int = 2
    peer_flash: bool = False
    """Also run llama.cpp with flash attention (slower for its hits and decode on these CPUs)."""
    peer_lookahead: int = 0
    """Also decode with prompt-lookup drafts of up to this many tokens, both engines (0: no)."""
    peer_python: str | None = None
    """A Python with llama-cpp-python (default: ``$PROMPTCACHE_LLAMACPP_PYTHON``, then this one)."""
    experiments: list[str] = field(default_factory=lambda: list(EXPERIMENTS))

    @classmethod
    def full(cls) -> "SuiteConfig":
        return cls()

    @classmethod
    def quick(cls) -> "SuiteConfig":
        """A few minutes on 2 CPU cores with the embedded model."""
        return cls(name="quick", repeats=3, ttft_repeats=9, lengths=[512, 1024, 2048], doc_qa_tokens=1024, rag_docs=8,
                   rag_doc_tokens=256, rag_k=4, template_system_tokens=512, code_files=6, code_file_tokens=192,
                   queries=4, check_tokens=8, hit_ratio_tokens=1024, hit_ratios=[0.0, 0.5, 0.9, 1.0],
                   amortisation_tokens=[512, 2048], decode_context_tokens=1024, decode_tokens=16,
                   concurrency_streams=[1, 2, 4, 8], concurrency_tokens=16, peer_contexts=[2048])

    @classmethod
    def tiny(cls) -> "SuiteConfig":
        """Seconds on a tiny random model: exercises every code path, measures nothing useful."""
        return cls(name="tiny", repeats=2, lengths=[48, 96], doc_qa_tokens=64, rag_docs=4, rag_doc_tokens=24,
                   rag_k=2, template_system_tokens=32, code_files=3, code_file_tokens=24, queries=3,
                   check_tokens=3, hit_ratio_tokens=64, hit_ratios=[0.0, 0.5, 1.0], amortisation_tokens=[32],
                   decode_context_tokens=48, decode_tokens=4, prefix_block_size=16, concurrency_streams=[1, 2],
                   concurrency_requests=1, concurrency_tokens=3, peer_contexts=[48])

    @classmethod
    def named(cls, name: str) -> "SuiteConfig":
        presets = {"full": cls.full, "quick": cls.quick, "tiny": cls.tiny}
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(presets)}")
        return presets[name]()

    def with_overrides(self, **changes) -> "SuiteConfig":
        """A copy with the given fields replaced (``None`` values are ignored)."""
        unknown = [e for e in changes.get("experiments") or [] if e not in EXPERIMENTS]
        if unknown:
            raise ValueError(f"unknown experiments {unknown}; expected some of {', '.join(EXPERIMENTS)}")
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)
