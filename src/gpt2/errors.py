"""Error types shared by every module: a GPT2Error is an expected failure with a message for people.

The CLI prints these as one line without a traceback; anything else is a bug and keeps its traceback.
"""


class GPT2Error(Exception):
    """Base class for expected, user-facing errors."""


class CheckpointError(GPT2Error, ValueError):
    """A model file or directory is missing, corrupt, truncated or of the wrong architecture."""


class ConfigError(GPT2Error, ValueError):
    """A configuration value is invalid or not supported."""


class TokenizerError(GPT2Error, ValueError):
    """Tokenizer files are missing or tampered with, or the input breaks the encoding rules."""


class DataError(GPT2Error, ValueError):
    """Input data or token shards are missing, empty or malformed."""


class ContextLengthError(GPT2Error, ValueError):
    """A prompt (plus the tokens to generate) does not fit in the model's context."""


class KVLimitExceeded(GPT2Error):
    """A sequence needs more KV-cache memory than the limit (`--max-kv-mb`) allows, even alone."""
