import os
import warnings

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Save tiny random models (with tokenizers) with save_pretrained; returns family -> dir."""
    from moelab.models.tiny import build_tiny
    from moelab.models.tokenizer import byte_tokenizer

    root = tmp_path_factory.mktemp("tiny-models")
    cache: dict[str, object] = {}

    def get(family: str):
        if family not in cache:
            d = root / family
            build_tiny(family, seed=0).save_pretrained(d)
            byte_tokenizer().save_pretrained(d)
            cache[family] = d
        return cache[family]

    return get
