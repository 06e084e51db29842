"""megamoe.core (floor 0): errors, typed configs, layout strings, output folders."""
