"""Byte-level BPE tokenizer for Python source, trained with the ``tokenizers`` library.
Design notes: docs/architecture.md, "models/tokenizer.py".

Invariants later stages depend on: lossless (``decode(encode(x)) == x`` for every valid Unicode
string: no normalizer, GPT-2's byte-level stand-ins); ``return_offsets_mapping`` gives
character offsets into the original string (``trim_offsets=False``); no implicit BOS or EOS
(callers append ``eos_token_id`` where a document ends); Qwen2's pre-split regex. The special
tokens carry Qwen2's names and occupy the first ids, so ``len(tokenizer)`` equals
``vocab_size``. Load it with :func:`privcode.models.loading.load_tokenizer` (plain
``AutoTokenizer`` adds an NFC normalizer for a qwen2 directory).
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "train_tokenizer",
]

#: End of a document; also the BOS token (GPT-2 convention), never added implicitly.
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = EOS_TOKEN
#: A separate padding token: collators that mask padding out of the labels then
#: never mask the real end-of-document token.
PAD_TOKEN = "<|pad|>"

#: Every special token, in id order (ids 0..len-1). Chat/prompt markers and
#: fill-in-the-middle markers use the Qwen2.5-Coder spellings.
SPECIAL_TOKENS: tuple[str, ...] = (
    EOS_TOKEN,
    PAD_TOKEN,
    "<|im_start|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|file_sep|>",
    "<|repo_name|>",
)

#: Qwen2's pre-tokenization pattern (single digits, whitespace kept off words).
SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            # use_regex=False: the Split above already did the (better) splitting.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps a token's leading space inside its offsets, so
    # the spans tile the text; adds no tokens.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, *, model_max_length: int = 2048, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it for transformers.

    ``vocab_size`` counts everything: the special tokens, the 256 byte
    symbols and the learned merges. Training is deterministic for a given
    sequence of texts. The result saves with ``save_pretrained`` and loads
    back with ``AutoTokenizer.from_pretrained`` (no custom code needed).
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256 + 1:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for merges")
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the alphabet even if the training text lacks it:
        # this is what makes any Unicode input encodable (no unknown token).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok, model_max_length=model_max_length)


def wrap_tokenizer(tok: Tokenizer, *, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """A ``tokenizers.Tokenizer`` as a transformers fast tokenizer with our special tokens."""
    extra = [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=extra,
        # Cleaning up "tokenization spaces" would rewrite " ." to "." and break
        # the lossless round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="right",
    )
