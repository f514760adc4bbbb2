"""A byte-level tokenizer that needs no training data (for tiny random models).

Ids 0..2 are ``<pad>``, ``<s>``, ``</s>``; ids 3..258 are the 256 bytes, so any text
round-trips. The bundled trained models ship their own trained BPE tokenizers.
"""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` over raw bytes (vocabulary of 259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        padding_side="left",
    )
