"""Embedders: text to vectors, behind one protocol.

The default, :class:`HashingEmbedder`, needs no model and no network: it
hashes a text's words and their character trigrams into a fixed number of
dimensions (signed feature hashing) and normalises the sum to unit length.
The same text gives the same vector on every machine and in every release
that keeps its ``name``; texts that share words are near each other, which
is enough for lexical search and for tests. A real model comes through
``JOBPLANE_EMBEDDER=fastembed:<model>`` when fastembed is installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from jobplane.config import ConfigError

#: The hashing embedder's dimensions.
HASH_DIM = 384
_WORD = re.compile(r"\w+", re.UNICODE)


class EmbedderUnavailable(ConfigError):
    """The configured embedder cannot be loaded (its library is not installed)."""


@runtime_checkable
class Embedder(Protocol):
    """Texts to vectors of ``dim`` floats, each of unit length.

    ``name`` identifies the model and its version: points keep it, and a
    change of it is a new version of every file's points.
    """

    @property
    def name(self) -> str:
        """``kind:model:version``, stable across processes."""

    @property
    def dim(self) -> int:
        """Dimensions of each vector."""

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """One vector per text, in order (blocking: callers run it in a thread)."""


class HashingEmbedder:
    """Signed feature hashing of words and character trigrams, L2-normalised."""

    def __init__(self, dim: int = HASH_DIM) -> None:
        if not 8 <= dim <= 65536:
            raise ValueError("dim must be 8..65536")
        self._dim = dim

    @property
    def name(self) -> str:
        return f"hash:v1:{self._dim}"

    @property
    def dim(self) -> int:
        return self._dim

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.embed_one(text) for text in texts]

    def embed_one(self, text: str) -> list[float]:
        """The vector of one text (a text with no words gets the first unit vector)."""
        vector = [0.0] * self._dim
        for word in _WORD.findall(text.lower()):
            self._add(vector, "w:" + word, 1.0)
            padded = f"<{word}>"
            for i in range(len(padded) - 2):
                self._add(vector, "t:" + padded[i : i + 3], 0.5)
        norm = math.sqrt(math.fsum(v * v for v in vector))
        if norm == 0.0:
            vector[0] = 1.0
            return vector
        return [v / norm for v in vector]

    def _add(self, vector: list[float], feature: str, weight: float) -> None:
        digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        # The low bits pick the dimension, the top bit the sign: collisions
        # cancel out on average instead of piling up.
        vector[value % self._dim] += -weight if value >> 63 else weight


class FastEmbedEmbedder:
    """A fastembed model (ONNX, CPU); its weights must already be in fastembed's cache."""

    def __init__(self, model: str) -> None:
        from fastembed import TextEmbedding  # type: ignore[import-not-found,unused-ignore]

        self._model_name = model
        self._model: Any = TextEmbedding(model_name=model)
        probe = list(self._model.embed(["dimension probe"]))
        self._dim = len(probe[0])

    @property
    def name(self) -> str:
        return f"fastembed:{self._model_name}"

    @property
    def dim(self) -> int:
        return self._dim

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        vectors = [[float(x) for x in v] for v in self._model.embed(list(texts))]
        return [_unit(v) for v in vectors]


class SentenceTransformersEmbedder:
    """A sentence-transformers model; its weights must already be in the local cache."""

    def __init__(self, model: str) -> None:
        from sentence_transformers import (  # type: ignore[import-not-found,unused-ignore]
            SentenceTransformer,
        )

        self._model_name = model
        self._model: Any = SentenceTransformer(model)
        self._dim = int(self._model.get_sentence_embedding_dimension())

    @property
    def name(self) -> str:
        return f"sentence-transformers:{self._model_name}"

    @property
    def dim(self) -> int:
        return self._dim

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        rows = self._model.encode(list(texts), normalize_embeddings=True)
        return [[float(x) for x in row] for row in rows]


_LIBRARIES = {"fastembed": "fastembed", "sentence-transformers": "sentence_transformers"}


def check_embedder(spec: str) -> None:
    """Raise :class:`EmbedderUnavailable` when ``spec`` names a library that is not installed.

    Cheap (no model is loaded): a worker checks at start, not at its first job.
    """
    kind, _, _model = spec.partition(":")
    library = _LIBRARIES.get(kind)
    if library is not None and importlib.util.find_spec(library) is None:
        extra = " (the extra jobplane[ingest-fastembed])" if kind == "fastembed" else ""
        raise EmbedderUnavailable(
            f"JOBPLANE_EMBEDDER={spec} needs the {kind} package: pip install {kind}{extra}"
        )


def load_embedder(spec: str) -> Embedder:
    """The embedder ``spec`` names.

    ``hash``, ``fastembed:<model>`` or ``sentence-transformers:<model>``.
    """
    check_embedder(spec)
    kind, _, model = spec.partition(":")
    if spec == "hash":
        return HashingEmbedder()
    if kind == "fastembed":
        return FastEmbedEmbedder(model)
    if kind == "sentence-transformers":
        return SentenceTransformersEmbedder(model)
    raise EmbedderUnavailable(f"unknown embedder {spec!r}")


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(math.fsum(v * v for v in vector))
    return [v / norm for v in vector] if norm else vector
