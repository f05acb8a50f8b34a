"""The converted-model cache (kvscope/engine/loader/model_cache.py): a GGUF converted once, read back directly.

These tests stand a small built-in model in for transformers' GGUF conversion (the injected
`convert`), so they run in seconds; tests/test_engine_gguf.py runs the real SmolLM2 file
through the cache against transformers' own GGUF loader.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvscope.engine.loader import model_cache
from kvscope.engine.loader.models import build_builtin


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(model_cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setattr(model_cache, "_last", None)
    return tmp_path


@pytest.fixture
def source(tmp_path):
    """A stand-in for the GGUF file: the cache keys it by content only."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return str(path)


class Converter:
    """Counts conversions; each returns a fresh built-in model (seeded: the same weights every time)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return build_builtin("tiny", dtype=torch.float32, seed=3), None


def fresh_load(source, convert, logs=None, dtype=torch.float32):
    model_cache._last = None  # as a new process would
    return model_cache.load(source, dtype, "cpu", convert, log=(logs.append if logs is not None else lambda m: None))


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def weights_file(source, dtype=torch.float32) -> str:
    return os.path.join(model_cache.entry_for(source, dtype).path, "model.safetensors")


def test_a_second_load_reads_the_cache_and_gets_the_same_weights(cache, source):
    convert = Converter()
    first, _, how1 = fresh_load(source, convert)
    second, tok, how2 = fresh_load(source, convert)
    assert convert.calls == 1 and (how1, how2) == ("converted into the cache", "from the converted cache")
    assert same_weights(first, second) and tok is None
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)


def test_the_key_is_the_content_and_the_dtype(cache, source, tmp_path):
    renamed = tmp_path / "other-name.gguf"
    renamed.write_bytes(open(source, "rb").read())
    assert model_cache.entry_for(source, torch.float32).key == model_cache.entry_for(str(renamed), torch.float32).key
    assert model_cache.entry_for(source, torch.float32).key != model_cache.entry_for(source, torch.bfloat16).key
    with open(renamed, "r+b") as f:  # one byte changed: another file, another entry
        f.seek(10)
        f.write(b"\xff")
    assert model_cache.entry_for(source, torch.float32).key != model_cache.entry_for(str(renamed), torch.float32).key


def test_a_truncated_weights_file_is_rebuilt_not_loaded(cache, source):
    convert = Converter()
    good, _, _ = fresh_load(source, convert)
    path = weights_file(source)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    logs: list[str] = []
    again, _, how = fresh_load(source, convert, logs)
    assert convert.calls == 2 and how == "converted into the cache"
    assert "damaged" in logs[0] and "model.safetensors is" in logs[0]
    assert same_weights(good, again)
    assert fresh_load(source, convert)[2] == "from the converted cache" and convert.calls == 2  # and whole again


def test_a_flipped_byte_in_the_weights_is_rebuilt_not_loaded(cache, source):
    convert = Converter()
    good, _, _ = fresh_load(source, convert)
    path = weights_file(source)
    with open(path, "r+b") as f:  # same size, one weight byte changed: only the digest finds it
        f.seek(os.path.getsize(path) - 3)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    logs: list[str] = []
    again, _, how = fresh_load(source, convert, logs)
    assert how == "converted into the cache" and "SHA-256" in logs[0]
    assert same_weights(good, again)


@pytest.mark.parametrize("damage", ["missing manifest", "garbage manifest", "foreign file name", "missing config"])
def test_a_damaged_entry_is_rebuilt(cache, source, damage):
    convert = Converter()
    fresh_load(source, convert)
    entry = model_cache.entry_for(source, torch.float32)
    manifest = os.path.join(entry.path, model_cache.MANIFEST)
    if damage == "missing manifest":  # as an entry whose writer died before its last file
        os.unlink(manifest)
    elif damage == "garbage manifest":
        with open(manifest, "w") as f:
            f.write("{not json")
    elif damage == "foreign file name":
        data = json.load(open(manifest))
        data["files"]["../../elsewhere"] = {"size": 1, "sha256": "0" * 64}
        json.dump(data, open(manifest, "w"))
    else:
        os.unlink(os.path.join(entry.path, "config.json"))
    logs: list[str] = []
    _, _, how = fresh_load(source, convert, logs)
    assert how == "converted into the cache" and convert.calls == 2 and "damaged" in logs[0]


def test_a_failed_write_leaves_no_entry_and_no_temporary_folder(cache, source, monkeypatch):
    def broken_save(self, *a, **k):
        raise OSError(28, "No space left on device")

    convert = Converter()
    monkeypatch.setattr(type(convert()[0]), "save_pretrained", broken_save)
    logs: list[str] = []
    model, _, how = fresh_load(source, convert, logs)
    assert model is not None and how == "" and "No space left" in logs[-1]  # the model is still served
    converted = model_cache.converted_dir()
    assert os.listdir(converted) == []


def test_an_entry_appears_whole_and_a_second_writer_keeps_the_first(cache, source):
    convert = Converter()
    model, _ = convert()
    entry = model_cache.entry_for(source, torch.float32)
    model_cache.write_entry(entry, model, None)
    before = os.stat(os.path.join(entry.path, model_cache.MANIFEST)).st_mtime_ns
    model_cache.write_entry(entry, model, None)  # as a second process that converted at the same time
    assert os.stat(os.path.join(entry.path, model_cache.MANIFEST)).st_mtime_ns == before
    assert sorted(os.listdir(model_cache.converted_dir())) == [entry.key]  # no .part folder left behind


def test_the_cache_can_be_turned_off(cache, source, monkeypatch):
    monkeypatch.setenv(model_cache.NO_CACHE_ENV, "1")
    convert = Converter()
    fresh_load(source, convert)
    fresh_load(source, convert)
    assert convert.calls == 2 and not os.path.exists(model_cache.converted_dir())


def test_a_model_an_engine_already_packed_is_not_written(cache, source):
    from kvscope.engine.cpu.linear import pack_linears, packing_unavailable

    if packing_unavailable(torch.float32):
        pytest.skip("this torch packs no linear layers")
    model, _ = Converter()()
    pack_linears(model)
    _, _, how = fresh_load(source, lambda: (model, None))
    assert how == "" and not os.path.exists(model_cache.entry_for(source, torch.float32).path)


def test_an_upgrade_replaces_the_same_files_entry_and_keeps_the_others(cache, source, monkeypatch):
    convert = Converter()
    monkeypatch.setattr(model_cache, "_versions", lambda: {"transformers": "1.0", "gguf": "1.0"})
    fresh_load(source, convert)
    fresh_load(source, convert, dtype=torch.bfloat16)
    old_f32 = model_cache.entry_for(source, torch.float32)
    old_bf16 = model_cache.entry_for(source, torch.bfloat16)
    monkeypatch.setattr(model_cache, "_versions", lambda: {"transformers": "2.0", "gguf": "1.0"})
    _, _, how = fresh_load(source, convert)
    assert how == "converted into the cache" and convert.calls == 3  # another converter: converted again
    new_f32 = model_cache.entry_for(source, torch.float32)
    assert sorted(os.listdir(model_cache.converted_dir())) == sorted([new_f32.key, old_bf16.key])
    assert old_f32.key not in os.listdir(model_cache.converted_dir())


def test_converting_and_reading_back_draw_none_of_transformers_bars(cache, source, capfd):
    """kvscope says what it does in its own lines; transformers' "Writing model shards" and "Loading weights"
    bars would glue themselves to them. Its bars are on again afterwards, for the user's own transformers code."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    logs: list[str] = []
    fresh_load(source, Converter(), logs)
    fresh_load(source, Converter(), logs)
    captured = capfd.readouterr()
    for bar in ("Writing model shards", "Loading weights", "it/s]"):
        assert bar not in captured.err and bar not in captured.out
    assert logs == ["converting model.gguf once into the model cache (later starts read it directly)"]
    assert hf_logging.is_progress_bar_enabled()
