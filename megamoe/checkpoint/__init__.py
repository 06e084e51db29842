"""megamoe.checkpoint (floor 4): every checkpoint format megamoe reads and writes."""
