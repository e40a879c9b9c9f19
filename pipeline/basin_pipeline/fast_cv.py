"""Cross-validation fits for tuning, ten times faster than refitting the pipeline per fold.

Each fold of each trial refits TF-IDF: scikit-learn re-counts every document per fit, which
dominated the study. Here every text is counted once (all n-grams, alphabetical columns, as
scikit-learn orders them), and a fold's vocabulary, pruning (`min_df`, `max_df`, `max_features`
with scikit-learn's own tie order), smoothed idf, L2 norm, log lengths and ridge are rebuilt from
those counts. `tests/pipeline/test_training.py` checks it against `build_model` fold by fold. The
final model is always the real pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import Ridge
from sklearn.preprocessing import normalize

from basin_pipeline.features import LENGTH_INPUTS, TEXT_INPUT, CachedAnalyzer, ModelParams, analysis_cache


class EmptyVocabularyError(ValueError):
    """The pruning settings leave no word in the vocabulary (scikit-learn refuses such a fit too)."""


class FoldFeaturizer:
    """All documents counted once per n-gram size; features for any train/test split on demand."""

    def __init__(self, frame: pd.DataFrame, ngram_sizes: Sequence[int]) -> None:
        texts = frame[TEXT_INPUT].tolist()
        self.counts: dict[int, sp.csr_matrix] = {}
        for n in ngram_sizes:
            vectorizer = CountVectorizer(analyzer=CachedAnalyzer(analysis_cache(texts, n)), dtype=np.float32)
            self.counts[n] = sp.csr_matrix(vectorizer.fit_transform(texts), dtype=np.float32)
        self.lengths = np.log1p(frame[list(LENGTH_INPUTS)].to_numpy(dtype=np.float64))
        self.log_target = np.log1p(frame["peak_prompt_tokens"].to_numpy(dtype=np.float64))

    def _vocabulary(self, counts: sp.csr_matrix, params: ModelParams) -> np.ndarray:
        """Columns scikit-learn's vectorizer would keep after fitting on these rows."""
        df = np.bincount(counts.indices, minlength=counts.shape[1])
        present = np.flatnonzero(df > 0)
        df = df[present]
        num_rows = int(counts.shape[0])
        mask = (df <= params.max_df * num_rows) & (df >= params.min_df)
        if params.max_features is not None and mask.sum() > params.max_features:
            tfs = np.asarray(counts[:, present].sum(axis=0), dtype=np.float32).ravel()
            chosen = (-tfs[mask]).argsort()[: params.max_features]
            keep = np.zeros(len(present), dtype=bool)
            keep[np.flatnonzero(mask)[chosen]] = True
            mask = keep
        if not mask.any():
            raise EmptyVocabularyError(f"min_df={params.min_df}, max_df={params.max_df} leave no word")
        return present[mask]

    def split(self, params: ModelParams, train: np.ndarray, test: np.ndarray) -> tuple[sp.csr_matrix, sp.csr_matrix]:
        """Feature matrices of the train and test rows, fitted on the train rows only."""
        counts = self.counts[params.ngram_max]
        c_train, c_test = counts[train], counts[test]
        if params.binary:
            c_train, c_test = c_train.sign(), c_test.sign()
        columns = self._vocabulary(c_train, params)
        c_train, c_test = c_train[:, columns], c_test[:, columns]
        df = np.bincount(c_train.indices, minlength=len(columns)).astype(np.float64)
        idf = sp.diags(np.log((c_train.shape[0] + 1) / (df + 1)) + 1)
        x_train, x_test = normalize(c_train @ idf), normalize(c_test @ idf)
        if params.use_lengths:
            x_train = sp.hstack([x_train, self.lengths[train]], format="csr")
            x_test = sp.hstack([x_test, self.lengths[test]], format="csr")
        return sp.csr_matrix(x_train), sp.csr_matrix(x_test)

    def out_of_fold(self, params: ModelParams, folds: np.ndarray) -> np.ndarray:
        """Predicted peak tokens for every row from a model fitted without its fold."""
        predicted = np.full(len(folds), np.nan)
        for fold in np.unique(folds[folds >= 0]):
            train, test = np.flatnonzero(folds != fold), np.flatnonzero(folds == fold)
            predicted[test] = self.fit_predict(params, train, test)
        return predicted

    def fit_predict(self, params: ModelParams, train: np.ndarray, test: np.ndarray) -> np.ndarray:
        """Peak tokens predicted for the `test` rows by the pipeline fitted on the `train` rows only."""
        x_train, x_test = self.split(params, train, test)
        ridge = Ridge(alpha=params.alpha).fit(x_train, self.log_target[train])
        return np.asarray(np.expm1(ridge.predict(x_test)), dtype=np.float64)
