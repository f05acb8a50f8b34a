#!/usr/bin/env bash
# Drive `kvscope serve --http` with the clients its users bring, unchanged: guidellm, aiperf and the
# official openai client, then the same against an --api-key server (refused without the key, served
# with it). Writes every tool's own result, /metrics scraped around each run, and summary.md (the
# table docs/HTTP.md "Clients tried" shows). Not part of the test suite: the tools live in their own
# venv (they pull uvloop/httptools, which uvicorn would pick up if they shared kvscope's).
#
#   python3 -m venv /work/clients-venv && /work/clients-venv/bin/pip install guidellm aiperf
#   CLIENTS_VENV=/work/clients-venv benchmarks/clients/run_clients.sh [tiny] [key] [smollm2]
#
# Phases (default: all three): tiny = guidellm + aiperf against --model tiny; key = the same server
# with --api-key, each tool without then with the key; smollm2 = guidellm + aiperf against the real
# model, then aiperf with --extra-inputs min_tokens:N and ignore_eos:true (one model load for all).
# Environment: CLIENTS_VENV (or GUIDELLM / AIPERF, the two commands), KVSCOPE (default: kvscope),
# PYTHON (a python with openai and transformers: kvscope's venv), TOKENIZER (an HF tokenizer folder;
# made from the cached SmolLM2 GGUF when missing), OUT (default: benchmarks/clients/out), PORT, N, N_EXTRA.
# A server already answering on PORT is used as it is (and left running), for the phase it fits.
set -euo pipefail

CLIENTS_VENV=${CLIENTS_VENV:-/work/clients-venv}
GUIDELLM=${GUIDELLM:-$CLIENTS_VENV/bin/guidellm}
AIPERF=${AIPERF:-$CLIENTS_VENV/bin/aiperf}
KVSCOPE=${KVSCOPE:-kvscope}
PYTHON=${PYTHON:-python}
TOKENIZER=${TOKENIZER:-/tmp/kvscope-clients-tokenizer}
OUT=${OUT:-bench/clients/out}
PORT=${PORT:-18127}
N=${N:-20}                      # requests per run
N_EXTRA=${N_EXTRA:-8}           # requests per --extra-inputs run
KEY=${KEY:-kvscope-clients-key}
URL=http://127.0.0.1:$PORT
PHASES=${*:-tiny key smollm2}
mkdir -p "$OUT"
SERVER_PID=

log() { echo "== $*" >&2; }

tokenizer() {  # the tools count tokens with an HF tokenizer; the hub is not needed: SmolLM2's GGUF has one
    [ -f "$TOKENIZER/tokenizer.json" ] && return
    HF_HUB_OFFLINE=1 "$PYTHON" - "$TOKENIZER" <<'PY'
import glob, os, sys
from transformers import AutoTokenizer
folder = os.path.expanduser("~/.cache/kvscope/models/smollm2-135m")
gguf = os.path.basename(glob.glob(f"{folder}/*.gguf")[0])
AutoTokenizer.from_pretrained(folder, gguf_file=gguf, local_files_only=True).save_pretrained(sys.argv[1])
PY
}

serve() {  # serve MODEL [ARGS...]: start the server, wait for /health
    local model=$1; shift
    if curl -sf "$URL/health" >/dev/null; then  # one already listening (started by hand): used as is
        log "using the server already on $URL"; return
    fi
    "$KVSCOPE" serve --http "127.0.0.1:$PORT" --model "$model" --no-progress "$@" >"$OUT/serve-$model.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 600); do
        curl -sf "$URL/health" >/dev/null && return
        kill -0 "$SERVER_PID" 2>/dev/null || { cat "$OUT/serve-$model.log" >&2; exit 1; }
        sleep 1
    done
    echo "server did not come up" >&2; exit 1
}

stop() {
    [ -n "$SERVER_PID" ] || return 0
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=
}
trap stop EXIT

scrape() { curl -s "$URL/metrics" >"$OUT/$1"; }

guidellm() {  # guidellm NAME MODEL [BACKEND_EXTRA]: a synchronous run of N short requests
    local name=$1 model=$2 extra=${3:-}
    log "guidellm $name"
    scrape "$name.metrics-before"
    HF_HUB_OFFLINE=1 "$GUIDELLM" run \
        --backend "kind=openai_http,target=$URL,model=$model$extra" \
        --profile kind=synchronous \
        --constraint "kind=max_requests,count=$N" --constraint kind=max_duration,seconds=300 \
        --data kind=synthetic_text,prompt_tokens=32,output_tokens=16 \
        --tokenizer "kind=hf_auto,model=$TOKENIZER" \
        --output "kind=json,path=$OUT/$name.json" --disable-progress >"$OUT/$name.log" 2>&1 \
        || echo "guidellm $name: exit $?" >&2
    scrape "$name.metrics-after"
}

aiperf() {  # aiperf NAME MODEL [ARGS...]: N streamed chat requests of OSL (16) tokens, 2 at a time
    local name=$1 model=$2; shift 2
    log "aiperf $name"
    rm -rf "${OUT:?}/$name"
    scrape "$name.metrics-before"
    # No HF_HUB_OFFLINE here: aiperf 0.13 then looks a local tokenizer path up as a hub repo id and
    # fails; a path is never looked up on the hub anyway.
    "$AIPERF" profile --model "$model" --url "$URL" --endpoint-type chat --streaming \
        --tokenizer "$TOKENIZER" --request-count "$N" --concurrency 2 \
        --isl 32 --isl-stddev 0 --osl "${OSL:-16}" --osl-stddev 0 \
        --ui none --workers-max 2 --artifact-dir "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1 \
        || echo "aiperf $name: exit $?" >&2
    scrape "$name.metrics-after"
}

openai_client() {  # openai_client NAME [KEY]: one chat and one streamed completion with the official client
    log "openai $1"
    "$PYTHON" - "$URL/v1" "${2:-}" >"$OUT/$1.openai.txt" 2>&1 <<'PY' || true
import os, sys
import openai
key = sys.argv[2] or os.environ.get("OPENAI_API_KEY", "none")  # the client's own variable
client = openai.OpenAI(base_url=sys.argv[1], api_key=key, max_retries=0)
try:
    chat = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hi"}])
    stream = client.completions.create(model=chat.model, prompt="Hello", max_tokens=8, stream=True)
    print("ok", chat.usage.completion_tokens, "tokens;", sum(1 for _ in stream), "chunks")
except openai.APIStatusError as e:
    print("refused", e.status_code, e.body)
PY
    cat "$OUT/$1.openai.txt" >&2
}

eos_check() {  # eos_check NAME: a chat answer that ends at EOS, then the same with min_tokens / ignore_eos
    log "openai $1"
    "$PYTHON" - "$URL/v1" >"$OUT/$1.openai.txt" 2>&1 <<'PY' || true
import sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="none", max_retries=0, timeout=600)
for extra in ({}, {"min_tokens": 48}, {"ignore_eos": True}):
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=48, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi"}], extra_body=extra)
    print(extra or "plain", r.usage.completion_tokens, "tokens, finish_reason", r.choices[0].finish_reason)
PY
    cat "$OUT/$1.openai.txt" >&2
}

refused() {  # refused NAME: a plain request without the key gets OpenAI's 401
    curl -s -o "$OUT/$1.401.json" -w "%{http_code}\n" "$URL/v1/models" >"$OUT/$1.401.status"
    log "no key: HTTP $(cat "$OUT/$1.401.status") $(cat "$OUT/$1.401.json")"
}

tokenizer
for phase in $PHASES; do
    case $phase in
    tiny)
        serve tiny
        openai_client tiny-openai
        guidellm tiny-guidellm tiny
        aiperf tiny-aiperf tiny --use-server-token-count  # tiny's byte tokenizer is not SmolLM2's
        stop ;;
    key)
        serve tiny --api-key "$KEY"
        refused key
        openai_client key-openai-nokey
        openai_client key-openai-key "$KEY"
        OPENAI_API_KEY=$KEY openai_client key-openai-envkey
        N=5 guidellm key-guidellm-nokey tiny
        guidellm key-guidellm-key tiny ",api_key=$KEY"
        N=5 aiperf key-aiperf-nokey tiny --use-server-token-count
        aiperf key-aiperf-key tiny --use-server-token-count --api-key "$KEY"
        stop ;;
    smollm2)
        serve smollm2-135m
        openai_client smollm2-openai
        eos_check smollm2-eos  # "Say hi" ends at EOS before 48 tokens, unless min_tokens / ignore_eos say not
        # aiperf's synthetic prompts run to 48 tokens anyway; these show it sends the fields and is answered
        N=$N_EXTRA OSL=48 aiperf smollm2-extra-none smollm2-135m
        N=$N_EXTRA OSL=48 aiperf smollm2-extra-min-tokens smollm2-135m --extra-inputs min_tokens:48
        N=$N_EXTRA OSL=48 aiperf smollm2-extra-ignore-eos smollm2-135m --extra-inputs ignore_eos:true
        guidellm smollm2-guidellm smollm2-135m
        aiperf smollm2-aiperf smollm2-135m
        stop ;;
    *) echo "unknown phase $phase (tiny, key, smollm2)" >&2; exit 2 ;;
    esac
done
python3 "$(dirname "$0")/summarise.py" "$OUT" | tee "$OUT/summary.md"
