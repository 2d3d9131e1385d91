#!/usr/bin/env bash
# make image-check: build the CPU image with podman from a local Debian base, run it, and check it.
#
#   docker/image/image_check.sh
#
# 1. builds (or reuses) the local base image (build_base.sh: debootstrap + podman import);
# 2. builds the `cpu` target with the host's package index (read from `pip config list`; local
#    file:// indexes and find-links folders are bind-mounted read-only into the build at the same paths);
# 3. runs it with --network none and waits for /health (the image's HEALTHCHECK command): it must start
#    from the baked-in model with no way out;
# 4. runs it with -p on a free loopback port (podman picks it), waits for /health, asks the default model for a chat completion, reads /metrics, checks the server
#    runs as the non-root user, and that `podman stop` (SIGTERM) drains and exits 0;
# 5. prints the image size, the build time and the time to healthy, and removes what it created
#    (the base image, the built image and the layer cache stay, so a second run is fast).
# Every container it starts is labelled with its pid and removed on any exit, a signal included; a
# later run removes those of a run that was killed outright.
#
# Environment: IMAGE (tag, localhost/servelm:cpu), BASE_IMAGE, PORT (default: a free one), HEALTH_TIMEOUT (600 s),
# TORCH_INDEX_URL (default: the host's index), KEEP_IMAGE=0 to remove the built image as well.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
BASE_IMAGE=${BASE_IMAGE:-localhost/servelm-base:bookworm}
IMAGE=${IMAGE:-localhost/servelm:cpu}
PORT=${PORT:-}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
NAME=servelm-image-check-$$
LIMITS=(--runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
PY=${PYTHON:-python3}

say() { printf 'image-check: %s\n' "$*"; }
fail() { say "FAIL: $*"; exit 1; }

LABEL=servelm-image-check
cleanup() {
    local c
    for c in "$NAME" "$NAME-offline"; do podman rm -f --ignore -t 0 "$c" >/dev/null 2>&1 || true; done
    if [[ ${KEEP_IMAGE:-1} == 0 ]]; then podman rmi -f "$IMAGE" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
# A signal ends the script through exit, so the EXIT trap removes the containers.
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM
# Containers of an earlier run that was killed (its pid gone) are removed.
while read -r c pid; do
    [[ -n $c ]] || continue
    if [[ -z $pid ]] || ! kill -0 "$pid" 2>/dev/null; then
        say "removing $c, left by an earlier run (pid ${pid:-?})"
        podman rm -f --ignore -t 0 "$c" >/dev/null 2>&1 || true
    fi
done < <(podman ps -a --filter "label=$LABEL" --format "{{.Names}} {{index .Labels \"$LABEL\"}}" 2>/dev/null || true)

BASE_IMAGE=$BASE_IMAGE "$HERE/build_base.sh"

# ----------------------------------------------------------------------------- the host's package index
# `pip config list` prints section.key='value'; environment (:env:) entries win over files.
declare -A PIPCFG=()
while IFS= read -r line; do
    [[ $line =~ ^([^.]*)\.([a-z-]+)=\'(.*)\'$ ]] || continue
    sect=${BASH_REMATCH[1]} key=${BASH_REMATCH[2]} val=${BASH_REMATCH[3]}
    case $key in index-url | extra-index-url | find-links | trusted-host | cert) ;; *) continue ;; esac
    if [[ $sect == ":env:" || -z ${PIPCFG[$key]:-} ]]; then PIPCFG[$key]=$val; fi
done < <("$PY" -m pip config list 2>/dev/null || true)
for key in index-url extra-index-url find-links trusted-host cert; do
    [[ -n ${PIPCFG[$key]:-} ]] && say "host pip $key: ${PIPCFG[$key]}"
done

BUILD_ARGS=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
MOUNTS=()
declare -A MOUNTED=()
mount_local() {  # bind-mount a file:// URL's or a path's folder read-only at the same place
    local p=$1 up=${2:-}
    p=${p#file://}
    p=${p%/}
    [[ $p == /* && -d $p ]] || return 0
    # An index's pages link to files beside it (/x/simple/pkg/ -> ../../files/...): mount its parent.
    if [[ -n $up && $(dirname "$p") != / ]]; then p=$(dirname "$p"); fi
    [[ -z ${MOUNTED[$p]:-} ]] || return 0
    MOUNTED[$p]=1
    MOUNTS+=(-v "$p:$p:ro")
}
for key in index-url extra-index-url find-links trusted-host; do
    val=${PIPCFG[$key]:-}
    [[ -n $val ]] || continue
    var=PIP_$(tr 'a-z-' 'A-Z_' <<<"$key")
    BUILD_ARGS+=(--build-arg "$var=$val")
    [[ $key == trusted-host ]] && continue
    up=1
    [[ $key == find-links ]] && up=
    for item in $val; do mount_local "$item" $up; done
done
# The host's CA bundle for pip (a host behind a TLS-inspecting proxy trusts its CA there): mounted
# read-only at a fixed place in the build, for pip only.
if [[ -n ${PIPCFG[cert]:-} && -f ${PIPCFG[cert]} ]]; then
    MOUNTS+=(-v "$(readlink -f "${PIPCFG[cert]}"):/run/servelm-build/pip-cert.pem:ro")
    BUILD_ARGS+=(--build-arg "PIP_CERT=/run/servelm-build/pip-cert.pem")
fi
# torch: from the host's own index (its CPU wheel, find-links and extra indexes apply too) unless given.
TORCH_INDEX_URL=${TORCH_INDEX_URL:-${PIPCFG[index-url]:-https://pypi.org/simple}}
BUILD_ARGS+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
mount_local "$TORCH_INDEX_URL" 1

# ----------------------------------------------------------------------------- build
say "building $IMAGE (target cpu) from $BASE_IMAGE"
old_id=$(podman image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
t0=$(date +%s)
podman build "${LIMITS[@]}" --format docker --network host --layers --target cpu -t "$IMAGE" \
    "${BUILD_ARGS[@]}" "${MOUNTS[@]}" -f "$REPO/Dockerfile" "$REPO"
build_s=$(( $(date +%s) - t0 ))
say "built in ${build_s} s"
# The image this build replaced (now untagged): remove it, its layers shared with the new one stay.
new_id=$(podman image inspect -f '{{.Id}}' "$IMAGE")
if [[ -n $old_id && $old_id != "$new_id" ]]; then podman rmi "$old_id" >/dev/null 2>&1 || true; fi

# ----------------------------------------------------------------------------- 1: start with no network
# Podman 4.3's internal networks do not forward published ports, so "offline" is checked on its own:
# a container with no network at all must come up healthy (the image's own HEALTHCHECK command) from
# the baked-in model. Its time to healthy is the one reported.
wait_healthy() {  # $1: container, $2: probe command...; sets healthy_s, counted from T0 (before `run`)
    local c=$1 t0=$T0
    shift
    while ! "$@" >/dev/null 2>&1; do
        if [[ $(podman inspect -f '{{.State.Running}}' "$c") != true ]]; then
            podman logs --tail 40 "$c" || true
            fail "$c exited before /health answered"
        fi
        if (( $(date +%s) - ${t0%.*} >= HEALTH_TIMEOUT )); then
            podman logs --tail 40 "$c" || true
            fail "no /health within ${HEALTH_TIMEOUT} s"
        fi
        sleep 0.5
    done
    healthy_s=$("$PY" -c "import time; print(f'{time.time() - $t0:.1f}')")
}
# No systemd here for podman's health timers: the probe runs the image's HEALTHCHECK by hand.
T0=$(date +%s.%N)
podman run -d --name "$NAME-offline" --label "$LABEL=$$" "${LIMITS[@]}" --network none --no-healthcheck "$IMAGE" >/dev/null
wait_healthy "$NAME-offline" podman exec "$NAME-offline" python -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
offline_healthy_s=$healthy_s
if podman exec "$NAME-offline" python -c "import socket; socket.create_connection(('pypi.org', 443), timeout=5)" 2>/dev/null; then
    fail "the --network none container reached pypi.org"
fi
say "--network none: healthy after ${offline_healthy_s} s, no way out (the model is baked in)"
podman rm -f -t 10 "$NAME-offline" >/dev/null

# ----------------------------------------------------------------------------- 2: on a loopback port
# A fixed port may be taken (podman then exits 126): by default podman picks a free one, read back.
T0=$(date +%s.%N)
podman run -d --name "$NAME" --label "$LABEL=$$" "${LIMITS[@]}" --no-healthcheck -p "127.0.0.1:$PORT:8000" "$IMAGE" >/dev/null \
    || fail "podman run -p 127.0.0.1:$PORT:8000 failed${PORT:+ (is port $PORT taken? leave PORT unset for a free one)}"
published=$(podman port "$NAME" 8000/tcp | head -n 1)
PORT=${published##*:}
[[ $PORT =~ ^[0-9]+$ ]] || fail "no published port for $NAME: '$published'"
URL=http://127.0.0.1:$PORT
wait_healthy "$NAME" curl -fsS -m 2 "$URL/health"
say "-p 127.0.0.1:$PORT:8000: healthy after ${healthy_s} s"

model=$(curl -fsS -m 10 "$URL/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
reply=$(curl -fsS -m 120 "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 16, \"temperature\": 0}") \
    || fail "chat completion failed"
text=$("$PY" -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["choices"][0]["message"]["content"])' "$reply")
[[ -n ${text//[[:space:]]/} ]] || fail "empty chat completion: $reply"
say "chat completion ($model): ${text//$'\n'/ }"

metrics=$(curl -fsS -m 10 "$URL/metrics") || fail "/metrics not served"
grep -q '^# TYPE' <<<"$metrics" || fail "/metrics is not Prometheus text"
say "/metrics served ($(grep -c '^# TYPE' <<<"$metrics") metric families)"

uid=$(podman exec "$NAME" id -u)
[[ $uid != 0 ]] || fail "the container runs as root"
top=$(podman top "$NAME" user huser pid args)
grep -q servelm <<<"$top" || fail "no servelm process in podman top"
grep -qE '^root\s' <<<"$top" && fail "a process runs as root: $top"
say "runs as uid $uid:"
sed 's/^/    /' <<<"$top"

# ----------------------------------------------------------------------------- SIGTERM drains, exits 0
podman stop -t 60 "$NAME" >/dev/null
code=$(podman inspect -f '{{.State.ExitCode}}' "$NAME")
podman logs --tail 8 "$NAME" 2>&1 | sed 's/^/    /'
[[ $code == 0 ]] || fail "podman stop: exit code $code (want 0)"
say "podman stop (SIGTERM): drained, exit code 0"

size=$(podman image inspect -f '{{.Size}}' "$IMAGE")
say "image $IMAGE: $(numfmt --to=si --suffix=B "$size") ($size bytes); build ${build_s} s; healthy after ${offline_healthy_s} s (--network none), ${healthy_s} s (-p)"
say "PASS"
