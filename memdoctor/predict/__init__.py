"""Predicting a configuration's peak without running it: the estimate on fake tensors (estimate,
config, hf_models, fake_build, fake_step, cpu_standin, data_dependent, fused_rnn, eager_libraries,
kernel_watch, fused_tables, grad_sums, events, distributed, replay, result, anchors), step time,
and the planner that searches remedies."""
