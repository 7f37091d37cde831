"""The model and the server program by what they are, not by their names.

- A local model folder is identified by its content: the SHA-256 of every small file (config.json,
  generation_config.json, tokenizer and chat-template files, preprocessor configs, the weight index)
  and the name, size and modification time of every weight file (hashing hundreds of GB per job would
  cost more than the job). A folder inside a Hugging Face cache snapshot, or a hub name found in the
  cache, is identified by the snapshot's revision (the commit its files came from).
- A name that is neither is identified by the name alone (a remote endpoint's model, or one not
  downloaded here); ``ModelIdentity.by_name`` says so and the job logs it.
- File-valued server arguments (``--chat-template x.jinja``: any argument naming an existing file) by
  their content.
- The server program: vLLM by its version (its launcher script is the same for every version), read
  from the installed package's metadata by the Python the launcher runs on (a fraction of a second;
  ``vllm --version`` imports torch and took 22-31 s on a GPU node before each job's server could
  start), ``vllm --version`` where the launcher is not a Python script; another program by the path,
  size and modification time of its executable.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from vidlabel.core.launcher import launcher_python
from vidlabel.core.models import hub_snapshot

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
SMALL_FILE_BYTES = 64 * 1024 * 1024  # above: identified by size and time, like weights
VERSION_TIMEOUT_S = 300.0  # `vllm --version` imports torch: seconds on a slow node
PROGRAMS_ASKED = ("vllm",)  # the programs identified by their version; each is its package's name
# Run by the launcher's own Python: the installed package's version, without importing the package.
DISTRIBUTION_VERSION = "import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))"


class IdentityError(RuntimeError):
    """Something an answer depends on cannot be identified; the message says what and why."""


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    kind: str  # folder | snapshot | file | name
    digest: str  # content digest, snapshot revision, or "" for a name alone

    @property
    def by_name(self) -> bool:
        return self.kind == "name"

    @property
    def revision(self) -> str:
        """What version of the model's files answered, in words (labels column ``model_revision``)."""
        if self.kind == "snapshot":
            return f"revision {self.digest}"
        if self.kind in ("folder", "file"):
            return f"content {self.digest[:16]}"
        return "name only"

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "digest": self.digest}


def _snapshot_revision(folder: Path) -> str | None:
    """The revision of a folder that is a Hugging Face cache snapshot (``.../snapshots/<revision>``)."""
    real = folder.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.name
    return None


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_weights(path: Path, size: int) -> bool:
    return path.suffix in WEIGHT_SUFFIXES or size > SMALL_FILE_BYTES


def folder_digest(folder: Path) -> str:
    """Small files by content, weight files by name, size and modification time (hidden entries left out)."""
    parts = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(root, name)
            st = path.stat()
            rel = path.relative_to(folder).as_posix()
            parts.append(f"{rel} {st.st_size} {st.st_mtime_ns}" if _is_weights(path, st.st_size)
                         else f"{rel} sha256:{_file_digest(path)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def model_identity(model: str, remote: bool = False) -> ModelIdentity:
    """The identity of ``model`` (a local folder or file, a hub name; see the module docstring).
    ``remote``: the model of an external endpoint, whose files are not here: its name."""
    if remote:
        return ModelIdentity(model, "name", "")
    local = Path(model).expanduser()
    if local.is_dir():
        revision = _snapshot_revision(local)
        if revision:
            return ModelIdentity(model, "snapshot", revision)
        return ModelIdentity(model, "folder", folder_digest(local))
    if local.is_file():
        st = local.stat()
        small = not _is_weights(local, st.st_size)
        return ModelIdentity(model, "file", _file_digest(local) if small else
                             hashlib.sha256(f"{st.st_size} {st.st_mtime_ns}".encode()).hexdigest())
    snapshot = hub_snapshot(model)
    if snapshot is not None:
        return ModelIdentity(model, "snapshot", snapshot.name)
    return ModelIdentity(model, "name", "")


def _argument_values(words: Sequence[str]) -> list[str]:
    values = []
    for word in words:
        values.append(word)
        if word.startswith("--") and "=" in word:
            values.append(word.split("=", 1)[1])
    return values


def file_arguments(words: Sequence[str], cwd: str | os.PathLike | None = None) -> dict[str, str]:
    """Every argument that names an existing file (relative to ``cwd``, where the server runs), by
    content: {argument: "sha256:..."} (a file over SMALL_FILE_BYTES by size and time)."""
    base = Path(cwd or os.getcwd())
    found = {}
    for value in _argument_values(words):
        if not value or value.startswith("-") or "\n" in value or len(value) > 4096:
            continue
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base / path
        try:
            if not path.is_file():
                continue
            st = path.stat()
        except OSError:
            continue
        found[value] = (f"size {st.st_size} mtime_ns {st.st_mtime_ns}" if st.st_size > SMALL_FILE_BYTES
                        else f"sha256:{_file_digest(path)}")
    return found


def program_version(words: Sequence[str]) -> str:
    """The server program's version (module docstring), or the executable's path, size and time."""
    if not words:
        raise IdentityError("config key 'classify.server_command': the server command is empty")
    program = shutil.which(words[0]) or words[0]
    name = Path(program).name
    if name in PROGRAMS_ASKED:
        python = launcher_python(program)
        if python is not None:
            try:
                proc = subprocess.run([python, "-c", DISTRIBUTION_VERSION, name], capture_output=True, text=True,
                                      timeout=VERSION_TIMEOUT_S, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError):
                proc = None
            version = proc.stdout.strip() if proc is not None and proc.returncode == 0 else ""
            if version:
                return f"{name} {version}"
        try:
            proc = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError) as exc:
            raise IdentityError(f"cannot ask the server program its version ({program} --version): {exc}") from None
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode != 0 or not lines:
            raise IdentityError(f"{program} --version failed (exit status {proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        return f"{name} {lines[-1]}"
    try:
        st = os.stat(program)
    except OSError as exc:
        return f"{program} ({type(exc).__name__})"
    return f"{program} size {st.st_size} mtime_ns {st.st_mtime_ns}"

