import pytest

from otel_dra.cluster.deviceclass import parse_cost
from otel_dra.kube.quantity import parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80Gi", 85899345920.0),
        ("1Gi", 1073741824.0),
        ("141Gi", 141 * 2**30),
        ("150754820096", 150754820096.0),
        ("132", 132.0),
        ("100m", 0.1),
        ("1.5Ki", 1536.0),
        ("2k", 2000.0),
        ("1e3", 1000.0),
        ("1E3", 1000.0),
        ("5M", 5e6),
        ("+7", 7.0),
        ("-1", -1.0),
        (".5", 0.5),
        ("3.", 3.0),
        ("0", 0.0),
        (12, 12.0),
    ],
)
def test_quantities(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "80GB", "1.2.3", "abc", "1e", "0x10", "1 Gi", None, True, [], "١٢"])
def test_invalid_quantities(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


@pytest.mark.parametrize(("raw", "value"), [("2.50", 2.5), ("0", 0.0), ("10", 10.0), ("  3.25 ", 3.25), ("007", 7.0)])
def test_valid_costs(raw, value):
    assert parse_cost(raw) == value


@pytest.mark.parametrize(
    "raw", ["1,234", "1e3", ".5", "1.", "+2", "-1", "NaN", "Inf", "", "  ", "2.5.1", "٣", "1_000", "9" * 400]
)
def test_invalid_costs(raw):
    with pytest.raises(ValueError, match="hourly-cost"):
        parse_cost(raw)
