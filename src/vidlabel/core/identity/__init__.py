"""What an answer depends on: the one declaration (``INPUTS``) and the fingerprints made from it.

Every label comes from a request, a model and a server. ``INPUTS`` names each thing that can change
an answer, what of it counts, how it is checked and when; docs/outputs.md shows the same table (a test
holds them together). Two fingerprints follow from it:

- the request fingerprint (``answer_fingerprint``): everything known before any server is asked
  (the rendered prompt, the post's media items in order, each with its kind, label, transcript and
  file, the transcript's identity, the plan, the model by content,
  the generation settings, the answer schema and, for the job's own servers, the server command with
  its file-valued arguments by content and the server program's version). A journal record is reused
  only under the same request fingerprint, so a job with nothing left to send needs no server to
  know that its answers still hold;
- the server fingerprint (``server_fingerprint``): what a running server reports and how it samples a
  calibration video (vidlabel.serve.probe), probed on every job that reaches a server (every job with
  ``classify.endpoints``; a job with its own servers once they are up). A record made by a server
  with another fingerprint is sent again.

Transcripts are identified the same way (``transcript_id``): the audio item they were made from and
the transcription settings, i.e. the transcribe stage's result settings (vidlabel.core.stage_settings.STAGES)
with the Whisper model by content.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from vidlabel.core.identity.media import MODES, media_item, media_items, media_state
from vidlabel.core.identity.model import (
    IdentityError,
    ModelIdentity,
    file_arguments,
    model_identity,
    program_version,
)
from vidlabel.core.stage_settings import digest, result_settings

__all__ = ["INPUTS", "Input", "MODES", "IdentityError", "ModelIdentity", "answer_fingerprint", "file_arguments",
           "files_state", "markdown_table", "media_item", "media_items", "media_state",
           "model_identity", "program_version", "server_fingerprint", "transcript_id", "transcription_fingerprint",
           "transcription_settings"]


@dataclass(frozen=True)
class Input:
    """One thing an answer depends on (a row of the table in docs/outputs.md)."""
    name: str
    counts: str  # what of it counts
    checked: str  # how it is checked
    when: str


INPUTS: tuple[Input, ...] = (
    Input("prompt", "the rendered text: template, questions, caption and transcript",
          "request fingerprint", "every classify job, per request"),
    Input("media", "every item of the post, in order: its kind, label and transcript, and the file sent "
          "(path, size and modification time; `classify.media_identity: content`: its SHA-256 too)",
          "request fingerprint",
          "every classify job, per request; a file replaced at its path reruns the inventory and, for that post, "
          "what follows (the media's state is the inventory's params)"),
    Input("transcript", "its identity: the audio item it was made from and the transcription settings "
          "(backend, model by content, device, compute type, beam size, VAD, language)",
          "transcribe journal; request fingerprint", "every transcribe job; every classify job"),
    Input("plan", "the post's plan (as-is or its transcode) and the planning settings: model family, fps, "
          "frame and pixel bounds, image pixel bounds, context and encoder-cache limits", "request fingerprint",
          "every classify job, per request"),
    Input("model", "a local folder by content (small files hashed, weights by name, size and time); a "
          "Hugging Face snapshot by revision; a name alone for a remote endpoint (the log says so)",
          "request fingerprint", "every classify job; a folder overwritten in place reruns the model's jobs "
          "(their params)"),
    Input("server command", "the job's own server command and `server_args`, per-job fields (port, GPUs, "
          "copies) left out; every argument naming a file, by content", "request fingerprint",
          "every classify job with its own servers; a file it names, edited, reruns the jobs (their params)"),
    Input("server program", "vLLM's installed version, read from its package metadata by the launcher's "
          "Python (`vllm --version` where the launcher is not Python; another program: its executable's path, "
          "size and time)",
          "request fingerprint", "every classify job with its own servers, also with nothing to send"),
    Input("generation", "temperature, max_tokens, log-probabilities asked, generation config",
          "request fingerprint", "every classify job"),
    Input("answer schema", "the JSON schema of the answer (question ids and choices)", "request fingerprint",
          "every classify job"),
    Input("running server", "`/version`, `/v1/models` (model, root, max_model_len), `/metrics` "
          "`vllm:cache_config_info` (KV-cache dtype), `/server_info` where the server exposes it, and the "
          "visual tokens of two calibration videos (the server's effective fps and pixel bounds)",
          "server fingerprint of each record against the live servers'",
          "every classify job with `classify.endpoints`, also with nothing to send; a job with its own servers "
          "once they are up"),
)


def answer_fingerprint(*, prompt: str, media: Any, transcript: str | None, plan: Mapping[str, Any],
                       model: Mapping[str, Any], server: Mapping[str, Any], generation: Mapping[str, Any],
                       schema: Mapping[str, Any]) -> str:
    """The request fingerprint: one keyword per input of ``INPUTS`` known before a server is asked."""
    return digest({"prompt": prompt, "media": media, "transcript": transcript, "plan": plan, "model": model,
                   "server": server, "generation": generation, "schema": schema})


def server_fingerprint(reported: Mapping[str, Any]) -> str:
    """The server fingerprint of what a running server reported (vidlabel.serve.probe)."""
    return digest({"running server": reported})


def files_state(config: Mapping) -> str:
    """The digest of what an answer depends on in files the config names (a classify rule's params,
    so that a model folder overwritten or a chat template edited in place reruns its jobs): the model
    by content, and every file the server command and ``server_args`` name, by content. The server
    program's version and a running server's state are checked by each job that runs (the table in
    docs/outputs.md)."""
    c = config["classify"]
    try:
        words = shlex.split(c["server_command"]) + shlex.split(c["server_args"]) if not c["endpoints"] else []
    except ValueError:  # bad quoting: the job reports it, naming the key
        words = []
    return _files_state(c["model"], bool(c["endpoints"]), tuple(words[1:]))


@functools.lru_cache(maxsize=64)
def _files_state(model: str, remote: bool, words: tuple[str, ...]) -> str:
    return digest({"model": model_identity(model, remote).as_dict(), "files": file_arguments(words)})


def markdown_table() -> str:
    """``INPUTS`` as the table of docs/outputs.md ("What identifies an answer")."""
    rows = ["| input | what of it counts | how it is checked | when |", "|---|---|---|---|"]
    rows += [f"| {i.name} | {i.counts} | {i.checked} | {i.when} |" for i in INPUTS]
    return "\n".join(rows)


def transcription_settings(config: Mapping) -> dict[str, Any]:
    """The transcribe stage's result settings, the Whisper model by content (a local folder or file)."""
    settings = result_settings(config, "transcribe")
    if "transcribe.model" in settings:
        settings["transcribe.model"] = model_identity(str(settings["transcribe.model"])).as_dict()
    return settings


def transcription_fingerprint(config: Mapping) -> str:
    return digest(transcription_settings(config))


def transcript_id(audio: Mapping[str, Any], transcription: str) -> str:
    """A transcript's identity: the audio item it was made from and the transcription fingerprint."""
    return digest({"audio": audio, "transcription": transcription})
