import sqlite3
db = sqlite3.connect('/app/shop.db')
db.execute('CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL)')
db.execute('CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id), amount REAL NOT NULL)')
db.executemany('INSERT INTO customers (id, name) VALUES (?, ?)', [(1, 'Acme'), (2, 'Globex'), (3, 'Initech'), (4, 'Umbrella'), (5, 'Hooli'), (6, 'Vandelay')])
db.executemany('INSERT INTO orders (customer_id, amount) VALUES (?, ?)', [(1, 120.0), (2, 75.5), (3, 300.25), (1, 99.0), (4, 10.0), (5, 150.0), (2, 180.0), (6, 45.0), (5, 20.0), (3, 1.0), (4, 12.5)])
db.commit()
