"""Capture: the two trace sources (dispatch, CUDA allocator history), the ownership hooks,
the budget, running a user's script, and the readers of snapshots and OOM logs."""
