"""Stages before the GPU: inventory, transcription, transcode, planning and the manifest."""
