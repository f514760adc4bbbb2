"""A small byte-level BPE tokenizer trained locally, digits split one per token."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 1024, model_max_length: int = 512
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts``; every digit is its own token.

    The result may stop below ``vocab_size`` (few merges left): size models with
    ``len(tokenizer)``. No BOS is prepended when encoding (as lm-eval's HF model expects
    for most tokenizers); EOS ends every training example. It pads on the left (the models
    are decoder-only) and its ``model_max_length`` should be the model's context.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        padding_side="left",
    )
    logger.info("trained a byte-level BPE with %d tokens", len(fast))
    return fast
