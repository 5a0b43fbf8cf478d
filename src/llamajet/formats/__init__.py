"""The one owner of weight layouts (being moved here: see stack.py)."""
