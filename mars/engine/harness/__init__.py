"""See mars/engine/__init__.py."""
