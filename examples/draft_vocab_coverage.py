"""Measure draft-vocabulary coverage for SmolLM2 (issue 3): build the top-N vocabulary on one half of the
assistant tokens and report coverage on both halves.

    SPECFRAME_HOME=... python examples/draft_vocab_coverage.py [--data sharegpt --limit 1000] [--data default]
"""

from __future__ import annotations

import argparse
import json

from transformers import AutoTokenizer

from specframe.data.chat import encode_dataset
from specframe.data.sources import load_data
from specframe.targets import ensure_default_target
from specframe.drafting.vocab import build_draft_vocab, count_tokens, coverage

ap = argparse.ArgumentParser()
ap.add_argument("--data", action="append", default=None)
ap.add_argument("--limit", type=int, default=1000)
ap.add_argument("--max-length", type=int, default=4096)
args = ap.parse_args()
tok = AutoTokenizer.from_pretrained(ensure_default_target())
records = [r for d in (args.data or ["sharegpt", "gsm8k"]) for r in load_data(d, limit=args.limit)]
ex = list(encode_dataset(tok, records, max_length=args.max_length))
fit, held = ex[0::2], ex[1::2]
c_fit, c_held = count_tokens(fit, len(tok)), count_tokens(held, len(tok))
out = {"data": args.data or ["sharegpt", "gsm8k"], "limit_per_source": args.limit, "conversations": len(ex),
       "assistant_tokens": int(c_fit.sum() + c_held.sum()), "distinct_tokens": int(((c_fit + c_held) > 0).sum()), "n": {}}
for n in (2048, 4096, 8192, 16384, 32000):
    v = build_draft_vocab(c_fit, n)
    out["n"][n] = {"coverage_fit_half": round(v.coverage, 4), "coverage_held_out_half": round(coverage(v, c_held), 4)}
print(json.dumps(out, indent=1))
