"""The predictor as one scikit-learn pipeline: featurizer and ridge together, so serving cannot drift.

Inputs (also the ONNX graph's inputs): `task_text` (string), `task_chars` and `first_prompt_tokens`
(floats). Features: TF-IDF over the task text (word n-grams, vocabulary limits) and, optionally, the
log-scaled lengths. Target: the ridge fits log(1 + peak); `predict` returns peak tokens.
Every option here is one that skl2onnx carries exactly (see ../shared/design/ONNX_NOTES.md): no
`sublinear_tf`, no stop words, no accent stripping; one token pattern shared with the ONNX graph.
Measured here too: with bigrams, onnxruntime counts a bigram only if both its words are in the
vocabulary, so bigram models take no `max_features` cap and no `max_df` (a cap can keep "x y" but
drop "x"); `min_df` is safe (a word is never rarer than a bigram that holds it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin, TransformerMixin
from sklearn.compose import ColumnTransformer
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge
from sklearn.pipeline import Pipeline

TEXT_INPUT = "task_text"
LENGTH_INPUTS = ("task_chars", "first_prompt_tokens")
MODEL_INPUTS = (TEXT_INPUT, *LENGTH_INPUTS)
# Words of two or more letters, digits or underscores: Python's \w\w+ and RE2's form of it, so that
# scikit-learn and onnxruntime cut the same tokens, non-ASCII text included.
TOKEN_PATTERN = r"[^\W]{2,}"
RE2_TOKEN_PATTERN = r"[\p{L}\p{N}_]{2,}"


@dataclass(frozen=True)
class ModelParams:
    """The knobs Optuna tunes (and the final model is built from)."""

    alpha: float = 1.0
    ngram_max: int = 1
    min_df: int = 1
    max_df: float = 1.0
    max_features: int | None = 20000
    binary: bool = False
    use_lengths: bool = True

    def __post_init__(self) -> None:
        if self.ngram_max > 1 and (self.max_features is not None or self.max_df < 1.0):
            raise ValueError(f"bigram models take no max_features/max_df cap (ONNX would count them wrongly): {self}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Log1p(TransformerMixin, BaseEstimator):  # type: ignore[misc]
    """log(1 + x), elementwise (has an ONNX converter in `basin_pipeline.onnx_export`)."""

    def fit(self, X: Any, y: Any = None) -> Log1p:
        return self

    def transform(self, X: Any) -> np.ndarray:
        return np.log1p(np.asarray(X, dtype=np.float64))

    def get_feature_names_out(self, input_features: Any = None) -> np.ndarray:
        return np.asarray(input_features if input_features is not None else [], dtype=object)


class LogRidge(RegressorMixin, BaseEstimator):  # type: ignore[misc]
    """Ridge on log(1 + y); predicts exp(.) - 1, i.e. in the target's own units (tokens)."""

    def __init__(self, alpha: float = 1.0) -> None:
        self.alpha = alpha

    def fit(self, X: Any, y: Any) -> LogRidge:
        self.ridge_ = Ridge(alpha=self.alpha).fit(X, np.log1p(np.asarray(y, dtype=np.float64)))
        self.coef_ = self.ridge_.coef_
        self.intercept_ = float(self.ridge_.intercept_)
        return self

    def predict_log(self, X: Any) -> npt.NDArray[np.float64]:
        return np.asarray(self.ridge_.predict(X), dtype=np.float64)

    def predict(self, X: Any) -> npt.NDArray[np.float64]:
        return np.expm1(self.predict_log(X))


class CachedAnalyzer:
    """Looks up a text's already-analysed n-grams: the same output as the vectorizer's own analyzer.

    Tuning (`basin_pipeline.fast_cv`) counts each text once through it; final models never use it.
    """

    def __init__(self, cache: Mapping[str, list[str]]) -> None:
        self.cache = cache

    def __call__(self, text: str) -> list[str]:
        return self.cache[text]


def analysis_cache(texts: Iterable[str], ngram_max: int) -> dict[str, list[str]]:
    """Each distinct text's n-grams, cut exactly as `build_model`'s vectorizer cuts them."""
    analyze = _tfidf(ModelParams(ngram_max=ngram_max, max_features=None)).build_analyzer()
    return {text: analyze(text) for text in set(texts)}


def _tfidf(params: ModelParams) -> TfidfVectorizer:
    return TfidfVectorizer(
        lowercase=True,
        token_pattern=TOKEN_PATTERN,
        ngram_range=(1, params.ngram_max),
        min_df=params.min_df,
        max_df=params.max_df,
        max_features=params.max_features,
        binary=params.binary,
        sublinear_tf=False,
        dtype=np.float32,
    )


def build_model(params: ModelParams) -> Pipeline:
    """The untrained pipeline for a set of knobs."""
    columns: list[tuple[str, Any, Any]] = [("tfidf", _tfidf(params), TEXT_INPUT)]
    if params.use_lengths:
        # log1p only, not standardised: a benchmark whose first prompt barely varies would get a
        # huge scale factor and explode on an unusual prompt at serving time.
        columns.append(("lengths", Log1p(), list(LENGTH_INPUTS)))
    features = ColumnTransformer(columns, sparse_threshold=1.0)
    return Pipeline([("features", features), ("ridge", LogRidge(alpha=params.alpha))])


def model_frame(task_text: Any, task_chars: Any, first_prompt_tokens: Any) -> pd.DataFrame:
    """The model's input frame from columns (lists or arrays)."""
    return pd.DataFrame({
        TEXT_INPUT: pd.Series(task_text, dtype=object),
        "task_chars": np.asarray(task_chars, dtype=np.float64),
        "first_prompt_tokens": np.asarray(first_prompt_tokens, dtype=np.float64),
    })
