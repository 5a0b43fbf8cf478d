"""One module per API family: its routes and their formatters, over the
serving layer (server/serving.py). Each module exposes `router`."""
