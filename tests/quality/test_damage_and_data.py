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
    from proxima.formats import Format
    from proxima.policy.schema import Damage

    assert damage.DEFAULT_PATH.exists(), "the calibrated damage model must ship with the package"
    model = damage.load()
    table = Damage(table=model["table"])
    # Measured errors: int8 costs less than int4, which costs less than int2.
    assert 0 < table.of(Format.parse("int8")) < table.of(Format.parse("int4")) < table.of(Format.parse("int2"))


def test_clean_wikitext():
    raw = "'''Foo''' is a [[bar|baz]] {{cite|x={{y}}}} thing.<ref>r</ref>\n== History ==\n* item [[Qux]]"
    assert datasets.clean_wikitext(raw) == "Foo is a baz  thing.\nHistory.\nitem Qux"


def test_offline_text_is_there():
    arts = datasets.lee_articles()  # scripts/bootstrap.sh installs gensim's data (--no-deps)
    assert len(arts) > 200
    title, text = next(iter(datasets.wiki_pages()))
    assert title and len(text) > 100


def test_text_dir_override_reads_staged_files(tmp_path, monkeypatch):
    """A machine without gensim (the GPU device) reads the same files from PROXIMA_TEXT_DIR."""
    import shutil

    src = datasets.data_dir()
    monkeypatch.setenv(datasets.TEXT_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"{datasets.TEXT_DIR_ENV}=.*missing {datasets.WIKI_FILE}"):
        datasets.data_dir()
    for f in datasets.TEXT_FILES:
        shutil.copyfile(src / f, tmp_path / f)
    assert datasets.data_dir() == tmp_path
    assert len(datasets.lee_articles()) > 200
