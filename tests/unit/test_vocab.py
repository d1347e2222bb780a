"""Draft vocabulary (top-N masked tokens, EAGLE-3 d2t/t2d) and the mask-token rule."""

from __future__ import annotations

import pytest
import torch

from specframe.data.chat import encode_dataset
from specframe.errors import SpecframeError
from specframe.drafting.vocab import DraftVocab, build_draft_vocab, count_tokens, coverage, mask_token_ids
from tests.target_fixtures import chat_records


def test_top_n_with_ties_and_maps(tmp_path):
    counts = torch.tensor([0, 5, 3, 3, 9, 0, 3, 1])
    v = build_draft_vocab(counts, 4)
    assert v.ids.tolist() == [1, 2, 3, 4]  # 4, 1, then the tie 2/3/6 broken towards lower ids; sorted ascending
    assert v.d2t.tolist() == [1, 1, 1, 1]
    assert v.t2d.tolist() == [False, True, True, True, True, False, False, False]
    assert v.coverage == pytest.approx(20 / 24)
    assert v.to_target(torch.arange(4)).tolist() == [1, 2, 3, 4]
    assert v.to_draft(torch.tensor([4, 6, 1])).tolist() == [3, -1, 0]
    assert coverage(v, torch.tensor([0, 1, 0, 0, 0, 0, 1, 0])) == 0.5
    v.save(tmp_path / "v.safetensors")
    w = DraftVocab.load(tmp_path / "v.safetensors")
    assert torch.equal(w.ids, v.ids) and torch.equal(w.d2t, v.d2t) and w.coverage == v.coverage
    # fewer distinct tokens than N: the lowest unseen ids fill the rest
    assert build_draft_vocab(torch.tensor([0, 0, 7, 0]), 3).ids.tolist() == [0, 1, 2]
    with pytest.raises(SpecframeError, match="draft vocabulary size 9 must be in 1..8"):
        build_draft_vocab(counts, 9)


def test_counts_only_assistant_tokens(tiny):  # noqa: F811
    ex = list(encode_dataset(tiny.tokenizer, chat_records(5)))
    masked = count_tokens(ex, tiny.vocab_size)
    everything = count_tokens(ex, tiny.vocab_size, masked_only=False)
    assert int(masked.sum()) == sum(sum(e.loss_mask) for e in ex) < int(everything.sum())
    im_start = tiny.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert masked[im_start] == 0 and everything[im_start] > 0
    with pytest.raises(SpecframeError, match="outside the target vocabulary"):
        count_tokens(ex, 10)


def test_mask_token_ids_rule(tiny):  # noqa: F811
    tok = tiny.tokenizer
    reserved = [tok.convert_tokens_to_ids(f"<|reserved_{i}|>") for i in range(4)]
    assert mask_token_ids(tok, 2) == reserved[:2]
    used = torch.zeros(tiny.vocab_size, dtype=torch.long)
    used[reserved[0]] = 1  # occurs in the training data: never a mask token
    assert mask_token_ids(tok, 3, data_counts=used) == reserved[1:4]
    # embedding rows beyond the tokenizer come before the special tokens (the references' reserved id: Qwen3's
    # 151669, the first row past its tokenizer, where a special token such as <|object_ref_start|> would come first
    # otherwise)
    assert mask_token_ids(tok, 6, embedding_rows=len(tok) + 2) == [len(tok), len(tok) + 1] + reserved
    assert mask_token_ids(tok, 1, embedding_rows=len(tok) + 1) == [len(tok)]
    with pytest.raises(SpecframeError, match=r"^only 4 token ids qualify as mask tokens \(special/reserved, unused by "
                                             r"the chat template and absent from the training data\), 5 needed"):
        mask_token_ids(tok, 5)


def test_mask_token_ids_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from specframe.targets import ensure_default_target

    tok = AutoTokenizer.from_pretrained(ensure_default_target())
    ids = mask_token_ids(tok, 4)
    assert ids == [3, 4, 5, 6]
    assert tok.convert_ids_to_tokens(ids) == ["<repo_name>", "<reponame>", "<file_sep>", "<filename>"]
