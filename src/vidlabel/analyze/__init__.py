"""Stages after the GPU: merge, aggregate, compare, statistics and human labels."""
