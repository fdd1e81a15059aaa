"""The way bytes cross between host and devices; nothing here knows a layout.

May import: `_format`, `_tree`, `_errors`.
"""
