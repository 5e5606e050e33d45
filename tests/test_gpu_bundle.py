"""`make gpu-bundle`'s checker and reuse, on fake bundles (the real one takes an hour of nvcc: bench/gpu_bundle.py).
A bundle is fit to carry when every file issue 44's run needs is in it, a wheel for each package the lent image
lacks, and it fits the device tool's 64 MiB together with the checkout."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_bundle  # noqa: E402
from moectl.errors import MoectlError  # noqa: E402


def fake_bundle(tmp_path: Path, drop: str | None = None, pad: int = 0, stamp: str = "x") -> Path:
    """A tarball laid out as a bundle: tiny stand-ins for every file, `drop` left out, `pad` random bytes added."""
    stage = tmp_path / "stage"
    files = [r for r in gpu_bundle.REQUIRED if r != "MANIFEST.json"] + ["llamacpp/bin/libggml-cpu-haswell.so"]
    files += [f"wheels/{n.replace('-', '_')}-1.0-py3-none-any.whl" for n in gpu_bundle.wheel_names()]
    for f in files:
        if f != drop:
            (stage / f).parent.mkdir(parents=True, exist_ok=True)
            (stage / f).write_bytes(b"\x7fELF stand-in")
    (stage / "MANIFEST.json").write_text(json.dumps({"format": gpu_bundle.FORMAT, "stamp": stamp,
                                                     "llamacpp": "0.3.36", "cuda_archs": "90-real"}))
    if pad:
        (stage / "wheels" / "pad.bin").write_bytes(__import__("os").urandom(pad))   # incompressible
    out = tmp_path / "gpu-bundle.tar.xz"
    with tarfile.open(out, "w:xz") as tf:
        for p in sorted(stage.iterdir()):
            tf.add(p, arcname=p.name)
    return out


def test_a_complete_bundle_passes_and_installs_with_exec_bits(tmp_path):
    b = fake_bundle(tmp_path)
    (tmp_path / "stage" / "llamacpp" / "bin" / "llama-bench").chmod(0o755)
    with tarfile.open(b, "w:xz") as tf:                                  # again, with the tool executable
        for p in sorted((tmp_path / "stage").iterdir()):
            tf.add(p, arcname=p.name)
    assert gpu_bundle.check(b, checkout=3 * 2**20) == []
    dest = gpu_bundle.install(b, tmp_path / "unpacked")
    assert (dest / "llamacpp" / "bin" / "llama-bench").stat().st_mode & 0o111
    assert (dest / "llamacpp" / "convert" / "gguf-py" / "gguf" / "__init__.py").is_file()


@pytest.mark.parametrize("drop", ["llamacpp/bin/libggml-cuda.so", "llamacpp/convert/convert_hf_to_gguf.py",
                                  "wheels/transformers-1.0-py3-none-any.whl", "llamacpp/bin/libggml-cpu-haswell.so"])
def test_each_missing_part_is_named(tmp_path, drop):
    problems = gpu_bundle.check(fake_bundle(tmp_path, drop=drop), checkout=0)
    assert len(problems) == 1
    name = Path(drop).name
    expect = ("the wheel of transformers" if name.startswith("transformers") else
              "libggml-cpu-*" if "cpu" in name else name)
    assert expect in problems[0] and problems[0].startswith("missing")
    with pytest.raises(MoectlError, match="incomplete: missing"):
        gpu_bundle.install(fake_bundle(tmp_path, drop=drop), tmp_path / "unpacked")


def test_over_the_carry_limit_with_the_checkout_is_refused(tmp_path):
    b = fake_bundle(tmp_path, pad=300_000)
    size = b.stat().st_size
    assert gpu_bundle.check(b, limit=size + 100_000, checkout=50_000) == []
    (msg,) = gpu_bundle.check(b, limit=size + 100_000, checkout=200_000)
    assert "over the device tool's carry limit" in msg and "checkout" in msg
    assert gpu_bundle.check(tmp_path / "nothing.tar.xz") == [f"no bundle at {tmp_path / 'nothing.tar.xz'}"]


def test_a_bundle_is_reused_only_when_its_inputs_are_unchanged(tmp_path, monkeypatch):
    """Same stamp and complete: reused, nothing built; another stamp (a flag, a pin changed): built again."""
    monkeypatch.setattr(gpu_bundle, "checkout_bytes", lambda: 0)
    built = []
    monkeypatch.setattr(gpu_bundle.llamacpp, "build", lambda **kw: built.append(kw) or tmp_path)
    b = fake_bundle(tmp_path, stamp=gpu_bundle.stamp())
    assert gpu_bundle.build(b, echo=lambda m: None)["stamp"] == gpu_bundle.stamp() and built == []
    stale = fake_bundle(tmp_path, stamp="0" * 16)
    with pytest.raises(FileNotFoundError):            # goes on to build: the stubbed build has no bin/ to copy
        gpu_bundle.build(stale, echo=lambda m: None)
    assert len(built) == 1 and built[0]["cuda"] is True


def test_the_stamp_follows_the_cuda_flags_and_the_pins(monkeypatch):
    s = gpu_bundle.stamp()
    monkeypatch.setattr(gpu_bundle.llamacpp, "CUDA_ARCHS", "90-real;120a-real")
    monkeypatch.setattr(gpu_bundle.llamacpp, "cmake_flags",
                        lambda cuda=False, deps=None: [f"-DCMAKE_CUDA_ARCHITECTURES={gpu_bundle.llamacpp.CUDA_ARCHS}"])
    assert gpu_bundle.stamp() != s


def test_wheels_are_stored_uncompressed_for_xz_and_keep_every_member(tmp_path):
    import zipfile

    w = tmp_path / "pkg-1.0-py3-none-any.whl"
    body = ("def f():\n    return 1\n" * 2000).encode()
    with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pkg/__init__.py", body)
        z.writestr("pkg-1.0.dist-info/RECORD", "pkg/__init__.py,,\n")
    gpu_bundle.store_uncompressed(w)
    with zipfile.ZipFile(w) as z:
        assert [i.compress_type for i in z.infolist()] == [zipfile.ZIP_STORED] * 2
        assert z.read("pkg/__init__.py") == body and z.testzip() is None


def test_build_lays_out_a_complete_bundle_from_a_cuda_build(tmp_path, monkeypatch):
    """build() on a stand-in CUDA build (real ELF files, so `strip` runs) and stand-in wheels: the bundle passes
    the check, its binaries are stripped copies, its manifest names the build's wall time here."""
    import shutil
    import zipfile

    root = tmp_path / "cuda-build"
    (root / "bin").mkdir(parents=True)
    for name in ("llama-bench", "llama-quantize", "libllama.so", "libggml.so", "libggml-base.so", "libggml-cuda.so",
                 "libggml-cpu-haswell.so"):
        shutil.copy2("/bin/true", root / "bin" / name)
    (root / "build-seconds").write_text("5400\n")
    src = gpu_bundle.llamacpp.source_dir(root)
    for f in ("convert_hf_to_gguf.py", "conversion/__init__.py", "gguf-py/gguf/__init__.py", "gguf-py/tests/t.py"):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("# stand-in\n")
    monkeypatch.setattr(gpu_bundle.llamacpp, "build", lambda **kw: root)

    def wheels(dest):
        dest.mkdir(parents=True, exist_ok=True)
        for n in gpu_bundle.wheel_names():
            with zipfile.ZipFile(dest / f"{n.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(f"{n}/__init__.py", "")
        return []
    monkeypatch.setattr(gpu_bundle.gpu_check, "wheel_commands", wheels)
    monkeypatch.setattr(gpu_bundle, "checkout_bytes", lambda: 3 * 2**20)
    out = tmp_path / "gpu-bundle.tar.xz"
    meta = gpu_bundle.build(out, echo=lambda m: None)
    assert gpu_bundle.check(out) == [] and meta["build_seconds_here"] == 5400.0
    assert meta["stamp"] == gpu_bundle.stamp() and meta["cuda_archs"] == gpu_bundle.llamacpp.CUDA_ARCHS
    files = meta["files"]
    assert files["llamacpp/bin/llama-bench"] <= Path("/bin/true").stat().st_size           # stripped
    assert "llamacpp/convert/gguf-py/tests/t.py" not in files                               # tests left out
    assert gpu_bundle.reusable(out)                                                          # the next make: reused
