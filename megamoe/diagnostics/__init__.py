"""megamoe.diagnostics (floor 6): measurements of a model or a layout."""
