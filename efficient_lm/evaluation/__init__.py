"""Scoring a trained model: the score step and the one batched loop over rows of tokens that every
scorer runs (`score_rows`), the scoring windows and the stream scoring with the context ablation and
recall by distance (`scoring`), the tests and rules that decide the claims
built on those scores (`stats`), and the field's long-context tasks (`long_context/`: needle in a
haystack, loss past the trained length, RULER's synthetic tasks).

It may import `training` (the train step's chunked loss, the loss figures), `inference`, `state`,
`models`, `data`, `parallel`, `ops`, `config` and `runtime`; never the face (`efficient_lm.load`,
`api`) or a command line, which build on it.
"""
