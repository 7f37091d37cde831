"""The Python a server command's program runs on, where the program is a Python console script (a
pip-installed ``vllm``): the job asks that Python, not the program itself, what is installed there (the
decoder's module: vidlabel.core.decode.preflight; vLLM's version: vidlabel.core.identity.program_version),
which takes a fraction of a second where the program would import torch first."""

from __future__ import annotations

import os
import shlex
import shutil
from typing import Mapping


def launcher_python(executable: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The Python that runs ``executable`` (a console script's ``#!`` line, ``env`` followed), or None when
    it is not a Python script. ``environ``: the environment the program runs in (its PATH)."""
    search = (environ if environ is not None else os.environ).get("PATH")
    path = executable if os.sep in executable else shutil.which(executable, path=search)
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            first = fh.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = shlex.split(first[2:])
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        words = [w for w in words[1:] if not w.startswith("-")]
    if words and "python" in os.path.basename(words[0]):
        return words[0] if os.sep in words[0] else shutil.which(words[0], path=search)
    return None
