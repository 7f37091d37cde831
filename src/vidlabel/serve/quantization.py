"""``classify.quantization``: the weight format the server loads the model in.

A config key rather than a raw server argument, so that it is part of every answer's settings (it
is in the classify fingerprint and, through the command, in the answer's server settings) and so
that ``parallelism: auto`` sizes the weights by it (``vidlabel.serve.parallelism``). ``fp8`` is vLLM's
``--quantization fp8``: the bf16 checkpoint is quantized to FP8 on load (one byte per parameter; the
vision tower and embeddings stay bf16), about half the memory, and faster on GPUs with FP8 units (H100,
H200). A method given in ``classify.server_args`` instead still sizes the layout, as before.
"""

from __future__ import annotations

from vidlabel.core.decode import flag_value

FLAG = "--quantization"
FLAG_ALIASES = ("--quantization", "-q")


class QuantizationConflict(ValueError):
    """``classify.quantization`` and a ``--quantization`` in the server command disagree."""


def with_flag(argv: list[str], method: str | None) -> list[str]:
    """``argv`` with ``--quantization METHOD`` for ``classify.quantization`` (appended, like
    ``classify.server_args``); unchanged when it is null or the command already says the same."""
    if not method:
        return list(argv)
    present = flag_value(argv, *FLAG_ALIASES)[1]
    if present == method:
        return list(argv)
    if present is not None:
        raise QuantizationConflict(
            f"config key 'classify.quantization' is {method!r} but the server command or classify.server_args "
            f"says --quantization {present}: keep one of them")
    return list(argv) + [FLAG, str(method)]
