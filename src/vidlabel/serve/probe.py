"""What a running server is: probed on every endpoint a job uses, before its traffic.

From vLLM 0.26's HTTP API:

- ``GET /version``: the vLLM version;
- ``GET /v1/models``: the served model's id, its ``root`` (the folder or hub name it loaded) and
  ``max_model_len``;
- ``GET /metrics``: the info gauge ``vllm:cache_config_info``, whose labels are the engine's cache
  config; its ``cache_dtype`` (an fp8 KV cache changes answers) is kept in the fingerprint, not the block
  counts (they follow the GPU memory the engine found free at start-up): those give the KV cache in tokens
  (``kv_cache_tokens``), from which the job sizes its in-flight limit (``concurrency.fit_in_flight``);
- ``GET /server_info?config_format=json`` (only where the server runs with VLLM_SERVER_DEV_MODE=1): the
  engine's whole config, of which the answer-relevant keys are kept (``SERVER_INFO_KEYS``: quantization,
  dtype, load format, media and processor kwargs, ...);
- calibration requests (``Calibration``): a text-only one and two small generated videos with the
  same text; the difference of their ``usage.prompt_tokens`` is the tokens the server makes of each
  video, which follows its model family, its effective fps (a long video of tiny frames) and pixel bounds
  (a short video of frames larger than the plan's upper bound, and the tiny frames below its lower
  one). A count other than the plan's stops the job before its traffic (CalibrationUnlikePlan: every
  estimate and the context gate of the manifest would be wrong), naming the plan's family and, where one
  family's rules give the server's count, that family. They also prove that the server decodes media
  from the job's media directory (a media error stops the job before its traffic:
  CalibrationMediaError). A job whose posts send images also sends two generated images (one larger
  than the plan's image_max_pixels, one below its image_min_pixels): a server that resizes images
  otherwise than the plan (the flat --mm-processor-kwargs bounding photos like video frames), or
  refuses images, stops the job before its traffic (CalibrationBelowPlan: every image estimate would be
  wrong). A job whose model hears audio sends a generated WAV as well (``audio``): a count other than the
  plan's stops it the same way; so does a calibration item refused under vLLM 0.33's cap on a request's
  decoded media (CalibrationBelowPlan: the posts' media would meet it too). The images and the sound
  check the server against the plan, which the request fingerprint holds already; they stay out of the
  server fingerprint, so that data that come to hold photos do not make every video's answer another
  server's.

Everything kept goes into the endpoint's ``ServerIdentity``, whose fingerprint every record carries
(vidlabel.core.identity.server_fingerprint): a record made by a server with another fingerprint is
sent again. Not visible here, so not checked for an external endpoint: its quantization and other
engine flags without VLLM_SERVER_DEV_MODE, and anything its /metrics does not report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from vidlabel.core.identity import server_fingerprint
from vidlabel.serve.error_kinds import classify_error, decode_cap_refusal, response_message

log = logging.getLogger(__name__)

GET_TIMEOUT_S = 60.0
CALIBRATION_TIMEOUT_S = 600.0  # a cold server decodes its first video slowly
CALIBRATION_TEXT = "Calibration request: reply with one word."
CALIBRATION_ID = "calibrate-"  # X-Request-Id prefix of the calibration requests
# Keys of /server_info's vllm_config that can change an answer, wherever they sit in the tree.
SERVER_INFO_KEYS = frozenset({"quantization", "dtype", "load_format", "media_io_kwargs", "mm_processor_kwargs",
                              "cache_dtype", "generation_config", "override_generation_config", "revision",
                              "tokenizer_revision", "hf_overrides", "seed", "disable_any_whitespace",
                              "logprobs_mode"})
METRIC_INFO_LABELS = {"vllm:cache_config_info": ("cache_dtype",)}
_METRIC_LINE = re.compile(r"^(vllm:[a-z_]+_info)\{(.*)\}\s")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


MEDIA_ERROR_KINDS = ("bad_media", "media_unreachable")


class CalibrationMediaError(RuntimeError):
    """The server could not read or decode a calibration video: it cannot read the job's media."""

    def __init__(self, base_url: str, path: str, status: int, message: str):
        super().__init__(f"{base_url}: the calibration video {path} failed with HTTP {status}: {message}")
        self.message = message


class CalibrationBelowPlan(RuntimeError):
    """A calibration image shows a server that resizes or limits images otherwise than the plan, or a
    calibration item meets a server limit the plan does not know (vLLM 0.33's cap on decoded media)."""


class CalibrationUnlikePlan(RuntimeError):
    """A calibration video or sound shows a server that counts it otherwise than the plan (another model
    family, other sampling or pixel bounds, another processor version)."""


@dataclass(frozen=True)
class CalibrationItem:
    path: str
    expected_tokens: int  # tokens the plan expects, markers included
    what: str  # what it reveals, in words
    kind: str = "video"  # video | image | audio
    # What each model family would count of it under its own defaults (family -> tokens), to name the
    # family of a server that counts otherwise than the plan.
    by_family: tuple[tuple[str, int], ...] = ()
    family: str = ""  # the plan's


@dataclass(frozen=True)
class Calibration:
    videos: tuple[CalibrationItem, ...]
    images: tuple[CalibrationItem, ...] = ()  # sent where the job's posts send images
    sounds: tuple[CalibrationItem, ...] = ()  # sent where the job's posts send audio for the model to hear


@dataclass(frozen=True)
class ServerIdentity:
    """What a running server reported; ``label`` in words, ``fingerprint`` for the records."""
    version: str | None
    model_id: str | None
    model_root: str | None
    max_model_len: int | None
    reported: dict = field(default_factory=dict)  # /metrics info labels and /server_info keys
    calibration: dict = field(default_factory=dict)  # video -> visual tokens (None: not measured)
    unlike_plan: tuple[str, ...] = ()  # calibration videos the server counts otherwise than the plan
    # Its KV cache in tokens (vllm:cache_config_info), None where not reported: how many requests it admits
    # at once, for the in-flight limit; not in the fingerprint (the GPU's memory, not the answer, sets it).
    kv_cache_tokens: int | None = None

    @property
    def label(self) -> str:
        name, root = self.model_id, self.model_root
        served = f"{root} as {name}" if root and name and root != name else (root or name or "unknown")
        text = f"vLLM {self.version or 'unknown version'}, model {served}"
        if self.unlike_plan:
            text += f"; samples video unlike the plan ({', '.join(self.unlike_plan)})"
        return text

    @property
    def fingerprint(self) -> str:
        return server_fingerprint({"version": self.version, "model_id": self.model_id, "model_root": self.model_root,
                                   "max_model_len": self.max_model_len, "reported": self.reported,
                                   "calibration": self.calibration})

    def __str__(self) -> str:
        return self.label


async def _get(session: aiohttp.ClientSession, url: str, headers: dict, as_json: bool = True):
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=GET_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None) if as_json else await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


def metrics_info(text: str | None) -> dict[str, str]:
    """The kept labels of vLLM's info gauges (``METRIC_INFO_LABELS``) in a /metrics text."""
    found: dict[str, str] = {}
    for line in (text or "").splitlines():
        match = _METRIC_LINE.match(line)
        if not match or match.group(1) not in METRIC_INFO_LABELS:
            continue
        labels = dict(_LABEL.findall(match.group(2)))
        for name in METRIC_INFO_LABELS[match.group(1)]:
            if name in labels:
                found[f"{match.group(1)}.{name}"] = labels[name]
    return found


def kv_cache_tokens(text: str | None) -> int | None:
    """A server's KV cache in tokens: ``num_gpu_blocks`` x ``block_size`` of vLLM's ``vllm:cache_config_info``,
    summed over its engines (one label set each; an engine repeated by several API servers counts once)."""
    per_engine: dict[str, int] = {}
    for line in (text or "").splitlines():
        match = _METRIC_LINE.match(line)
        if not match or match.group(1) != "vllm:cache_config_info":
            continue
        labels = dict(_LABEL.findall(match.group(2)))
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit():
            per_engine[labels.get("engine", "")] = int(blocks) * int(size)
    return sum(per_engine.values()) or None


def server_info_keys(node: Any, path: str = "") -> dict[str, Any]:
    """The answer-relevant keys (``SERVER_INFO_KEYS``) of /server_info's config, by dotted path."""
    found: dict[str, Any] = {}
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}" if path else str(key)
            if key in SERVER_INFO_KEYS:
                found[here] = value
            elif isinstance(value, (dict, list)):
                found.update(server_info_keys(value, here))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.update(server_info_keys(value, f"{path}[{i}]"))
    return found


async def _prompt_tokens(session: aiohttp.ClientSession, chat_url, headers: dict, model: str,
                         item: CalibrationItem | None) -> tuple[int | None, int, str]:
    """(usage.prompt_tokens, HTTP status, error message) of one calibration request."""
    content: list[dict] = [{"type": "text", "text": CALIBRATION_TEXT}]
    if item is not None:
        part = f"{item.kind}_url"
        content.insert(0, {"type": part, part: {"url": Path(item.path).as_uri()}})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    try:
        async with session.post(chat_url, json=body, timeout=aiohttp.ClientTimeout(total=CALIBRATION_TIMEOUT_S),
                                headers={**headers, "X-Request-Id": f"{CALIBRATION_ID}{secrets.token_hex(6)}"}) as resp:
            data = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return None, 0, f"{type(exc).__name__}: {exc}"
    if status != 200:
        return None, status, response_message(data)
    try:
        return (json.loads(data).get("usage") or {}).get("prompt_tokens"), status, ""
    except (ValueError, AttributeError):
        return None, status, f"unreadable response body: {data[:200].decode(errors='replace')}"


async def calibrate(session: aiohttp.ClientSession, ep, model: str, calibration: Calibration,
                    ) -> tuple[dict, tuple[str, ...]]:
    """(visual tokens per calibration video, the videos counted otherwise than the plan). Raises
    CalibrationMediaError when the server cannot read or decode them, CalibrationBelowPlan when it
    resizes or refuses the calibration images, CalibrationUnlikePlan when it counts a video or the sound
    otherwise than the plan (module docstring)."""
    text_only, _, _ = await _prompt_tokens(session, ep.chat_url, ep.headers, model, None)
    measured: dict[str, int | None] = {}
    unlike = []
    for item in (*calibration.videos, *calibration.images, *calibration.sounds):
        tokens, status, message = await _prompt_tokens(session, ep.chat_url, ep.headers, model, item)
        if tokens is None:
            kind = classify_error(status, message, item.path)[0]
            if kind in MEDIA_ERROR_KINDS:
                raise CalibrationMediaError(ep.base_url, item.path, status, message)
            if kind == "decode_cap":  # every post's media over the cap would meet it too
                raise CalibrationBelowPlan(f"{ep.base_url} refused the calibration {item.kind} "
                                           f"{Path(item.path).name} (HTTP {status}): {decode_cap_refusal(message)}")
            if item.kind == "image" and kind == "too_many_items":
                raise CalibrationBelowPlan(f"{ep.base_url} refused the calibration image {item.path} (HTTP {status}: "
                                           f"{message}): it takes no images, and the job's posts send them. Restart "
                                           "it with `--limit-mm-per-prompt` allowing the data's images (for the "
                                           "job's own server, the {limit_mm_per_prompt} field of "
                                           "classify.server_command; docs/serving.md), then rerun.")
            log.warning("%s: calibration %s %s not measured (HTTP %s: %s); the server's %s is not checked",
                        ep.base_url, item.kind, Path(item.path).name, status, message[:200], item.what)
            if item.kind == "video":
                measured[item.what] = None
            continue
        visual = tokens - text_only if text_only is not None else None
        if item.kind == "image":
            if visual is not None and visual != item.expected_tokens:
                raise CalibrationBelowPlan(
                    f"{ep.base_url} resizes images otherwise than the plan: the calibration image for its {item.what} "
                    f"({Path(item.path).name}) took {visual} visual tokens where the plan expects "
                    f"{item.expected_tokens} (planning.image_min_pixels / image_max_pixels), so every image "
                    "estimate of the manifest would be wrong. A server started with one flat min_pixels/max_pixels "
                    "pair in --mm-processor-kwargs bounds photos like video frames: give images their own bounds "
                    "(the {mm_processor_kwargs} field of classify.server_command; docs/serving.md, \"Photos and "
                    "video frames\"), or set planning.image_min_pixels / image_max_pixels to the server's; then rerun.")
            continue
        if item.kind == "video":
            measured[item.what] = visual
        if visual is not None and visual != item.expected_tokens:
            unlike.append(item.what)
            raise CalibrationUnlikePlan(unlike_text(ep.base_url, item, visual))
    return measured, tuple(unlike)


def unlike_text(base_url: str, item: CalibrationItem, counted: int) -> str:
    """Why a server that counts a calibration item otherwise than the plan is refused, naming both families."""
    same = [name for name, tokens in item.by_family if tokens == counted]
    if same and item.family not in same:
        who = (f"it counts as the {' or '.join(same)} family does (at that family's defaults), not as the plan's "
               f"{item.family}: the model is not of the family the plan assumes. Set planning.model_family (or the "
               f"entry's model_family) to the server's family, or serve the model the plan names")
    else:
        who = (f"the plan's family is {item.family}; the server samples or resizes otherwise (planning.fps, min/max "
               "pixels, min/max frames, or another vLLM/transformers version: docs/serving.md): restart it with the "
               "plan's --media-io-kwargs and --mm-processor-kwargs, or set planning.* to the server's")
    return (f"{base_url}: the calibration {item.kind} for the {item.what} ({Path(item.path).name}) took {counted} "
            f"tokens where the plan expects {item.expected_tokens}, so the manifest's token estimates and context "
            f"gate do not describe this server and no post is sent; {who}; then rerun.")


async def identify(session: aiohttp.ClientSession, ep, model: str, calibration: Calibration | None) -> ServerIdentity:
    """The endpoint's identity (module docstring)."""
    version = (await _get(session, ep.version_url, ep.headers) or {}).get("version")
    models = (await _get(session, ep.models_url, ep.headers) or {}).get("data") or []
    card = models[0] if models and isinstance(models[0], dict) else {}
    metrics = await _get(session, ep.metrics_url, ep.headers, as_json=False)
    reported = metrics_info(metrics)
    info = await _get(session, ep.server_info_url, ep.headers)
    if isinstance(info, dict) and isinstance(info.get("vllm_config"), dict):
        reported.update({f"server_info.{k}": v for k, v in server_info_keys(info["vllm_config"]).items()})
    measured, unlike = await calibrate(session, ep, model, calibration) if calibration else ({}, ())
    return ServerIdentity(version=version, model_id=card.get("id"), model_root=card.get("root"),
                          max_model_len=card.get("max_model_len"), reported=reported, calibration=measured,
                          unlike_plan=unlike, kv_cache_tokens=kv_cache_tokens(metrics))
