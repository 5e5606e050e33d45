"""Calibration sets: every source type loads the same texts; the builtin corpus is clean and deterministic."""

from __future__ import annotations

import json

import pytest

from moectl.calib.builtin_corpus import build_builtin_corpus, clean_pydoc
from moectl.calib.dataset import load_calibration
from moectl.errors import MoectlError

TEXTS = ["The first calibration text.", "A second one, with unicode: héllo ✓.", "Third text about experts."]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("moectl_home")


@pytest.fixture(autouse=True)
def _home_env(home, monkeypatch):
    monkeypatch.setenv("MOECTL_HOME", str(home))


def test_text_file_and_directory(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("\n\n".join(TEXTS) + "\n")
    assert load_calibration(str(f)) == TEXTS
    d = tmp_path / "texts"
    d.mkdir()
    (d / "1.txt").write_text(TEXTS[0])
    (d / "2.txt").write_text(TEXTS[1] + "\n\n" + TEXTS[2])
    assert load_calibration(str(d)) == TEXTS
    assert load_calibration(str(d), max_samples=2) == TEXTS[:2]


def test_jsonl_and_parquet(tmp_path):
    import datasets

    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps({"id": i, "content": t}) + "\n" for i, t in enumerate(TEXTS)))
    spec = tmp_path / "mine.yaml"
    spec.write_text("source: data.jsonl\ntext_field: content\nmax_samples: 2\n")   # relative to the YAML
    assert load_calibration(str(spec)) == TEXTS[:2]
    with pytest.raises(MoectlError, match="no column 'text'"):
        load_calibration(str(f))

    pq = tmp_path / "data.parquet"
    datasets.Dataset.from_dict({"text": TEXTS}).to_parquet(str(pq))
    assert load_calibration(str(pq)) == TEXTS


def test_saved_datasets_dir(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    assert load_calibration(str(tmp_path / "ds")) == TEXTS
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                               "validation": datasets.Dataset.from_dict({"text": TEXTS[::-1]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_calibration(str(tmp_path / "dd")) == TEXTS
    assert load_calibration(str(tmp_path / "dd"), split="validation") == TEXTS[::-1]
    with pytest.raises(MoectlError, match="splits"):
        load_calibration(str(tmp_path / "dd"), split="test")


def test_builtin_corpus_and_default_yaml(home):
    train = load_calibration("builtin", split="train")
    val = load_calibration("builtin", split="validation")
    assert len(train) > 500 and 50 < len(val) < len(train) / 5
    assert not set(train) & set(val)
    meta = json.loads(next(home.glob("corpus/*/meta.json")).read_text())
    assert meta["chars"]["train"] > 1_000_000 and not meta["missing_modules"]
    joined = "".join(train[:200])
    assert "0x7f" not in joined and "site-packages" not in joined and "https://" not in joined
    assert "Python Library Documentation" not in joined

    default = load_calibration("default")                     # calibration/default.yaml
    assert len(default) == 64 and default[0] == val[0][: len(default[0])]
    assert max(len(t) for t in default) <= 4 * 512
    assert load_calibration("default", max_samples=5) == default[:5]


def test_builtin_corpus_is_deterministic(tmp_path, home):
    from moectl.calib.builtin_corpus import BUILTIN_MODULES

    load_calibration("builtin")                               # make sure the cached one exists
    cached = next(home.glob("corpus/*/"))
    first = BUILTIN_MODULES[:6]                               # rebuilding a prefix of the module list is enough
    build_builtin_corpus(tmp_path / "again", modules=first)
    for name in ("train.jsonl", "validation.jsonl"):
        lines = (cached / name).read_text().splitlines()
        expected = [line for line in lines if json.loads(line)["name"].split(":")[0] in first]
        assert expected and (tmp_path / "again" / name).read_text().splitlines() == expected


def test_clean_pydoc():
    raw = ("Python Library Documentation: module foo\n\nNAME\n    foo - Does things.\n\nMODULE REFERENCE\n"
           "    https://docs.python.org/3.11/library/foo.html\n\nCLASSES\n    class A(builtins.object)\n"
           "     |  A thing <function f at 0x7f12ab34cd56>.\n     |  \n     |  ------------------\n"
           "\nDATA\n    X = 1\n\nFILE\n    /usr/lib/python3.11/foo.py\n")
    out = clean_pydoc(raw)
    assert "Name\n    foo - Does things." in out
    assert "A thing <function f>." in out
    for gone in ("Python Library Documentation", "docs.python.org", "0x7f", "X = 1", "/usr/lib", "---", "|"):
        assert gone not in out


@pytest.mark.parametrize("spec, message", [
    ("no-such-set", "not found"),
    ("/nonexistent/data.jsonl", "does not exist"),
    ("/nonexistent/set.yaml", "does not exist"),
])
def test_bad_specs(spec, message):
    with pytest.raises(MoectlError, match=message):
        load_calibration(spec)


def test_bad_yaml_and_files(tmp_path):
    cases = {
        "broken.yaml": ("source: [unclosed\n", "not valid YAML"),
        "nosource.yaml": ("split: train\n", "'source'"),
        "unknown.yaml": ("source: builtin\nsamples: 3\n", "unknown keys"),
        "negative.yaml": ("source: builtin\nmax_samples: -1\n", "positive integer"),
        "badsplit.yaml": ("source: builtin\nsplit: test\n", "'train' and 'validation'"),
    }
    for name, (body, message) in cases.items():
        (tmp_path / name).write_text(body)
        with pytest.raises(MoectlError, match=message):
            load_calibration(str(tmp_path / name))
    (tmp_path / "weights.bin").write_bytes(b"\0\1")
    with pytest.raises(MoectlError, match="unsupported file type"):
        load_calibration(str(tmp_path / "weights.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MoectlError, match="holds no"):
        load_calibration(str(tmp_path / "empty"))
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(MoectlError, match="no texts"):
        load_calibration(str(tmp_path / "blank.txt"))
