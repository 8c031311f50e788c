"""Paired tests for the claims, and the rules that turn them into verdicts, fixed before the runs.

The unit is the training seed. A claim about an architecture ("A recalls better than B", "A's loss
is comparable to B's") is decided over training seeds (`train.seed` fixes the initialization and
the data order, so A's and B's seed-s runs are a pair), never over the items (queries, tokens) of
a few fixed runs: `paired_bootstrap` over items describes one run, it decides nothing.

  - `paired_t_test`: "A is better than B" on one number per seed (two-sided, n - 1 df).
  - `equivalence_test`: "A is comparable to B" within +-`margin` (two one-sided tests, TOST).
  - `benjamini_hochberg`: adjusted p-values over the family of claims; `decide_family` decides every
    claim on its adjusted p-value (confirmed / refuted, equivalent / not equivalent, not decided,
    not comparable). A claim with fewer seeds than `PLANNED_SEEDS` is pending: not decided, and
    counted in the family with p = 1.
  - `decide`: the per-test rule on an unadjusted p-value (the paper tables' older one-table view).
  - `false_positive_rate`, `architecture_null_rates`: the rules on simulated nulls.
  - `proportion_control` (and its `proportion_control_power`): a control on a share of prompts,
    decided on its interval; `every_cell_power`: what a minimum-over-cells control can do.

numpy only, no scipy. Details: docs/evaluation.md, Statistics.

    python -m efficient_lm.evaluation.stats      # the false-positive rates of the rules
"""

import dataclasses
import functools
import math
from typing import Callable, Mapping, Sequence

import numpy as np

ALPHA = 0.05  # two-sided; the intervals are 1 - ALPHA = 95%

CONFIRMED, REFUTED, NOT_DECIDED, NOT_COMPARABLE = "confirmed", "refuted", "not decided", "not comparable"
EQUIVALENT, NOT_EQUIVALENT = "equivalent", "not equivalent"
VERDICTS = (CONFIRMED, REFUTED, EQUIVALENT, NOT_EQUIVALENT, NOT_DECIDED, NOT_COMPARABLE)

# Written down before the runs (issue 33): training seeds per arm a claim is decided on, and the
# equivalence margins ("comparable" means the seed-mean difference lies within +-margin).
PLANNED_SEEDS = {"recall": 5, "loss": 3}
EQUIVALENCE_MARGIN = {"loss": 0.02,     # nats per token
                      "recall": 0.05}   # accuracy (chance is 1/16 = 0.0625)


@dataclasses.dataclass(frozen=True)
class TestResult:
  """One test of "A is better than B". `difference`, `ci_low`, `ci_high`: the mean paired
  difference and its 95% interval, in the metric's units, positive = A better. `statistic`: the t
  value (t-test) or the mean difference (bootstrap). `n`: the pairs (seeds) or the resampled units
  (documents when grouped, else items). NaN p-value / interval when there are fewer than 2."""
  __test__ = False  # not a pytest class

  test: str
  difference: float
  statistic: float
  p_value: float
  ci_low: float
  ci_high: float
  n: int


@dataclasses.dataclass(frozen=True)
class Decision:
  """A claim, the test it was judged by, and the verdict (one of VERDICTS); `note` says why when
  the verdict is 'not comparable' or the test could not be run."""
  claim: str
  test: str
  difference: float
  statistic: float
  p_value: float
  ci_low: float
  ci_high: float
  n: int
  verdict: str
  note: str = ""

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Student's t for integer degrees of freedom.


def _t_central(theta: float, df: int) -> float:
  """A(t | df) = P(|T| < t) with theta = atan(t / sqrt(df)): Abramowitz & Stegun 26.7.3 (odd df)
  and 26.7.4 (even df), finite sums of positive terms."""
  s, c2 = math.sin(theta), math.cos(theta) ** 2
  if df % 2:  # (2/pi) (theta + sin(theta) (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ... cos^(df-2)))
    term, total = math.cos(theta), 0.0
    for j in range(1, (df - 1) // 2 + 1):
      total += term
      term *= c2 * (2 * j) / (2 * j + 1)
    return (2 / math.pi) * (theta + s * total)
  term, total = 1.0, 0.0  # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... cos^(df-2))
  for j in range(df // 2):
    total += term
    term *= c2 * (2 * j + 1) / (2 * j + 2)
  return s * total


def t_two_sided_p(t: float, df: int) -> float:
  """P(|T| >= |t|) for Student's t with `df` (an integer >= 1) degrees of freedom. Computed as
  1 - A, so accurate to ~1e-16 absolute (ample for a decision at 0.05)."""
  if df < 1 or df != int(df):
    raise ValueError(f"df must be an integer >= 1, got {df}")
  if math.isnan(t):
    return float("nan")
  return min(1.0, max(0.0, 1.0 - _t_central(math.atan(abs(t) / math.sqrt(df)), int(df))))


@functools.lru_cache(maxsize=None)
def t_critical(df: int, alpha: float = ALPHA) -> float:
  """The two-sided critical value: P(|T| >= t) = alpha (12.706 for df = 1 at 0.05). Bisection in
  theta = atan(t / sqrt(df)) on [0, pi/2), where A is increasing."""
  lo, hi = 0.0, math.pi / 2
  for _ in range(100):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if _t_central(mid, df) < 1 - alpha else (lo, mid)
  return math.sqrt(df) * math.tan((lo + hi) / 2)


# ----------------------------------------------------------------------------------------------
# The tests.


def paired_difference(a_by_seed: Mapping[int, float], b_by_seed: Mapping[int, float]) -> dict[int, float]:
  """{seed: a - b} over the seeds both have, in seed order (raw A - B; the tests orient it)."""
  return {s: float(a_by_seed[s]) - float(b_by_seed[s]) for s in sorted(set(a_by_seed) & set(b_by_seed))}


def paired_t_test(a_by_seed: Mapping[int, float], b_by_seed: Mapping[int, float], *,
                  higher_is_better: bool = False) -> TestResult:
  """Paired t-test of "A is better than B" on per-seed values ({seed: value}, one run each).

  The differences d_s (positive = A better) over the shared seeds: t = mean(d) / (sd(d) / sqrt(n)),
  n - 1 degrees of freedom, two-sided p-value, interval mean(d) +- t_crit(n - 1) sd(d) / sqrt(n).
  Valid with n >= 2 pairs (fewer: NaN p and interval). With n = 2 there is 1 degree of freedom and
  t_crit = 12.71: only very consistent gaps are decided. Identical differences (sd = 0): p = 0 and
  a zero-width interval when they are not 0, p = 1 when they are.
  """
  sign = 1.0 if higher_is_better else -1.0
  d_by_seed = [sign * d for d in paired_difference(a_by_seed, b_by_seed).values()]
  n = len(d_by_seed)
  mean = math.fsum(d_by_seed) / n if n else float("nan")
  if n < 2:
    return TestResult("paired t", mean, float("nan"), float("nan"), float("nan"), float("nan"), n)
  sd = math.sqrt(math.fsum((d - mean) ** 2 for d in d_by_seed) / (n - 1))
  se = sd / math.sqrt(n)
  if se == 0.0:
    t = math.copysign(math.inf, mean) if mean else float("nan")
    return TestResult("paired t", mean, t, 0.0 if mean else 1.0, mean, mean, n)
  t = mean / se
  half = t_critical(n - 1) * se
  return TestResult("paired t", mean, t, t_two_sided_p(t, n - 1), mean - half, mean + half, n)


def paired_bootstrap(values_a: Sequence[float], values_b: Sequence[float], groups: Sequence | None = None, *,
                     higher_is_better: bool = False, num_resamples: int = 10_000, seed: int = 0) -> TestResult:
  """Test of "A is better than B" on per-item values, paired by position: values_a[i] and
  values_b[i] are the same item (query / document) of the same seed, scored by A and by B (flatten
  (seed, item) the same way for both). `groups[i]`: the item's cluster (e.g. its document; items
  of one document are not independent), resampled whole; None: every item is its own.

  Statistic: the mean per-item difference d (positive = A better) over all items.
  Interval: the percentile 95% interval of the statistic over `num_resamples` bootstrap resamples
  of the clusters (with replacement; the statistic of a resample is the mean over its items).
  p-value: a sign-flip randomization test. Under the null that A and B are exchangeable on every
  cluster (which model scored which half of a pair is arbitrary), each cluster's summed
  difference is as likely to have either sign; the p-value is the share of `num_resamples`
  random sign flips whose |sum| reaches the observed |sum|, counting the observed one:
  (1 + hits) / (1 + num_resamples) (a valid Monte-Carlo p-value, never below 1 / (1 + R)).
  Fewer than 2 clusters: NaN p and interval. Measures evaluation-set noise only (docs/evaluation.md).

  Few clusters: the sign-flip test stays valid at any number (but with G clusters p >= 2 / 2^G,
  so at most 5 documents nothing is decided), while the percentile interval runs narrow: in
  simulation it covers about 89% at 10 documents, 93% at 40, 94-95% from 100 on. `decide` needs
  both the p-value and the interval, so its false-positive rate stays at or below 5%.
  """
  a, b = np.asarray(values_a, np.float64).ravel(), np.asarray(values_b, np.float64).ravel()
  if a.shape != b.shape:
    raise ValueError(f"values_a and values_b differ in size: {a.size} vs {b.size}")
  if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
    raise ValueError("values_a and values_b must be finite")
  d_by_item = (a - b) if higher_is_better else (b - a)
  if groups is None:
    cluster_of_item = np.arange(d_by_item.size)
  else:
    groups = np.asarray(groups).ravel()
    if groups.shape != d_by_item.shape:
      raise ValueError(f"groups has {groups.size} entries for {d_by_item.size} items")
    cluster_of_item = np.unique(groups, return_inverse=True)[1].ravel()
  sum_by_cluster = np.bincount(cluster_of_item, weights=d_by_item, minlength=0)
  items_by_cluster = np.bincount(cluster_of_item).astype(np.float64)
  num_clusters, num_items = sum_by_cluster.size, d_by_item.size
  mean = float(sum_by_cluster.sum() / num_items) if num_items else float("nan")
  name = "paired bootstrap" + (" (clustered)" if groups is not None else "")
  if num_clusters < 2:
    return TestResult(name, mean, mean, float("nan"), float("nan"), float("nan"), num_clusters)

  rng = np.random.default_rng(seed)
  chunk = max(1, 2_000_000 // num_clusters)  # resamples per step: at most ~2e6 draws in memory
  boot_means, hits = [], 0
  observed = abs(float(sum_by_cluster.sum()))
  tolerance = 1e-9 * float(np.abs(sum_by_cluster).sum())  # float ties count as reaching it
  for start in range(0, num_resamples, chunk):
    r = min(chunk, num_resamples - start)
    picks = rng.integers(0, num_clusters, size=(r, num_clusters))
    boot_means.append(sum_by_cluster[picks].sum(axis=1) / items_by_cluster[picks].sum(axis=1))
    signs = rng.integers(0, 2, size=(r, num_clusters)) * 2.0 - 1.0
    hits += int(np.count_nonzero(np.abs(signs @ sum_by_cluster) >= observed - tolerance))
  ci_low, ci_high = np.quantile(np.concatenate(boot_means), [ALPHA / 2, 1 - ALPHA / 2])
  p_value = (1 + hits) / (1 + num_resamples)
  return TestResult(name, mean, mean, p_value, float(ci_low), float(ci_high), num_clusters)


def t_upper_p(t: float, df: int) -> float:
  """P(T >= t), one-sided, for Student's t with `df` degrees of freedom."""
  if math.isnan(t):
    return float("nan")
  half = t_two_sided_p(t, df) / 2
  return half if t >= 0 else 1.0 - half


@dataclasses.dataclass(frozen=True)
class EquivalenceResult:
  """Two one-sided tests (TOST) of "A and B are within +-margin" on per-seed differences
  (positive = A better, as `TestResult`). `p_equivalent`: the larger of the two one-sided p-values
  against the margins (null: |delta| >= margin); `p_not_equivalent`: the one-sided p-value that
  delta lies beyond the margin on the side the mean is on (null: |delta| <= margin; 1 when the
  mean is inside). `ci_low`, `ci_high`: the 90% interval (TOST at 5% is "that interval inside
  (-margin, margin)"). `p_value`: the test the claim is decided on: `p_equivalent` when the mean
  lies inside the margin, else `p_not_equivalent`."""
  __test__ = False

  test: str
  difference: float
  statistic: float
  margin: float
  p_equivalent: float
  p_not_equivalent: float
  ci_low: float
  ci_high: float
  n: int

  @property
  def p_value(self) -> float:
    return self.p_equivalent if abs(self.difference) < self.margin else self.p_not_equivalent


def equivalence_test(a_by_seed: Mapping[int, float], b_by_seed: Mapping[int, float], *, margin: float,
                     higher_is_better: bool = False) -> EquivalenceResult:
  """TOST on the paired per-seed differences d_s (positive = A better), n - 1 degrees of freedom:
  t_low = (mean + margin) / se tests delta > -margin, t_high = (mean - margin) / se tests
  delta < margin; p_equivalent = max(P(T >= t_low), P(T <= t_high)). Fewer than 2 pairs: NaN."""
  if not margin > 0:
    raise ValueError(f"margin={margin} must be positive (the equivalence margin, stated before the runs)")
  t = paired_t_test(a_by_seed, b_by_seed, higher_is_better=higher_is_better)
  nan = float("nan")
  if t.n < 2:
    return EquivalenceResult("TOST (paired t)", t.difference, nan, margin, nan, nan, nan, nan, t.n)
  se = (t.ci_high - t.ci_low) / (2 * t_critical(t.n - 1)) if t.ci_high > t.ci_low else 0.0
  mean, df = t.difference, t.n - 1
  if se == 0.0:  # identical differences: decided by where they lie
    inside = abs(mean) < margin
    return EquivalenceResult("TOST (paired t)", mean, t.statistic, margin, 0.0 if inside else 1.0,
                             1.0 if inside or abs(mean) == margin else 0.0, mean, mean, t.n)
  p_low = t_upper_p((mean + margin) / se, df)          # null: delta <= -margin
  p_high = 1.0 - t_upper_p((mean - margin) / se, df)   # null: delta >= +margin
  if mean > margin:
    p_beyond = t_upper_p((mean - margin) / se, df)     # null: delta <= +margin
  elif mean < -margin:
    p_beyond = 1.0 - t_upper_p((mean + margin) / se, df)
  else:
    p_beyond = 1.0
  half = t_critical(df, 2 * ALPHA) * se
  return EquivalenceResult("TOST (paired t)", mean, t.statistic, margin, max(p_low, p_high), p_beyond,
                           mean - half, mean + half, t.n)


def benjamini_hochberg(p_values: Sequence[float | None], family_size: int | None = None) -> list[float]:
  """Benjamini-Hochberg adjusted p-values (the step-up rule: controls the false-discovery rate at
  alpha when "adjusted < alpha" decides). None or NaN (a claim not tested: pending, not
  comparable) counts as p = 1. `family_size` (>= len(p_values)): the claims of the family stated
  up front; the ones not listed count as p = 1 (so deciding on part of the family is never less
  strict than deciding on all of it). adjusted_(i) = min over j >= i of p_(j) m / j, capped at 1."""
  p = np.array([1.0 if v is None or math.isnan(v) else float(v) for v in p_values], np.float64)
  if np.any((p < 0) | (p > 1)):
    raise ValueError(f"p-values must lie in [0, 1], got {p_values}")
  m = len(p) if family_size is None else family_size
  if m < len(p):
    raise ValueError(f"family_size={family_size} is below the {len(p)} p-values given")
  if not len(p):
    return []
  order = np.argsort(p, kind="stable")
  ranked = p[order] * m / np.arange(1, len(p) + 1)
  adjusted = np.minimum(1.0, np.minimum.accumulate(ranked[::-1])[::-1])
  out = np.empty_like(adjusted)
  out[order] = adjusted
  return out.tolist()


def benjamini_yekutieli(p_values: Sequence[float | None], family_size: int | None = None) -> list[float]:
  """Benjamini-Yekutieli adjusted p-values: Benjamini-Hochberg's times c(m) = sum_{i<=m} 1/i,
  valid under any dependence between the claims (claims that share an arm are dependent); the same
  conventions as `benjamini_hochberg`."""
  bh = benjamini_hochberg(p_values, family_size)
  m = len(bh) if family_size is None else family_size
  c_m = sum(1.0 / i for i in range(1, m + 1))
  return [min(1.0, p * c_m) for p in bh]


def power(kind: str, n: int, sd: float, *, effect: float = 0.0, margin: float = 0.0,
          alpha: float = ALPHA, draws: int = 20000, seed: int = 0) -> float:
  """The chance that a claim is decided at `n` seeds when the per-seed paired differences are
  Normal(effect, sd): kind 'difference': the two-sided paired t at `alpha` rejects in the effect's
  direction; 'equivalence': TOST within `margin` (tested at `alpha` each side) concludes
  equivalence. Monte Carlo over `draws` fixed-seed samples (about +-0.005 at 20,000), so it is a
  planning figure, stated before a study runs (experiments/registered/)."""
  if kind not in ("difference", "equivalence"):
    raise ValueError(f"kind={kind!r} must be 'difference' or 'equivalence'")
  if n < 2 or not sd > 0:
    raise ValueError(f"power needs n >= 2 seeds and sd > 0, got n={n}, sd={sd}")
  d_DN = np.random.default_rng(seed).normal(effect, sd, size=(draws, n))
  mean_D = d_DN.mean(axis=1)
  se_D = d_DN.std(axis=1, ddof=1) / math.sqrt(n)
  if kind == "difference":
    t_D = mean_D / se_D
    crit = t_critical(n - 1, alpha)
    hit_D = (t_D >= crit) if effect >= 0 else (t_D <= -crit)
  else:
    crit = t_critical(n - 1, 2 * alpha)  # one-sided alpha each side
    hit_D = ((mean_D + margin) / se_D >= crit) & ((mean_D - margin) / se_D <= -crit)
  return float(hit_D.mean())


@dataclasses.dataclass(frozen=True)
class Claim:
  """One claim of the family, tested: `kind` 'difference' ("A is better than B": `result` a
  `TestResult`) or 'equivalence' ("A is comparable to B": an `EquivalenceResult`); `seeds`: the
  pairs tested; `planned`: the seeds fixed before the runs (`PLANNED_SEEDS`); `comparable`: True,
  or the reason a precondition fails."""
  claim: str
  kind: str
  result: TestResult | EquivalenceResult | None
  seeds: int
  planned: int
  comparable: bool | str = True


def decide_family(claims: Sequence[Claim], family_size: int | None = None) -> list[dict]:
  """Every claim's verdict, on its Benjamini-Hochberg adjusted p-value over the family
  (`family_size`: the claims stated up front, default len(claims); those not given count as p = 1).

  difference: confirmed (adjusted p < 0.05, A ahead), refuted (adjusted p < 0.05, B ahead);
  equivalence: equivalent (adjusted TOST p < 0.05), not equivalent (adjusted p < 0.05 that the
  difference lies beyond the margin); not decided otherwise; pending claims (fewer seeds than
  planned) are not decided and count as p = 1; not comparable when a precondition fails (p = 1).
  Returns dicts: claim, test, unit 'seed', seeds, planned_seeds, difference, statistic, p_value,
  p_adjusted, ci_low, ci_high, verdict, note (and margin, p_equivalent, p_not_equivalent for
  equivalence claims)."""
  for c in claims:
    if c.kind not in ("difference", "equivalence"):
      raise ValueError(f"claim {c.claim!r}: kind={c.kind!r} must be 'difference' or 'equivalence'")
  usable = [c.comparable is True and c.result is not None and c.seeds >= max(2, c.planned)
            for c in claims]
  p_raw = [c.result.p_value if ok else None for c, ok in zip(claims, usable)]
  adjusted = benjamini_hochberg(p_raw, family_size)
  adjusted_by = benjamini_yekutieli(p_raw, family_size)
  out = []
  for c, ok, p_adj, p_by in zip(claims, usable, adjusted, adjusted_by):
    r = c.result
    row = {"claim": c.claim, "kind": c.kind, "test": r.test if r else "none", "unit": "seed",
           "seeds": c.seeds, "planned_seeds": c.planned,
           "difference": r.difference if r else None, "statistic": r.statistic if r else None,
           "p_value": r.p_value if r else None, "p_adjusted": p_adj if ok else None,
           "p_adjusted_by": p_by if ok else None,
           "ci_low": r.ci_low if r else None, "ci_high": r.ci_high if r else None, "note": ""}
    if isinstance(r, EquivalenceResult):
      row.update(margin=r.margin, p_equivalent=r.p_equivalent, p_not_equivalent=r.p_not_equivalent,
                 interval="90% (TOST)")
    if c.comparable is not True:
      row.update(verdict=NOT_COMPARABLE, note=c.comparable or "precondition failed")
    elif not ok:
      row.update(verdict=NOT_DECIDED, note=f"pending: {c.seeds} of {c.planned} planned seeds")
    elif p_adj >= ALPHA:
      row["verdict"] = NOT_DECIDED
    elif c.kind == "difference":
      row["verdict"] = CONFIRMED if r.difference > 0 else REFUTED
    else:
      row["verdict"] = EQUIVALENT if abs(r.difference) < r.margin else NOT_EQUIVALENT
    out.append(row)
  return out


# ----------------------------------------------------------------------------------------------
# Controls: a threshold a model's share of prompts must meet, sized by their power.


def normal_quantile(q: float) -> float:
  """The standard normal's q-quantile (bisection on erf; 1.95996 at 0.975)."""
  lo, hi = -40.0, 40.0
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q else (lo, mid)
  return (lo + hi) / 2


def proportion_interval(successes: int, n: int, alpha: float = ALPHA) -> tuple[float, float]:
  """The Wilson score interval (two-sided, 1 - alpha) of a share `successes` / `n`."""
  if n < 1 or not 0 <= successes <= n:
    raise ValueError(f"a share needs 0 <= successes <= n and n >= 1, got {successes} of {n}")
  z = normal_quantile(1 - alpha / 2)
  share = successes / n
  centre = (share + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return max(0.0, centre - half), min(1.0, centre + half)


def proportion_control(successes: int, n: int, bound: float, direction: str) -> dict:
  """A control "the share is at least (`at_least`) / at most (`at_most`) `bound`" decided on the
  share's 95% interval over all its prompts: holds when the whole interval is on the bound's
  side, fails when it is wholly on the other side, not decided otherwise (too few prompts to
  tell). The minimum over many small cells is no such test: at 20 cells of 20 prompts a model
  truly at 0.95 everywhere meets "every cell >= 0.9" with probability 0.21 (`every_cell_power`)."""
  if direction not in ("at_least", "at_most"):
    raise ValueError(f"direction={direction!r} must be 'at_least' or 'at_most'")
  low, high = proportion_interval(successes, n)
  good, bad = (low >= bound, high < bound) if direction == "at_least" else (high <= bound, low > bound)
  verdict = "holds" if good else "fails" if bad else "not decided"
  return {"share": successes / n, "n": n, "ci_low": low, "ci_high": high, "bound": bound,
          "direction": direction, "verdict": verdict}


def _binomial_pmf(n: int, p: float) -> np.ndarray:
  k = np.arange(n + 1)
  if p in (0.0, 1.0):
    return (k == (n if p else 0)).astype(np.float64)
  log = (math.lgamma(n + 1) - np.array([math.lgamma(i + 1) + math.lgamma(n - i + 1) for i in k])
         + k * math.log(p) + (n - k) * math.log1p(-p))
  return np.exp(log)


def proportion_control_power(n: int, p: float, bound: float, direction: str) -> float:
  """The chance that `proportion_control` holds over `n` prompts for a model whose true share is
  `p` (exact, over the binomial): the figure a control states before its runs."""
  pmf = _binomial_pmf(n, p)
  holds = [proportion_control(k, n, bound, direction)["verdict"] == "holds" for k in range(n + 1)]
  return float(pmf[np.array(holds)].sum())


def every_cell_power(per_cell: int, cells: int, p: float, bound: float) -> float:
  """The chance that every one of `cells` cells of `per_cell` prompts meets share >= `bound` for
  a model whose true share is `p` in each (independent cells): how likely a "minimum over the
  cells" control is to hold for a model that truly meets it."""
  pmf = _binomial_pmf(per_cell, p)
  meets = np.arange(per_cell + 1) / per_cell >= bound - 1e-12
  return float(pmf[meets].sum()) ** cells


# ----------------------------------------------------------------------------------------------
# The rule.


def decide(claim: str, result: TestResult,
           comparable: bool | str | Callable[[], bool | str] = True) -> Decision:
  """The verdict on "A is better than B" from a test's `result` (docs/evaluation.md: the rule).

  confirmed: p < 0.05 and ci_low > 0 (the 95% interval excludes 0 in A's favour);
  refuted: p < 0.05 and ci_high < 0; not decided: otherwise, or fewer than 2 pairs;
  not comparable: `comparable` is False or a string (the reason, e.g. "not trained: <model> did
  not learn the task"), or a callable returning one of those; True: the precondition holds.
  """
  status = comparable() if callable(comparable) else comparable
  if not isinstance(status, (bool, str)):
    raise TypeError(f"comparable must be a bool or a reason (str), got {status!r}")
  fields = dict(claim=claim, test=result.test, difference=result.difference, statistic=result.statistic,
                p_value=result.p_value, ci_low=result.ci_low, ci_high=result.ci_high, n=result.n)
  if status is not True:
    return Decision(**fields, verdict=NOT_COMPARABLE, note=status or "precondition failed")
  if result.n < 2 or math.isnan(result.p_value):
    return Decision(**fields, verdict=NOT_DECIDED, note=f"{result.n} pair(s): nothing to test")
  if result.p_value < ALPHA and result.ci_low > 0:
    return Decision(**fields, verdict=CONFIRMED)
  if result.p_value < ALPHA and result.ci_high < 0:
    return Decision(**fields, verdict=REFUTED)
  return Decision(**fields, verdict=NOT_DECIDED)


# ----------------------------------------------------------------------------------------------
# Rules as functions of per-seed values (lower is better), and their false-positive rate.


def paired_t_rule(a_by_seed: Mapping[int, float], b_by_seed: Mapping[int, float]) -> str:
  """The rule on per-seed losses: `decide` on `paired_t_test`."""
  return decide("A is better than B", paired_t_test(a_by_seed, b_by_seed)).verdict


def spread_rule(a_by_seed: Mapping[int, float], b_by_seed: Mapping[int, float]) -> str:
  """The old rule (experiments/paper_tables/render.py `verdict`, two seeds or more a side), on losses:
  gap = mean(B) - mean(A); confirmed when gap > the larger min-max seed spread of the two rows,
  refuted when gap < -that spread. Unpaired."""
  a, b = list(a_by_seed.values()), list(b_by_seed.values())
  if len(a) < 2 or len(b) < 2:
    return NOT_DECIDED
  gap, noise = sum(b) / len(b) - sum(a) / len(a), max(max(a) - min(a), max(b) - min(b))
  return CONFIRMED if gap > noise else REFUTED if gap < -noise else NOT_DECIDED


def false_positive_rate(rule: Callable[[Mapping[int, float], Mapping[int, float]], str], n_pairs: int = 2,
                        noise_sd: float = 1.0, trials: int = 20_000, seed: int = 0,
                        seed_sd: float = 0.0) -> float:
  """The share of `trials` simulated comparisons with no true difference in which `rule` declares
  a verdict (confirmed or refuted). Each trial: seeds 0..n_pairs-1; A's and B's value for seed s
  are the same seed effect (normal, sd `seed_sd`, shared by the pair) plus independent run noise
  (normal, sd `noise_sd`). Monte-Carlo standard error: sqrt(rate (1 - rate) / trials)."""
  rng = np.random.default_rng(seed)
  shared = rng.normal(0.0, seed_sd, (trials, n_pairs))
  a = (shared + rng.normal(0.0, noise_sd, (trials, n_pairs))).tolist()
  b = (shared + rng.normal(0.0, noise_sd, (trials, n_pairs))).tolist()
  declared = sum(rule(dict(enumerate(a[i])), dict(enumerate(b[i]))) in (CONFIRMED, REFUTED)
                 for i in range(trials))
  return declared / trials


def architecture_null_rates(num_seeds: int = 2, seed_sd: float = 0.03, accuracy: float = 0.5,
                            sequences: int = 512, queries_per_sequence: int = 2, trials: int = 200,
                            resamples: int = 500, seed: int = 0) -> dict[str, float]:
  """Under an architecture-level null (A and B the same architecture: each run's accuracy is
  `accuracy` + a normal seed effect of sd `seed_sd`, drawn for every run), the share of `trials`
  in which (a) the query bootstrap over the pooled seeds (`paired_bootstrap`, clustered by (seed,
  sequence), `decide`) and (b) the per-seed paired t (`paired_t_test`, `decide`) declare a
  difference. (a) answers "do these runs differ", so it declares one far more often than 5%."""
  rng = np.random.default_rng(seed)
  declared = {"query bootstrap": 0, "per-seed t": 0}
  n = sequences * queries_per_sequence
  groups = np.repeat(np.arange(num_seeds * sequences), queries_per_sequence)
  for i in range(trials):
    p_AS = np.clip(accuracy + rng.normal(0.0, seed_sd, (2, num_seeds)), 0.0, 1.0)
    correct_ASN = rng.random((2, num_seeds, n)) < p_AS[:, :, None]
    boot = paired_bootstrap(correct_ASN[0].ravel(), correct_ASN[1].ravel(), groups=groups,
                            higher_is_better=True, num_resamples=resamples, seed=i)
    t = paired_t_test(dict(enumerate(correct_ASN[0].mean(1))), dict(enumerate(correct_ASN[1].mean(1))),
                      higher_is_better=True)
    for name, result in (("query bootstrap", boot), ("per-seed t", t)):
      declared[name] += decide("", result).verdict in (CONFIRMED, REFUTED)
  return {name: count / trials for name, count in declared.items()}


if __name__ == "__main__":
  trials = 20_000
  print(f"false-positive rates, no true difference, {trials} trials (se ~0.0015 at 0.05):")
  for n in (2, 3, 5):
    new = false_positive_rate(paired_t_rule, n, trials=trials)
    old = false_positive_rate(spread_rule, n, trials=trials)
    print(f"  {n} seeds: paired t rule {new:.4f}, old spread rule {old:.4f}")
  rates = architecture_null_rates(num_seeds=2, sequences=1024, queries_per_sequence=8, trials=200)
  print("architecture-level null (run accuracy varies by sd 0.03 between seeds, 2 seeds, 8,192 "
        "queries a run, 200 trials): " + ", ".join(f"{k} declares {v:.0%}" for k, v in rates.items()))
