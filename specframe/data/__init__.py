"""Data: conversation sources (``sources``), the data specs users type (``specs``: ``load_data``), chat-template encoding with assistant-only loss masks (``chat``),
evaluation prompt sets (``evalsets``), self-distillation (``regenerate``) and the committed default set (``default``).
"""

from specframe.data.chat import EncodeStats, Encoded, encode_conversation, encode_dataset, encode_prompt
from specframe.data.sources import (
    load_chat_file,
    load_gsm8k,
    load_humaneval,
    load_mtbench,
    load_sharegpt,
    read_jsonl,
)
from specframe.data.specs import load_data

__all__ = [
    "EncodeStats",
    "Encoded",
    "encode_conversation",
    "encode_dataset",
    "encode_prompt",
    "load_chat_file",
    "load_data",
    "load_gsm8k",
    "load_humaneval",
    "load_mtbench",
    "load_sharegpt",
    "read_jsonl",
]
