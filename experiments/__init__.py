"""Example trainers built on dcp (see ``experiments/train_gpt.py``)."""
