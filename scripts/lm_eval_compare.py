"""Check lm-evaluation-harness's logged loglikelihoods against transformers' float32 model.

    python scripts/lm_eval_compare.py MODEL_DIR RESULTS_DIR   # (scripts/lm_eval_check.sh runs it)

For every logged request (context, continuation): the tokens are split as lm-eval splits them (the
whole text encoded, the context's own encoding as its prefix), the model scores the whole sequence in
one forward, and the continuation's summed logprob and "every continuation token is the argmax" are
compared with what lm-eval got from the server. Exits 1 past ``TOLERANCE`` or on an is_greedy mismatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TOLERANCE = 1e-3


def main(model_dir: str, results: str) -> int:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = sorted(Path(results).rglob("samples_*.jsonl"))
    if not samples:
        print(f"no samples_*.jsonl under {results}")
        return 1
    worst, pairs, greedy_mismatch = 0.0, 0, 0
    for line in samples[-1].read_text().splitlines():
        s = json.loads(line)
        for args, resp in zip(s["arguments"].values(), s["resps"]):
            ctx, cont = args["arg_0"], args["arg_1"]
            whole = tok.encode(ctx + cont)
            n_ctx = len(tok.encode(ctx))
            with torch.inference_mode():
                lp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
            rows = range(n_ctx - 1, len(whole) - 1)
            ll = sum(lp[r, whole[r + 1]].item() for r in rows)
            greedy = all(int(lp[r].argmax()) == whole[r + 1] for r in rows)
            got_ll, got_greedy = float(resp[0][0]), str(resp[0][1]) == "True"
            worst = max(worst, abs(ll - got_ll))
            greedy_mismatch += greedy != got_greedy
            pairs += 1
    print(
        f"{pairs} loglikelihood requests: max |servelm - transformers float32| = {worst:.2e}; is_greedy differs on {greedy_mismatch}"
    )
    return 0 if pairs and worst <= TOLERANCE and not greedy_mismatch else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
