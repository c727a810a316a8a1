"""``python -m apps.eval``: a model directory's greedy accuracy on a task's held-out problems."""
