"""vidlabel: label large video datasets with a multimodal LLM served by vLLM."""

__version__ = "0.1.0"
