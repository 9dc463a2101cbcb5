"""A checkpoint's Hugging Face tokenizer, made into the manifest's ``tokenizer`` entry (kind ``huggingface``).

    found = find_tokenizer(checkpoint_dir, given)          # the tokenizer.json to use, or None
    entry = hf_tokenizer_entry(found, vocab_size, checkpoint_dir)
    entry.spec                                             # the manifest entry, file hashes included
    entry.files                                            # name -> source path, copied into the export folder

The special ids are read from the checkpoint, first found wins, for each of bos, eos and pad:
``generation_config.json`` (``*_token_id``), ``config.json`` (``*_token_id``), then ``tokenizer_config.json``
and ``special_tokens_map.json`` (``*_token``: the token's text, looked up in tokenizer.json). ``eos_token_id``
may be a list: every id in it ends a sequence (``eos_ids``; ``eos_id`` is the first). Whether a bos is
prepended (``add_bos``) is ``tokenizer_config.json``'s ``add_bos_token`` where it says, else whether the
tokenizer's post-processor puts the bos in front of an encoded text. Every id must lie inside the model's
vocabulary; a tokenizer that can produce an id beyond it is refused, naming the token.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgelin.errors import ExportError, RuntimeInputError
from edgelin.runtime.files import check_path, read_regular
from edgelin.runtime.manifest import HUGGINGFACE, file_sha256
from edgelin.runtime.tokenizer import HF_FILES, TOKENIZER_BYTES, TOKENIZER_FILE, read_hf_tokenizer, tokenizer_id_range

CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SPECIALS = ("bos", "eos", "pad")
HINT = "pass the checkpoint's tokenizer with --tokenizer PATH (a folder holding tokenizer.json, or the file)"


@dataclass(frozen=True)
class TokenizerEntry:
    spec: dict[str, Any]  # the manifest's tokenizer entry
    files: dict[str, Path]  # file name in the export folder -> the file to copy
    sources: dict[str, str]  # "bos_id" / "eos_id" / "pad_id" / "add_bos" -> where it was read


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` (which exists as a name) is not a regular file to read, or None if it is one."""
    if path.is_symlink() and not path.exists():
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    if path.is_dir():
        return f"{path} is a folder"
    if not path.is_file():
        return f"{path} is not a regular file (a FIFO, device or socket is never read)"
    return None


def find_tokenizer(checkpoint: str | os.PathLike | None, given: str | os.PathLike | None) -> Path | None:
    """The tokenizer.json to export with: ``given`` (a folder holding one, or the file itself), else the
    checkpoint folder's own, else None. A tokenizer.json that is there but cannot be read as a file (a FIFO, a
    dangling link) is refused, never passed over for the byte tokenizer."""
    if given is not None:
        path = check_path(given, "tokenizer", ExportError)
        if path.is_dir():
            path = path / TOKENIZER_FILE
            if not os.path.lexists(path):
                raise ExportError(f"{given} holds no {TOKENIZER_FILE}; {HINT}")
        elif not os.path.lexists(path):
            raise ExportError(f"tokenizer {given} does not exist; {HINT}")
        why = _not_a_file(path)
        if why:
            raise ExportError(f"tokenizer: {why}; {HINT}")
        return path
    if checkpoint is not None and Path(checkpoint).is_dir() and os.path.lexists(Path(checkpoint) / TOKENIZER_FILE):
        path = Path(checkpoint) / TOKENIZER_FILE
        why = _not_a_file(path)
        if why:
            raise ExportError(f"the checkpoint's tokenizer: {why}; make it the tokenizer's file (or remove it to export "
                              "without a tokenizer, or name one with --tokenizer)")
        return path
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(read_regular(path, TOKENIZER_BYTES, "tokenizer file").decode("utf-8"))
    except RuntimeInputError as exc:
        raise ExportError(str(exc)) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ExportError(f"{path} is not readable JSON ({str(exc).splitlines()[0][:200]}); fix or remove it") from None
    if not isinstance(data, dict):
        raise ExportError(f"{path} must hold a JSON object; fix or remove it")
    return data


def _token_text(value: Any) -> str | None:
    """A tokenizer_config / special_tokens_map entry: the token's text, or an AddedToken object's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids_value(value: Any, key: str, where: Path, allow_list: bool) -> list[int] | None:
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if (isinstance(value, list) and not allow_list) or not items or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items
    ):
        kind = "a non-negative integer" + (" or a list of them" if allow_list else "")
        raise ExportError(f"{where}: {key} must be {kind}, got {value!r}; fix the file or {HINT}")
    return list(items)


def hf_tokenizer_entry(tokenizer_json: Path, vocab_size: int, checkpoint: str | os.PathLike | None = None) -> TokenizerEntry:
    """The manifest entry of ``tokenizer_json`` for a model of ``vocab_size`` ids, the files to copy beside
    it (tokenizer.json, and tokenizer_config.json / special_tokens_map.json / generation_config.json where
    the tokenizer's or the checkpoint's folder has them) and where each special id came from."""
    tok = read_hf_tokenizer(tokenizer_json, error=ExportError, hint=HINT)
    top, token = tokenizer_id_range(tok)
    if top >= vocab_size:
        raise ExportError(
            f"{tokenizer_json}: token {token!r} has id {top}, outside the model's vocabulary of {vocab_size}; "
            f"this tokenizer does not belong to the model -- {HINT}"
        )
    tok_dir = tokenizer_json.parent
    ckpt_dir = Path(checkpoint) if checkpoint is not None and Path(checkpoint).is_dir() else None
    read_config = getattr(checkpoint, "config", None)  # an edgelin.checkpoint.Checkpoint: its config.json, read once
    files = {TOKENIZER_FILE: tokenizer_json}
    for name in HF_FILES[1:]:
        for folder in ([tok_dir, ckpt_dir] if name != GENERATION_CONFIG else [ckpt_dir, tok_dir]):
            if folder is not None and (folder / name).is_file():
                files[name] = folder / name
                break
    generation = _read_json(files[GENERATION_CONFIG]) if GENERATION_CONFIG in files else None
    config = read_config if read_config is not None else _read_json(ckpt_dir / CONFIG_FILE) if ckpt_dir is not None else None
    tok_config = _read_json(files[TOKENIZER_CONFIG]) if TOKENIZER_CONFIG in files else None
    special_map = _read_json(files[SPECIAL_TOKENS_MAP]) if SPECIAL_TOKENS_MAP in files else None

    ids: dict[str, list[int] | None] = {}
    sources: dict[str, str] = {}
    for name in SPECIALS:
        key = f"{name}_token_id"
        found = None
        for data, path in ((generation, files.get(GENERATION_CONFIG)), (config, ckpt_dir and ckpt_dir / CONFIG_FILE)):
            if data is not None and data.get(key) is not None:
                found, sources[f"{name}_id"] = _ids_value(data[key], key, path, allow_list=name == "eos"), f"{path.name} {key}"
                break
        if found is None:
            for data, path in ((tok_config, files.get(TOKENIZER_CONFIG)), (special_map, files.get(SPECIAL_TOKENS_MAP))):
                text = _token_text(data.get(f"{name}_token")) if data is not None else None
                if text is None:
                    continue
                i = tok.token_to_id(text)
                if i is None:
                    raise ExportError(f"{path}: {name}_token {text!r} is not a token of {tokenizer_json.name}; fix the file or {HINT}")
                found, sources[f"{name}_id"] = [i], f"{path.name} {name}_token {text!r}"
                break
        for i in found or ():
            if i >= vocab_size:
                raise ExportError(
                    f"{sources[f'{name}_id']}: {name} id {i} is outside the model's vocabulary of {vocab_size}; fix the file or {HINT}"
                )
        ids[name] = found

    bos = ids["bos"][0] if ids["bos"] else None
    if tok_config is not None and isinstance(tok_config.get("add_bos_token"), bool):
        add_bos, sources["add_bos"] = tok_config["add_bos_token"], f"{TOKENIZER_CONFIG} add_bos_token"
    else:
        plain = tok.encode("a", add_special_tokens=False).ids
        full = tok.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and len(full) > len(plain) and full[0] == bos and full[1:1 + len(plain)] == plain
        sources["add_bos"] = f"{TOKENIZER_FILE} post_processor"
    if add_bos and bos is None:
        raise ExportError(f"{sources['add_bos']} says a bos token is prepended, but the checkpoint names no bos id; {HINT}")
    eos_ids = ids["eos"] or []
    spec = {
        "kind": HUGGINGFACE, "encoding": None, "offset": 0, "bos_id": bos, "eos_id": eos_ids[0] if eos_ids else None,
        "pad_id": ids["pad"][0] if ids["pad"] else None, "eos_ids": list(dict.fromkeys(eos_ids)), "add_bos": bool(add_bos),
        "skip_special_tokens": True, "files": {name: file_sha256(path) for name, path in files.items()},
    }
    return TokenizerEntry(spec=spec, files=files, sources=sources)


__all__ = ["TokenizerEntry", "find_tokenizer", "hf_tokenizer_entry"]
