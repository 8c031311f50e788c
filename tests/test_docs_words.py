"""The docs say no more than the verdicts: a result is reported in its verdict's own words.

Read over README.md, experiments/README.md and docs/*.md: the phrases that said more than a verdict
("finds no difference" for a claim not decided, "π retrieves" for a study that measured copying one
value) appear nowhere outside quotation marks, and every verdict label set in bold is one that
results/verdicts.json gives to some claim (so no paragraph can call a claim confirmed, refuted or
equivalent while the verdicts say otherwise everywhere)."""

import glob
import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "experiments/README.md", *sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
# Said of a claim not decided, or of a needle study that measured carrying one value.
OVERCLAIMS = (r"\bfinds? no difference\b", r"\bfound no difference\b", r"\bno difference found\b",
              r"\bfinding no difference\b", r"\bdoes not differ\b", r"π retrieves",
              r"\bretrieves needles\b", r"\bteaches retrieval\b", r"\bECP retrieves like\b")
LABELS = ("confirmed", "refuted", "differ", "equivalent", "not equivalent", "not decided",
          "not comparable")


def _text(page: str) -> str:
  with open(os.path.join(REPO, page), encoding="utf-8") as f:
    return " ".join(f.read().split())


def _unquoted(text: str) -> str:
  """The text with every "..." quotation removed (a phrase may be named, as in '"not decided" is
  never "no difference"', and a registered claim's text is quoted as registered)."""
  return re.sub(r'"[^"]{0,600}"', '""', text)


def test_no_page_says_more_than_its_verdict():
  found = []
  for page in PAGES:
    text = _unquoted(_text(page))
    for pattern in OVERCLAIMS:
      for m in re.finditer(pattern, text, flags=re.IGNORECASE):
        found.append(f"{page}: ...{text[max(0, m.start() - 60):m.end() + 40]}...")
  assert not found, "\n".join(found)


def test_every_bold_verdict_is_one_the_verdicts_give():
  with open(os.path.join(REPO, "experiments", "results", "verdicts.json")) as f:
    verdicts = json.load(f)
  given = {r["verdict"] for r in verdicts["rows"] + verdicts["pending"] + verdicts["registered"]}
  used = {}
  for page in PAGES:
    for label in re.findall(r"\*\*(" + "|".join(LABELS) + r")\*\*", _text(page)):
      used.setdefault(label, []).append(page)
  assert used, "no page quotes a verdict"
  unknown = {label: pages for label, pages in used.items() if label not in given}
  assert not unknown, f"bold verdicts no claim has: {unknown}"


def test_the_check_catches_an_overclaim():
  """The patterns match the sentences they were written against (so the check can fail)."""
  for sentence in ("The replication finds no difference: BCMT ahead by 0.004.",
                   "the needle study, where π retrieves past the window's reach",
                   "a training source that teaches retrieval in text"):
    assert any(re.search(p, sentence, flags=re.IGNORECASE) for p in OVERCLAIMS), sentence
  assert not any(re.search(p, _unquoted('"not decided" is never "no difference found"'))
                 for p in OVERCLAIMS)
