#!/usr/bin/env bash
# lm-evaluation-harness against a live servelm, and its loglikelihoods against Hugging Face's:
#
#   bash scripts/lm_eval_check.sh              # after `make setup model` (uses .venv)
#
# Installs lm-eval (pinned below, with its API extra and transformers for the tokenizer; no torch) into
# its own venv under $SERVELM_CACHE/peers, starts `servelm serve $SERVE_ARGS` (default: --quantization
# auto, as `make serve`) on $PORT, and runs lm-eval's `local-completions` model on a 10-question,
# 4-choice task (scripts/lm_eval/tinyfacts.jsonl, no download): 40 loglikelihood requests, each
# `echo` + `logprobs` + `max_tokens: 1` over the context and one choice, $CONCURRENT at a time. Then
# scripts/lm_eval_compare.py recomputes every request with transformers' LlamaForCausalLM (float32) on
# the same token split lm-eval uses and fails if a loglikelihood differs by more than 1e-3 or an
# is_greedy flag differs. Output under $OUT_DIR (default /tmp/servelm-lm-eval).
set -euo pipefail
cd "$(dirname "$0")/.."

LM_EVAL_VERSION="${LM_EVAL_VERSION:-0.4.13}"
CACHE="${SERVELM_CACHE:-$HOME/.cache/servelm}"
VENV="$CACHE/peers/lm-eval-$LM_EVAL_VERSION"
OUT_DIR="${OUT_DIR:-/tmp/servelm-lm-eval}"
PORT="${PORT:-8017}"
CONCURRENT="${CONCURRENT:-4}"
SERVE_ARGS="${SERVE_ARGS:---quantization auto}"
PY=.venv/bin/python
mkdir -p "$OUT_DIR"

if [ ! -x "$VENV/bin/lm_eval" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "lm-eval[api]==$LM_EVAL_VERSION" transformers > "$OUT_DIR/install.log"
fi
model_dir="$("$PY" -m servelm.runtime.model_files)"  # the default model (prints its folder)

task_dir="$OUT_DIR/task"
mkdir -p "$task_dir"
cat > "$task_dir/tinyfacts.yaml" <<YAML
task: tinyfacts
dataset_path: json
dataset_kwargs:
  data_files:
    test: $PWD/scripts/lm_eval/tinyfacts.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
YAML

# shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
.venv/bin/servelm serve --port "$PORT" $SERVE_ARGS > "$OUT_DIR/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $server 2>/dev/null || { cat "$OUT_DIR/server.log"; exit 1; }
    sleep 1
done

rm -rf "$OUT_DIR/results"
HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$VENV/bin/lm_eval" --model local-completions \
    --model_args "model=$(basename "$model_dir"),base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$model_dir,tokenizer_backend=huggingface,num_concurrent=$CONCURRENT,max_retries=1" \
    --include_path "$task_dir" --tasks tinyfacts --log_samples --output_path "$OUT_DIR/results" \
    > "$OUT_DIR/lm_eval.log" 2>&1 || { tail -30 "$OUT_DIR/lm_eval.log"; exit 1; }
grep -E "^\|" "$OUT_DIR/lm_eval.log"
"$PY" scripts/lm_eval_compare.py "$model_dir" "$OUT_DIR/results"
