"""Data: TFDS builders (shakespeare, wikitext103, any TFDS text set, text:<glob> files), tokenizer, Grain.

    corpus = data.load(config.data)
    it = corpus.train_iterator(batch_size=..., seed=...)
    for batch in corpus.eval_batches('validation', batch_size=...): ...

Heavy imports (tensorflow_datasets, grain) happen inside `load`, so `validate` stays cheap.
"""

from efficient_lm.data.pipeline import Corpus, DataError, KNOWN_DATASETS, MIN_VOCAB_SIZE, known_splits, load, validate
from efficient_lm.data.archives import DownloadError
from efficient_lm.data.tokenizer import Tokenizer

__all__ = ['Corpus', 'DataError', 'DownloadError', 'KNOWN_DATASETS', 'MIN_VOCAB_SIZE', 'Tokenizer', 'known_splits', 'load', 'validate']
