"""How a classify job spreads one model over the GPUs it was granted: tensor parallel x data parallel.

``classify.parallelism: auto`` picks the smallest tensor-parallel size (TP) at which one copy of the
model fits: per GPU, ``weights / TP + KV cache of the shard's largest request / TP + a fixed
overhead`` must stay within ``gpu_memory_gib * gpu_memory_utilization``. The job then serves
``GPUs // TP`` copies (data parallel, DP). A model that fits one GPU (Qwen2.5-VL-7B) becomes one copy
per GPU rather than one copy split over all of them; Qwen2.5-VL-72B (137 GiB of bf16 weights) needs
TP 2 on 141 GB H200s and TP 4 on 80 GB GPUs. ``{tensor: N, data: M}`` sets both by hand.

Inputs, each logged with the decision:

- GPUs: ``CUDA_VISIBLE_DEVICES`` (what SLURM granted), else the GPUs ``nvidia-smi -L`` lists, else
  one (no GPU seen: only a stand-in server can run).
- Memory per GPU: ``classify.gpu_memory_gib``, else the smallest ``memory.total`` nvidia-smi reports.
- Weights: the model's ``model.safetensors.index.json`` total size when present, else the parameter
  count its family computes from its ``config.json`` (``Family.model_shape``: the text decoder, every
  expert of a mixture of experts, the vision and audio towers) times the dtype's bytes. The files are
  looked up in the model directory (``classify.model`` as a local path) or in the Hugging Face cache;
  without them a size in the model name ("72B") is the last resort.
- KV cache per token: 2 x layers x KV heads x head size x dtype bytes (the family's ``model_shape``).
- Quantization: ``classify.quantization`` (or a ``--quantization`` flag in the server command or
  ``classify.server_args``) on a checkpoint that is not quantized already (no ``quantization_config``
  in its config.json) stores the weights at the method's width (``QUANTIZED_BYTES``: fp8 one byte
  per parameter, so Qwen2.5-VL-72B fits one H200); a ``--kv-cache-dtype fp8`` halves the KV cache.
- GPU decoding (``planning.decode: gpu``) takes memory per API server from every GPU of a copy
  (``vidlabel.core.decode.gpu_reserve_gib``). Layers vLLM leaves unquantized
  (embeddings, the vision tower: about 4 % of the 72B) fit inside the overhead.

When memory or the model's size is unknown, ``auto`` uses every GPU for one copy (the safe layout for
any model that fits the job at all) and says so.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from vidlabel import families
from vidlabel.core.models import model_files
from vidlabel.core import decode
from vidlabel.serve import quantization

if TYPE_CHECKING:
    from vidlabel.serve.settings import LayoutSettings, ServeSettings

log = logging.getLogger(__name__)

GIB = 1024 ** 3
# Activations of the largest batch, CUDA graphs, the vision tower's work space and the encoder cache,
# per GPU (vLLM measures it at start-up; this only has to be on the safe side of it).
OVERHEAD_GIB = 4.0
# Bytes per parameter of the weights as a --quantization method stores them (vLLM quantizes fp8 on load).
QUANTIZED_BYTES = {"fp8": 1, "fbgemm_fp8": 1, "ptpc_fp8": 1, "modelopt": 1, "awq": 0.5, "awq_marlin": 0.5,
                   "gptq": 0.5, "gptq_marlin": 0.5, "bitsandbytes": 0.5}
_SIZE_IN_NAME = re.compile(r"(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])")


class ParallelismError(ValueError):
    """The configured layout does not match the GPUs the job has; the message names the key."""


@dataclass(frozen=True)
class ModelFootprint:
    """What one copy of a model needs: weights and KV cache per token, and its head counts."""

    weight_bytes: float
    kv_bytes_per_token: float
    attention_heads: int | None
    source: str
    dtype_bytes: float = 2.0
    prequantized: bool = False  # the checkpoint's own config names a quantization: its size is the stored one


@dataclass(frozen=True)
class Layout:
    """Tensor parallel x data parallel over ``gpus`` (device ids as CUDA_VISIBLE_DEVICES names them)."""

    tensor: int
    data: int
    gpus: tuple[str, ...]
    reason: str
    held: int = 0  # GPUs the job was granted (0: none seen, only a stand-in server can run)

    def groups(self) -> list[tuple[str, ...]]:
        """The GPUs of each copy: consecutive ids, ``tensor`` per copy."""
        return [self.gpus[i * self.tensor:(i + 1) * self.tensor] for i in range(self.data)]


# ------------------------------------------------------------------------------- the machine

def granted_gpus(environ=os.environ) -> tuple[list[str], str]:
    """Device ids of the GPUs this job may use, and where that came from."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        if ids and ids[0] not in ("-1", "NoDevFiles"):
            return ids, "CUDA_VISIBLE_DEVICES"
        return [], "CUDA_VISIBLE_DEVICES (none)"
    listed = _nvidia_smi(["-L"])
    if listed:
        count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
        if count:
            return [str(i) for i in range(count)], "nvidia-smi -L"
    return [], "no GPU visible"


def gpu_memory_gib(layout: LayoutSettings) -> tuple[float | None, str]:
    """Memory per GPU in GiB (the smallest GPU's), and where it came from."""
    configured = layout.gpu_memory_gib
    if configured:
        return float(configured), "classify.gpu_memory_gib"
    out = _nvidia_smi(["--query-gpu=memory.total", "--format=csv,noheader,nounits"])
    values = []
    for line in (out or "").splitlines():
        try:
            values.append(float(line.strip()) / 1024)  # MiB
        except ValueError:
            continue
    if values:
        return min(values), "nvidia-smi memory.total"
    return None, "unknown (no nvidia-smi, classify.gpu_memory_gib unset)"


def _nvidia_smi(args: list[str]) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------- the model

def model_footprint(model: str, family: families.Family) -> ModelFootprint | None:
    """Weights and KV cache per token of ``model`` (a checkpoint of ``family``, which knows its shape); None
    when nothing tells its size."""
    directory = model_files(model)
    if directory is None:
        match = _SIZE_IN_NAME.search(Path(model).name)
        if not match:
            return None
        return ModelFootprint(float(match.group(1)) * 1e9 * 2, math.nan, None,
                              f"size in the model name ({match.group(0)}, bf16); no config.json found")
    cfg = json.loads((directory / "config.json").read_text())
    shape = family.model_shape(cfg)
    index = directory / "model.safetensors.index.json"
    if index.is_file() and json.loads(index.read_text()).get("metadata", {}).get("total_size"):
        weights = float(json.loads(index.read_text())["metadata"]["total_size"])
        source = f"{index.name} total_size"
    else:
        weights = shape.parameters * shape.dtype_bytes
        source = f"config.json ({shape.parameters / 1e9:.2f}B parameters x {shape.dtype_bytes:g} bytes, {family.name})"
    prequantized = any("quantization_config" in c for c in (cfg, cfg.get("text_config") or {},
                                                              cfg.get("thinker_config") or {}))
    return ModelFootprint(weights, shape.kv_bytes_per_token, shape.attention_heads, f"{source}, {directory}",
                          float(shape.dtype_bytes), prequantized)


def server_flag(words: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` in the server command plus ``classify.server_args``, if any."""
    return decode.flag_value(words, *names)[1]


def served_footprint(settings: ServeSettings, footprint: ModelFootprint) -> ModelFootprint:
    """``footprint`` as the server stores it: weights at the width of ``classify.quantization`` (or of a
    --quantization in the server command), KV at --kv-cache-dtype."""
    words = settings.server.words
    method = settings.server.quantization or server_flag(words, *quantization.FLAG_ALIASES)
    kv_dtype = server_flag(words, "--kv-cache-dtype")
    weights, kv, notes = footprint.weight_bytes, footprint.kv_bytes_per_token, []
    if method in QUANTIZED_BYTES and not footprint.prequantized:
        weights = weights * QUANTIZED_BYTES[method] / footprint.dtype_bytes
        notes.append(f"--quantization {method}: {QUANTIZED_BYTES[method]:g} byte(s) per parameter")
    if kv_dtype and kv_dtype.startswith("fp8") and not math.isnan(kv):
        kv = kv / footprint.dtype_bytes
        notes.append(f"--kv-cache-dtype {kv_dtype}")
    if not notes:
        return footprint
    return replace(footprint, weight_bytes=weights, kv_bytes_per_token=kv,
                   source=f"{footprint.source}; {', '.join(notes)}")


# ------------------------------------------------------------------------------- the choice

def fits(footprint: ModelFootprint, tensor: int, memory_gib: float, utilization: float, request_tokens: int,
         reserve_gib: float = 0.0) -> bool:
    """Whether one copy at this tensor-parallel size holds its weights and one largest request, next to
    ``reserve_gib`` per GPU that the server sets aside for something else (GPU video decoding)."""
    kv = 0.0 if math.isnan(footprint.kv_bytes_per_token) else footprint.kv_bytes_per_token * request_tokens
    per_gpu = (footprint.weight_bytes + kv) / tensor / GIB + OVERHEAD_GIB + reserve_gib
    return per_gpu <= memory_gib * utilization


def choose_layout(settings: ServeSettings, largest_request_tokens: int, environ=os.environ,
                  footprint: ModelFootprint | None = None) -> Layout:
    """The layout for this job (see the module docstring); ``footprint`` overrides the lookup (tests)."""
    c = settings.layout
    gpus, gpu_source = granted_gpus(environ)
    if c.parallelism is not None:
        tensor, data = c.parallelism
        if gpus and tensor * data > len(gpus):
            raise ParallelismError(
                f"config key 'classify.parallelism': tensor {tensor} x data {data} needs {tensor * data} GPUs "
                f"but the job has {len(gpus)} ({gpu_source}: {','.join(gpus)})")
        ids = tuple(gpus[:tensor * data]) if gpus else tuple(str(i) for i in range(tensor * data))
        unused = f"; {len(gpus) - tensor * data} GPUs left unused" if gpus and len(gpus) > tensor * data else ""
        return Layout(tensor, data, ids, f"classify.parallelism: tensor {tensor} x data {data}{unused}", held=len(gpus))

    n = max(1, len(gpus))
    ids = tuple(gpus) if gpus else ("0",)
    memory, memory_source = gpu_memory_gib(c)
    footprint = footprint or model_footprint(settings.model, settings.plan.family)
    if footprint is not None:
        footprint = served_footprint(settings, footprint)
    inputs = (f"{n} GPUs ({gpu_source}: {','.join(ids)}), {'%.1f GiB' % memory if memory else 'memory unknown'} per GPU "
              f"({memory_source}), utilization {c.gpu_memory_utilization:g}, largest request "
              f"{largest_request_tokens} tokens")
    if footprint is None or memory is None:
        why = "model size unknown" if footprint is None else "GPU memory unknown"
        return Layout(n, 1, ids, f"auto: {why}, one copy over every GPU: tensor {n} x data 1; {inputs}", held=len(gpus))
    candidates = [t for t in range(1, n + 1) if n % t == 0
                  and (footprint.attention_heads is None or footprint.attention_heads % t == 0)]
    kv = ("KV size unknown" if math.isnan(footprint.kv_bytes_per_token)
          else f"KV {footprint.kv_bytes_per_token / 1024:.0f} KiB/token")
    weights = f"weights {footprint.weight_bytes / GIB:.1f} GiB, {kv} ({footprint.source})"
    # GPU decoding takes memory per API server from every GPU of a copy (at most 8 API servers:
    # vidlabel.serve.command.MAX_API_SERVERS, unless classify.api_server_count says otherwise).
    reserve = decode.gpu_reserve_gib(settings.server.decode_backend, settings.server.api_server_count or 8)
    if reserve:
        weights += f"; GPU decoding {reserve:.1f} GiB per GPU"
    for tensor in candidates:
        if fits(footprint, tensor, memory, c.gpu_memory_utilization, largest_request_tokens, reserve):
            return Layout(tensor, n // tensor, ids,
                          f"auto: tensor {tensor} x data {n // tensor} (smallest tensor-parallel size that fits); "
                          f"{weights}; {inputs}", held=len(gpus))
    return Layout(n, 1, ids, f"auto: the model does not fit even at tensor {n}; trying one copy over every GPU "
                             f"anyway (vLLM will say what is missing); {weights}; {inputs}", held=len(gpus))
