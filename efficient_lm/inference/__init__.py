"""From a trained model to text: generation with the caches that do not grow with the context
(`generation`: prefill, the cached decoder, sampling, a workdir's model restored to sample from)
and the export format's writer (`export`: a workdir's weights as safetensors with its config, its
tokenizer and a model card; `efficient_lm.load` reads them).

It may import `state`, `models`, `data`, `parallel`, `ops`, `config` and `runtime`; never the
training loop or the scoring (`training` and `evaluation` build on it). Importing `export` loads
no jax: the export command's refusals answer before it starts.
"""
