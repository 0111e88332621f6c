"""Predicting a configuration's peak without running it: the estimate on fake tensors (estimate,
config, fake_build, fake_step, cpu_standin, kernel_watch, fused_tables, grad_sums, events,
distributed, replay, result, anchors), step time, and the planner that searches remedies."""
