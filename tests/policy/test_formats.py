import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxima.formats import HOT, QUANTS, Format, FormatError


@pytest.mark.parametrize(
    ("text", "ratio"),
    [
        ("bf16", 1),
        ("fp8", 2),
        ("int8", 2),
        ("int4", 4),
        ("int2", 8),
        ("sparse(4)", 4),
        ("cluster(2)", 2),
        ("sparse(2)+int8", 4),
        ("cluster(2)+int4", 8),
        (" cluster( 4 ) + int2 ", 32),
    ],
)
def test_pack_ratio(text: str, ratio: int) -> None:
    assert Format.parse(text).pack_ratio == ratio


@pytest.mark.parametrize(
    "text",
    [
        "int3",
        "sparse",
        "sparse()",
        "sparse(1)",
        "cluster(0)",
        "sparse(4)int8",
        "+int8",
        "sparse(2)+",
        "sparse(65)",
        "",
        "int8+sparse(2)",
    ],
)
def test_rejects_invalid(text: str) -> None:
    with pytest.raises(FormatError):
        Format.parse(text)


@given(
    red=st.sampled_from([None, "sparse", "cluster"]),
    ratio=st.integers(2, 64),
    quant=st.sampled_from(QUANTS),
)
def test_name_round_trip(red: str | None, ratio: int, quant: str) -> None:
    fmt = Format(reduction=red, reduction_ratio=ratio if red else 1, quant=quant)  # type: ignore[arg-type]
    assert Format.parse(fmt.name) == fmt
    bits = {"bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2, "int4h": 4, "int2h": 2}  # every quant, by hand
    assert fmt.pack_ratio == (ratio if red else 1) * 16 // bits[quant]


def test_kept_tokens_and_hot() -> None:
    assert Format.parse("sparse(4)").kept_tokens(128) == 32
    assert Format.parse("int4").kept_tokens(16) == 16
    with pytest.raises(FormatError, match="not divisible"):
        Format.parse("cluster(3)").kept_tokens(16)
    assert HOT.is_hot and not Format.parse("int8").is_hot


@given(st.sampled_from(["bf16", "int4", "sparse(4)", "cluster(2)+int8", "sparse(8)+int2"]), st.integers(0, 256))
def test_kept_count_rounds_a_partial_block_up(text: str, tokens: int) -> None:
    """One kept-token rule: ceil(tokens / R); a full block divisible by R keeps exactly B / R."""
    fmt = Format.parse(text)
    kept = fmt.kept_count(tokens)
    assert kept * fmt.reduction_ratio >= tokens > (kept - 1) * fmt.reduction_ratio or kept == tokens == 0
    if tokens and tokens % fmt.reduction_ratio == 0:
        assert fmt.kept_tokens(tokens) == kept


def test_kept_count_refuses_a_negative_count() -> None:
    assert Format.parse("cluster(3)").kept_count(16) == 6  # a partial reduction rounds up where kept_tokens raises
    with pytest.raises(FormatError, match="non-negative"):
        Format.parse("sparse(2)").kept_count(-1)
