"""What a classify job's answers are made under: the request fingerprint of every row (from the one
declaration, vidlabel.core.identity) and the provenance every record is stamped with.

``JobIdentity.resolve`` identifies, once per job and before any server is asked, everything the
answers depend on besides the row itself: the model by content, the server command with its
file-valued arguments and the server program's version (own servers), the generation settings, the
answer schema and the plan. A job with nothing left to send therefore knows that its answers still
hold without starting a server.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping

from vidlabel.core import identity
from vidlabel.core.prompt import response_format
from vidlabel.serve.command import placeholder_command
from vidlabel.serve.confidence import logprobs_request
from vidlabel.serve.record import Record
from vidlabel.serve.request import Answering, Request, request_of
from vidlabel.serve.settings import ServeSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobIdentity:
    model: identity.ModelIdentity
    answering: Answering  # the job's part of every request (vidlabel.serve.request)

    @classmethod
    def resolve(cls, settings: ServeSettings) -> "JobIdentity":
        model = identity.model_identity(settings.model, remote=not settings.own_servers)
        if model.by_name:
            log.warning("model %s is identified by its name alone (%s): answers are not tied to its files or "
                        "revision", settings.model,
                        "the endpoints' model is not here" if settings.endpoints else
                        "neither a local folder nor in the Hugging Face cache here; download it first to tie "
                        "answers to its revision")
        else:
            log.info("model %s: %s", settings.model, model.revision)
        if settings.own_servers:
            words = placeholder_command(settings.server)
            server = {"command": words, "program": identity.program_version(words),
                      "files": identity.file_arguments(words[1:])}
            log.info("server program %s; file arguments by content: %s", server["program"],
                     ", ".join(server["files"]) or "none")
        else:
            server = {"external": True}
        c = settings.client
        generation = {"temperature": c.temperature, "max_tokens": c.max_tokens,
                      "logprobs": logprobs_request(c.top_logprobs),
                      "generation_config": settings.server.generation_config}
        return cls(model=model, answering=Answering.of(
            c.model, model.as_dict(), server, generation, response_format(list(c.questions)),
            settings.plan.identity()))

    def request(self, row: Mapping[str, Any], media: Mapping[str, Any]) -> Request:
        """The request of a manifest row, the identity of every file it sends in ``media``
        (vidlabel.core.identity.media_items)."""
        return request_of(row, row["items"], media, self.answering)


def new_job_id(shard: int) -> str:
    """``shard-3/20250101T120000Z/a1b2c3``: unique per job run, readable in throughput.csv."""
    return f"shard-{shard}/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}/{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Provenance:
    """What every record of this job is stamped with (docs/outputs.md, labels)."""
    model: str
    model_revision: str
    settings_fingerprint: str
    prompt_hash: str
    shard: int
    job_id: str
    gpus: int | None = None  # held by the job's own servers, once they are laid out

    @classmethod
    def of(cls, settings: ServeSettings, job: JobIdentity, shard: int) -> "Provenance":
        return cls(model=settings.model, model_revision=job.model.revision,
                   settings_fingerprint=settings.settings_fingerprint, prompt_hash=settings.prompt_hash,
                   shard=shard, job_id=new_job_id(shard))

    def record(self, result: Record, row: Mapping[str, Any]) -> Record:
        """The client's record of ``row`` stamped with what made it: model, settings, prompt, request
        fingerprint, GPUs, job and shard."""
        return result.stamped(
            model=self.model, model_revision=self.model_revision, settings_fingerprint=self.settings_fingerprint,
            prompt_hash=self.prompt_hash, request_fingerprint=row["fingerprint"], gpus=self.gpus,
            job_id=self.job_id, shard=self.shard)
