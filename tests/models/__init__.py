"""Models and helpers that several test modules share."""
