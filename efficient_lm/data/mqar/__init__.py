"""Multi-query associative recall (MQAR) at controlled distances: `data.dataset='mqar:<options>'`.

`parse(dataset, seq_len)` -> `MqarTask` (every option has a default, so 'mqar:' runs; a bad
option is a one-line ConfigError); `check` / `validate` hold it against data.seq_len,
data.vocab_size and a Perceiver-AR model's num_latents; `load` -> `MqarCorpus`, the
`pipeline.Corpus` interface with no files: `train_iterator` yields {inputs, targets, weights},
`eval_batches` adds `distances` (`[B, S]`, the query's distance at each answer, -1 elsewhere).
Sequence i of a split is a pure function of (task, split, seed, i); the loss is on the answers
only, all in the last `latents` positions. `DistanceAccuracy` / `accuracy_by_distance`: accuracy
of argmax predictions per distance bin.

The modules, one job each: `task` (the options, their parsing and checks), `sequences` (the
generator), `corpus` (the tokenizer, iterator and corpus), `readout` (accuracy by distance).
Details (layout, options and defaults, limits, distances, vocabulary, batches): docs/data.md, MQAR.
"""

from efficient_lm.data.mqar.corpus import MqarCorpus, MqarIterator, MqarTokenizer, load
from efficient_lm.data.mqar.readout import (DEFAULT_BINS, DistanceAccuracy, accuracy_by_distance,
                                            distance_bins)
from efficient_lm.data.mqar.sequences import batch, sequence
from efficient_lm.data.mqar.task import (DEFAULT_PAIR_TOKENS, DEFAULT_SEQ_LEN, EOS_ID,
                                         NUM_RESERVED, OPTIONS, PAD_ID, PREFIX, QUERY_ID, SPLITS,
                                         TRAIN_SEQUENCES, MqarTask, check, parse, validate)

__all__ = [
    'DEFAULT_BINS', 'DEFAULT_PAIR_TOKENS', 'DEFAULT_SEQ_LEN', 'EOS_ID', 'NUM_RESERVED', 'OPTIONS',
    'PAD_ID', 'PREFIX', 'QUERY_ID', 'SPLITS', 'TRAIN_SEQUENCES', 'DistanceAccuracy', 'MqarCorpus',
    'MqarIterator', 'MqarTask', 'MqarTokenizer', 'accuracy_by_distance', 'batch', 'check',
    'distance_bins', 'load', 'parse', 'sequence', 'validate',
]
