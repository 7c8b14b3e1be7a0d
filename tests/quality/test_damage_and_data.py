from __future__ import annotations

import json
import math
import random

import pytest

from proxima.quality import damage, datasets


def test_fit_exports_plain_json_and_predicts():
    rng = random.Random(0)
    rows = []
    for fmt, base in (("int4", 0.03), ("int2", 0.3)):
        for _ in range(200):
            imp, spread, layer = rng.random(), rng.random(), rng.randrange(30)
            x = damage.features(imp, spread, layer, 30)
            rows.append({"fmt": fmt, "x": x, "error": base * math.exp(0.8 * spread)})
    model = damage.fit(rows)
    model = json.loads(json.dumps(model))  # plain data, no pickle
    assert model["r2"] > 0.9
    assert model["table"]["int4"] < model["table"]["int2"]
    x = damage.features(0.5, 0.5, 10, 30)
    assert damage.predict(model, "int4", x) == pytest.approx(0.03 * math.exp(0.4), rel=0.05)
    with pytest.raises(KeyError, match="no damage model"):
        damage.predict(model, "int8", x)


def test_shipped_damage_model_loads_into_a_policy():
    if not damage.DEFAULT_PATH.exists():
        pytest.skip("no damage model committed yet")
    from proxima.policy.schema import Damage

    model = damage.load()
    table = Damage(table=model["table"])
    assert table.of(__import__("proxima.formats", fromlist=["Format"]).Format.parse("int4")) >= 0


def test_clean_wikitext():
    raw = "'''Foo''' is a [[bar|baz]] {{cite|x={{y}}}} thing.<ref>r</ref>\n== History ==\n* item [[Qux]]"
    assert datasets.clean_wikitext(raw) == "Foo is a baz  thing.\nHistory.\nitem Qux"


def test_offline_text_is_there():
    pytest.importorskip("transformers")
    try:
        arts = datasets.lee_articles()
    except FileNotFoundError:
        pytest.skip("gensim not installed")
    assert len(arts) > 200
    title, text = next(iter(datasets.wiki_pages()))
    assert title and len(text) > 100
