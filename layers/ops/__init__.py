"""Operators with a readable reference and a fast form side by side, one folder per op
(flash-linear-attention's shape): ``naive.py`` holds the reference, the other files the forms
layers run."""
