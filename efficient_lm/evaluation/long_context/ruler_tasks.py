"""RULER's eleven synthetic tasks under lm-eval's names, and what each is (`long_context.ruler` draws
them). No heavy import: `efficient_lm.evaluate` reads the names for its flags."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Spec:
  """One task: `kind` (niah, vt, cwe, fwe); for NIAH the haystack (repeat, essay, needle), the
  key and value kinds (words, numbers, uuids) and the needle counts; `new_tokens`: RULER's
  tokens to generate."""
  kind: str
  haystack: str = ""
  keys: str = "words"
  values: str = "numbers"
  num_keys: int = 1
  num_values: int = 1
  num_queries: int = 1
  new_tokens: int = 128


SPECS = {
    "niah_single_1": Spec("niah", "repeat"),
    "niah_single_2": Spec("niah", "essay"),
    "niah_single_3": Spec("niah", "essay", values="uuids"),
    "niah_multikey_1": Spec("niah", "essay", num_keys=4),
    "niah_multikey_2": Spec("niah", "needle"),
    "niah_multikey_3": Spec("niah", "needle", keys="uuids", values="uuids"),
    "niah_multivalue": Spec("niah", "essay", num_values=4),
    "niah_multiquery": Spec("niah", "essay", num_keys=4, num_queries=4),
    "ruler_vt": Spec("vt", new_tokens=30),
    "ruler_cwe": Spec("cwe", new_tokens=120),
    "ruler_fwe": Spec("fwe", new_tokens=50),
}
TASKS = tuple(SPECS)
