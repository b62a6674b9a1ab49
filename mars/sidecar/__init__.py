"""See mars/__init__.py for the layout."""
