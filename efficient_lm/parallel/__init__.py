"""Where a run's arrays live and which processes run it: the device mesh, the logical-axis rules
and the placement of parameters and batches (`sharding`), many processes as one job
(`distributed`: `jax.distributed`, the primary process, stop agreement), and the accelerators a
step compiles for from any host (`targets`, with the GPU descriptions in `targets/gpu/`).

It may import `runtime` and `config` (the mesh section and the logical axes it reads); it knows no
model, no data pipeline and no attention op (`ops` and `data` are its independent siblings).
"""
