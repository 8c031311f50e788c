"""Data: datasets named once (registry) and their hooks run (hooks: each source's module imported on
first use), their checks (config), the tokenizer and token cache (cache), the corpus and its Grain
iterators (corpus), and `load`, which puts them together.

    data_config = data.validate(run.data)  # a RunConfig's data, checked against the registry and disk
    corpus = data.load(data_config)
    it = corpus.train_iterator(batch_size=..., seed=...)
    for batch in corpus.eval_batches('validation', batch_size=...): ...

Heavy imports (tensorflow_datasets, grain) happen inside `load`, so `validate` stays cheap.

A wing of the package (docs/architecture.md, "The wings"): it may import `config` and `runtime`;
never `ops` or `parallel`, its siblings, nor `models` (declared independent: the data knows no
model) or anything above.
"""

from efficient_lm.data.archives import DownloadError
from efficient_lm.data.config import (DataError, MIN_VOCAB_SIZE, has_document_ids, known_splits,
                                      validate)
from efficient_lm.data.corpus import Corpus, bits_per_byte_withheld, document_ids, without_text
from efficient_lm.data.pipeline import check_splits, load, preflight
from efficient_lm.data.registry import BUILT_IN as KNOWN_DATASETS
from efficient_lm.data.tokenizer import Tokenizer

__all__ = ['Corpus', 'DataError', 'DownloadError', 'bits_per_byte_withheld', 'check_splits',
           'document_ids', 'KNOWN_DATASETS', 'MIN_VOCAB_SIZE', 'Tokenizer',
           'has_document_ids', 'known_splits', 'load', 'preflight', 'validate', 'without_text']
