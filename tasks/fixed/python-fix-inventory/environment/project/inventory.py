class Inventory:
    """Stock of items: name -> (quantity, unit price)."""

    def __init__(self):
        self.items = {}

    def add(self, name, quantity, unit_price):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        old_quantity, _ = self.items.get(name, (0, unit_price))
        self.items[name] = (old_quantity + quantity, unit_price)

    def remove(self, name, quantity):
        """Take `quantity` out of stock; an item whose stock reaches 0 is dropped.

        Raises ValueError when there is not enough stock (and changes nothing)."""
        have, price = self.items[name]
        self.items[name] = (have - quantity, price)

    def quantity(self, name):
        return self.items.get(name, (0, 0))[0]

    def total_value(self):
        return sum(price for quantity, price in self.items.values())
