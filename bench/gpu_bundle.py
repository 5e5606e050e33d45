"""`make gpu-bundle`: what a lent GPU machine needs for issue 44's check and cannot make itself, in one file.

    python bench/gpu_bundle.py [--out gpu-bundle.tar.xz] [--jobs 2] [--force]    # build (or reuse) and check it
    python bench/gpu_bundle.py --check gpu-bundle.tar.xz                          # check one only

A lent machine has no package index and 15 minutes of device time, too few to compile llama.cpp's CUDA backend.
So everything is made here, ahead of time, and carried as one xz tarball (git-ignored; the device tool's `carry`
takes it, within its 64 MiB for the checkout and everything carried):
  llamacpp/bin/      llama-bench, llama-quantize and their shared libraries, stripped: libllama, libggml*, the
                     CUDA backend (sm_90, bench/llamacpp.py: CUDA_ARCHS) and the CPU variants it picks from at run
                     time. They load the lent machine's own libcudart/libcublas (its torch's nvidia wheels):
                     `bench/gpu_check.py` sets LD_LIBRARY_PATH to those.
  llamacpp/convert/  llama.cpp's converter, unmodified: convert_hf_to_gguf.py, conversion/, gguf-py/.
  wheels/            the packages the image lacks, at constraints.txt's versions (gpu_check.wheel_commands).
  MANIFEST.json      llama.cpp's version, CUDA archs, the build's wall time here, the inputs' stamp, every file.
A bundle whose stamp matches the inputs (llama.cpp's version and flags, the wheels' pins) and that passes the
check is reused: nothing is rebuilt or fetched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import llamacpp  # noqa: E402
from moectl.errors import MoectlError  # noqa: E402

DEFAULT_OUT = ROOT / "gpu-bundle.tar.xz"
CARRY_LIMIT = 64 * 2**20                        # the device tool carries at most 64 MiB: checkout + bundle
FORMAT = "moectl-gpu-bundle-v1"
# What a complete bundle holds (paths inside the archive).
REQUIRED = ("MANIFEST.json", "llamacpp/bin/llama-bench", "llamacpp/bin/llama-quantize", "llamacpp/bin/libllama.so",
            "llamacpp/bin/libggml.so", "llamacpp/bin/libggml-base.so", "llamacpp/bin/libggml-cuda.so",
            "llamacpp/convert/convert_hf_to_gguf.py", "llamacpp/convert/conversion/__init__.py",
            "llamacpp/convert/gguf-py/gguf/__init__.py")


def wheel_names() -> tuple[str, ...]:
    """The packages whose wheels the bundle must hold: what the image lacks, and what has no wheel (built here)."""
    return gpu_check.IMAGE_LACKS + gpu_check.NO_WHEEL


def stamp() -> str:
    """A digest of the bundle's inputs: llama.cpp's version, the CUDA build's flags (not this machine's paths) and
    the wheels' pinned versions. A change of any of them makes the bundle again."""
    pins = gpu_check.pinned_versions()
    inputs = {"llamacpp": llamacpp.VERSION, "flags": llamacpp.cmake_flags(cuda=True),
              "targets": llamacpp.cuda_targets(), "wheels": {n: pins.get(gpu_check._norm(n)) for n in wheel_names()}}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def checkout_bytes() -> int:
    """Bytes of the tracked files: the checkout travels with the bundle in the same 64 MiB."""
    p = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    names = [n for n in p.stdout.decode().split("\0") if n]
    return sum((ROOT / n).stat().st_size for n in names if (ROOT / n).is_file())


def _members(bundle: Path) -> dict[str, int]:
    """{path inside: size} of a bundle tarball (or a directory laid out as one)."""
    if bundle.is_dir():
        return {str(p.relative_to(bundle)): p.stat().st_size for p in bundle.rglob("*") if p.is_file()}
    with tarfile.open(bundle) as tf:
        return {m.name.removeprefix("./"): m.size for m in tf.getmembers() if m.isfile()}


def manifest(bundle: Path) -> dict:
    if bundle.is_dir():
        return json.loads((bundle / "MANIFEST.json").read_text())
    with tarfile.open(bundle) as tf:
        return json.load(tf.extractfile("MANIFEST.json"))


def check(bundle: Path, limit: int = CARRY_LIMIT, checkout: int | None = None) -> list[str]:
    """What is wrong with a bundle (empty: complete and small enough): each REQUIRED file, at least one CPU variant,
    a wheel for every package of `wheel_names`, a MANIFEST of this format, and the bundle plus the checkout within
    the device tool's carry limit."""
    if not bundle.exists():
        return [f"no bundle at {bundle}"]
    try:
        have = _members(bundle)
    except (tarfile.TarError, OSError) as e:
        return [f"{bundle} is not a readable tarball: {e}"]
    problems = [f"missing {r}" for r in REQUIRED if r not in have]
    if not any(n.startswith("llamacpp/bin/libggml-cpu-") for n in have):
        problems.append("missing llamacpp/bin/libggml-cpu-*.so (a CPU backend for --n-cpu-moe's experts)")
    wheels = {gpu_check._norm(Path(n).name.split("-")[0]) for n in have if n.startswith("wheels/") and n.endswith(".whl")}
    problems += [f"missing the wheel of {n}" for n in wheel_names() if gpu_check._norm(n) not in wheels]
    if "MANIFEST.json" in have and manifest(bundle).get("format") != FORMAT:
        problems.append(f"MANIFEST.json is not {FORMAT}")
    size = bundle.stat().st_size if bundle.is_file() else sum(have.values())
    total = size + (checkout_bytes() if checkout is None else checkout)
    if total > limit:
        problems.append(f"bundle {size / 2**20:.1f} MiB + checkout {(total - size) / 2**20:.1f} MiB is over the "
                        f"device tool's carry limit of {limit / 2**20:.0f} MiB")
    return problems


def reusable(out: Path) -> bool:
    return out.is_file() and not check(out) and manifest(out).get("stamp") == stamp()


def _strip(path: Path) -> None:
    subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)


def store_uncompressed(wheel: Path) -> None:
    """Rewrite a wheel with its members stored, not deflated: still a wheel pip installs, and xz then compresses the
    files across the whole bundle (transformers' 13 MB wheel is mostly Python source that deflate packs worse)."""
    import zipfile

    tmp = wheel.with_suffix(".stored")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            kept = zipfile.ZipInfo(info.filename, info.date_time)
            kept.external_attr = info.external_attr                          # file modes (scripts' exec bits)
            dst.writestr(kept, data, compress_type=zipfile.ZIP_STORED)
    tmp.replace(wheel)


def build(out: Path = DEFAULT_OUT, jobs: int = 2, force: bool = False, echo=print) -> dict:
    """Build (or reuse) the bundle; returns its manifest. The CUDA build is llamacpp.build(cuda=True) (reused when
    $MOECTL_HOME/llamacpp/<version>-cuda/ holds one); the wheels are fetched from the package index."""
    if not force and reusable(out):
        echo(f"gpu-bundle: {out} is up to date (stamp {stamp()}): reused")
        return manifest(out)
    root = llamacpp.build(jobs=jobs, cuda=True, echo=echo)
    with tempfile.TemporaryDirectory() as d:
        stage = Path(d) / "bundle"
        bin_dir = stage / "llamacpp" / "bin"
        bin_dir.mkdir(parents=True)
        for f in sorted((root / "bin").iterdir()):
            shutil.copy2(f, bin_dir / f.name)
            _strip(bin_dir / f.name)
        src, conv = llamacpp.source_dir(root), stage / "llamacpp" / "convert"
        conv.mkdir()
        shutil.copy2(src / "convert_hf_to_gguf.py", conv)
        ignore = shutil.ignore_patterns("__pycache__", "tests", "*.md")
        shutil.copytree(src / "conversion", conv / "conversion", ignore=ignore)
        shutil.copytree(src / "gguf-py", conv / "gguf-py", ignore=ignore)
        wheels = stage / "wheels"
        echo("gpu-bundle: fetching the wheels the image lacks ...")
        for cmd in gpu_check.wheel_commands(wheels):
            if subprocess.run(cmd).returncode:
                raise MoectlError(f"{' '.join(cmd[:5])} ... failed (the package index is needed here)")
        for w in wheels.glob("*.whl"):
            store_uncompressed(w)
        seconds = root / "build-seconds"
        meta = {"format": FORMAT, "stamp": stamp(), "llamacpp": llamacpp.VERSION, "cuda_archs": llamacpp.CUDA_ARCHS,
                "cpu_variants": list(llamacpp.CPU_VARIANTS), "cublas_linked": llamacpp.CUBLAS_WHEEL,
                "build_seconds_here": float(seconds.read_text()) if seconds.exists() else None,
                "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": {str(p.relative_to(stage)): p.stat().st_size for p in sorted(stage.rglob("*")) if p.is_file()}}
        (stage / "MANIFEST.json").write_text(json.dumps(meta, indent=1))
        echo(f"gpu-bundle: compressing {sum(meta['files'].values()) / 2**20:.0f} MiB (xz -9) ...")
        tmp = out.with_suffix(".partial")
        with tarfile.open(tmp, "w:xz", preset=9) as tf:
            for p in sorted(stage.iterdir()):
                tf.add(p, arcname=p.name)
        tmp.replace(out)
    problems = check(out)
    if problems:
        raise MoectlError(f"the bundle {out} is not fit to carry: " + "; ".join(problems))
    return meta


def install(bundle: Path, dest: Path) -> Path:
    """Unpack a bundle on the lent machine (seconds); returns `dest`. Refuses an incomplete one."""
    problems = check(bundle, limit=2**62, checkout=0)
    if problems:
        raise MoectlError(f"the bundle {bundle} is incomplete: " + "; ".join(problems))
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(bundle) as tf:
        tf.extractall(dest, filter="tar")               # "tar", not "data": the binaries keep their exec bits
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the bundle to make (default %(default)s)")
    ap.add_argument("--check", type=Path, default=None, metavar="FILE", help="only check FILE, then exit")
    ap.add_argument("--jobs", type=int, default=2, help="compile jobs for the CUDA build (default %(default)s)")
    ap.add_argument("--force", action="store_true", help="make it again even when the one there is up to date")
    ap.add_argument("--install", type=Path, default=None, metavar="FILE", help="on the lent machine: unpack FILE "
                    "into --into (gpu_check.py's install step)")
    ap.add_argument("--into", type=Path, default=ROOT / ".gpu-bundle", help="where --install unpacks")
    a = ap.parse_args(argv)
    target = a.check or a.out
    try:
        if a.install:
            print(f"gpu-bundle: unpacked into {install(a.install, a.into)}")
            return 0
        if a.check is None:
            build(a.out, a.jobs, a.force)
        problems = check(target)
    except MoectlError as e:
        print(f"error: {e}")
        return 2
    size = target.stat().st_size if target.is_file() else 0
    if problems:
        print(f"error: {target} is not fit to carry: " + "; ".join(problems))
        return 1
    m = manifest(target)
    built = m.get("build_seconds_here")
    print(f"gpu-bundle: {target} {size / 2**20:.1f} MiB, complete, within the {CARRY_LIMIT // 2**20} MiB carry "
          f"limit with the checkout; llama.cpp {m['llamacpp']} for sm {m['cuda_archs']}"
          + (f", its CUDA build took {built / 60:.0f} min here" if built else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
