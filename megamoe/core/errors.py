"""Errors users see. Each message is one line that names the field, tensor or file."""


class MegamoeError(Exception):
    """Base class: every error megamoe raises on bad input."""


class ConfigError(MegamoeError, ValueError):
    """A config value, recipe or layout string is invalid."""


class CheckpointError(MegamoeError, ValueError):
    """A checkpoint or converted file is missing, truncated or does not match the model."""


class DataError(MegamoeError, ValueError):
    """A data file, record or tokenizer is malformed; the message starts with ``FILE:LINE:``."""
