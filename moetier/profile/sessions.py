"""Session files: the workload a profile, a KL measurement and a sweep run over.

JSONL, one record per request (blank lines skipped):
    {"phase": "explore", "ids": [1, 17, 240, ...]}
    {"phase": "edit", "text": "def f(x): ...", "session": "s1"}
    {"phase": "second_language", "ids": [...], "profile": false}
`phase` is any label (explore / edit / verify in the examples; each phase gets
an equal vote in a profile). `ids` are token ids; `text` is tokenized with the
model's own tokenizer (moetier.model.tokenizer: a folder's tokenizer.json or a
GGUF's vocabulary; special tokens' text parsed, no BOS added), only when it has
one. `moetier serve --record` writes these files (moetier.serve.record). `profile: false` holds a record out of profiles (it is still measured
by `kl` and `sweep`); `session` groups records; `meta` is free-form and ignored.
Invariant: every error is one line naming the file, the line and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

KEYS = {"phase", "ids", "text", "profile", "session", "meta"}


class SessionError(ValueError):
    """A session file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Request:
    """One record of a session file, tokenized."""

    ids: np.ndarray  # [T] int64 token ids
    phase: str
    profile: bool = True  # votes in profiles (False: held out, measured only)
    session: str = ""
    where: str = ""  # "file:line", for messages


class _Tokenizer:
    """The model's tokenizer, loaded on the first `text` record."""

    def __init__(self, model_dir: Path | None):
        self.model_dir = model_dir
        self._tokenizer = None

    def encode(self, text: str, where: str) -> list[int]:
        if self._tokenizer is None:
            from moetier.model.tokenizer import TokenizerError, has_tokenizer, load_tokenizer

            folder = self.model_dir
            if folder is None or not has_tokenizer(folder):
                raise SessionError(
                    f"{where}: the record has 'text' but {folder or 'the model'} has no tokenizer "
                    f"(no tokenizer.json, nor a GGUF vocabulary); give token ids as \"ids\" instead")
            try:
                self._tokenizer = load_tokenizer(folder)
            except TokenizerError as err:
                raise SessionError(f"{where}: cannot load the tokenizer of {folder} ({err})") from None
        return self._tokenizer.encode(text, add_special=False)


def _parse(record: object, where: str, tokenizer: _Tokenizer, vocab_size: int | None) -> Request:
    if not isinstance(record, dict):
        raise SessionError(f"{where}: expected a JSON object like {{\"phase\": \"edit\", \"ids\": [1, 2, 3]}}")
    unknown = sorted(set(record) - KEYS)
    if unknown:
        raise SessionError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(sorted(KEYS))})")
    phase = record.get("phase")
    if not isinstance(phase, str) or not phase.strip():
        raise SessionError(f"{where}: 'phase' is {phase!r} (expected a non-empty label such as \"explore\")")
    if ("ids" in record) == ("text" in record):
        raise SessionError(f"{where}: give exactly one of 'ids' (token ids) or 'text'")
    if "ids" in record:
        ids = record["ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise SessionError(f"{where}: 'ids' must be a list of integers")
    else:
        if not isinstance(record["text"], str):
            raise SessionError(f"{where}: 'text' must be a string")
        ids = tokenizer.encode(record["text"], where)
    if not ids:
        raise SessionError(f"{where}: the record has no tokens (expected at least one)")
    if vocab_size is not None:
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise SessionError(f"{where}: token id {bad[0]} is outside the vocabulary (expected 0 <= id < {vocab_size})")
    profile = record.get("profile", True)
    if not isinstance(profile, bool):
        raise SessionError(f"{where}: 'profile' is {profile!r} (expected true or false)")
    return Request(np.asarray(ids, dtype=np.int64), phase.strip(), profile, str(record.get("session", "")), where)


def load_sessions(paths: Sequence[Path] | Path, model_dir: Path | None = None, vocab_size: int | None = None) -> list[Request]:
    """Every record of one or more JSONL files, validated (token ids against vocab_size when given)."""
    tokenizer = _Tokenizer(Path(model_dir) if model_dir is not None else None)
    requests: list[Request] = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise SessionError(f"{path}: no such session file (expected JSONL, one request per line)") from None
        except (OSError, UnicodeDecodeError) as err:
            raise SessionError(f"{path}: cannot read ({err})") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise SessionError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            requests.append(_parse(record, where, tokenizer, vocab_size))
    if not requests:
        raise SessionError(f"{', '.join(map(str, [paths] if isinstance(paths, (str, Path)) else paths))}: no records")
    return requests


def requests_from_ids(ids: np.ndarray, phase: str = "all", where: str = "") -> list[Request]:
    """A bare id array [T] as one request (for `kl --ids`)."""
    return [Request(np.asarray(ids, dtype=np.int64).reshape(-1), phase, True, "", where)]


def write_sessions(path: Path, records: Iterable[dict]) -> Path:
    from moetier.model.output import new_file

    path = Path(path)
    with new_file(path) as partial, open(partial, "w", encoding="utf-8") as out:  # whole file or nothing
        for record in records:
            out.write(json.dumps(record) + "\n")
    return path


def example_records(model_dir: Path, sessions: int = 3, tokens_per_phase: int = 64, held_out: int = 1, seed: int = 0) -> list[dict]:
    """Agent-like sessions of a synthetic model: explore / edit / verify records, plus held-out
    "second_language" records (profile: false) whose tokens lean on experts the phases rarely use."""
    from moetier.model.synth import sample_session

    records = []
    for s in range(sessions):
        for phase, ids in sample_session(model_dir, tokens_per_phase=tokens_per_phase, seed=seed + s):
            records.append({"phase": phase, "ids": [int(i) for i in ids], "session": f"example-{s}"})
    for s in range(held_out):
        for phase, ids in sample_session(model_dir, phases=("second_language",), tokens_per_phase=tokens_per_phase,
                                         seed=seed + 1000 + s):
            records.append({"phase": phase, "ids": [int(i) for i in ids], "session": f"held-out-{s}", "profile": False})
    return records


def write_example_sessions(model_dir: Path, path: Path, sessions: int = 3, tokens_per_phase: int = 64,
                           held_out: int = 1, seed: int = 0) -> Path:
    """Write `example_records` of a synthetic model folder as a session file; returns its path."""
    from moetier.model.synth import SYNTH_META

    if not (Path(model_dir) / SYNTH_META).exists():
        raise SessionError(f"{model_dir}: not a synthetic model (no {SYNTH_META}); example sessions come from its token families")
    return write_sessions(path, example_records(Path(model_dir), sessions, tokens_per_phase, held_out, seed))


def token_family_of(model_dir: Path, vocab_size: int) -> np.ndarray | None:
    """[V] family name per token id for synthetic models ("" for specials), else None."""
    from moetier.model.synth import SYNTH_META, token_families

    if not (Path(model_dir) / SYNTH_META).exists():
        return None
    family = np.full(vocab_size, "", dtype=object)
    for name, ids in token_families(model_dir).items():
        family[ids] = name
    return family
