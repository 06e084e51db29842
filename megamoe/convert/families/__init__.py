"""Importing this package registers every family (megamoe.convert.family.FAMILIES)."""
from megamoe.convert.families import qwen3  # noqa: F401
