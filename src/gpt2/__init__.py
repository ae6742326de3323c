"""gpt2: OpenAI's GPT-2, exact and fast, in one readable package.

    from gpt2 import GPT, GPTConfig
    model = GPT.from_pretrained("gpt2")
    model = GPT(GPTConfig.preset("gpt2"))

Run `gpt2 --help` for the command line.
"""

from gpt2.config import GPTConfig
from gpt2.data import DataLoader
from gpt2.engine import generate, stream
from gpt2.errors import CheckpointError, ConfigError, ContextLengthError, DataError, GPT2Error, TokenizerError
from gpt2.kv_cache import KVCache
from gpt2.model import GPT
from gpt2.tokenizer import Tokenizer

__all__ = [
    "GPT", "GPTConfig", "KVCache", "Tokenizer", "DataLoader", "generate", "stream",
    "GPT2Error", "CheckpointError", "ConfigError", "ContextLengthError", "DataError", "TokenizerError",
]
