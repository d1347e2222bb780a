"""Shared fixtures for targets and data tests: the default target (converted once into $SPECFRAME_HOME, or the
user's specframe home when unset, so CI caches it within one run) and tiny random targets."""

from __future__ import annotations

import pytest

# the default target's first 8 greedy ids for PINNED_PROMPT (computed once from the converted GGUF; a broken
# conversion changes them). Decodes to "The capital of France is Paris.<|im_end|>".
PINNED_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
PINNED_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]

_cache: dict = {}


@pytest.fixture(scope="session")
def default_target():
    from specframe.targets import load_target

    if "default" not in _cache:
        _cache["default"] = load_target("default")
    return _cache["default"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A loaded tiny random Llama target (4 layers, hidden 32, ChatML template, 4 reserved special tokens)."""
    from specframe.targets import load_target, tiny_target

    if "tiny" not in _cache:
        _cache["tiny"] = load_target(tiny_target(tmp_path_factory.mktemp("tiny")))
    return _cache["tiny"]


def chat_records(n: int, *, turns: int = 2, source: str = "toy") -> list[dict]:
    """n small deterministic conversations (alternating user / assistant turns)."""
    words = ["add", "the", "fox", "jumps", "over", "clips", "sold", "hello", "world", "return", "a", "b"]
    out = []
    for i in range(n):
        msgs = []
        for t in range(turns):
            role = "user" if t % 2 == 0 else "assistant"
            text = " ".join(words[(i * 7 + t * 3 + k) % len(words)] for k in range(3 + (i + t) % 5))
            msgs.append({"role": role, "content": text})
        out.append({"source": source, "id": str(i), "messages": msgs})
    return out
