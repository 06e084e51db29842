"""megamoe.planning (floor 6): plans a model without allocating it."""
