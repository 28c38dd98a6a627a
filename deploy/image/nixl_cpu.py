"""Cuts an installed NIXL backend wheel down to what tandem uses on a CPU host, then proves it works.

PyPI ships NIXL only as CUDA builds: the `nixl` meta package pulls nixl-cu12 and nixl-cu13
(~430 MB installed). Neither links the CUDA runtime: CUDA is reached only through optional
pieces that a CPU host never loads. The CPU image installs `nixl` without its deps and one
backend (nixl-cu12), then this script deletes
  - nixl_ep* (expert-parallel CUDA kernels built against torch, ~100 MB) and the example scripts,
  - every transfer plugin but UCX (what tandem's transceiver creates) and POSIX,
  - UCX's CUDA and GPUDirect modules and its CUDA perftest,
  - every bundled library that no remaining module needs (resolved with ldd),
and creates a NIXL agent with the UCX backend, failing the build if that does not work.

Run inside the image build: python3 nixl_cpu.py [backend package, default nixl_cu12]
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

KEEP_PLUGINS = {"libplugin_UCX.so", "libplugin_POSIX.so"}
GPU_UCX_MODULE = re.compile(r"cuda|gdp|gda|perftest")


def _site_packages(backend: str) -> Path:
    spec = importlib.util.find_spec(backend)
    if spec is None or spec.origin is None:
        raise SystemExit(f"nixl_cpu.py: {backend} is not installed")
    return Path(spec.origin).parent.parent


def _remove(path: Path) -> int:
    if not path.exists():
        return 0
    size = (
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if path.is_dir()
        else path.stat().st_size
    )
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    return size


def _needed(elf: Path) -> set[Path]:
    """Libraries ldd resolves for one shared object (unresolved ones are loaded by a parent already)."""
    out = subprocess.run(["ldd", str(elf)], capture_output=True, text=True, check=False).stdout
    return {Path(m.group(1)).resolve() for m in re.finditer(r"=> (/\S+)", out)}


def prune(backend: str) -> int:
    site = _site_packages(backend)
    libs = site / f"{backend}.libs"
    meson_libs = site / f".{backend}.mesonpy.libs"
    freed = 0
    for path in list(site.glob("nixl_ep*")) + [site / f"{backend}.scripts"]:
        freed += _remove(path)
    for plugin_dir in (libs / "nixl", meson_libs / "plugins"):
        for plugin in plugin_dir.glob("*.so"):
            if plugin.name not in KEEP_PLUGINS:
                freed += _remove(plugin)
    for module in (libs / "ucx").glob("*"):
        if GPU_UCX_MODULE.search(module.name):
            freed += _remove(module)
    kept_modules = [
        p
        for d in (site / backend, meson_libs, libs / "nixl", libs / "ucx")
        for p in d.rglob("*.so*")
    ]
    needed: set[Path] = set()
    for module in kept_modules:
        needed |= _needed(module)
    for lib in libs.iterdir():
        if lib.is_file() and lib.resolve() not in needed:
            freed += _remove(lib)
    return freed


def smoke_test() -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("image-build-probe", nixl_agent_config(backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise SystemExit(
            f"nixl_cpu.py: no UCX backend after pruning (plugins: {agent.get_plugin_list()})"
        )


def main() -> int:
    backend = sys.argv[1] if len(sys.argv) > 1 else "nixl_cu12"
    freed = prune(backend)
    smoke_test()
    print(
        f"nixl_cpu.py: {backend} pruned to its CPU pieces ({freed / 2**20:.0f} MiB removed); UCX agent OK"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
