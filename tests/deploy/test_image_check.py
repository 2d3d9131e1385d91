"""``make image-check``'s clean-up and port choice, run against a fake ``podman`` (the real build takes
minutes; CI runs it after the tests): it asks podman for a free host port instead of a fixed one, and
every container it starts is gone after any exit, a failure or a signal, or after the next run when
it was killed outright."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs image_check.sh end to end

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "image" / "image_check.sh"

# A podman that keeps its containers as files in $FAKE_STATE (name -> labels) and logs its calls.
FAKE_PODMAN = r"""#!/usr/bin/env bash
state=$FAKE_STATE
echo "$*" >> "$state/calls"
cmd=$1; shift
case $cmd in
  image) [[ $1 == exists || $1 == inspect ]] && { [[ $1 == inspect ]] && echo sha256:fake; exit 0; } ;;
  build|rmi|stop|logs|top) exit 0 ;;
  run)
    name= label= port=
    while (($#)); do
      case $1 in
        --name) name=$2; shift ;;
        --label) label=$2; shift ;;
        -p) port=$2; shift ;;
      esac
      shift
    done
    if [[ $port =~ ^127\.0\.0\.1:([0-9]+):8000$ ]]; then
      python3 -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "${BASH_REMATCH[1]}" 2>/dev/null \
        || { echo "Error: rootlessport listen tcp 127.0.0.1:${BASH_REMATCH[1]}: bind: address already in use" >&2; exit 126; }
    fi
    echo "${label#*=}" > "$state/c.$name"; echo "id-$name" ;;
  port) echo "127.0.0.1:$FAKE_FREE_PORT" ;;
  inspect) echo true ;;
  exec) [[ $* == *pypi.org* ]] && exit 1; exit 0 ;;
  rm)
    for a in "$@"; do rm -f "$state/c.$a"; done ;;
  ps)
    for f in "$state"/c.*; do [[ -e $f ]] && echo "${f##*/c.} $(cat "$f")"; done ;;
esac
exit 0
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir(), state.mkdir()
    (bin_dir / "podman").write_text(FAKE_PODMAN)
    for tool in ("runc", "debootstrap"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PORT", "IMAGE", "BASE_IMAGE")}
    # Nothing listens on the port podman "published": /health never answers, so the check fails there.
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_STATE=str(state), FAKE_FREE_PORT=str(_free_port()),
               HEALTH_TIMEOUT="3", PYTHON="python3")  # fmt: skip
    return env


def _containers(env: dict[str, str]) -> list[str]:
    return sorted(p.name for p in Path(env["FAKE_STATE"]).glob("c.*"))


def _calls(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_STATE"]) / "calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.skipif(not Path("/usr/bin/curl").exists() and not Path("/bin/curl").exists(), reason="needs curl")
def test_a_free_port_and_no_container_left_after_a_failure(fake: dict[str, str]) -> None:
    r = subprocess.run(["bash", str(SCRIPT)], env=fake, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no /health within 3 s" in r.stdout, r.stdout + r.stderr
    runs = [c for c in _calls(fake) if c.startswith("run ")]
    assert len(runs) == 2 and "-p 127.0.0.1::8000" in runs[1], runs  # podman picks the host port
    assert all("--label servelm-image-check=" in c for c in runs), runs
    assert _containers(fake) == [], "a container was left behind"


def test_a_taken_port_fails_by_name_and_leaves_nothing(fake: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            ["bash", str(SCRIPT)], env={**fake, "PORT": str(port)}, capture_output=True, text=True, timeout=120
        )
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"is port {port} taken?" in r.stdout, r.stdout
    assert _containers(fake) == []


@pytest.mark.skipif(not Path("/usr/bin/curl").exists() and not Path("/bin/curl").exists(), reason="needs curl")
def test_a_signal_removes_the_containers_and_a_killed_runs_are_removed_next_time(fake: dict[str, str]) -> None:
    env = {**fake, "HEALTH_TIMEOUT": "60"}
    p = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not any(c.startswith("c.servelm-image-check-") and not c.endswith("-offline") for c in _containers(fake)):
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=30)[0]
    assert p.returncode == 143, out
    assert _containers(fake) == [], out
    # SIGKILL cannot be trapped: the next run removes what the dead one left.
    p = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not _containers(fake):
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.1)
    p.kill()
    p.wait()
    left = _containers(fake)
    assert left, "nothing to clean up: the test did not leave a container"
    r = subprocess.run(
        ["bash", str(SCRIPT)], env={**fake, "HEALTH_TIMEOUT": "1"}, capture_output=True, text=True, timeout=120
    )
    assert "left by an earlier run" in r.stdout, r.stdout
    assert _containers(fake) == []
