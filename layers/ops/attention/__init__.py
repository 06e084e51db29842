"""Softmax attention cores: one device (core) and across a context-parallel group (context)."""
