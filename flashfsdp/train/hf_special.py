"""The special tokens an exported run keeps (`flashfsdp-train export`): beginning and end of
sequence, padding and unknown, as transformers reads them from three files.

- `config.json`: `bos_token_id`, `eos_token_id` (an id or a list of ids), `pad_token_id`;
- `tokenizer_config.json`: `bos_token`, `eos_token`, `pad_token`, `unk_token` (the token's text),
  and a `chat_template`;
- `generation_config.json`: what `generate` stops at (`eos_token_id`) and starts with.

The job itself trains on documents concatenated without special tokens, so these come from where
the run's model and tokenizer came from: the --init-from folder's `config.json` and
`generation_config.json`, and the `tokenizer_config.json` beside the run's tokenizer.json (the
--init-from folder's, or the folder of --tokenizer FILE). What one file gives, the tokenizer
completes in the other (an id's token text, a token's id). A byte-level run (no --tokenizer, no
--init-from) has no special tokens: its folder has none of these keys and no generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os

from flashfsdp.log import get_logger

ROLES = ("bos", "eos", "pad", "unk")
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
_log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """A run's special tokens, as the exported folder's files carry them.

    Attributes:
        tokens: {"bos_token": "<s>", "eos_token": "</s>", ...} for tokenizer_config.json.
        ids: {"bos_token_id": 1, "eos_token_id": 2, ...} for config.json (an eos may be a list).
        generation: the generation_config.json object to write, or None for none.
        chat_template: the tokenizer's chat template, or None.
    """

    tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    ids: dict[str, int | list[int]] = dataclasses.field(default_factory=dict)
    generation: dict | None = None
    chat_template: str | None = None


def _json(path: str) -> dict:
    """The JSON object of `path`, or {} when it is missing; a file that is not one is skipped
    with a warning naming it (the export goes on without what it would have given)."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            found = json.load(fh)
    except (OSError, ValueError) as err:
        _log.warning("export: %s is not readable JSON (%s); its special tokens are not carried over", path, err)
        return {}
    return found if isinstance(found, dict) else {}


def _text(token) -> str | None:
    """A tokenizer_config.json token: a string, or an AddedToken object's "content"."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def special_tokens(tokenizer_path: str | None, init_from: str | None) -> SpecialTokens:
    """The special tokens of a run whose tokenizer is `tokenizer_path` (a tokenizer.json, None for
    bytes) and whose model came from `init_from` (a transformers folder, or None); see the module
    docstring for where each comes from. A token the tokenizer does not know is left out."""
    if tokenizer_path is None:
        return SpecialTokens()
    from tokenizers import Tokenizer  # noqa: PLC0415 - a --tokenizer run has it (FileTokenizer)

    tokenizer = Tokenizer.from_file(tokenizer_path)
    written = _json(os.path.join(os.path.dirname(tokenizer_path), TOKENIZER_CONFIG))
    model = _json(os.path.join(init_from, "config.json")) if init_from else {}
    generation = _json(os.path.join(init_from, GENERATION_CONFIG)) if init_from else {}
    tokens, ids = {}, {}
    for role in ROLES:
        text, index = _text(written.get(f"{role}_token")), model.get(f"{role}_token_id")
        first = index[0] if isinstance(index, list) and index else index
        if text is None and isinstance(first, int):
            text = tokenizer.id_to_token(first)
        if index is None and text is not None:
            index = tokenizer.token_to_id(text)
        if text is not None and tokenizer.token_to_id(text) is not None:
            tokens[f"{role}_token"] = text
        if index is not None and role != "unk":
            ids[f"{role}_token_id"] = index
    if not generation and ids:
        generation = {key: value for key, value in ids.items() if key != "unk_token_id"}
    template = written.get("chat_template")
    return SpecialTokens(tokens, ids, generation or None, template if isinstance(template, str) else None)


def write_generation_config(special: SpecialTokens, to: str, transformers) -> None:
    """`<to>/generation_config.json` of `special` (transformers' `GenerationConfig`), or none
    when the run has no special tokens (and an earlier export's is removed)."""
    path = os.path.join(to, GENERATION_CONFIG)
    if special.generation is None:
        if os.path.exists(path):
            os.remove(path)
        return
    fields = {key: value for key, value in special.generation.items() if key != "transformers_version"}
    transformers.GenerationConfig(**fields).save_pretrained(to)
