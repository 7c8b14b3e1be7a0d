"""Offline text for quality runs, from files shipped in PyPI's `gensim==4.4.0` (FACTS.md).

- Wikipedia: `enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`, 206 pages
  of wikitext, cleaned to plain prose here (templates, tables, references and markup removed).
  Long pages give perplexity contexts and their natural continuations.
- Lee corpus: `lee_background.cor`, ~300 short news articles, one per line: the haystack of the
  passkey task (news prose, unrelated to the needle).

The files are read directly: importing gensim needs scipy, which we do not install.
`PROXIMA_TEXT_DIR` names a folder holding the same two files instead (a machine without gensim,
e.g. the GPU device, gets them carried over: `bench/quality.py --stage-text DIR`).
"""

from __future__ import annotations

import bz2
import html
import importlib.util
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_FILE = "lee_background.cor"


TEXT_DIR_ENV = "PROXIMA_TEXT_DIR"
TEXT_FILES = (WIKI_FILE, LEE_FILE)


def data_dir() -> Path:
    """The folder holding `TEXT_FILES`: `$PROXIMA_TEXT_DIR` if set, else gensim's test data."""
    override = os.environ.get(TEXT_DIR_ENV)
    if override:
        folder = Path(override)
        missing = [f for f in TEXT_FILES if not (folder / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{TEXT_DIR_ENV}={override}: missing {', '.join(missing)}")
        return folder
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"gensim is not installed; install it with `pip install --no-deps gensim==4.4.0`, or set {TEXT_DIR_ENV}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data"


def lee_articles() -> list[str]:
    text = (data_dir() / LEE_FILE).read_text(encoding="utf-8", errors="replace")
    return [line.strip() for line in text.splitlines() if line.strip()]


_PAGE = re.compile(r"<page>.*?<title>(.*?)</title>.*?<text[^>]*>(.*?)</text>.*?</page>", re.S)


def _strip_nested(text: str, open_: str, close: str) -> str:
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth += 1
            i += len(open_)
        elif depth and text.startswith(close, i):
            depth -= 1
            i += len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def clean_wikitext(text: str) -> str:
    """Wikitext -> plain prose (good enough for perplexity; not a full parser)."""
    t = html.unescape(text)
    t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
    t = re.sub(r"<ref[^>/]*/>", "", t)
    t = re.sub(r"<ref.*?</ref>", "", t, flags=re.S)
    t = _strip_nested(t, "{{", "}}")
    t = _strip_nested(t, "{|", "|}")
    t = re.sub(r"\[\[(?:File|Image|Category|[a-z]{2,3}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", t)
    t = re.sub(r"\[\[([^|\]]*\|)?([^\]]*)\]\]", r"\2", t)
    t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[https?://\S+\]", "", t)
    t = re.sub(r"<[^>]+>", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1.", t, flags=re.M)
    t = re.sub(r"^[*#:;]+\s*", "", t, flags=re.M)
    lines = [ln.strip() for ln in t.splitlines()]
    t = "\n".join(ln for ln in lines if ln and not ln.startswith(("|", "!")))
    return re.sub(r"\n{2,}", "\n", t).strip()


def wiki_pages() -> Iterator[tuple[str, str]]:
    """(title, cleaned text) for every article page (redirects skipped)."""
    raw = bz2.decompress((data_dir() / WIKI_FILE).read_bytes()).decode("utf-8", errors="replace")
    for m in _PAGE.finditer(raw):
        title, body = html.unescape(m.group(1)), m.group(2)
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        yield title, clean_wikitext(body)


@dataclass(frozen=True)
class TextSample:
    """A context to compress and the continuation scored after it."""

    name: str
    context_ids: list[int]
    continuation_ids: list[int]


def text_samples(tokenizer, context_len: int, n: int, continuation: int = 64, seed: int = 0) -> list[TextSample]:
    """`n` Wikipedia pages long enough for `context_len + continuation` tokens (deterministic)."""
    pages = []
    for title, text in wiki_pages():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= context_len + continuation:
            pages.append((title, ids))
    if len(pages) < n:
        raise ValueError(f"only {len(pages)} pages have {context_len + continuation} tokens, {n} wanted")
    rng = random.Random(seed)
    chosen = rng.sample(pages, n)
    return [
        TextSample(f"wiki:{title}", ids[:context_len], ids[context_len : context_len + continuation])
        for title, ids in chosen
    ]


@dataclass(frozen=True)
class NeedleSample:
    """A passkey task: the context (to compress) holds the needle; the question follows."""

    name: str
    context_ids: list[int]
    question_ids: list[int]
    answer: str
    depth: float


NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
QUESTION = "\n\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is "  # trailing space: without it SmolLM2 defines the term instead


def needle_samples(tokenizer, context_len: int, depths: list[float], seed: int = 0) -> list[NeedleSample]:
    """Passkey prompts of about `context_len` tokens (chat template), needle at each depth.

    The context ends right before the question, so compression cannot know what will be asked.
    The answer is primed with "The pass key is" so a correct reply starts with the digits.
    """
    rng = random.Random(seed * 1000 + context_len)
    arts = lee_articles()
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": "@@"}], tokenize=False, add_generation_prompt=True
    )
    pre, post = head.split("@@")
    out = []
    for depth in depths:
        key = f"{rng.randrange(10000, 99999)}"
        rng.shuffle(arts)
        fixed = len(tokenizer(pre + INTRO + NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]) + 4
        hay_ids: list[int] = []
        for a in arts:
            hay_ids += tokenizer(" " + a, add_special_tokens=False)["input_ids"]
            if len(hay_ids) >= context_len - fixed:
                break
        hay_ids = hay_ids[: context_len - fixed]
        cut = int(len(hay_ids) * depth)
        before = tokenizer.decode(hay_ids[:cut])
        after = tokenizer.decode(hay_ids[cut:])
        # Put the needle on a sentence boundary near the cut so it reads as its own sentence.
        context = pre + INTRO + before + " " + NEEDLE.format(key=key) + " " + after
        ctx_ids = tokenizer(context, add_special_tokens=False)["input_ids"][:context_len]
        q_ids = tokenizer(QUESTION + post + ANSWER_PREFIX, add_special_tokens=False)["input_ids"]
        out.append(NeedleSample(f"passkey:{context_len}@{depth:.1f}", ctx_ids, q_ids, key, depth))
    return out
