import pytest

from inventory import Inventory


def test_add_and_quantity():
    inv = Inventory()
    inv.add("bolt", 5, 0.1)
    inv.add("bolt", 2, 0.1)
    assert inv.quantity("bolt") == 7


def test_remove_to_zero_drops_item():
    inv = Inventory()
    inv.add("nut", 2, 0.05)
    inv.remove("nut", 2)
    assert "nut" not in inv.items


def test_remove_too_many_raises():
    inv = Inventory()
    inv.add("gear", 1, 3.0)
    with pytest.raises(ValueError):
        inv.remove("gear", 2)


def test_total_value():
    inv = Inventory()
    inv.add("a", 2, 1.5)
    inv.add("b", 3, 2.0)
    assert inv.total_value() == pytest.approx(9.0)
