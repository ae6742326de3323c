"""Shared fixtures: Transformers reference models at random init, saved as Hugging Face directories."""

import os
import warnings

import pytest
import torch

# Deterministic, quiet, and no network: tests never reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*bos_token_id.*")
warnings.filterwarnings("ignore", message=".*eos_token_id.*")

TINY = dict(n_layer=2, n_head=2, n_embd=16, vocab_size=97, n_positions=64)


def make_hf_model(seed=0, attn_implementation="eager", **config):
    """A transformers.GPT2LMHeadModel at random init (eval mode)."""
    import transformers
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(**{**TINY, **config}, attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(hf_config).eval()


def save_hf_model(directory, seed=0, **config):
    """make_hf_model(seed, **config) written to `directory` by save_pretrained; returns the model."""
    model = make_hf_model(seed=seed, **config)
    model.save_pretrained(directory)
    return model


@pytest.fixture
def hf_model_dir(tmp_path):
    """Factory: (hf_model, directory) with the model written by save_pretrained."""
    def make(seed=0, **config):
        directory = tmp_path / f"hf_{seed}_{abs(hash(tuple(sorted(config.items()))))}"
        return save_hf_model(directory, seed=seed, **config), directory
    return make
