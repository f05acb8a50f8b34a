"""A GGUF converted once into a form the engine loads directly: safetensors in the engine's dtype.

transformers parses and dequantizes a GGUF on every load (SmolLM2's 98 MB Q4_1 file: 15-30 s,
most of it Python over 272 tensors and a 49k-entry vocabulary). The first load of a file in a
dtype writes what it produced into the cache (the weights as safetensors, the config, the
generation config and the tokenizer, all through transformers' own save_pretrained), and every
later load reads that back with from_pretrained: about the time it takes to read the weights.

An entry is keyed by the GGUF's SHA-256 (its content, not its name or date), the dtype, the
transformers and gguf versions that did the conversion, and FORMAT (bumped when this module
changes what it writes). It lives in <model cache>/converted/<key>/ (named_models.cache_dir).

Safety: an entry is built in a temporary folder and renamed into place whole, so a reader sees
all of it or nothing, and two processes converting at once keep one. Its manifest, written
last, lists every file with its size and SHA-256: a file of the wrong size (truncated) is found
before anything is read, and a changed byte while the weights load (the digests are checked
beside the load, on another thread); either way the entry is moved aside and rebuilt from
the GGUF, never used. Where the cache cannot be written, the model is loaded from the GGUF as
before, with a one-line note. Writing an entry deletes the same file's entries in the same dtype
made by other versions (after an upgrade nothing would read them again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kvscope.errors import KvscopeError
from kvscope.engine.loader.hf_quiet import transformers_bars_off

if TYPE_CHECKING:
    import torch

FORMAT = 1  # what an entry holds and how; bump it when that changes (older entries are then not read)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of files: anything larger is not ours
CHUNK = 1 << 22
NO_CACHE_ENV = "KVSCOPE_NO_MODEL_CACHE"  # set (to anything but empty or 0): always load the GGUF itself


class CorruptEntry(Exception):
    """An entry that must not be loaded: missing files, wrong sizes or digests, an unreadable manifest."""


@dataclass(frozen=True)
class Entry:
    path: str  # the entry's folder
    key: str
    key_fields: dict  # what the key was made of, kept in the manifest for people reading the cache


def converted_dir() -> str:
    from kvscope.engine.loader.named_models import cache_dir

    return os.path.join(cache_dir(), "converted")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)  # hashlib lets go of the GIL over large buffers: a thread hashes beside a load
    return h.hexdigest()


def _versions() -> dict:
    """The installed versions of the packages that convert (read from their metadata: importing transformers
    here would take seconds that the digest check can overlap instead, see load_entry)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("transformers", "gguf"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:  # gguf missing: check_servable has already said so
            found[package] = "none"
    return found


def entry_for(gguf_path: str, dtype: torch.dtype, digest: str | None = None) -> Entry:
    """Where the conversion of this file (by content) in this dtype lives, whether or not it is there yet."""
    fields = {"format": FORMAT, "gguf_sha256": digest or file_sha256(gguf_path),
              "dtype": str(dtype).removeprefix("torch."), **_versions()}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:40]
    return Entry(os.path.join(converted_dir(), key), key, fields)


def _read_manifest(entry: Entry) -> dict:
    path = os.path.join(entry.path, MANIFEST)
    try:
        if os.path.getsize(path) > MAX_MANIFEST_BYTES:
            raise CorruptEntry(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptEntry(f"unreadable {MANIFEST}: {e}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("key") != entry.key or not isinstance(files, dict) or not files:
        raise CorruptEntry(f"{MANIFEST} is not this entry's")
    for name, meta in files.items():
        if (not isinstance(name, str) or os.path.basename(name) != name or name in (".", "..", MANIFEST)
                or not isinstance(meta, dict) or not isinstance(meta.get("size"), int)
                or not isinstance(meta.get("sha256"), str)):
            raise CorruptEntry(f"{MANIFEST} lists a bad file entry {name!r}")
    return manifest


def check_sizes(entry: Entry, manifest: dict) -> None:
    """Every listed file is there at its listed size (a truncated write or copy is found here, before any read)."""
    for name, meta in manifest["files"].items():
        try:
            size = os.path.getsize(os.path.join(entry.path, name))
        except OSError:
            raise CorruptEntry(f"{name} is missing") from None
        if size != meta["size"]:
            raise CorruptEntry(f"{name} is {size} bytes, its manifest says {meta['size']}")


def check_digests(entry: Entry, manifest: dict) -> None:
    for name, meta in manifest["files"].items():
        if file_sha256(os.path.join(entry.path, name)) != meta["sha256"]:
            raise CorruptEntry(f"{name} does not match its manifest's SHA-256")


class _Checker(threading.Thread):
    """check_digests on another thread, while the main one loads the same files."""

    def __init__(self, entry: Entry, manifest: dict) -> None:
        super().__init__(name="kvscope-cache-check", daemon=True)
        self.entry, self.manifest = entry, manifest
        self.error: CorruptEntry | None = None

    def run(self) -> None:
        try:
            check_digests(self.entry, self.manifest)
        except CorruptEntry as e:
            self.error = e
        except OSError as e:
            self.error = CorruptEntry(f"cannot read the entry: {e}")

    def result(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def load_entry(entry: Entry, dtype: torch.dtype, device: str):
    """(model, tokenizer or None) from a complete, checked entry; CorruptEntry when it is not one."""
    manifest = _read_manifest(entry)
    check_sizes(entry, manifest)
    checker = _Checker(entry, manifest)
    checker.start()  # hashing lets go of the GIL: it runs on another core while transformers is imported and reads
    from kvscope.engine.loader import light_llama

    try:
        light = light_llama.unsupported(light_llama.read_config(entry.path), device) is None
    except (OSError, ValueError):
        light = False  # transformers' loader below says what is wrong with it
    try:
        if light:  # a plain llama on a CPU: its weights without transformers' model classes (light_llama.py)
            model, tokenizer = light_llama.load_with_tokenizer(entry.path, dtype, bool(manifest.get("tokenizer")))
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            with transformers_bars_off():
                model = AutoModelForCausalLM.from_pretrained(entry.path, dtype=dtype, local_files_only=True)
            tokenizer = (AutoTokenizer.from_pretrained(entry.path, local_files_only=True)
                         if manifest.get("tokenizer") else None)
    except Exception as e:  # noqa: BLE001 - a damaged file surfaces as several exception types
        checker.join()
        raise CorruptEntry(f"transformers cannot load it: {(str(e).strip().splitlines() or [type(e).__name__])[0]}")
    checker.result()  # nothing read from a file that fails its digest is used
    return model.to(device).eval(), tokenizer


def write_entry(entry: Entry, model, tokenizer) -> None:
    """Save the converted model into a temporary folder beside the entry, list it in a manifest, rename it in."""
    parent = os.path.dirname(entry.path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{entry.key}.", suffix=".part", dir=parent)
    try:
        with transformers_bars_off():
            model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = {name: {"size": os.path.getsize(os.path.join(tmp, name)), "sha256": file_sha256(os.path.join(tmp, name))}
                 for name in sorted(os.listdir(tmp))}
        manifest = {"key": entry.key, "source": entry.key_fields, "tokenizer": tokenizer is not None, "files": files}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for name in [*files, MANIFEST]:  # the data on disk before the rename makes the entry visible
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
            os.chmod(os.path.join(tmp, name), 0o644)  # as readable as the model file (some writers make 0600)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, entry.path)
        except OSError:
            if not os.path.isdir(entry.path):
                raise  # not another process's entry in the way: a real failure
            # another process renamed its own conversion in first: keep that one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prune_superseded(entry: Entry) -> int:
    """Delete the entries of the same GGUF in the same dtype made by other versions (an upgrade of transformers or
    of this module leaves them unreachable); returns how many. Entries of other files or dtypes are kept."""
    parent, same = os.path.dirname(entry.path), 0
    for name in os.listdir(parent):
        if name == entry.key or name.startswith("."):
            continue
        other = Entry(os.path.join(parent, name), name, {})
        try:
            source = _read_manifest(other).get("source", {})
        except CorruptEntry:
            continue  # not an entry we can read: someone else's, or one being replaced; left alone
        if (isinstance(source, dict) and source.get("gguf_sha256") == entry.key_fields["gguf_sha256"]
                and source.get("dtype") == entry.key_fields["dtype"]):
            discard(other)
            same += 1
    return same


def discard(entry: Entry) -> None:
    """Move a bad entry out of the way (a rename: a reader that has it open keeps its files), then delete it."""
    aside = f"{entry.path}.bad-{os.getpid()}"
    try:
        os.rename(entry.path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _say(msg: str) -> None:
    print(f"kvscope: {msg}", file=sys.stderr, flush=True)


def cache_enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "") in ("", "0")


def _touched_by_an_engine(model) -> bool:
    """An engine has packed its linear layers (cpu_linear.py): their weights are no longer in its state_dict."""
    return any(getattr(m, "packed", None) is not None for m in model.modules())


_last: tuple[tuple, tuple] | None = None  # ((entry key, device), (model, tokenizer)): engines made one after
# another in one process (tests, the bench's modes) share the last model read, as gguf.load_gguf's own


def load(gguf_path: str, dtype: torch.dtype, device: str,
         convert: Callable[[], tuple], log: Callable[[str], None] = _say) -> tuple:
    """(model, tokenizer or None, how it was loaded): from the cache when it holds this file in this dtype,
    else from convert() (transformers' GGUF loader), whose result is then written to the cache."""
    global _last
    if not cache_enabled():
        return (*convert(), "")
    try:
        entry = entry_for(gguf_path, dtype)
    except OSError as e:
        raise KvscopeError(f"cannot read {gguf_path}: {e.strerror or e}") from None
    memo_key = (entry.key, str(device))
    if _last is not None and _last[0] == memo_key:
        return (*_last[1], "from the converted cache")
    _last = None  # let the previous model go before the next one is read
    if os.path.isdir(entry.path):
        try:
            got = load_entry(entry, dtype, device)
            _last = (memo_key, got)
            return (*got, "from the converted cache")
        except CorruptEntry as e:
            log(f"the converted cache of {os.path.basename(gguf_path)} is damaged ({e}); converting it again")
            discard(entry)
    log(f"converting {os.path.basename(gguf_path)} once into the model cache (later starts read it directly)")
    model, tokenizer = convert()
    if _touched_by_an_engine(model):  # from gguf.py's in-process memo, already packed: its weights are not all there
        return model, tokenizer, ""
    try:
        write_entry(entry, model, tokenizer)
        prune_superseded(entry)
    except OSError as e:
        log(f"cannot write the converted cache ({e.strerror or e}); the next start converts the GGUF again")
        return model, tokenizer, ""
    return model, tokenizer, "converted into the cache"


def checkpoint_dir(gguf_path: str, dtype: torch.dtype, log: Callable[[str], None] = _say) -> str:
    """The converted entry of this GGUF in this dtype as a Hugging Face checkpoint directory, for another
    program to load (`kvscope serve --engine vllm` hands it to vLLM); converted first if the cache lacks it."""
    from kvscope.engine.loader import gguf

    gguf.check_servable(gguf_path)  # refused in one line before any conversion
    if not cache_enabled():
        raise KvscopeError(f"another engine reads the converted model from the cache, which {NO_CACHE_ENV} "
                           "turns off: unset it")
    try:
        entry = entry_for(gguf_path, dtype)
    except OSError as e:
        raise KvscopeError(f"cannot read {gguf_path}: {e.strerror or e}") from None
    if os.path.isdir(entry.path):
        try:
            check_sizes(entry, _read_manifest(entry))
            return entry.path
        except CorruptEntry as e:
            log(f"the converted cache of {os.path.basename(gguf_path)} is damaged ({e}); converting it again")
            discard(entry)
    load(gguf_path, dtype, "cpu", lambda: gguf.load_gguf(gguf_path, dtype, "cpu")[:2], log)
    if not os.path.isdir(entry.path):
        raise KvscopeError(f"could not write the converted model into {converted_dir()}; another engine needs it "
                           "there (is the cache folder writable? set KVSCOPE_CACHE_DIR)")
    return entry.path
