"""The tokenizer of a `flashfsdp-train` run as a transformers tokenizer (`flashfsdp-train export`).

`AutoTokenizer.from_pretrained(DIR)` on the exported folder then gives the ids the job trained on:

- a byte-level run (the default, `flashfsdp.train.tokenizer.ByteTokenizer`: id = UTF-8 byte): a
  byte-level BPE of 256 ids and no merges, whose id of a byte is the byte's value (each byte is one
  character of GPT-2's byte-to-character table, transformers' `bytes_to_unicode`; no regex split,
  no prefix space, no special tokens), decoded by the byte-level decoder;
- a `--tokenizer` run: its tokenizer.json, as it is.
"""

from __future__ import annotations

from flashfsdp.train.tokenizer import BYTE_VOCAB


def byte_tokenizer():
    """A `tokenizers.Tokenizer` whose ids are the UTF-8 bytes of the text (vocabulary 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 - transformers' dependency
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: PLC0415

    char_of = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def run_tokenizer(path: str | None, transformers, special=None):
    """The run's tokenizer (`TrainConfig.data.tokenizer`: a tokenizer.json, or None for bytes) as a
    `transformers.PreTrainedTokenizerFast`, to `save_pretrained` beside the model, naming the
    special tokens and chat template of `special` (a `flashfsdp.train.hf_special.SpecialTokens`;
    None: none), which its tokenizer_config.json then carries.

    Raises:
        Exception: the tokenizers package's own error for a tokenizer.json it cannot read.
    """
    if path is None:
        return transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer())
    from tokenizers import Tokenizer  # noqa: PLC0415

    named = {} if special is None else dict(special.tokens)
    if special is not None and special.chat_template is not None:
        named["chat_template"] = special.chat_template
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(path), **named)
