"""The attention kernels a compiled module calls, counted from its text (the device check's rows).

    kernel_calls(compiled.as_text())  ->  {"cudnn": 2, "triton": 0, "tpu": 0}

`cudnn`: cuDNN's fused attention (`__cudnn$fmha...` custom calls, forward and backward);
`triton`: Pallas GPU kernels (`__gpu$xla.gpu.triton` or `triton_kernel_call`); `tpu`: Pallas
TPU kernels such as splash (`tpu_custom_call`). An instruction inside a loop body counts once.
"""

import re

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
KINDS = ("cudnn", "triton", "tpu")


def kind_of(target: str) -> str | None:
  """The kernel kind of one custom-call target, or None for other custom calls."""
  if target.startswith("__cudnn$fmha"):
    return "cudnn"
  if target in ("__gpu$xla.gpu.triton", "triton_kernel_call"):
    return "triton"
  if target == "tpu_custom_call":
    return "tpu"
  return None


def kernel_calls(hlo_text: str) -> dict[str, int]:
  """{kind: number of custom-call instructions of that kind} in a compiled module's text."""
  counts = dict.fromkeys(KINDS, 0)
  for target in _TARGET.findall(hlo_text):
    kind = kind_of(target)
    if kind is not None:
      counts[kind] += 1
  return counts
