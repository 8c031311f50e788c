"""The training loop and what it needs: the edge's whole check before anything compiles
(`prepare`: every field, the devices, the data and the model from shapes), the jitted train and
eval steps with the chunked loss (`step`), the loop (`loop`: `train_and_evaluate`) and what it
runs: the run's start, data, state and resume (`start`), evaluation over a split (`evaluate`), the
profiler (`profile`), the summary, preemption summary and sample (`report`); `main
--compile_only` (`compile_only`), the train step's memory per device (`step_memory`), FLOPs per token (`flops`), the metrics it writes (`metrics`) and Weights &
Biases (`wandb`, imported only when `train.wandb` is on).

It may import `inference` (the sample at the end of a run), `state`, `models`, `data`, `parallel`,
`ops`, `config` and `runtime`; knows no model by name, and nothing that scores a trained model or
parses a command line (`evaluation` and `cli` build on it).
"""
