"""Predicting a configuration's peak without running it: the estimate on fake tensors, the\nallocator replay, kernel workspaces, step time and the planner that searches remedies."""
